"""axis_name inside jax.shard_map on 8 simulated devices equals one device (SPEC §10):
data parallel (rows over devices) and sequence parallel (segments split across devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import mis_jax
from helpers import pack, random_seqs

SEQS = random_seqs(np.random.default_rng(3), n_seqs=12, with_ref=True, mismatch=0.4)
BATCH, EXTRA, _ = pack(SEQS, row_len=16, num_rows=8)
MIS = mis_jax.MISConfig(tis_level="sequence", tis_mode="mask", tis_upper_bound=4.0, use_rs=True, rs_level="token",
                        rs_upper_bound=3.0, rs_veto_threshold=1e-4, tis_batch_normalize=True)
LAYOUTS = {"data-8": ((8,), ("data",), P("data")), "data-4x-seq-2": ((4, 2), ("data", "seq"), P("data", "seq")),
           "data-2x-seq-4": ((2, 4), ("data", "seq"), P("data", "seq"))}


def _sharded(fn, layout):
  shape, names, spec = LAYOUTS[layout]
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  bspec = jax.tree_util.tree_map(lambda _: spec, BATCH)
  mapped = jax.shard_map(lambda lp, b: fn(lp, b, names), mesh=mesh, in_specs=(spec, bspec), out_specs=P())
  return mapped, put(jnp.asarray(EXTRA["lp"])), jax.tree_util.tree_map(put, BATCH)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("use_roll,use_tis,den", [(False, False, "kept"), (True, False, "kept"),
                                                  (False, True, "kept"), (True, True, "original")])
def test_policy_loss_sharded_equals_single_device(layout, use_roll, use_tis, den):
  cfg = mis_jax.LossConfig(use_rollout_logprobs=use_roll, use_tis=use_tis, mis=MIS if use_tis else None,
                           kl_coef=0.1, denominator=den)
  mapped, lp, batch = _sharded(lambda lp, b, ax: mis_jax.policy_loss(lp, b, cfg, axis_name=ax), layout)
  loss, metrics = jax.jit(mapped)(lp, batch)
  loss0, metrics0 = mis_jax.policy_loss(EXTRA["lp"], BATCH, cfg)
  np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-5, atol=1e-7)
  assert set(metrics) == set(metrics0)
  for k in metrics0:
    np.testing.assert_allclose(float(metrics[k]), float(metrics0[k]), rtol=1e-5, atol=1e-6, err_msg=k)
  grad = jax.jit(jax.grad(lambda lp, b: mapped(lp, b)[0]))(lp, batch)
  grad0 = jax.grad(lambda lp: mis_jax.policy_loss(lp, BATCH, cfg)[0])(jnp.asarray(EXTRA["lp"]))
  np.testing.assert_allclose(np.asarray(grad), np.asarray(grad0), rtol=1e-5, atol=1e-7)


def test_compute_mis_weights_sequence_parallel():
  def fn(lp, b, ax):
    w, kept, met = mis_jax.compute_mis_weights(b.old_logprobs, b.rollout_logprobs, b.loss_mask, b.segment_ids,
                                               MIS, num_segments=b.num_segments, axis_name=ax)
    return met
  mapped, lp, batch = _sharded(fn, "data-2x-seq-4")
  metrics = jax.jit(mapped)(lp, batch)
  _, _, metrics0 = mis_jax.compute_mis_weights(BATCH.old_logprobs, BATCH.rollout_logprobs, BATCH.loss_mask,
                                               BATCH.segment_ids, MIS, num_segments=BATCH.num_segments)
  for k in metrics0:
    np.testing.assert_allclose(float(metrics[k]), float(metrics0[k]), rtol=1e-5, atol=1e-6, err_msg=k)
