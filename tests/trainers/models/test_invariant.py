"""Batch-invariant arithmetic (`trainers.models.invariant`, the decoder's `arithmetic: batch_invariant`,
exact mode's, contract §13): its sums equal a NumPy left-to-right float32 loop bit for bit, its
16-bit rounding is a cast's, a row's values do not depend on the rows beside it, and a token's
attention over its sequence is the same in a cache window (left padding, masked slots, a longer
window) as in a packed row (other sequences before it). The decoder-level equalities (the engine's
decoding against the trainer's teacher-forced exact pass) are `test_exact_sampler.py`'s."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trainers.learner.step import ExactPass
from trainers.models import invariant
from trainers.models.attention import segment_mask

pytestmark = pytest.mark.slow  # batch-invariant programs compile at LLVM level 2: make test, not make test-fast

jit = lambda f: jax.jit(f, compiler_options=invariant.COMPILER_OPTIONS)
F32, BF16 = jnp.float32, jnp.bfloat16


def numpy_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """The oracle: `Σ_k x_k w_k` left to right in float32, each product rounded before it is added."""
  acc = np.zeros(x.shape[:-1] + (w.shape[1],), np.float32)
  for k in range(x.shape[-1]):
    acc = (acc + (x[..., k, None] * w[k]).astype(np.float32)).astype(np.float32)
  return acc


def numpy_sum(x: np.ndarray) -> np.ndarray:
  acc = np.zeros(x.shape[:-1], np.float32)
  for k in range(x.shape[-1]):
    acc = (acc + x[..., k]).astype(np.float32)
  return acc


@pytest.mark.parametrize("m, k, n", [(1, 64, 64), (5, 64, 48), (17, 100, 30), (3, 200, 8)])
def test_matmul_is_the_numpy_left_to_right_loop(m, k, n):
  """A loop over blocks of terms, the odd one written out: the same order."""
  rng = np.random.default_rng(m * k)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((k, n)).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(jit(invariant.matmul)(x, w)), numpy_matmul(x, w))
  x3 = x.reshape(1, m, k)  # leading axes are rows like any other
  np.testing.assert_array_equal(np.asarray(jit(invariant.matmul)(x3, w))[0], numpy_matmul(x, w))


@pytest.mark.parametrize("length", [1, 7, 64, 65, 300])
def test_ordered_sum_is_the_numpy_loop(length):
  x = np.random.default_rng(length).standard_normal((3, length)).astype(np.float32) * 10
  np.testing.assert_array_equal(np.asarray(jit(invariant.ordered_sum)(x)), numpy_sum(x))


def test_the_sum_fused_with_exp_is_not_contracted():
  """A product rounded before it is added even where XLA fuses the sum with a transcendental after it
  (LLVM contracted such a fused 64-term sum into FMAs: the guard keeps the products rounded)."""
  rng = np.random.default_rng(0)
  x, w = rng.standard_normal((13, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32) * 0.3
  fused = np.asarray(jit(lambda x, w: jnp.exp(invariant.matmul(x, w)))(x, w))
  np.testing.assert_array_equal(fused, np.asarray(jit(jnp.exp)(numpy_matmul(x, w))))


def test_round_to_is_a_cast_to_bfloat16():
  rng = np.random.default_rng(0)
  x = np.concatenate(
    [
      rng.standard_normal(1000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 1000),
      np.array([0.0, -0.0, np.inf, -np.inf, 1e-40, -3e-39, 3.4e38, 1.00390625, 1.01171875], np.float32),
    ]
  ).astype(np.float32)
  want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(jit(lambda v: invariant.round_to(v, BF16))(x)), want)
  np.testing.assert_array_equal(np.asarray(jit(lambda v: invariant.round_to(v, F32))(x)), x)


@pytest.mark.parametrize(
  "weight_dtype, served_dtype",
  [("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")],
)
def test_exact_pass_holds_the_engines_copy_of_the_weights(weight_dtype, served_dtype):
  """`ExactPass.served` == the handover's casts (`MemorySync`: to the pushed dtype; the engine: to its
  served dtype), each a separate program, as the engine makes them."""
  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.standard_normal((64, 33)).astype(np.float32) * 3e-3), "i": jnp.arange(4)}
  dt = {"float32": F32, "bfloat16": BF16}
  engine = jax.tree.map(
    lambda a: (
      jax.jit(lambda v: v.astype(dt[served_dtype]))(jax.jit(lambda v: v.astype(dt[weight_dtype]))(a))
      if a.dtype == F32
      else a
    ),
    params,
  )
  served = jax.jit(ExactPass(served_dtype, weight_dtype, None).served)(params)
  assert served["w"].dtype == dt[served_dtype] and served["i"].dtype == params["i"].dtype
  np.testing.assert_array_equal(np.asarray(served["w"]).astype(np.float32), np.asarray(engine["w"]).astype(np.float32))


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("width", [64, 37])
def test_a_rows_values_do_not_depend_on_the_batch(dtype, width):
  """Each row alone equals the same row inside a batch of 17 (another kernel for XLA's own products),
  at a width of whole vectors and at one that leaves a remainder (37)."""
  rng = np.random.default_rng(2)
  carry = lambda a: np.asarray(jit(lambda v: invariant.round_to(v, dtype))(a))
  x = carry(rng.standard_normal((17, width)).astype(np.float32))
  w = carry(rng.standard_normal((width, 48)).astype(np.float32) * 0.2)
  norm = carry(rng.standard_normal(width).astype(np.float32) + 1)
  fns = {
    "linear": lambda v: invariant.linear(v, w, None, dtype),
    "rms_norm": lambda v: invariant.rms_norm(v, norm, 1e-6, dtype),
    "log_softmax": invariant.log_softmax,
    "softmax": invariant.softmax,
    "logsumexp": invariant.logsumexp,
    "temperature_log_softmax": lambda v: invariant.temperature_log_softmax(v * 3, jnp.float32(0.7)),
    "silu": invariant.silu,
  }
  for name, fn in fns.items():
    batch = np.asarray(jit(fn)(x))
    for i in (0, 5, 16):
      np.testing.assert_array_equal(np.asarray(jit(fn)(x[i : i + 1])), batch[i : i + 1], err_msg=name)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_tokens_attention_is_the_same_in_a_cache_window_and_in_a_packed_row(dtype):
  """Query `t` of a sequence that sits at offset 5 of a packed row (another sequence before it, padding
  after) == the same query decoded alone over a 32-slot cache window holding the sequence's keys from
  slot 9 (left padding before, unwritten slots after): masked keys add exact zeros."""
  rng = np.random.default_rng(3)
  carry = lambda a: np.array(jit(lambda v: invariant.round_to(v, dtype))(a.astype(np.float32)))
  length, row = 12, 24
  q = carry(rng.standard_normal((1, row, 4, 16)))
  k, v = carry(rng.standard_normal((1, row, 2, 16))), carry(rng.standard_normal((1, row, 2, 16)))
  seg = np.full((1, row), -1, np.int32)
  seg[0, :5], seg[0, 5 : 5 + length] = 0, 1
  packed = np.asarray(jit(lambda q, k, v, m: invariant.attention(q, k, v, m, dtype))(q, k, v, segment_mask(seg)))
  attend = jit(lambda q, k, v, m: invariant.attention(q, k, v, m, dtype))
  for t in (0, 4, length - 1):
    kw, vw = carry(rng.standard_normal((1, 32, 2, 16))), np.zeros((1, 32, 2, 16), np.float32)
    kw[0, 9 : 9 + t + 1], vw[0, 9 : 9 + t + 1] = k[0, 5 : 5 + t + 1], v[0, 5 : 5 + t + 1]
    mask = np.zeros((1, 1, 32), bool)
    mask[0, 0, 9 : 9 + t + 1] = True
    alone = np.asarray(attend(q[:, 5 + t : 5 + t + 1], kw, vw, mask))
    np.testing.assert_array_equal(alone, packed[:, 5 + t : 5 + t + 1])


def test_unknown_arithmetic_is_an_error():
  with pytest.raises(ValueError, match="arithmetic='fast'; allowed: default, batch_invariant"):
    invariant.check_arithmetic("fast")
