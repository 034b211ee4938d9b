"""Hugging Face checkpoints: `config.json` + `*.safetensors` with HF parameter names.

The NNX module tree mirrors HF's, so a parameter's HF name is its path with a `model.` prefix
(`lm_head` excepted), `embedding`/`kernel` renamed `weight`, and Linear kernels transposed
(flax stores `[in, out]`, torch `[out, in]`). Layer parameters are stacked (`layers.mlp.up_proj.kernel`
is `[num_layers, in, out]`): layer `i` of it is HF's `model.layers.{i}.mlp.up_proj.weight`; a
mixture-of-experts kernel `layers.mlp.experts.up_proj.kernel` is `[num_layers, num_experts, in,
out]`, its `[i, e]` block HF's `model.layers.{i}.mlp.experts.{e}.up_proj.weight` (fused
checkpoints are read through `Family.hf_views`).
Loading reads each device's block of each tensor straight from the files (`safe_open` slices). Save followed by load is
bit-exact in the saved
dtype.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import tempfile
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from trainers.models import registry
from trainers.models.config import ModelConfig
from trainers.models import decoder
from trainers.models.decoder import CausalLM

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Non-parameter buffers some older HF checkpoints carry; recomputed here, so skipped on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _name_map(config: ModelConfig | None):
  """The architecture's HF weight-name map (`Family.hf_name`); the shared decoder's without a config."""
  return decoder.hf_name if config is None else config.family.hf_name


def _config_of(model_or_state) -> ModelConfig | None:
  return getattr(model_or_state, "config", None)


def _lead(name: str) -> int:
  """Leading stacked axes of a parameter: one per placeholder of its HF name (`{i}`: the layer,
  `{e}`: the expert of a mixture-of-experts layer, `[L, E, ...]`)."""
  return ("{i}" in name) + ("{e}" in name)


def _stacked_names(name: str, shape: tuple, lead_index=None) -> list[tuple[str, tuple[int, ...]]]:
  """`(HF name, leading index)` of every per-layer (per-expert) tensor of a stacked parameter;
  `lead_index`: ranges of the leading axes to cover (default all)."""
  lead = _lead(name)
  ranges = lead_index or [range(n) for n in shape[:lead]]
  keys = ("i", "e")[:lead]
  return [(name.format(**dict(zip(keys, idx))), idx) for idx in itertools.product(*ranges)]


def param_leaves(model_or_state):
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
  return nnx.to_flat_state(state)


def hf_arrays(path: tuple, x, config: ModelConfig | None = None) -> dict[str, object]:
  """`{hf_name: array in HF layout}` for one parameter (one entry per layer when stacked), by
  `config`'s architecture's name map."""
  name, transpose = _name_map(config)(path)
  fix = (lambda a: a.T) if transpose else (lambda a: a)
  return {hf: fix(x[idx]) for hf, idx in _stacked_names(name, x.shape)}


class HFSlot(NamedTuple):
  """Where one HF tensor lives in a parameter state: the parameter's `path`, the `lead` index of its
  stacked axes (layer, expert), whether HF stores it transposed, and its HF `shape`."""

  path: tuple
  lead: tuple
  transpose: bool
  shape: tuple


def hf_slots(state, config: ModelConfig | None = None) -> dict[str, HFSlot]:
  """`{hf_name: HFSlot}` of every HF tensor of a parameter state (arrays or
  `jax.ShapeDtypeStruct`s), by `config`'s architecture's name map."""
  out = {}
  for path, var in param_leaves(state):
    shape = tuple(var.get_value().shape)
    name, transpose = _name_map(config)(path)
    block = shape[_lead(name) :]
    for hf, idx in _stacked_names(name, shape):
      out[hf] = HFSlot(path, tuple(idx), transpose, tuple(block[::-1] if transpose else block))
  return out


def hf_transposed(path: tuple, config: ModelConfig | None = None) -> bool:
  """Whether HF stores parameter `path`'s per-layer blocks transposed (Linear kernels: ours
  `[..., in, out]`, HF's `[..., out, in]`); `jnp.swapaxes(x, -1, -2)` of such a parameter is its HF
  layout with the leading stacked axes kept, which `hf_pieces` cuts without a copy."""
  return _name_map(config)(path)[1]


def hf_pieces(path: tuple, x_hf, config: ModelConfig | None = None) -> list[tuple[str, object]]:
  """`[(hf_name, block)]` of a parameter already in HF layout (`hf_transposed`): one block per layer
  (and expert) when stacked, each a view of `x_hf`."""
  name, _ = _name_map(config)(path)
  return [(hf, x_hf[idx]) for hf, idx in _stacked_names(name, x_hf.shape)]


def hf_named(params: nnx.State, config: ModelConfig) -> dict[str, object]:
  """A parameter state as `{hf_name: array}` in HF layout, the arrays where they are (traceable:
  colocated rollouts compile it)."""
  return {name: a for path, var in param_leaves(params) for name, a in hf_arrays(path, var.get_value(), config).items()}


def hf_state_dict(model: CausalLM, *, dtype: str | None = None) -> dict[str, np.ndarray]:
  """The model's parameters as `{hf_name: array}` in HF layout, cast to `dtype` if given."""
  out = {}
  for path, var in param_leaves(model):
    x = np.asarray(var.get_value())
    for name, a in hf_arrays(path, x, _config_of(model)).items():
      out[name] = np.ascontiguousarray(a.astype(DTYPES[dtype]) if dtype else a)
  return out


