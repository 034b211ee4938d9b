"""This machine's limits and the model FLOPs of a program, in one place.

    python -m benchmarks.roofline [--seconds S]   # prints the measured limits of the default device

`measure()` times, in the same process as the benchmark that uses it (a few seconds):

- dense-matmul FLOP/s: a jitted chain of square matmuls (`x <- x @ w`, `2 n^3` FLOPs each) in
  float32 and in bfloat16, `n` and the chain length grown until one call takes ~50 ms, best of
  several calls;
- memory bandwidth: a jitted `x <- x * a + b` over a float32 buffer far larger than any cache
  (256 MB on CPU, 1 GB on an accelerator): bytes read + written per second, best of several.

The model FLOPs are counted the standard way (Kaplan et al. 2020; PaLM's MFU): `2 N` per token
for a forward, `6 N` for a forward + backward, where `N` counts the parameters of the matmuls
(every linear kernel, plus the vocabulary projection: the embedding table when it is tied, the
untied embedding lookup is not a matmul), plus causal attention within each sequence (`q k` and
`p v`: `2 · 2 · layers · heads · head_dim` FLOPs per (query, key) pair, a causal sequence of `s`
tokens having `s^2 / 2` pairs); remat's recomputed forward is not counted. Decoding a token at
context `c` attends to all `c` keys.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Dense bf16 peak (TFLOP/s) by device kind, the figure MFU is quoted against: vendors' spec sheets.
PEAK_BF16_TFLOPS = {
  "H100": 989.0,
  "H200": 989.0,
  "H800": 989.0,
  "A100": 312.0,
  "L4": 121.0,
  "TPU v4": 275.0,
  "TPU v5 lite": 197.0,
  "TPU v5e": 197.0,
  "TPU v5p": 459.0,
  "TPU v5": 459.0,
  "TPU v6 lite": 918.0,
  "TPU v6e": 918.0,
}
DEFAULT_PEAK_TFLOPS = 989.0  # H100/H200 dense bf16


def nominal_peak_tflops(device_kind: str) -> float | None:
  """The spec-sheet dense bf16 TFLOP/s of `device_kind` (`jax.Device.device_kind`), None if unknown."""
  for name in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):  # "TPU v5 lite" before "TPU v5"
    if name.lower() in device_kind.lower():
      return PEAK_BF16_TFLOPS[name]
  return None


# ---- what a model computes -----------------------------------------------------------------------
def matmul_params(cfg) -> int:
  """`N`: the parameters that take part in a matmul per token (dense models only)."""
  if getattr(cfg, "is_moe", False):
    raise ValueError(f"matmul_params counts dense models only; {cfg.model_type} is a mixture of experts")
  h, layers = cfg.hidden_size, cfg.num_hidden_layers
  q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
  attention = h * q + 2 * h * kv + q * h
  mlp = 3 * h * cfg.intermediate_size
  return layers * (attention + mlp) + h * cfg.vocab_size  # the vocabulary projection, tied or not


def _attention_pairs(seq_lens: Sequence[int]) -> float:
  return float(sum(s * s for s in seq_lens)) / 2.0


def _per_pair(cfg) -> float:
  return 2.0 * 2.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim


def forward_flops(cfg, seq_lens: Sequence[int]) -> float:
  """One forward over sequences of `seq_lens` tokens: `2 N tokens` + causal attention."""
  return 2.0 * matmul_params(cfg) * sum(seq_lens) + _per_pair(cfg) * _attention_pairs(seq_lens)


def train_flops(cfg, seq_lens: Sequence[int]) -> float:
  """One forward + backward (the backward twice the forward): `6 N tokens` + 3x the attention."""
  return 3.0 * forward_flops(cfg, seq_lens)


def model_flops(cfg, tokens: int, seq_len: int) -> float:
  """`train_flops` of `tokens` packed in sequences of `seq_len`."""
  return train_flops(cfg, [seq_len] * (tokens // seq_len))


def prefill_flops(cfg, prompt_lens: Sequence[int]) -> float:
  """The prompts' forward: `2 N` per prompt token + causal attention."""
  return forward_flops(cfg, prompt_lens)


def decode_flops(cfg, prompt_lens: Sequence[int], new_tokens: int) -> float:
  """`new_tokens` decoded after each prompt: `2 N` per token + attention over the whole context."""
  contexts = sum(sum(p + t for t in range(new_tokens)) for p in prompt_lens)
  return 2.0 * matmul_params(cfg) * new_tokens * len(prompt_lens) + _per_pair(cfg) * contexts


# ---- what this machine can do --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Limits:
  """Measured on `device`: dense-matmul FLOP/s per dtype and streaming bandwidth (bytes/s)."""

  device: str
  matmul_flops: dict  # {"float32": FLOP/s, "bfloat16": FLOP/s}
  matmul_n: dict  # the matrix side each was measured at
  bandwidth: float
  bandwidth_bytes: int  # the buffer streamed

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def fraction(self, flops: float, seconds: float, dtype: str = "float32") -> float:
    """Achieved FLOP/s of a program over this machine's matmul FLOP/s in `dtype`."""
    return flops / seconds / self.matmul_flops[dtype]


