"""The step's global-norm clip (`step.clip_by_global_norm`) against Optax's: the same gradients
where nothing is clipped, within an ulp where they are. (What it saves shows in the compiled step
of a real-size model, not of a toy one: at Qwen3-0.6B in float32 XLA materialised Optax's divided
gradients, 2.4 GB of temporaries, and not ours; docs/performance.md.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainers.learner.step import clip_by_global_norm


def _grads(scale):
  rng = np.random.default_rng(0)
  return {
    "a": jnp.asarray(rng.standard_normal((64, 32)) * scale, jnp.float32),
    "b": [jnp.asarray(rng.standard_normal(7) * scale, jnp.float32)],
  }


@pytest.mark.parametrize("jit", [False, True])
def test_unclipped_gradients_are_optaxs_bit_for_bit_and_clipped_ones_to_an_ulp(jit):
  ours, theirs = clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
  for scale, exact in ((1e-3, True), (10.0, False)):
    g = _grads(scale)
    run = (
      (lambda t: jax.jit(lambda u: t.update(u, t.init(u))[0]))
      if jit
      else (lambda t: lambda u: t.update(u, t.init(u))[0])
    )
    a, b = run(ours)(g), run(theirs)(g)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      if exact:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      else:
        np.testing.assert_array_max_ulp(np.asarray(x), np.asarray(y), maxulp=1)
    norm = float(optax.tree.norm(a))
    assert (norm < 1.0) if exact else norm == pytest.approx(1.0, rel=1e-6)
