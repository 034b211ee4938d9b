"""The threshold controller (contract §3.1): a bound given as a target (``auto``) is set each
step from the step's own raw weights, exactly, inside the jitted pass.

The bound ``U`` is a float32; for positive floats the bit pattern orders like the value, so the
bound is built bit by bit from the top, each bit one evaluation of a monotone predicate over
the whole step (one global sum: every device, and every micro-batch since the correction runs
once per step). 31 evaluations give the float32 boundary itself: the chosen bound meets the
target and the next float32 past it does not.

The predicates work on *units*: tokens at token level, segments at the sequence and geometric
levels, each with its raw weight ``x`` and two multiplicities — ``count`` (1 per trained token,
or per live segment: what a masked share counts) and ``kept`` (the unit's kept tokens: what the
ESS sums over).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mis_jax._engine import AxisName, pmax, pmin, psum
from mis_jax._search import largest_with

_SMALLEST_NORMAL = float(jnp.finfo(jnp.float32).tiny)


class Units(NamedTuple):
  """What a controller predicate sums over (flat arrays, 0 multiplicity off the units).

  Attributes:
    x: float32 raw weights ``w_raw`` of the units.
    count: float32 multiplicity for masked shares (1 per trained token / live segment).
    kept: float32 multiplicity for the ESS (the unit's kept tokens).
    axis_name: the mesh axes the units are sharded over (tokens), or None (segments: global).
  """

  x: jax.Array
  count: jax.Array
  kept: jax.Array
  axis_name: AxisName


def _bits(x):
  return jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)


def _value(bits):
  return jax.lax.bitcast_convert_type(bits, jnp.float32)


def largest_true(pred, floor, cap):
  """The largest float32 ``U`` in ``[floor, cap]`` with ``pred(U)``, for a ``pred`` that is true
  up to a point and false after it; ``floor`` when ``pred(floor)`` is false."""
  lo, hi = _bits(floor), _bits(jnp.maximum(cap, floor))
  found = largest_with(lambda bits: pred(_value(jnp.clip(bits, lo, hi))), bits=31, dtype=jnp.int32)
  return _value(jnp.clip(found, lo, hi))


def smallest_true(pred, floor, cap):
  """The smallest float32 ``U`` in ``[floor, cap]`` with ``pred(U)``, for a ``pred`` that is false
  up to a point and true after it; ``cap`` when ``pred(cap)`` is false."""
  last_false = largest_true(lambda u: ~pred(u), floor, cap)
  hi = _bits(jnp.maximum(cap, floor))
  return jnp.where(pred(floor), floor, _value(jnp.minimum(_bits(last_false) + 1, hi)))


def _lower(lower: float | None, upper):
  """The band's lower bound: the fixed one, or ``1/U`` (contract §3's default)."""
  return 1.0 / upper if lower is None else jnp.float32(lower)


def _symmetric_cap(x_min, x_max):
  """A bound whose band ``[1/U, U]`` holds every unit: ``1/x_min`` nudged up so that its float32
  reciprocal is below ``x_min`` whatever the roundings."""
  return jnp.maximum(jnp.maximum(x_max, (1.0 / x_min) * jnp.float32(1 + 2**-20)), 1.0)


def _extremes(units: Units, multiplicity):
  on = multiplicity > 0
  lo = pmin(jnp.min(jnp.where(on, units.x, jnp.inf)), units.axis_name)
  hi = pmax(jnp.max(jnp.where(on, units.x, 0.0)), units.axis_name)
  return on, lo, hi


def ess_ratio(units: Units, mode: str, lower: float | None, upper):
  """``(Σ k w)² / (Σ k · Σ k w²)`` of the weights ``tis_mode`` makes of ``x`` at bound ``upper``
  (``k`` the kept multiplicity); 1 when nothing is kept."""
  w = jnp.minimum(units.x, upper) if mode == "truncate" else jnp.clip(units.x, _lower(lower, upper), upper)
  k = units.kept
  s = psum(jnp.stack([jnp.sum(k * w), jnp.sum(k * w * w), jnp.sum(k)]), units.axis_name)
  den = s[2] * s[1]
  return jnp.where(den > 0, s[0] * s[0] / jnp.where(den > 0, den, 1.0), 1.0)


def masked_count(units: Units, lower: float | None, upper, *, reciprocal: bool = True):
  """The masked count (by ``count``) of the band ``[lower, upper]`` and the total count; an unset
  ``lower`` is ``1/upper`` (``reciprocal``) or absent."""
  c = units.count
  out = units.x > upper
  if lower is not None or reciprocal:
    out = out | (units.x < _lower(lower, upper))
  s = psum(jnp.stack([jnp.sum(jnp.where(out, c, 0.0)), jnp.sum(c)]), units.axis_name)
  return s[0], s[1]


def ess_bound(units: Units, mode: str, lower: float | None, target: float):
  """``target_ess_ratio`` for ``truncate`` / ``clip``: the loosest ``U`` whose ESS ratio is
  ``>= target`` (the ESS does not increase as ``U`` loosens: every weight is ``<= U``, so
  ``Σ w² <= U Σ w``). Returns ``(U, ess_reached)``; when the raw weights meet the target, ``U``
  is their maximum (nothing is truncated)."""
  on, x_min, x_max = _extremes(units, units.kept)
  if mode == "clip" and lower is None:  # the band [1/U, U]: at U = 1 every weight is 1
    floor, cap = jnp.float32(1.0), _symmetric_cap(x_min, x_max)
  elif mode == "clip":
    floor = jnp.maximum(jnp.nextafter(jnp.float32(lower), jnp.float32(jnp.inf)), _SMALLEST_NORMAL)
    floor = jnp.maximum(floor, x_min)
    cap = jnp.maximum(x_max, floor)
  else:
    floor, cap = x_min, x_max
  any_kept = psum(jnp.sum(on.astype(jnp.float32)), units.axis_name) > 0
  floor, cap = jnp.where(any_kept, floor, 1.0), jnp.where(any_kept, cap, 1.0)
  u = largest_true(lambda u: ess_ratio(units, mode, lower, u) >= target, floor, cap)
  ess = ess_ratio(units, mode, lower, u)
  return u, ess, ess >= target


def masking_bound(units: Units, lower: float | None, fraction: float, *, reciprocal: bool = True):
  """``max_masked_fraction`` for a masking band: the tightest ``U`` whose band
  ``[lower (or 1/U), U]`` masks at most ``fraction`` of the units (by ``count``): the most
  extreme go, no more (``⌊f · Σ count⌋`` units at most, in float32). Returns
  ``(U, masked_share_reached, met)``; ``met`` is false only when a fixed lower bound alone masks
  more (then ``U`` is the loosest, masking nothing above)."""
  on, x_min, x_max = _extremes(units, units.count)
  if lower is None and not reciprocal:  # an upper bound alone, on values >= 0 (a divergence)
    floor, cap = jnp.float32(0.0), jnp.maximum(x_max, 0.0)
  elif lower is None:
    floor, cap = jnp.float32(1.0), _symmetric_cap(x_min, x_max)
  else:
    floor = jnp.maximum(jnp.nextafter(jnp.float32(lower), jnp.float32(jnp.inf)), _SMALLEST_NORMAL)
    cap = jnp.maximum(x_max, floor)
  any_unit = psum(jnp.sum(on.astype(jnp.float32)), units.axis_name) > 0
  floor, cap = jnp.where(any_unit, floor, 1.0), jnp.where(any_unit, cap, 1.0)

  def within(u):
    masked, total = masked_count(units, lower, u, reciprocal=reciprocal)
    return masked <= jnp.floor(jnp.float32(fraction) * total)

  u = smallest_true(within, floor, cap)
  masked, total = masked_count(units, lower, u, reciprocal=reciprocal)
  return u, masked / jnp.maximum(total, 1.0), within(u)


def m2po_cutoff(units: Units, threshold: float):
  """M2PO (contract §4.2): the loosest cutoff ``T`` on the squared log-ratios ``x = r²`` such that
  the tokens with ``r² <= T`` have a mean ``r²`` (their second moment) ``<= threshold`` — the
  largest squared log-ratios go until it holds. The mean of the kept does not decrease as ``T``
  loosens (each token let in is at least every kept one). Returns ``(T, second_moment_kept,
  masked_share)``."""
  c = units.count

  def moments(t):
    keep = units.x <= t
    s = psum(
      jnp.stack([jnp.sum(jnp.where(keep, c * units.x, 0.0)), jnp.sum(jnp.where(keep, c, 0.0)), jnp.sum(c)]),
      units.axis_name,
    )
    return s[0], s[1], s[2]

  def within(t):
    total, n, _ = moments(t)
    return total <= jnp.float32(threshold) * n

  _, _, x_max = _extremes(units, c)
  t = largest_true(within, jnp.float32(0.0), jnp.maximum(x_max, 0.0))
  total, n, all_n = moments(t)
  return t, total / jnp.maximum(n, 1.0), (all_n - n) / jnp.maximum(all_n, 1.0)