def save_hf_checkpoint(model: CausalLM, path: str | os.PathLike, *, dtype: str = "float32") -> None:
  """Writes `path/config.json` and `path/model.safetensors` (`dtype`: "float32" | "bfloat16").

  Each file is written to a temporary name and renamed, so a server reading the directory
  concurrently sees either the old or the new file, never a partial one.
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  os.makedirs(path, exist_ok=True)
  tensors = hf_state_dict(model, dtype=dtype)
  atomic_write(os.path.join(path, "model.safetensors"), lambda f: save_file(tensors, f, metadata={"format": "pt"}))
  write_json(os.path.join(path, "config.json"), model.config.to_hf_dict(dtype=dtype))


def write_json(dest: str, payload) -> None:
  """``payload`` as indented JSON at ``dest``, renamed into place whole."""

  def write(f):
    with open(f, "w") as fh:
      json.dump(payload, fh, indent=2)

  atomic_write(dest, write)


def atomic_write(dest: str, write) -> None:
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".tmp-")
  os.close(fd)
  try:
    write(tmp)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; a server running as another user must read it
    os.replace(tmp, dest)
  except BaseException:
    os.unlink(tmp)
    raise


def checkpoint_files(path: str | os.PathLike) -> list[str]:
  """The `*.safetensors` files of the checkpoint directory `path`, sorted."""
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors file in {path}")
  return files


def skipped_on_load(name: str, tie_word_embeddings: bool) -> bool:
  """A stored tensor a load leaves out: a recomputed buffer (`rotary_emb.inv_freq`), or a tied
  model's `lm_head.weight` (the embedding is its output projection)."""
  return name.endswith(_IGNORED_SUFFIXES) or (tie_word_embeddings and name == "lm_head.weight")


