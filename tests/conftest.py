"""Suite-wide JAX settings, as equinox does: implicit rank promotion raises, implicit dtype
promotion is strict (in every thread of the test processes: the trainer's producer and the
embedded engine's scheduler too), and 8 simulated CPU devices exist so multi-device tests need
no environment tricks."""

import atexit
import os
import pathlib
import shutil
import sys
import tempfile

# tests/ mirrors the packages (tests/mis_jax, tests/trainers/<package>); their shared helpers
# (helpers, oracle, fake_sglang, test_train's make_cfg, ...) import by module name from any folder.
for _dir in sorted(
  p for p in pathlib.Path(__file__).resolve().parent.rglob("*") if p.is_dir() and p.name != "__pycache__"
):
  if str(_dir) not in sys.path:
    sys.path.append(str(_dir))

# The suite's programs are tiny and compiled once each: LLVM's optimisation passes cost more than
# they save. Level 0 changes no result (XLA CPU does no fast-math; reductions keep XLA's order) and
# cuts compile time by about 30% (test_step's micro-batch and chunked tests: 40.8 s -> 28.0 s).
# Every process the tests start inherits it, servers and trainers included.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")  # mis_jax and trainers promote nothing implicitly


def _share_compilations():
  """One persistent XLA compilation cache per test session, shared by the xdist workers and by
  every process the tests start (servers, trainers, workers inherit the environment): the same
  tiny-model programs are built by many tests and processes, and on 2 cores compiling them is
  most of the suite's time. Each program is still compiled, lowered and run by the first test
  that needs it; later identical ones load it. The session that created the directory removes it."""
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    path = tempfile.mkdtemp(prefix="mis-jax-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")),
  )


_share_compilations()

from hypothesis import settings  # noqa: E402

# Property tests run on bucketed shapes (few compilations); keep them quick on 2 cores.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# The longest files first (measured durations, longest first): `--dist loadfile` hands whole
# files to the two workers in collection order, so a long file collected last would leave one
# worker running it alone at the end. Within a file, and among the rest, the order is unchanged.
LONGEST_FIRST = (
  "trainers/serving/test_sglang_jax.py",
  "trainers/app/test_moe_train.py",
  "trainers/models/test_moe_model.py",
  "trainers/learner/test_step.py",
  "trainers/rollout/test_sampling_replay.py",
  "trainers/app/test_train.py",
  "trainers/app/test_crash.py",
  "trainers/rollout/test_colocated.py",
  "mis_jax/integrations/test_tunix.py",
  "trainers/agents/test_agents_train.py",
  "trainers/rollout/test_fleet.py",
  "mis_jax/integrations/test_tunix_agentic.py",
  "trainers/app/test_faults.py",
  "test_notebooks.py",
  "trainers/serving/test_server.py",
)


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
