"""The pass engine (mis_jax.engine.PassOptions): chunked passes == one pass for weights, kept mask,
every metric, the loss and its gradient, for chunks that divide the batch, chunks with a
smaller last chunk, and inside shard_map; the oracle under jit across every engine path
({1, many lanes} x {paired, unpaired} x {chunked with a tail, one chunk}); options resolved
from the inputs; and the scatter count of the reference config (losing a shared per-mask
count adds a scatter and fails). The one-pass results are checked against the NumPy oracle
by test_weights/test_losses too."""

import itertools

import jax
import jax.extend
import numpy as np
import pytest
from jax.sharding import AxisType

import mis_jax
from mis_jax import _engine
from helpers import assert_weights_match_oracle, pack, random_seqs

SEQS = random_seqs(
  np.random.default_rng(11), n_seqs=14, max_len=11, with_ref=True, with_entropy=True, mismatch=0.5, catastrophic=0.04
)
# 8 rows x 37 tokens = 296 tokens: chunk 8 divides it (no tail), chunk 30 does not (tail 26).
BATCH, EXTRA, PACKING = pack(SEQS, row_len=37, num_rows=8)
CRITERIA = (
  mis_jax.RSCriterion("k3", "seq_mean", upper=0.5),
  mis_jax.RSCriterion("k1", "seq_max", lower=-1.0),
  mis_jax.RSCriterion("k2", "token", upper=0.3),
)
MIS_CONFIGS = [
  mis_jax.MISConfig(
    use_rs=True, tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4, tis_batch_normalize=True
  ),
  mis_jax.MISConfig(
    tis_level="sequence",
    tis_mode="mask",
    tis_upper_bound=4.0,
    use_rs=True,
    rs_level="token",
    rs_upper_bound=3.0,
    rs_veto_threshold=1e-4,
    tis_batch_normalize=True,
  ),
  mis_jax.MISConfig(
    tis_level="geometric",
    tis_mode="clip",
    tis_lower_bound=0.8,
    tis_upper_bound=1.2,
    use_rs=True,
    rs_level="sequence",
    rs_upper_bound=5.0,
    tis_batch_normalize=True,
    rs_criteria=CRITERIA,
  ),
  mis_jax.MISConfig(tis_mode="none", use_rs=True, rs_level="geometric", rs_lower_bound=0.9, rs_upper_bound=1.1),
]
MODES = ("seq-mean-token-mean", "token-mean")
# This batch's CPU options (pass_options: lanes 1 for its mean segment length of 21) with a
# given chunk size.
DEFAULT = mis_jax.engine.pass_options(BATCH.segment_ids, BATCH.num_segments, platform="cpu")


def chunks(n, **kw):
  return mis_jax.engine.PassOptions(chunk_tokens=n, lanes=kw.get("lanes", DEFAULT.lanes), paired=kw.get("paired", True))


def weights(cfg, mode, options, batch=BATCH):
  return jax.jit(
    lambda b: mis_jax.compute_mis_weights(
      b.old_logprobs,
      b.rollout_logprobs,
      b.loss_mask,
      b.segment_ids,
      cfg,
      num_segments=b.num_segments,
      metric_reduction=mode,
      pass_options=options,
    )
  )(batch)


