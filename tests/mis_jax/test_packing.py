"""Packer (first-fit-decreasing), its inverse and the PackedBatch pytree (contract §1)."""

import jax
import numpy as np
import pytest

import mis_jax


def test_first_fit_decreasing_layout():
  # Sorted: 6(a) 5(b) 4(c) 3(d) 2(e); rows of 8: a|e, b|d, c.
  lengths = [6, 4, 5, 2, 3]
  p = mis_jax.plan_packing(lengths, 8)
  assert p.num_rows == 3
  np.testing.assert_array_equal(p.rows, [0, 2, 1, 0, 1])
  np.testing.assert_array_equal(p.offsets, [0, 0, 0, 6, 5])
  np.testing.assert_array_equal(
    p.segment_ids, [[0, 0, 0, 0, 0, 0, 3, 3], [2, 2, 2, 2, 2, 4, 4, 4], [1, 1, 1, 1, -1, -1, -1, -1]]
  )
  np.testing.assert_array_equal(p.positions[1], [0, 1, 2, 3, 4, 0, 1, 2])
  np.testing.assert_array_equal(p.positions[2], [0, 1, 2, 3, 0, 0, 0, 0])


def test_pack_unpack_roundtrip_and_fixed_rows():
  rng = np.random.default_rng(0)
  seqs = [rng.normal(size=n).astype(np.float32) for n in [3, 0, 7, 1, 5, 8]]
  p = mis_jax.plan_packing([len(s) for s in seqs], 8, num_rows=5)
  packed = p.pack(seqs, np.nan)
  assert packed.shape == (5, 8) and packed.dtype == np.float32
  for a, b in zip(p.unpack(packed), seqs):
    np.testing.assert_array_equal(a, b)
  assert np.isnan(packed[p.segment_ids < 0]).all()
  assert mis_jax.plan_packing([1, 1], 4, row_multiple=4).num_rows == 4


def test_packing_errors():
  with pytest.raises(ValueError, match=r"sequence 1 has length 9 > row_len=8"):
    mis_jax.plan_packing([3, 9], 8)
  with pytest.raises(ValueError, match=r"need 2 rows of 8 tokens, but num_rows=1"):
    mis_jax.plan_packing([5, 5], 8, num_rows=1)
  p = mis_jax.plan_packing([2, 3], 8)
  with pytest.raises(ValueError, match=r"sequence 0 has shape \(3,\), expected \(2,\)"):
    p.pack([np.zeros(3), np.zeros(3)])


def test_packed_batch_is_a_pytree_with_static_num_segments():
  b = mis_jax.PackedBatch(
    segment_ids=np.zeros((2, 4), np.int32), loss_mask=np.ones((2, 4)), advantages=np.ones((2, 4)), num_segments=3
  )
  leaves, treedef = jax.tree_util.tree_flatten(b)
  assert len(leaves) == 3  # None fields are not leaves; num_segments is static
  again = jax.tree_util.tree_unflatten(treedef, leaves)
  assert again.num_segments == 3 and again.old_logprobs is None
  parts = mis_jax.split_microbatches(b, 2)
  assert len(parts) == 2 and parts[0].shape == (1, 4)
  with pytest.raises(TypeError, match="num_segments must be a Python int"):
    mis_jax.PackedBatch(
      segment_ids=b.segment_ids, loss_mask=b.loss_mask, advantages=b.advantages, num_segments=np.zeros(2)
    )
  with pytest.raises(ValueError, match="cannot split 2 rows into 3"):
    mis_jax.split_microbatches(b, 3)