def read_hf_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of the `*.safetensors` files in `path` (one file or HF-sharded)."""
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors file in {path}")
  tensors = {}
  for f in files:
    tensors.update(load_file(f))
  return tensors


def checkpoint_dir_problem(path: str | os.PathLike) -> str | None:
  """Why `path` is not an HF checkpoint directory (config.json + *.safetensors), or None."""
  if not os.path.isdir(path):
    return "no such directory"
  if not os.path.isfile(os.path.join(path, "config.json")):
    return "has no config.json (an HF checkpoint directory is needed)"
  if not glob.glob(os.path.join(path, "*.safetensors")):
    return "has no *.safetensors file"
  return None


class _Reader:
  """Reads HF tensors, whole or a slice at a time, from a dict or from open safetensors files."""

  def __init__(self, tensors=None, files=None, config: ModelConfig | None = None):
    self._tensors, self._files = tensors, files or {}
    self.hf_name = _name_map(config)  # the architecture's weight-name map
    # Tensors stored fused in the files, read as the per-tensor names the model asks for
    # (`Family.hf_views`: transformers 5.x's fused experts): name → (stored name, view).
    views = getattr(config.family, "hf_views", None) if config is not None else None
    self._views = views(self._stored_names(), self._stored_shape) if views else {}

  def _stored_names(self):
    return set(self._tensors) if self._tensors is not None else set(self._files)

  def _stored_shape(self, name):
    if self._tensors is not None:
      return tuple(self._tensors[name].shape)
    return tuple(self._files[name].get_slice(name).get_shape())

  def _stored_read(self, name, index):
    if self._tensors is not None:
      return np.asarray(self._tensors[name][index])
    return np.asarray(self._files[name].get_slice(name)[index])

  def names(self):
    stored = self._stored_names() - {real for real, _ in self._views.values()}
    return stored | set(self._views)

  def shape(self, name):
    if name in self._views:
      return self._views[name][1].shape
    return self._stored_shape(name)

  def read(self, name, index):
    if name in self._views:
      real, view = self._views[name]
      return self._stored_read(real, view.index(index))
    return self._stored_read(name, index)


def _check_names(model_state, reader: _Reader, tie_word_embeddings: bool) -> None:
  """Every parameter has its HF tensors with the right shapes, and nothing else is there."""
  names = reader.names()
  missing, bad, seen = [], [], set()
  for path, var in param_leaves(model_state):
    shape = tuple(var.get_value().shape)
    name, transpose = reader.hf_name(path)
    per_layer = shape[_lead(name) :]
    want = per_layer[::-1] if transpose else per_layer
    for hf, _ in _stacked_names(name, shape):
      seen.add(hf)
      if hf not in names:
        missing.append(hf)
      elif reader.shape(hf) != tuple(want):
        bad.append(f"{hf}: checkpoint {reader.shape(hf)} vs model {tuple(want)}")
  unexpected = [n for n in names if n not in seen and not skipped_on_load(n, tie_word_embeddings)]
  if missing or bad or unexpected:
    parts = [
      f"{label}: {', '.join(sorted(items)[:8])}{' ...' if len(items) > 8 else ''}"
      for label, items in (("missing", missing), ("shape mismatch", bad), ("unexpected", unexpected))
      if items
    ]
    raise ValueError("checkpoint does not match the model; " + "; ".join(parts))


def _read_param(reader: _Reader, path: tuple, index: tuple, dtype) -> np.ndarray:
  """The block `index` (a tuple of slices in our layout) of one parameter, read from HF
  tensors without materialising the rest (stacked layers read layer by layer)."""
  name, transpose = reader.hf_name(path)

  def one(hf, idx):
    if transpose:
      return reader.read(hf, (idx[1], idx[0])).T
    return reader.read(hf, idx)

  lead = _lead(name)
  if lead:  # slices of the stacked axes (their stops are always set)
    ranges = [range(*s.indices(10**9)) for s in index[:lead]]
    parts = [one(hf, index[lead:]) for hf, _ in _stacked_names(name, (), ranges)]
    block = np.stack(parts).reshape(tuple(len(r) for r in ranges) + parts[0].shape)
  else:
    block = one(name, index)
  return np.asarray(block).astype(dtype)


def _fill(abstract_state, reader: _Reader, shardings=None) -> nnx.State:
  """Parameters of `abstract_state` read through `reader`, each placed straight into its
  shards with `jax.make_array_from_callback` (a device reads only its own block)."""
  flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
  out = []
  for path, var in param_leaves(abstract_state):
    ref = var.get_value()
    shape, dtype = tuple(ref.shape), ref.dtype
    sharding = flat_shardings.get(path)
    if isinstance(sharding, nnx.Variable):
      sharding = sharding.get_value()
    if sharding is None:
      sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    index_all = tuple(slice(0, n) for n in shape)

    def callback(index, path=path, dtype=dtype, shape=shape):
      index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape)) if index else index_all
      return _read_param(reader, path, index, dtype)

    out.append((path, var.replace(jax.make_array_from_callback(shape, sharding, callback))))
  return nnx.from_flat_state(out)


def state_from_hf_tensors(model, tensors: dict[str, np.ndarray], *, shardings=None) -> nnx.State:
  """The NNX parameter state of `model` (a model or its abstract param state) filled from HF
  tensors, cast to the model's dtypes.

  Raises `ValueError` naming every missing, unexpected or mis-shaped tensor; `model` itself is
  never modified, so a failed load leaves it intact.
  """
  state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.Param)
  reader = _Reader(tensors=tensors, config=_config_of(model))
  _check_names(state, reader, _tied(state))
  return _fill(state, reader, shardings)


def _tied(state) -> bool:
  return not any(str(path[0]) == "lm_head" for path, _ in param_leaves(state))


def abstract_model(cfg: ModelConfig, **model_kwargs) -> CausalLM:
  """The architecture's module (`registry`) with `jax.ShapeDtypeStruct` parameters: nothing allocated."""
  return nnx.eval_shape(lambda: registry.family(cfg.model_type).module(cfg, rngs=nnx.Rngs(0), **model_kwargs))


