"""The device mesh and where every array lives on it (the trainer's `parallel` section).

Four mesh axes, built with `jax.make_mesh` (GSPMD-style `Auto` axes):

- `data`: plain data parallelism — parameters replicated, the batch split;
- `fsdp`: fully sharded data parallelism — the batch split *and* every matrix parameter (and
  its optimiser state and gradient accumulator) split along its largest dimension; XLA
  all-gathers a layer's weights when it runs and reduce-scatters its gradients;
- `expert`: expert parallelism (a mixture-of-experts model) — every expert's weights live on
  one `1/expert` slice of the axis (the expert dimension of `[L, E, ...]` kernels split), and
  the batch is split over it too, as over `fsdp`; XLA moves the tokens' hidden states to the
  experts' devices and back;
- `tensor`: Megatron tensor parallelism — q/k/v, gate and up projections split by output
  columns (heads / MLP columns), o and down projections by input rows, the vocabulary of the
  embedding and LM head split; activations replicated.

The batch (`[micro_batches, rows, row_len]`) is split over `data × fsdp × expert` along its rows.
Partition rules are keyed by parameter name and owned by the architecture (`Family.tensor_rules`,
`fsdp_rules`; the shared decoder's in `trainers.models.decoder`), as MaxText's logical axis rules.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from mis_jax import ConfigError
from trainers.models import decoder
from trainers.config import ParallelSection

AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")


def mesh_shape(section: ParallelSection, num_devices: int) -> tuple[int, int, int, int]:
  """The resolved `(data, fsdp, expert, tensor)` sizes of `section` for `num_devices`, or a `ConfigError`."""
  sizes = {a: getattr(section, a) for a in AXES}
  for axis, n in sizes.items():
    if isinstance(n, bool) or not isinstance(n, int) or (n < 1 and n != -1):
      raise ConfigError(f"parallel.{axis} must be a positive int or -1 (the rest of the devices), got {n!r}")
  free = [a for a, n in sizes.items() if n == -1]
  if len(free) > 1:
    raise ConfigError(f"only one of parallel.{{data,fsdp,expert,tensor}} may be -1, got {', '.join(free)}")
  fixed = math.prod(n for n in sizes.values() if n != -1)
  if num_devices % fixed:
    given = " x ".join(f"{a}={n}" for a, n in sizes.items() if n != -1)
    raise ConfigError(f"parallel: {given} (= {fixed}) does not divide the {num_devices} devices")
  if free:
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(
      f"parallel: data x fsdp x expert x tensor = {fixed} but there are {num_devices} devices "
      "(set one axis to -1 to take the rest)"
    )
  return sizes["data"], sizes["fsdp"], sizes["expert"], sizes["tensor"]


def make_mesh(section: ParallelSection, devices=None) -> jax.sharding.Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(section, len(devices))
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def check_model(mesh: jax.sharding.Mesh, model_cfg) -> None:
  """Tensor parallelism splits heads and MLP (expert FFN) columns, expert parallelism the
  experts: they must divide evenly; an `expert` axis needs a mixture-of-experts model."""
  tp, ep = mesh.shape["tensor"], mesh.shape["expert"]
  if ep > 1:
    if not model_cfg.is_moe:
      raise ConfigError(
        f"parallel.expert={ep} needs a mixture-of-experts model; {model_cfg.model_type} is dense "
        "(use fsdp or data for the devices)"
      )
    if model_cfg.num_experts % ep:
      raise ConfigError(f"parallel.expert={ep} does not divide the model's num_experts ({model_cfg.num_experts})")
  names = (
    "num_attention_heads",
    "num_key_value_heads",
    "moe_intermediate_size" if model_cfg.is_moe else "intermediate_size",
  )
  for name in names:
    n = getattr(model_cfg, name)
    if n % tp:
      raise ConfigError(
        f"parallel.tensor={tp} does not divide the model's {name} ({n}); choose a tensor size that divides {name}"
      )


def param_spec(path: tuple, shape: tuple[int, ...], mesh: jax.sharding.Mesh, family=None) -> P:
  """The `PartitionSpec` of one parameter from its name and shape, by the rules of `family`
  (a `trainers.models.Family`; default the shared decoder's `TENSOR_RULES` / `FSDP_RULES`).

  Stacked layer parameters keep their layer axis whole; a mixture-of-experts kernel
  (`[L, E, in, out]`) has its expert axis split over `expert`. `tensor` takes the axis its rule
  names (when it divides); `fsdp` then takes the largest remaining axis it divides (the
  embedding's hidden axis: `FSDP_RULES`), for every parameter with at least two axes of its
  own (vectors stay replicated: tiny). With an `expert` axis, the parameters that are not
  experts' (attention, router, embeddings) are split over `fsdp × expert` the same way, as
  MaxText does: that axis splits the batch, so it shards them like FSDP.
  """
  names = tuple(str(p) for p in path)
  lead = 1 if names[0] == "layers" else 0
  spec: list = [None] * len(shape)
  ep = mesh.shape["expert"] if "expert" in mesh.axis_names else 1
  shard_axes: str | tuple = "fsdp"
  if "experts" in names:
    if ep > 1 and shape[lead] % ep == 0:
      spec[lead] = "expert"
    lead += 1
  elif ep > 1:  # the other parameters are split over `expert` too, as over fsdp (it splits the batch)
    shard_axes = ("fsdp", "expert") if mesh.shape["fsdp"] > 1 else "expert"
  own = list(range(lead, len(shape)))
  tp = mesh.shape["tensor"]
  fsdp = math.prod(mesh.shape[a] for a in ((shard_axes,) if isinstance(shard_axes, str) else shard_axes))
  tensor_rules = decoder.TENSOR_RULES if family is None else family.tensor_rules
  fsdp_rules = decoder.FSDP_RULES if family is None else family.fsdp_rules
  rule = tensor_rules.get(names[-2:])
  if rule is not None and tp > 1:
    axis = own[rule]
    if shape[axis] % tp == 0:
      spec[axis] = "tensor"
  if len(own) >= 2 and fsdp > 1:
    free = sorted((a for a in own if spec[a] is None and shape[a] % fsdp == 0), key=lambda a: -shape[a])
    preferred = fsdp_rules.get(names[-2:])
    if preferred is not None and own[preferred] in free:
      free.insert(0, own[preferred])
    if free:
      spec[free[0]] = shard_axes
  return P(*spec)


def param_shardings(abstract_state: nnx.State, mesh: jax.sharding.Mesh, family=None) -> nnx.State:
  """An `nnx.State` of `NamedSharding`s with the structure of the parameter state (`family`:
  whose partition rules; default the shared decoder's)."""
  flat = [
    (path, var.replace(NamedSharding(mesh, param_spec(path, tuple(var.get_value().shape), mesh, family))))
    for path, var in nnx.to_flat_state(abstract_state)
  ]
  return nnx.from_flat_state(flat)


def state_shardings(abstract_tree, params_abstract, params_shardings, mesh):
  """Shardings for a tree holding copies of the parameter tree (an optimiser state: Adam's
  moments are parameter-shaped): parameter-shaped subtrees get the parameters' shardings,
  everything else (step counts) is replicated."""
  params_def = jax.tree.structure(params_abstract)
  replicated = NamedSharding(mesh, P())

  def like_params(x):
    return jax.tree.structure(x) == params_def

  return jax.tree.map(lambda x: params_shardings if like_params(x) else replicated, abstract_tree, is_leaf=like_params)


def batch_sharding(mesh: jax.sharding.Mesh, ndim: int = 3) -> NamedSharding:
  """`[micro_batches, rows, ...]` arrays: rows split over `data × fsdp × expert`."""
  return NamedSharding(mesh, P(None, BATCH_AXES, *([None] * (ndim - 2))))


def activation_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """The `[rows, row_len, hidden]` residual stream: rows over `data × fsdp × expert`, replicated over `tensor`."""
  return NamedSharding(mesh, P(BATCH_AXES, None, None))


def batch_devices(mesh: jax.sharding.Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]


def sharding_mismatches(tree, shardings) -> list[str]:
  """Paths of leaves of `tree` whose sharding differs from the declared one (empty if none)."""
  bad = []
  for (path, x), s in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(shardings)):
    if not x.sharding.is_equivalent_to(s, np.ndim(x)):
      bad.append(f"{jax.tree_util.keystr(path)}: {x.sharding} != {s}")
  return bad
