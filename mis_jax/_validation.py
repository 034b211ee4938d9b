"""Input checks that run in Python before tracing: shapes, dtypes, segment ids.

Shape and dtype checks work on tracers too (they are static); value checks (segment ids in
range) run whenever the array is concrete, i.e. whenever the caller is not inside a trace.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mis_jax._vocabulary import LOSS_AGG_MODES, metric_reduction as _metric_reduction


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def as_array(name: str, x):
  if isinstance(x, (jax.Array, np.ndarray)) or isinstance(x, jax.core.Tracer):
    return x
  if isinstance(x, (list, tuple, int, float)):
    return np.asarray(x)
  raise TypeError(f"'{name}' must be an array, got {type(x).__name__}")


def check_token_arrays(arrays: Mapping[str, object], *, float_keys=()) -> dict:
  """Checks that all per-token arrays share one shape and have sensible dtypes."""
  arrays = {k: as_array(k, v) for k, v in arrays.items() if v is not None}
  ref_key = "segment_ids" if "segment_ids" in arrays else next(iter(arrays))
  ref_shape = tuple(jnp.shape(arrays[ref_key]))
  for key, value in arrays.items():
    shape = tuple(jnp.shape(value))
    if shape != ref_shape:
      raise ValueError(
        f"shape mismatch: '{key}' has shape {shape} but '{ref_key}' has shape {ref_shape}; "
        "all per-token arrays must have the same shape"
      )
    dtype = jnp.asarray(value).dtype if not hasattr(value, "dtype") else value.dtype
    if key in float_keys and not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(f"'{key}' must be a floating-point array, got dtype {dtype}")
    if key == "segment_ids" and not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"'segment_ids' must be an integer array, got dtype {dtype}")
    if key in ("loss_mask", "kept_mask", "cov_selected") and not (
      dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    ):
      raise TypeError(f"'{key}' must be a bool, integer or float array, got dtype {dtype}")
  return arrays


def check_segments(segment_ids, num_segments) -> None:
  if isinstance(num_segments, bool) or not isinstance(num_segments, (int, np.integer)):
    raise TypeError(f"num_segments must be a Python int (static), got {type(num_segments).__name__} {num_segments!r}")
  if num_segments <= 0:
    raise ValueError(f"num_segments must be > 0, got {num_segments}")
  if _is_concrete(segment_ids):
    ids = np.asarray(segment_ids)
    if ids.size:
      lo, hi = int(ids.min()), int(ids.max())
      if hi >= num_segments:
        raise ValueError(
          f"'segment_ids' holds {hi}, which is >= num_segments={num_segments}; "
          "segment ids must lie in [0, num_segments) (or be -1 for padding)"
        )
      if lo < -1:
        raise ValueError(f"'segment_ids' holds {lo}; the only negative id allowed is -1 (padding)")


def check_choice(name: str, value: str, allowed=LOSS_AGG_MODES) -> None:
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is invalid; allowed values: {', '.join(allowed)}")


def metric_reduction(value: str) -> str:
  """Checks a ``metric_reduction`` argument (any loss mode) and returns how it reduces metrics."""
  check_choice("metric_reduction", value)
  return _metric_reduction(value)


def as_bool(mask):
  """A bool, int or float mask as bool (nonzero = set), with no implicit dtype promotion."""
  m = jnp.asarray(mask)
  return m if m.dtype == jnp.bool_ else m != jnp.zeros((), m.dtype)


def flat_mask(loss_mask, valid):
  return jnp.reshape(as_bool(loss_mask), (-1,)) & valid


def flat_float(x):
  return jnp.reshape(jnp.asarray(x), (-1,)).astype(jnp.float32)


def flat_inputs(arrays, segs):
  """Flat float32 train/rollout log-probs and the bool trained mask (padding excluded)."""
  return (
    flat_float(arrays["train_logprobs"]),
    flat_float(arrays["rollout_logprobs"]),
    flat_mask(arrays["loss_mask"], segs.valid),
  )


def check_nonnegative(name: str, x, loss_mask) -> None:
  """A per-token array that must be finite and ``>= 0`` on the trained tokens (when concrete)."""
  if _is_concrete(x) and _is_concrete(loss_mask):
    values = np.asarray(x)[np.asarray(as_bool(loss_mask))]
    if values.size and not (np.all(np.isfinite(values)) and values.min() >= 0):
      bad = values[~(np.isfinite(values) & (values >= 0))][0]
      raise ValueError(f"'{name}' must be finite and >= 0 on the trained tokens, got {bad}")
