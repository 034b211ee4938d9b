"""Sharded == single device on 8 simulated CPU devices (contract §10): loss, every metric and the
gradient w.r.t. replicated parameters of a small Flax NNX model, under every algorithm, for
data parallelism (rows over devices) and sequence parallelism (segments split across
devices), on meshes 8, 4x2 and 2x4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import mis_jax
from helpers import pack, random_seqs

SEQS = random_seqs(np.random.default_rng(3), n_seqs=12, with_ref=True, with_entropy=True, mismatch=0.4)
BATCH, EXTRA, _ = pack(SEQS, row_len=16, num_rows=8)
MIS = mis_jax.MISConfig(
  tis_level="sequence",
  tis_mode="mask",
  tis_upper_bound=4.0,
  use_rs=True,
  rs_level="token",
  rs_upper_bound=3.0,
  rs_veto_threshold=1e-4,
  tis_batch_normalize=True,
)
CONFIGS = [
  mis_jax.LossConfig(
    use_rollout_logprobs=roll,
    use_tis=tis,
    mis=MIS if tis else None,
    kl_coef=0.1,
    entropy_coef=0.01,
    denominator="original" if roll and tis else "kept",
  )
  for roll in (False, True)
  for tis in (False, True)
]
# (mesh shape, axis names, data axis, seq axis)
LAYOUTS = {
  "8-data": ((8,), ("data",), "data", None),
  "4x2-data": ((4, 2), ("data", "seq"), ("data", "seq"), None),
  "4x2-seq": ((4, 2), ("data", "seq"), "data", "seq"),
  "2x4-data": ((2, 4), ("data", "seq"), ("data", "seq"), None),
  "2x4-seq": ((2, 4), ("data", "seq"), "data", "seq"),
}
VOCAB = 32


class TinyPolicy(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, 16, rngs=rngs)
    self.head = nnx.Linear(16, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    return self.head(jnp.tanh(self.embed(tokens)))


GRAPHDEF, PARAMS = nnx.split(TinyPolicy(nnx.Rngs(0)))
_rng = np.random.default_rng(0)
TOKENS = _rng.integers(0, VOCAB, BATCH.shape).astype(np.int32)
TARGETS = _rng.integers(0, VOCAB, BATCH.shape).astype(np.int32)


def model_logprobs(params, tokens, targets):
  logits = nnx.merge(GRAPHDEF, params)(tokens)
  logp = jax.nn.log_softmax(logits)
  entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
  return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], entropy


def all_algorithms(loss_fns, params, batch, tokens, targets):
  out = []
  for f in loss_fns:

    def loss(p):
      lp, ent = model_logprobs(p, tokens, targets)
      return f(lp, batch, ent)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(params)
    out.append((value, metrics, grad))
  return out


@pytest.fixture(scope="module")
def single_device():
  fns = [lambda lp, b, ent, c=c: mis_jax.policy_loss(lp, b, c, entropy=ent) for c in CONFIGS]
  return jax.jit(lambda p: all_algorithms(fns, p, BATCH, TOKENS, TARGETS))(PARAMS)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.slow
def test_sharded_equals_single_device(layout, single_device):
  shape, names, data_axis, seq_axis = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
  fns = [mis_jax.sharded_policy_loss(mesh, c, data_axis=data_axis, seq_axis=seq_axis) for c in CONFIGS]
  batch, tokens, targets = mis_jax.shard_batch(mesh, (BATCH, TOKENS, TARGETS), data_axis=data_axis, seq_axis=seq_axis)
  with jax.set_mesh(mesh):
    sharded = jax.jit(lambda p, b, x, y: all_algorithms(fns, p, b, x, y))(PARAMS, batch, tokens, targets)
  for cfg, (loss, metrics, grad), (loss0, metrics0, grad0) in zip(CONFIGS, sharded, single_device):
    name = cfg.algorithm
    np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-5, atol=1e-7, err_msg=name)
    assert set(metrics) == set(metrics0)
    for k in metrics0:
      np.testing.assert_allclose(float(metrics[k]), float(metrics0[k]), rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}")
    for g, g0 in zip(jax.tree_util.tree_leaves(grad), jax.tree_util.tree_leaves(grad0)):
      g0 = np.asarray(g0)
      np.testing.assert_allclose(np.asarray(g), g0, rtol=1e-5, atol=1e-6 * np.abs(g0).max(), err_msg=name)


def test_compute_mis_weights_sequence_parallel():
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  spec = mis_jax.batch_partition_spec("data", "seq")

  def fn(b):
    return mis_jax.compute_mis_weights(
      b.old_logprobs,
      b.rollout_logprobs,
      b.loss_mask,
      b.segment_ids,
      MIS,
      num_segments=b.num_segments,
      axis_name=("data", "seq"),
    )

  mapped = jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(jax.tree_util.tree_map(lambda _: spec, BATCH),),
    out_specs=(spec, spec, jax.sharding.PartitionSpec()),
  )
  w, kept, metrics = jax.jit(mapped)(mis_jax.shard_batch(mesh, BATCH, seq_axis="seq"))
  w0, kept0, metrics0 = mis_jax.compute_mis_weights(
    BATCH.old_logprobs, BATCH.rollout_logprobs, BATCH.loss_mask, BATCH.segment_ids, MIS, num_segments=BATCH.num_segments
  )
  np.testing.assert_allclose(np.asarray(w), np.asarray(w0), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(kept), np.asarray(kept0))
  for k in metrics0:
    np.testing.assert_allclose(float(metrics[k]), float(metrics0[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def test_wrapper_rejects_bad_layouts():
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match="no axis named 'seq'"):
    mis_jax.sharded_policy_loss(mesh, CONFIGS[0], seq_axis="seq")
  f = mis_jax.sharded_policy_loss(mesh, CONFIGS[0])
  small, extra, _ = pack(SEQS[:3], row_len=16, num_rows=2)
  with pytest.raises(ValueError, match=r"rows by 8"):
    f(extra["lp"], small, extra["ent"])


def test_sharded_loss_takes_the_steps_correction():
  """`sharded_policy_loss(...)(..., correction=)`: the step's Correction (decoupled PPO's weights
  and kept mask, kl_cov's selection, the denominators) sharded like the batch (its denominators
  replicated) gives the single-device loss with the same correction."""
  cfg = mis_jax.LossConfig(
    use_tis=True, mis=MIS, policy_loss={"name": "kl_cov", "kl_cov_ratio": 0.1}, kl_coef=0.1, entropy_coef=0.01
  )
  correction, _ = mis_jax.prepare_step(BATCH, cfg)
  lp, ent = model_logprobs(PARAMS, TOKENS, TARGETS)
  loss0, metrics0 = mis_jax.policy_loss(lp, BATCH, cfg, entropy=ent, correction=correction)
  mesh = jax.make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)
  sharded = mis_jax.sharded_policy_loss(mesh, cfg, seq_axis="seq")
  batch, lp_s, ent_s = mis_jax.shard_batch(mesh, (BATCH, lp, ent), seq_axis="seq")
  per_token = mis_jax.shard_batch(mesh, correction.replace(denominators=None), seq_axis="seq")
  with jax.set_mesh(mesh):
    loss, metrics = jax.jit(lambda a, b, c, d: sharded(a, b, c, correction=d))(
      lp_s, batch, ent_s, per_token.replace(denominators=correction.denominators)
    )
  np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-5, atol=1e-7)
  assert set(metrics) == set(metrics0) and "cov_selected_fraction" in metrics
  for k in metrics0:
    np.testing.assert_allclose(float(metrics[k]), float(metrics0[k]), rtol=1e-5, atol=1e-6, err_msg=k)
