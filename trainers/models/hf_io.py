"""Hugging Face checkpoints: `config.json` + `*.safetensors` with HF parameter names.

The NNX module tree mirrors HF's, so a parameter's HF name is its path with a `model.` prefix
(`lm_head` excepted), `embedding`/`kernel` renamed `weight`, and Linear kernels transposed
(flax stores `[in, out]`, torch `[out, in]`). Save followed by load is bit-exact in the saved
dtype.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from trainers.models.config import PRESETS, ModelConfig
from trainers.models.qwen import Qwen

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# Non-parameter buffers some older HF checkpoints carry; recomputed here, so skipped on load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _hf_name(path: tuple) -> tuple[str, bool]:
  """HF name of an NNX parameter path, and whether its array is transposed in HF."""
  *module, leaf = (str(p) for p in path)
  name = ".".join(module + ["weight" if leaf in ("kernel", "embedding") else leaf])
  return (name if module[0] == "lm_head" else "model." + name), leaf == "kernel"


def hf_state_dict(model: Qwen, *, dtype: str | None = None) -> dict[str, np.ndarray]:
  """The model's parameters as `{hf_name: array}` in HF layout, cast to `dtype` if given."""
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, transpose = _hf_name(path)
    x = var.get_value()
    x = x.T if transpose else x
    out[name] = np.asarray(x.astype(DTYPES[dtype]) if dtype else x)
  return out


def save_hf_checkpoint(model: Qwen, path: str | os.PathLike, *, dtype: str = "float32") -> None:
  """Writes `path/config.json` and `path/model.safetensors` (`dtype`: "float32" | "bfloat16").

  Each file is written to a temporary name and renamed, so a server reading the directory
  concurrently sees either the old or the new file, never a partial one.
  """
  if dtype not in DTYPES:
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
  os.makedirs(path, exist_ok=True)
  tensors = hf_state_dict(model, dtype=dtype)
  _atomic_write(os.path.join(path, "model.safetensors"),
                lambda f: save_file(tensors, f, metadata={"format": "pt"}))
  config = model.config.to_hf_dict(dtype=dtype)

  def write_json(f):
    with open(f, "w") as fh:
      json.dump(config, fh, indent=2)
  _atomic_write(os.path.join(path, "config.json"), write_json)


def _atomic_write(dest: str, write) -> None:
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".tmp-")
  os.close(fd)
  try:
    write(tmp)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; a server running as another user must read it
    os.replace(tmp, dest)
  except BaseException:
    os.unlink(tmp)
    raise


def read_hf_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of the `*.safetensors` files in `path` (one file or HF-sharded)."""
  files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
  if not files:
    raise FileNotFoundError(f"no *.safetensors file in {path}")
  tensors = {}
  for f in files:
    tensors.update(load_file(f))
  return tensors


def state_from_hf_tensors(model: Qwen, tensors: dict[str, np.ndarray]) -> nnx.State:
  """The NNX parameter state of `model` filled from HF tensors, cast to the model's dtypes.

  Raises `ValueError` naming every missing, unexpected or mis-shaped tensor; `model` itself is
  never modified, so a failed load leaves it intact.
  """
  cfg = model.config
  new, missing, bad = [], [], []
  seen = set()
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    name, transpose = _hf_name(path)
    seen.add(name)
    if name not in tensors:
      missing.append(name)
      continue
    x = tensors[name].T if transpose else tensors[name]
    ref = var.get_value()
    if x.shape != ref.shape:
      bad.append(f"{name}: checkpoint {tensors[name].shape} vs model "
                 f"{ref.shape[::-1] if transpose else ref.shape}")
      continue
    new.append((path, var.replace(jnp.asarray(x, dtype=ref.dtype))))
  unexpected = [n for n in tensors if n not in seen and not n.endswith(_IGNORED_SUFFIXES)
                and not (cfg.tie_word_embeddings and n == "lm_head.weight")]
  if missing or bad or unexpected:
    parts = [f"{label}: {', '.join(sorted(names)[:8])}{' ...' if len(names) > 8 else ''}"
             for label, names in (("missing", missing), ("shape mismatch", bad),
                                  ("unexpected", unexpected)) if names]
    raise ValueError("checkpoint does not match the model; " + "; ".join(parts))
  return nnx.from_flat_state(new)


def load_hf_checkpoint(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32) -> Qwen:
  """Builds a `Qwen` from `path/config.json` and loads its safetensors weights."""
  cfg = ModelConfig.from_pretrained(path)
  model = nnx.eval_shape(lambda: Qwen(cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
  graphdef = nnx.graphdef(model)  # every variable of `Qwen` is a Param
  return nnx.merge(graphdef, state_from_hf_tensors(model, read_hf_tensors(path)))


def init_checkpoint(out: str | os.PathLike, *, preset: str = "tiny-qwen3", seed: int = 0,
                    dtype: str = "float32", config: ModelConfig | None = None) -> ModelConfig:
  """Writes a randomly initialised HF checkpoint (a preset or an explicit `config`) to `out`.

  Initialisation is HF's: weights `N(0, initializer_range²)`, biases 0, norms 1.
  """
  if config is None:
    if preset not in PRESETS:
      raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    config = PRESETS[preset]
  model = Qwen(config, rngs=nnx.Rngs(seed))
  save_hf_checkpoint(model, out, dtype=dtype)
  return config
