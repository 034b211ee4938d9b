"""A ready-made ``shard_map`` around :func:`policy_loss` (contract §10).

The packed batch is sharded along rows over the data axis (whole rows, so whole segments per
device when segments don't span rows: data parallelism) and optionally along columns over a
sequence axis (a segment split across devices: sequence/context parallelism). Inside, every
reduction is completed with ``psum``/``pmin``/``pmax`` over both axes, so the result and its
gradient equal the single-device ones.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mis_jax._config import LossConfig
from mis_jax._losses import _check_batch, policy_loss
from mis_jax._packing import PackedBatch
from mis_jax._prepared import Correction


def batch_partition_spec(data_axis="data", seq_axis: str | None = None) -> P:
  """PartitionSpec of every per-token ``[rows, row_len]`` array."""
  return P(data_axis, seq_axis) if seq_axis is not None else P(data_axis)


def shard_batch(mesh: Mesh, tree, *, data_axis="data", seq_axis: str | None = None):
  """``device_put`` every array leaf of ``tree`` (e.g. a PackedBatch) with the batch sharding."""
  sharding = NamedSharding(mesh, batch_partition_spec(data_axis, seq_axis))
  return jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding), tree)


def sharded_policy_loss(mesh: Mesh, loss_cfg: LossConfig, *, data_axis="data", seq_axis: str | None = None) -> Callable:
  """Builds ``f(logprobs, batch, entropy=None, key=None, correction=None, topk_logprobs=None) ->
  (loss, metrics)`` under ``jax.shard_map`` (``key``: clip_cov's, replicated; ``correction``: a
  :class:`Correction` from :func:`mis_jax.prepare_step`, its per-token arrays sharded like the
  batch, its denominators replicated; ``topk_logprobs``: score centering's ``[rows, row_len, k]``,
  sharded like the batch, its top-k axis whole).

  Per-token arrays must be ``[rows, row_len]`` with rows divisible by the data-axis size and
  ``row_len`` divisible by the sequence-axis size. Outputs are replicated scalars. The
  returned function is differentiable in ``logprobs`` (and so in the parameters of a model
  that produced them) and can be jitted; ``loss_cfg`` is closed over (static).

  Args:
    mesh: a mesh holding ``data_axis`` (and ``seq_axis`` if given).
    loss_cfg: the :class:`LossConfig`.
    data_axis: mesh axis name (or tuple of names) the rows are sharded over.
    seq_axis: optional mesh axis name the columns (positions) are sharded over.
  """
  if not isinstance(loss_cfg, LossConfig):
    raise TypeError(f"loss_cfg must be a mis_jax.LossConfig, got {type(loss_cfg).__name__}")
  names = tuple(data_axis) if isinstance(data_axis, (tuple, list)) else (data_axis,)
  if seq_axis is not None:
    names += (seq_axis,)
  for name in names:
    if name not in mesh.axis_names:
      raise ValueError(f"mesh has axes {mesh.axis_names}; no axis named {name!r}")
  axis_name = names if len(names) > 1 else names[0]
  spec = batch_partition_spec(data_axis if not isinstance(data_axis, list) else tuple(data_axis), seq_axis)

  return functools.partial(
    _sharded_policy_loss,
    mesh=mesh,
    loss_cfg=loss_cfg,
    data_axis=data_axis,
    seq_axis=seq_axis,
    axis_name=axis_name,
    spec=spec,
  )


def _sharded_policy_loss(
  logprobs,
  batch: PackedBatch,
  entropy=None,
  key=None,
  correction: Correction | None = None,
  topk_logprobs=None,
  *,
  mesh: Mesh,
  loss_cfg: LossConfig,
  data_axis,
  seq_axis,
  axis_name,
  spec: P,
):
  """:func:`sharded_policy_loss`'s function: the inputs checked before tracing, then `policy_loss` under
  `shard_map` (per-token arrays as `spec`, the correction's denominators and the key replicated)."""
  _check_batch(logprobs, batch, loss_cfg, entropy, correction, topk_logprobs=topk_logprobs)  # before tracing
  if len(batch.shape) != 2:
    raise ValueError(f"sharded_policy_loss needs [rows, row_len] arrays, got shape {batch.shape}")
  rows, cols = batch.shape
  n_data = _axis_size(mesh, data_axis)
  n_seq = 1 if seq_axis is None else mesh.shape[seq_axis]
  if rows % n_data or cols % n_seq:
    raise ValueError(
      f"batch shape {batch.shape} must divide into the mesh: rows by {n_data} "
      f"({data_axis}), row_len by {n_seq} ({seq_axis})"
    )
  bspec = jax.tree_util.tree_map(lambda _: spec, batch)
  inner = lambda lp, b, ent, k, c, topk: policy_loss(
    lp, b, loss_cfg, entropy=ent, axis_name=axis_name, key=k, correction=c, topk_logprobs=topk
  )
  espec = None if entropy is None else spec
  cspec = None
  if correction is not None:  # per-token arrays like the batch, the step's denominators replicated
    cspec = jax.tree_util.tree_map(lambda _: spec, correction.replace(denominators=None)).replace(
      denominators=None if correction.denominators is None else P()
    )
  tspec = None if topk_logprobs is None else spec
  mapped = jax.shard_map(
    inner, mesh=mesh, in_specs=(spec, bspec, espec, None if key is None else P(), cspec, tspec), out_specs=P()
  )
  return mapped(logprobs, batch, entropy, key, correction, topk_logprobs)


def _axis_size(mesh: Mesh, axis) -> int:
  names = axis if isinstance(axis, (tuple, list)) else (axis,)
  size = 1
  for name in names:
    size *= mesh.shape[name]
  return size
