"""The one bitwise threshold search: the largest integer with a monotone property, built bit by
bit from the top (each bit one evaluation of the property, so exact and with a static trip count).

Two callers: the covariance forms' global top-k (`_policy_losses`: the threshold on order-
preserving uint32 keys whose global count reaches k) and the threshold controller (`_controller`:
the loosest or tightest float32 bound meeting a target, searched over the bits of a non-negative
float, whose integer order is its value's order).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def largest_with(pred: Callable[[jax.Array], jax.Array], *, bits: int, dtype) -> jax.Array:
  """The largest ``k`` in ``[0, 2**bits)`` (of integer ``dtype``) with ``pred(k)``, for a ``pred``
  true up to a point and false after it; 0 when ``pred`` holds nowhere above 0."""
  one = jnp.dtype(dtype).type(1)  # a scalar literal, not a constant the loop carries

  def bit(i, k):
    candidate = k | jnp.left_shift(one, (bits - 1 - i).astype(dtype))
    return jnp.where(pred(candidate), candidate, k)

  return jax.lax.fori_loop(0, bits, bit, jnp.dtype(dtype).type(0))