def assert_same(got, want, rtol=2e-6):
  got, want = jax.tree_util.tree_map(np.asarray, (got, want))
  flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
  flat_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
  assert tree_got == tree_want
  for (path, a), (_, b) in zip(flat_got, flat_want):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_chunking_plan():
  assert _engine.chunking(296, None) == (296, 1, 0)
  assert _engine.chunking(296, 8) == (8, 37, 0)
  assert _engine.chunking(296, 30) == (30, 9, 26)  # 296 = 8 * 37: no divisor in [15, 30]
  assert _engine.chunking(296, 1000) == (296, 1, 0)
  with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
    mis_jax.engine.PassOptions(chunk_tokens=0)
  with pytest.raises(ValueError, match="lanes must be a power of two"):
    mis_jax.engine.PassOptions(lanes=3)
  with pytest.raises(TypeError, match="pass options must be a mis_jax.engine.PassOptions"):
    mis_jax.compute_mis_weights(
      BATCH.old_logprobs,
      BATCH.rollout_logprobs,
      BATCH.loss_mask,
      BATCH.segment_ids,
      MIS_CONFIGS[0],
      num_segments=BATCH.num_segments,
      pass_options={"chunk_tokens": 8},
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", range(len(MIS_CONFIGS)))
@pytest.mark.slow
def test_weights_chunked_equal_one_pass(cfg, mode):
  want = weights(MIS_CONFIGS[cfg], mode, chunks(None))
  for n in (8, 30):
    assert_same(weights(MIS_CONFIGS[cfg], mode, chunks(n)), want)


def test_unpaired_scatters_equal_paired():
  """Per-segment sums as separate float32 scatters (the accelerator path) == complex64 pairs."""
  cfg = MIS_CONFIGS[2]  # four per-segment sums in pass 1 and two in pass 2, in pairs
  want = weights(cfg, "seq-mean-token-mean", chunks(30, paired=True))
  assert_same(weights(cfg, "seq-mean-token-mean", chunks(30, paired=False)), want)


@pytest.mark.parametrize("roll,tis", [(False, True), (True, True), (True, False)])
def test_loss_and_gradient_chunked_equal_one_pass(roll, tis):
  cfg = mis_jax.LossConfig(
    use_rollout_logprobs=roll, use_tis=tis, mis=MIS_CONFIGS[1] if tis else None, kl_coef=0.1, entropy_coef=0.01
  )
  fn = lambda lp, b, o: jax.value_and_grad(
    lambda x: mis_jax.policy_loss(x, b, cfg, entropy=EXTRA["ent"], pass_options=o), has_aux=True
  )(lp)
  fn = jax.jit(fn, static_argnums=2)
  want = fn(EXTRA["lp"], BATCH, chunks(None))
  got = fn(EXTRA["lp"], BATCH, chunks(30))
  assert_same(got, want)


def test_chunked_inside_shard_map():
  cfg = MIS_CONFIGS[1]
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  spec = mis_jax.batch_partition_spec("data", "seq")
  batch = pack(SEQS, row_len=44, num_rows=8)[0]  # 4 rows x 11 tokens per device

  def fn(b):  # 44 tokens per device: 4 chunks of 10 and one of 4
    return mis_jax.compute_mis_weights(
      b.old_logprobs,
      b.rollout_logprobs,
      b.loss_mask,
      b.segment_ids,
      cfg,
      num_segments=b.num_segments,
      axis_name=("data", "seq"),
      pass_options=chunks(10),
    )

  in_specs = (jax.tree_util.tree_map(lambda _: spec, batch),)
  mapped = jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(spec, spec, jax.sharding.PartitionSpec()))
  )
  want = weights(cfg, "seq-mean-token-mean", chunks(None), batch)
  got = mapped(mis_jax.shard_batch(mesh, batch, seq_axis="seq"))
  assert_same(got, want, rtol=1e-5)


# Every engine path: {1, 4} lanes x {paired, unpaired} x {chunks of 30 with a tail of 26, one
# chunk}. The config has every kind of contribution (per-segment sums, a per-segment max,
# totals, a global max and min, per-token outputs) and both kinds of level.
GRID_CFG = mis_jax.MISConfig(
  tis_level="geometric",
  tis_mode="clip",
  tis_lower_bound=0.8,
  tis_upper_bound=1.2,
  use_rs=True,
  rs_level="sequence",
  rs_upper_bound=5.0,
  rs_veto_threshold=1e-4,
  tis_batch_normalize=True,
  rs_criteria=CRITERIA,
)
GRID = [
  mis_jax.engine.PassOptions(chunk_tokens=c, lanes=lanes, paired=p)
  for lanes, p, c in itertools.product((1, 4), (True, False), (30, None))
]


@pytest.mark.parametrize(
  "options",
  GRID,
  ids=lambda o: (
    f"lanes{o.lanes}-{'paired' if o.paired else 'unpaired'}-"
    f"{'chunk' + str(o.chunk_tokens) if o.chunk_tokens else 'one'}"
  ),
)
def test_every_engine_path_matches_oracle_under_jit(options):
  mode = "seq-mean-token-mean"
  w, kept, metrics = weights(GRID_CFG, mode, options)
  assert_weights_match_oracle(w, kept, metrics, SEQS, PACKING, GRID_CFG, mode)