def best_time(fn, repeats: int) -> float:
  """Best of `repeats` calls of `fn` (which blocks until its results are ready), after a warm-up
  call (the compile)."""
  fn()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def generation_times(sampler, prompts: list, *, n: int, new_tokens: int, repeats: int) -> dict:
  """Prefill (a call generating one token per sample) and decode (the rest of a full call) of the
  embedded `sampler` (`trainers.serving.embedded.sampler.Sampler`), every sample `new_tokens` long."""
  from trainers.serving.embedded.sampler import SamplingOptions

  def generate(tokens):
    options = SamplingOptions(temperature=0.8, max_new_tokens=tokens, ignore_eos=True, n=n, seed=0)
    return lambda: sampler.generate(prompts, options)

  prefill_s = best_time(generate(1), repeats)
  full_s = best_time(generate(new_tokens), repeats)
  return {"prefill_s": prefill_s, "decode_s": max(full_s - prefill_s, 1e-9), "generate_s": full_s}


def _matmul_chain(x, w, length):
  return jax.lax.fori_loop(0, length, lambda _, y: y @ w, x)


_chain = jax.jit(_matmul_chain)


def matmul_flops_per_s(
  dtype, *, n: int = 256, max_n: int = 8192, target_s: float = 0.05, repeats: int = 5, device=None
) -> tuple[float, int]:
  """(FLOP/s, n): a chain of `n x n` matmuls in `dtype`, grown until a call takes `target_s`."""
  device = device or jax.devices()[0]
  length = 1
  while True:
    key = jax.random.key(0)
    x = jax.device_put(jax.random.normal(key, (n, n), jnp.float32).astype(dtype), device)
    # Orthogonal-ish w (entries ~ 1/sqrt(n)): the chain neither overflows nor underflows.
    w = jax.device_put(
      (jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float32) / float(np.sqrt(n))).astype(dtype), device
    )
    seconds = best_time(lambda: jax.block_until_ready(_chain(x, w, length)), repeats=1)
    if seconds >= target_s or (n >= max_n and length >= 64):
      break
    if n < max_n:
      n *= 2
    else:
      length *= 2
  seconds = best_time(lambda: jax.block_until_ready(_chain(x, w, length)), repeats)
  return 2.0 * n**3 * length / seconds, n


@jax.jit
def _stream(x, length):
  return jax.lax.fori_loop(0, length, lambda _, y: y * 0.5 + 1.0, x)


def bandwidth_bytes_per_s(num_bytes: int, *, repeats: int = 5, length: int = 1, device=None) -> float:
  """Bytes read + written per second by `x <- x * 0.5 + 1` over a float32 buffer of `num_bytes`."""
  device = device or jax.devices()[0]
  x = jax.device_put(jnp.ones((num_bytes // 4,), jnp.float32), device)
  seconds = best_time(lambda: jax.block_until_ready(_stream(x, length)), repeats)
  return 2.0 * x.nbytes * length / seconds


def measure(*, quick: bool = False, device=None) -> Limits:
  """This machine's limits on `device` (default: the first), in a few seconds; `quick` at tiny
  sizes (a check that the code runs: the figures mean nothing)."""
  device = device or jax.devices()[0]
  on_cpu = device.platform == "cpu"
  flops, sides = {}, {}
  for dtype in (jnp.float32, jnp.bfloat16):
    kwargs = dict(n=32, max_n=64, target_s=0.0, repeats=1) if quick else {}
    flops[jnp.dtype(dtype).name], sides[jnp.dtype(dtype).name] = matmul_flops_per_s(dtype, device=device, **kwargs)
  num_bytes = 1 << 20 if quick else (256 << 20 if on_cpu else 1 << 30)
  bandwidth = bandwidth_bytes_per_s(
    num_bytes, device=device, repeats=1 if quick else 5, length=1 if on_cpu or quick else 20
  )
  return Limits(
    device=f"{device.platform}: {device.device_kind}",
    matmul_flops=flops,
    matmul_n=sides,
    bandwidth=bandwidth,
    bandwidth_bytes=num_bytes,
  )


def describe(limits: Limits) -> str:
  mm = ", ".join(f"{d} {f / 1e9:,.1f} GFLOP/s (n={limits.matmul_n[d]})" for d, f in limits.matmul_flops.items())
  return f"roofline of {limits.device}: matmul {mm}; bandwidth {limits.bandwidth / 1e9:,.1f} GB/s"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny sizes: the code runs, the figures mean nothing")
  args = parser.parse_args(argv)
  limits = measure(quick=args.quick)
  print(describe(limits))
  print(json.dumps(limits.to_dict(), indent=1))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
