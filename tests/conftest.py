"""Suite-wide JAX settings, as equinox does: implicit rank promotion raises, implicit dtype
promotion is strict (in every thread of the test processes: the trainer's producer and the
embedded engine's scheduler too), and 8 simulated CPU devices exist so multi-device tests need
no environment tricks."""

import atexit
import os
import shutil
import tempfile

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
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")))


_share_compilations()

from hypothesis import settings  # noqa: E402

# Property tests run on bucketed shapes (few compilations); keep them quick on 2 cores.
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

