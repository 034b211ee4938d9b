"""Chunked ``token_logprobs`` vs the naive full-logits computation: time and peak memory.

    python -m benchmarks.logprobs [--quick] [--json PATH] [--time-tokens N] [--repeats N]

Peak memory is the compiled executable's own account (``memory_analysis()``: arguments +
outputs + temporaries − aliased), not process RSS, so it is measured without running anything
and a variant that would not fit is still sized. Both variants compute log-probs *and* entropy;
"fwd+bwd" is ``value_and_grad`` of ``-mean(lp) - 0.01 mean(H)`` w.r.t. hidden and lm_head.

Timing (warm-up, then the median of ``repeats`` runs, naive and chunked alternating so that
load drift hits both, ``block_until_ready``) skips any variant whose compiled peak exceeds
``max_run_gb`` and says so. On CPU the default timing is reduced
(one T=8192 chunked fwd+bwd is four 2.5-TFLOP matmuls, and bf16 matmuls are emulated): float32
only, at ``time_tokens=2048`` (two chunks); ``--time-tokens 8192`` times the full size. The
memory tables are always at full size. Both reductions are stated in the output.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from mis_jax import token_logprobs

FULL = dict(tokens=8192, hidden_size=1024, vocab_size=151936, chunk_size=1024, sweep=(1024, 2048, 4096, 8192))
QUICK = dict(tokens=1024, hidden_size=64, vocab_size=8192, chunk_size=128, sweep=(256, 512, 1024))
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ENTROPY_COEF = 0.01


def naive_logprobs(hidden, lm_head, targets):
  """Full ``[T, V]`` float32 logits, ``log_softmax``, gather: what autodiff would keep alive."""
  z = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32)
  log_p = jax.nn.log_softmax(z, axis=-1)
  lp = jnp.take_along_axis(log_p, targets[:, None], axis=-1)[:, 0]
  return lp, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def _impls(chunk_size):
  return {
    "naive": naive_logprobs,
    "chunked": lambda h, w, y: token_logprobs(h, w, y, chunk_size=chunk_size, return_entropy=True),
  }


def _program(fn, kind):
  if kind == "fwd":
    return fn

  def loss(h, w, y):
    lp, ent = fn(h, w, y)
    return -jnp.mean(lp) - ENTROPY_COEF * jnp.mean(ent)

  return jax.value_and_grad(loss, argnums=(0, 1))


def _inputs(tokens, hidden_size, vocab_size, dtype, seed=0):
  kh, kw, ky = jax.random.split(jax.random.key(seed), 3)
  hidden = jax.random.normal(kh, (tokens, hidden_size), jnp.float32).astype(dtype)
  lm_head = (jax.random.normal(kw, (hidden_size, vocab_size), jnp.float32) / np.sqrt(hidden_size)).astype(dtype)
  targets = jax.random.randint(ky, (tokens,), 0, vocab_size, jnp.int32)
  return hidden, lm_head, targets


def _abstract(tokens, hidden_size, vocab_size, dtype):
  return (
    jax.ShapeDtypeStruct((tokens, hidden_size), dtype),
    jax.ShapeDtypeStruct((hidden_size, vocab_size), dtype),
    jax.ShapeDtypeStruct((tokens,), jnp.int32),
  )


def _compiler(impls):
  """``compile(name, kind, args)``, cached on the abstract signature (memory and timing share)."""
  cache = {}

  def compile_(name, kind, args):
    key = (name, kind) + tuple((a.shape, str(a.dtype)) for a in args)
    if key not in cache:
      cache[key] = jax.jit(_program(impls[name], kind)).lower(*args).compile()
    return cache[key]

  return compile_


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  return {
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
    "peak_bytes": int(peak),
  }


def _median_seconds(compiled: dict, args, repeats) -> dict:
  """Median wall time per executable; runs alternate so load drift hits every variant alike."""
  for c in compiled.values():
    jax.block_until_ready(c(*args))  # warm-up
  times = {name: [] for name in compiled}
  for _ in range(repeats):
    for name, c in compiled.items():
      start = time.perf_counter()
      jax.block_until_ready(c(*args))
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def _gb(n):
  return f"{n / 1e9:8.3f}"


def run(
  quick: bool = False,
  *,
  time_tokens: int | None = None,
  time_dtypes=None,
  repeats: int | None = None,
  max_run_gb: float = 12.0,
  verbose: bool = True,
) -> dict:
  """Runs the benchmark; returns a JSON-able dict (``memory``, ``timing``, ``sweep``, ``notes``)."""
  cfg = dict(QUICK if quick else FULL)
  tokens, d, v, chunk = cfg["tokens"], cfg["hidden_size"], cfg["vocab_size"], cfg["chunk_size"]
  backend = jax.default_backend()
  on_cpu = backend == "cpu"
  notes = []
  if time_tokens is None:
    time_tokens = 2048 if (on_cpu and not quick) else tokens
    if time_tokens != tokens:
      notes.append(
        f"timing at T={time_tokens} (not {tokens}): full-size runs take minutes "
        f"each on {backend}; memory is reported at full size"
      )
  if time_dtypes is None:
    time_dtypes = ("float32",) if (on_cpu and not quick) else tuple(DTYPES)
    if len(time_dtypes) < len(DTYPES):
      notes.append("bfloat16 not timed on cpu (emulated bf16 matmuls); its memory is reported")
  repeats = repeats or (2 if on_cpu and not quick else 3)
  impls = _impls(chunk)
  compile_ = _compiler(impls)
  say = print if verbose else (lambda *a, **k: None)
  say(f"backend={backend} devices={jax.device_count()} T={tokens} D={d} V={v} chunk={chunk}")

  # 1. Memory at full size, compile only.
  memory = []
  say(f"\n{'impl':8} {'dtype':9} {'pass':8} {'T':>6} {'temp GB':>8} {'peak GB':>8}")
  for dtype_name, dtype in DTYPES.items():
    for kind in ("fwd", "fwd+bwd"):
      for name in impls:
        row = dict(
          impl=name,
          dtype=dtype_name,
          kind=kind,
          tokens=tokens,
          **_memory(compile_(name, kind, _abstract(tokens, d, v, dtype))),
        )
        memory.append(row)
        say(f"{name:8} {dtype_name:9} {kind:8} {tokens:6d} {_gb(row['temp_bytes'])} {_gb(row['peak_bytes'])}")

  # 2. Temp memory vs T: the chunked one should not grow (beyond O(T·D) and O(T) buffers).
  sweep = []
  say(f"\nsweep (float32, fwd+bwd): {'T':>6} {'naive temp GB':>14} {'chunked temp GB':>16}")
  for t in cfg["sweep"]:
    row = {"tokens": t}
    for name in impls:
      compiled = compile_(name, "fwd+bwd", _abstract(t, d, v, jnp.float32))
      row[f"{name}_temp_bytes"] = _memory(compiled)["temp_bytes"]
    sweep.append(row)
    say(f"{'':26}{t:6d} {_gb(row['naive_temp_bytes']):>14} {_gb(row['chunked_temp_bytes']):>16}")

  # 3. Time, skipping what would not fit.
  timing = []
  say(f"\ntiming (median of {repeats}, after warm-up): T={time_tokens}")
  say(f"{'impl':8} {'dtype':9} {'pass':8} {'seconds':>9} {'peak GB':>8}")
  for dtype_name in time_dtypes:
    args = _inputs(time_tokens, d, v, DTYPES[dtype_name])
    for kind in ("fwd", "fwd+bwd"):
      rows, runnable = {}, {}
      for name in impls:
        compiled = compile_(name, kind, args)
        peak = _memory(compiled)["peak_bytes"]
        rows[name] = dict(impl=name, dtype=dtype_name, kind=kind, tokens=time_tokens, peak_bytes=peak, seconds=None)
        if peak > max_run_gb * 1e9:
          rows[name]["skipped"] = f"needs {peak / 1e9:.1f} GB > {max_run_gb} GB"
        else:
          runnable[name] = compiled
      for name, seconds in _median_seconds(runnable, args, repeats).items():
        rows[name]["seconds"] = seconds
      for name, row in rows.items():
        timing.append(row)
        secs = f"{row['seconds']:9.3f}" if row["seconds"] is not None else f"{'skipped':>9}"
        say(
          f"{name:8} {dtype_name:9} {kind:8} {secs} {_gb(row['peak_bytes'])}"
          + (f"  ({row['skipped']})" if "skipped" in row else "")
        )
    del args

  ratios = {}
  for row in timing:
    if row["impl"] == "chunked" and row["seconds"] is not None:
      base = next(r for r in timing if r["impl"] == "naive" and r["dtype"] == row["dtype"] and r["kind"] == row["kind"])
      if base["seconds"]:
        ratios[f"{row['dtype']} {row['kind']}"] = row["seconds"] / base["seconds"]
  for key, ratio in ratios.items():
    say(f"chunked / naive time, {key}: {ratio:.2f}x")
  for n in notes:
    say(f"note: {n}")
  return {
    "name": "logprobs",
    "backend": backend,
    "config": {**cfg, "sweep": list(cfg["sweep"])},
    "time_tokens": time_tokens,
    "repeats": repeats,
    "memory": memory,
    "sweep": sweep,
    "timing": timing,
    "time_ratio_chunked_over_naive": ratios,
    "notes": notes,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small shapes, well under a minute")
  parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
  parser.add_argument(
    "--time-tokens", type=int, default=None, help="tokens for the timing runs (default: full T; 2048 on CPU)"
  )
  parser.add_argument(
    "--time-dtypes", default=None, help="comma-separated dtypes to time (default: both; float32 on CPU)"
  )
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument(
    "--max-run-gb", type=float, default=12.0, help="skip timing a variant whose compiled peak exceeds this"
  )
  args = parser.parse_args(argv)
  time_dtypes = tuple(args.time_dtypes.split(",")) if args.time_dtypes else None
  result = run(
    args.quick, time_tokens=args.time_tokens, time_dtypes=time_dtypes, repeats=args.repeats, max_run_gb=args.max_run_gb
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
