"""Exact mode end to end (`rollout.placement.exact`, contract §13): the trainer's old log-probs equal
the engine's rollout log-probs bit for bit at every step — `mis_k3_kl == 0.0`, every token's
|old − rollout| == 0.0 (read back from the run's records), the IS weights exactly 1 — with a nonzero
gradient every step and the weights moving; colocated (bfloat16) and through `mis-jax serve`
(float32, started by the trainer). The control, the same run with exact mode off, shows the usual
nonzero mismatch at every step. A server that does not compute in batch-invariant arithmetic is a
config error before step 1. The 20-step runs of both dtypes and placements are `repeat` tests here
and `make bench-exact`'s proof."""

import contextlib
import glob

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest

import mis_jax
from fake_sglang import FakeSGLang
from test_train import make_cfg
from trainers.app import build, trainer as train_lib
from trainers.rollout import backend

pytestmark = pytest.mark.integration

MIS = mis_jax.LossConfig(
  use_tis=True, mis=mis_jax.MISConfig(tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4)
)


def run(tmp_path, name, *, steps=2, exact=True, mode="colocated", dtype="bfloat16", **rollout):
  """A run of `steps` steps; its per-step metrics and, per step, the largest |old − rollout log-prob|
  over its tokens (from the records, an independent read of both columns)."""
  records = str(tmp_path / name / "records")
  cfg = make_cfg(
    tmp_path,
    name,
    train={"steps": steps},
    rollout={
      "placement": {"mode": mode, "exact": exact, "server_dtype": dtype},
      "records": {"save_dir": records},
      **rollout,
    },
  )
  with contextlib.ExitStack() as running:
    urls = []
    if mode == "server":  # as `mis-jax train` without --sglang-url: it starts `mis-jax serve` in exact mode
      urls = [running.enter_context(backend.start_server(cfg, build.initial_weights_dir(cfg), is_moe=False)).url]
    trainer = train_lib.Trainer(cfg, MIS, urls=urls)
    before = jax.device_get(trainer.params)
    history = trainer.run(progress=False)
  moved = any(
    not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(trainer.params)))
  )
  gaps = []
  for path in sorted(glob.glob(f"{records}/*.parquet")):
    cols = pq.read_table(path).to_pydict()
    gaps.append(
      max(
        float(np.max(np.abs(np.asarray(o, np.float64) - np.asarray(r, np.float64))))
        for o, r in zip(cols["old_logprobs"], cols["rollout_logprobs"])
        if r
      )
    )
  assert len(gaps) == len(history) == steps
  return history, gaps, moved


def assert_exact(history, gaps, moved):
  for step, (h, gap) in enumerate(zip(history, gaps), 1):
    assert h["mis_k3_kl"] == 0.0 and h["train_rollout_logprob_abs_diff"] == 0.0 and gap == 0.0, (step, h, gap)
    assert h["mis_is_ratio_min_final"] == h["mis_is_ratio_max_final"] == 1.0, (step, h)
    assert h["grad_norm"] > 0, (step, h)
  assert moved


def test_exact_colocated_bfloat16_and_the_control(tmp_path):
  assert_exact(*run(tmp_path, "exact"))
  history, gaps, moved = run(tmp_path, "control", exact=False)
  assert all(h["mis_k3_kl"] > 0 and gap > 0 for h, gap in zip(history, gaps)) and moved, (history, gaps)


def test_exact_through_mis_jax_serve_float32(tmp_path):
  """The trainer starts `mis-jax serve --arithmetic batch_invariant`; weights go over safetensors on disk."""
  assert_exact(*run(tmp_path, "serve", mode="server", dtype="float32"))


def test_a_server_without_batch_invariant_arithmetic_is_a_config_error(tmp_path):
  cfg = make_cfg(tmp_path, "fake", rollout={"placement": {"exact": True}})
  with FakeSGLang() as server:
    trainer = train_lib.Trainer(cfg, MIS, urls=[server.url])
    with pytest.raises(
      mis_jax.ConfigError,
      match=rf"rollout.placement.exact: {server.url} .* does not report "
      r"batch-invariant arithmetic.*--arithmetic batch_invariant",
    ):
      trainer.run(progress=False)


@pytest.mark.repeat
@pytest.mark.parametrize(
  "mode, dtype", [("colocated", "bfloat16"), ("colocated", "float32"), ("server", "bfloat16"), ("server", "float32")]
)
def test_twenty_exact_steps(tmp_path, mode, dtype):
  assert_exact(*run(tmp_path, "long", steps=20, mode=mode, dtype=dtype))