def load_hf_params(
  path: str | os.PathLike, abstract_state: nnx.State, shardings=None, config: ModelConfig | None = None
) -> nnx.State:
  """The parameter state with the structure, shapes and dtypes of `abstract_state`, read from
  the `*.safetensors` files in `path`.

  `shardings`: an `nnx.State` of `jax.sharding.Sharding`s with the same structure
  (`trainers.runtime.parallel.param_shardings`); each device then reads only its own block of every
  tensor from the files (no full copy on one device). Default: everything on the first device.
  `config`: the checkpoint's architecture (its HF weight names); default read from
  `path/config.json` when there is one.
  Raises `ValueError` naming every missing, unexpected or mis-shaped tensor before reading any.
  """
  if config is None and os.path.isfile(os.path.join(path, "config.json")):
    config = ModelConfig.from_pretrained(path)
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors file in {path}")
  with contextlib.ExitStack() as stack:
    handles = {}
    for f in files:
      h = stack.enter_context(safe_open(f, framework="numpy"))
      handles.update({name: h for name in h.keys()})
    reader = _Reader(files=handles, config=config)
    _check_names(abstract_state, reader, _tied(abstract_state))
    return _fill(abstract_state, reader, shardings)


def load_hf_checkpoint(
  path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32, shardings=None, **model_kwargs
) -> CausalLM:
  """Builds the registered architecture of `path/config.json` and loads its safetensors weights
  (`load_hf_params`; `shardings` as there). `model_kwargs` go to its module (`attention`, `remat`,
  `activation_sharding`)."""
  cfg = ModelConfig.from_pretrained(path)
  graphdef, abstract = nnx.split(abstract_model(cfg, dtype=dtype, param_dtype=param_dtype, **model_kwargs))
  return nnx.merge(
    graphdef, load_hf_params(path, abstract, shardings, config=cfg)
  )  # every variable of the module is a Param


def init_checkpoint(
  out: str | os.PathLike,
  *,
  preset: str = "tiny-qwen3",
  seed: int = 0,
  dtype: str = "float32",
  config: ModelConfig | None = None,
) -> ModelConfig:
  """Writes a randomly initialised HF checkpoint (a preset or an explicit `config`) to `out`.

  Initialisation is HF's: weights `N(0, initializer_range²)`, biases 0, norms 1.
  """
  from trainers.models.presets import PRESETS

  if config is None:
    if preset not in PRESETS:
      raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[preset]
  model = registry.family(config.model_type).module(config, rngs=nnx.Rngs(seed))
  save_hf_checkpoint(model, out, dtype=dtype)
  return config