def test_pass_options_follow_where_the_inputs_live():
  ids = np.zeros((4, 1024), np.int32)
  assert mis_jax.engine.pass_options(ids, 4, platform="cpu") == mis_jax.engine.PassOptions(8192, 8, True)
  assert mis_jax.engine.pass_options(ids, 4, platform="gpu") == mis_jax.engine.PassOptions(None, 8, False)
  assert mis_jax.engine.pass_options(ids, 4096, platform="tpu").lanes == 1  # short segments: no lanes
  assert mis_jax.engine.pass_options(ids, 64, platform="cpu").lanes == 4  # mean length 64: 64 // 16
  on_cpu = jax.device_put(ids, jax.devices("cpu")[0])
  assert mis_jax.engine.pass_options(on_cpu, 4) == mis_jax.engine.pass_options(ids, 4, platform="cpu")


def _count(jaxpr, name):
  """Equations named ``name`` in a jaxpr, recursing into every sub-jaxpr (scan, loops, jit)."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == name
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          n += _count(sub.jaxpr, name)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          n += _count(sub, name)
  return n


@pytest.mark.parametrize("paired,want", [(True, 4), (False, 7)])
def test_reference_config_scatter_count(paired, want):
  """Decoupled PPO with configs/mis.yaml, one chunk: pass 1 sums n_s, Σ m r, Σ m o, Σ m q and
  the catastrophic counts (5 sums: 3 paired scatters), pass 2 the kept counts and kept
  weights (2 sums: 1 paired scatter); the loss aggregation and the metrics over m and m'
  reuse those counts (MaskStats), so a lost share is one more scatter."""
  cfg = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig.from_yaml("configs/mis.yaml"))
  options = mis_jax.engine.PassOptions(chunk_tokens=None, lanes=1, paired=paired)
  jaxpr = jax.make_jaxpr(lambda lp, b: mis_jax.policy_loss(lp, b, cfg, pass_options=options))(EXTRA["lp"], BATCH)
  assert _count(jaxpr.jaxpr, "scatter-add") == want


def test_chunking_follows_the_options_even_with_closed_over_numpy_ids():
  """Chunking is what the options say, not whether segment_ids happen to be traced."""
  ids, mask = np.asarray(BATCH.segment_ids), np.asarray(BATCH.loss_mask)

  def loops(options):
    fn = lambda o, q: mis_jax.compute_mis_weights(
      o, q, mask, ids, MIS_CONFIGS[0], num_segments=BATCH.num_segments, pass_options=options
    )
    jaxpr = jax.make_jaxpr(jax.jit(fn))(BATCH.old_logprobs, BATCH.rollout_logprobs).jaxpr
    return _count(jaxpr, "scan") + _count(jaxpr, "while")

  assert loops(chunks(30)) == 2  # one loop per pass
  assert loops(chunks(None)) == 0


def test_segments_hold_no_state_between_traces():
  """A Segments built outside any trace serves two jits and eager calls alike."""
  segs = mis_jax.engine.Segments(BATCH.segment_ids, BATCH.num_segments, options=chunks(None))
  x = np.where(np.asarray(BATCH.loss_mask), 1.0, 0.0).astype(np.float32)
  want = np.asarray(segs.sum(x.reshape(-1)))
  for fn in (jax.jit(lambda x: segs.sum(x.reshape(-1))), jax.jit(lambda x: 2.0 * segs.sum(x.reshape(-1)))):
    fn(x)
  np.testing.assert_array_equal(np.asarray(segs.sum(x.reshape(-1))), want)
  stats = jax.jit(lambda m: segs.mask_stats(m.reshape(-1)))(np.asarray(BATCH.loss_mask))
  np.testing.assert_array_equal(np.asarray(stats.counts), want)
  assert float(stats.total) == want.sum() and float(stats.num_live) == (want > 0).sum()
