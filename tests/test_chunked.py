"""Chunked token passes (mis_jax.set_chunk_tokens) == one pass: weights, kept mask, every
metric, the loss and its gradient, for chunks that divide the batch, chunks with a smaller
last chunk, and inside shard_map. The one-pass results themselves are checked against the
NumPy oracle by test_weights/test_losses."""

import contextlib

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import mis_jax
from mis_jax import _segments
from helpers import pack, random_seqs

SEQS = random_seqs(np.random.default_rng(11), n_seqs=14, max_len=11, with_ref=True, with_entropy=True,
                   mismatch=0.5, catastrophic=0.04)
# 8 rows x 37 tokens = 296 tokens: chunk 8 divides it (no tail), chunk 30 does not (tail 26).
BATCH, EXTRA, _ = pack(SEQS, row_len=37, num_rows=8)
CRITERIA = (mis_jax.RSCriterion("k3", "seq_mean", upper=0.5), mis_jax.RSCriterion("k1", "seq_max", lower=-1.0),
            mis_jax.RSCriterion("k2", "token", upper=0.3))
MIS_CONFIGS = [
    mis_jax.MISConfig(use_rs=True, tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4,
                      tis_batch_normalize=True),
    mis_jax.MISConfig(tis_level="sequence", tis_mode="mask", tis_upper_bound=4.0, use_rs=True, rs_level="token",
                      rs_upper_bound=3.0, rs_veto_threshold=1e-4, tis_batch_normalize=True),
    mis_jax.MISConfig(tis_level="geometric", tis_mode="clip", tis_lower_bound=0.8, tis_upper_bound=1.2,
                      use_rs=True, rs_level="sequence", rs_upper_bound=5.0, tis_batch_normalize=True,
                      rs_criteria=CRITERIA),
    mis_jax.MISConfig(tis_mode="none", use_rs=True, rs_level="geometric", rs_lower_bound=0.9, rs_upper_bound=1.1),
]
MODES = ("seq-mean-token-mean", "token-mean")


@contextlib.contextmanager
def paired(flag):
  before = _segments._pair
  _segments._pair = flag
  try:
    yield
  finally:
    _segments._pair = before


@contextlib.contextmanager
def chunks(n):
  before = _segments._chunk_tokens
  mis_jax.set_chunk_tokens(n)
  try:
    yield
  finally:
    _segments._chunk_tokens = before


def weights(cfg, mode, batch=BATCH):
  return jax.jit(lambda b: mis_jax.compute_mis_weights(
      b.old_logprobs, b.rollout_logprobs, b.loss_mask, b.segment_ids, cfg, num_segments=b.num_segments,
      metric_reduction=mode))(batch)


def assert_same(got, want, rtol=2e-6):
  got, want = jax.tree_util.tree_map(np.asarray, (got, want))
  flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
  flat_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
  assert tree_got == tree_want
  for (path, a), (_, b) in zip(flat_got, flat_want):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_chunking_plan():
  assert _segments._chunking(296, None) == (296, 1, 0)
  assert _segments._chunking(296, 8) == (8, 37, 0)
  assert _segments._chunking(296, 30) == (30, 9, 26)  # 296 = 8 * 37: no divisor in [15, 30]
  assert _segments._chunking(296, 1000) == (296, 1, 0)
  with pytest.raises(ValueError, match="chunk tokens must be a positive int"):
    mis_jax.set_chunk_tokens(0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", range(len(MIS_CONFIGS)))
def test_weights_chunked_equal_one_pass(cfg, mode):
  with chunks(None):
    want = weights(MIS_CONFIGS[cfg], mode)
  for n in (8, 30):
    with chunks(n):
      assert_same(weights(MIS_CONFIGS[cfg], mode), want)


def test_unpaired_scatters_equal_paired():
  """Per-segment sums as separate float32 scatters (the accelerator path) == complex64 pairs."""
  cfg = MIS_CONFIGS[2]  # four per-segment sums in pass 1 and two in pass 2, in pairs
  with chunks(30), paired(True):
    want = weights(cfg, "seq-mean-token-mean")
  with chunks(30), paired(False):
    assert_same(weights(cfg, "seq-mean-token-mean"), want)


@pytest.mark.parametrize("roll,tis", [(False, True), (True, True), (True, False)])
def test_loss_and_gradient_chunked_equal_one_pass(roll, tis):
  cfg = mis_jax.LossConfig(use_rollout_logprobs=roll, use_tis=tis, mis=MIS_CONFIGS[1] if tis else None,
                           kl_coef=0.1, entropy_coef=0.01)
  fn = lambda lp, b: jax.value_and_grad(lambda x: mis_jax.policy_loss(x, b, cfg, entropy=EXTRA["ent"]),
                                        has_aux=True)(lp)
  with chunks(None):
    want = jax.jit(fn)(EXTRA["lp"], BATCH)
  with chunks(30):
    got = jax.jit(fn)(EXTRA["lp"], BATCH)
  assert_same(got, want)


def test_chunked_inside_shard_map():
  cfg = MIS_CONFIGS[1]
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  spec = mis_jax.batch_partition_spec("data", "seq")
  batch = pack(SEQS, row_len=44, num_rows=8)[0]  # 4 rows x 11 tokens per device

  def fn(b):
    return mis_jax.compute_mis_weights(b.old_logprobs, b.rollout_logprobs, b.loss_mask, b.segment_ids, cfg,
                                       num_segments=b.num_segments, axis_name=("data", "seq"))
  in_specs = (jax.tree_util.tree_map(lambda _: spec, batch),)
  mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs,
                                 out_specs=(spec, spec, jax.sharding.PartitionSpec())))
  with chunks(None):
    want = weights(cfg, "seq-mean-token-mean", batch)
  with chunks(10):  # 44 tokens per device: 4 chunks of 10 and one of 4
    got = mapped(mis_jax.shard_batch(mesh, batch, seq_axis="seq"))
  assert_same(got, want, rtol=1e-5)
