"""The embedded sampler's decode step against the cache length, and the colocated rollout, before
and after a change: two source trees measured back to back in one run.

    python -m benchmarks.decode --baseline /tmp/sampler-main [--rounds 2] [--json PATH]

`--baseline` is a checkout of the code to compare against (e.g. `git worktree add --detach
/tmp/sampler-main main`); without it only this tree is measured. Each tree runs in its own
process (`PYTHONPATH` = the tree), the trees alternating for `--rounds` rounds; a figure is the
minimum over rounds. The shape is `benchmarks.colocated`'s larger one: a 4-layer 256-wide Qwen3
(4 heads × 64 over 2 KV heads, 64-token vocabulary), bfloat16 sampler of float32 weights,
64 rows, 16-token prompts, temperature 1, no stop tokens:

- **decode step ms at S slots**: 64 decoding steps after the prefill, in a cache of `S = 80`
  (64 new tokens) or `1024` slots (1008 new tokens), as the tree's sampler dispatches them
  (one `while_loop` before; one per attention window after), over 64, min of `--repeats`;
- **colocated rollout ms**: `benchmarks.colocated.ours(larger, "colocated")`'s median rollout
  phase (64 samples × 64 tokens) and step time, steps 5–12.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS, PROMPT, STEPS = 64, 16, 64
CACHES = (80, 1024)


def _sampler():
  import jax.numpy as jnp
  from flax import nnx

  from benchmarks.colocated import SHAPES, VOCAB
  from trainers.models import PRESETS, CausalLM
  from trainers.serving.embedded.sampler import Sampler

  shape = next(s for s in SHAPES if s.name == "larger")
  config = dataclasses.replace(
    PRESETS["tiny-qwen3"],
    num_hidden_layers=shape.layers,
    hidden_size=shape.hidden,
    intermediate_size=shape.intermediate,
    head_dim=shape.head_dim,
    vocab_size=VOCAB,
    num_attention_heads=shape.heads,
    num_key_value_heads=shape.kv_heads,
    tie_word_embeddings=False,
    initializer_range=0.02,
  )
  return Sampler(CausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), max_batch_size=ROWS)


def decode_step_ms(cache_len: int, repeats: int) -> float:
  """ms per decoding step: `STEPS` steps of `ROWS` rows from a prefilled cache of `cache_len` slots."""
  import jax
  import numpy as np

  from trainers.serving.embedded import sampler as sampler_mod

  s = _sampler()
  num_steps = cache_len - PROMPT
  rng = np.random.default_rng(0)
  ids = rng.integers(3, 64, (ROWS, PROMPT)).astype(np.int32)
  ones, seeds = np.ones((ROWS,), np.float32), np.arange(ROWS, dtype=np.uint32)
  max_new = np.full((ROWS,), num_steps, np.int32)
  per_row = dict(
    seeds=seeds,
    temperature=ones,
    top_p=ones,
    top_k=np.full((ROWS,), -1, np.int32),
    min_p=np.zeros((ROWS,), np.float32),
    max_new=max_new,
    stop=np.full((ROWS, 4), -1, np.int32),
  )
  windowed = "window" in inspect.signature(sampler_mod._decode).parameters
  # Before: `_prefill(ids right-padded, prompt_lens)`; after: `_prefill(ids left-padded, start)`.
  first = np.zeros((ROWS,), np.int32) if windowed else np.full((ROWS,), PROMPT, np.int32)

  def run():
    state = s._prefill(s.params, ids, first, ones, max_new, num_steps=num_steps)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    step = 0
    while step < STEPS:  # as `Sampler._run` dispatches them
      window = sampler_mod._window(PROMPT + step + 1, cache_len) if windowed else None
      until = min(STEPS, window - PROMPT) if windowed else STEPS
      state = s._decode(
        s.params, state, first, *per_row.values(), np.int32(until), **({"window": window} if windowed else {})
      )
      step = until
    jax.block_until_ready(state)
    assert int(jax.device_get(state["step"])) == STEPS
    return time.perf_counter() - t0

  run()  # compiles
  return 1e3 * min(run() for _ in range(repeats)) / STEPS


def colocated_rollout() -> dict:
  from benchmarks.colocated import SHAPES, ours

  shape = next(s for s in SHAPES if s.name == "larger")
  with tempfile.TemporaryDirectory(prefix="bench-decode-") as root:
    r = ours(shape, "colocated", root)
  return {"rollout_ms": r["rollout_ms"], "step_ms": r["step_ms"], "train_ms": r["train_ms"]}


def child(repeats: int, rollout: bool) -> dict:
  out = {f"decode_step_ms_{n}": decode_step_ms(n, repeats) for n in CACHES}
  if rollout:
    out.update(colocated_rollout())
  return out


def _measure(tree: str, repeats: int, rollout: bool) -> dict:
  env = dict(os.environ, PYTHONPATH=tree)
  # This file is loaded by path in the child; the tree's packages come from PYTHONPATH.
  code = (
    "import importlib.util, json, sys; spec = importlib.util.spec_from_file_location('decode_bench', sys.argv[1]); "
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
    "print('RESULT ' + json.dumps(m.child(int(sys.argv[2]), sys.argv[3] == '1')))"
  )
  proc = subprocess.run(
    [sys.executable, "-c", code, os.path.abspath(__file__), str(repeats), "1" if rollout else "0"],
    cwd=tree,
    env=env,
    capture_output=True,
    text=True,
  )
  lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"measuring {tree} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1][len("RESULT ") :])


def _commit(tree: str) -> str:
  proc = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
  return proc.stdout.strip() + (
    " + uncommitted changes" if subprocess.run(["git", "-C", tree, "diff", "--quiet", "HEAD"]).returncode else ""
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--baseline", default=None, help="a checkout to compare against (before)")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--no-rollout", action="store_true", help="the decode step only")
  parser.add_argument("--json", default="benchmarks/results/decode.json")
  args = parser.parse_args(argv)
  trees = ([("before", os.path.abspath(args.baseline))] if args.baseline else []) + [("after", ROOT)]
  runs = {name: [] for name, _ in trees}
  for r in range(args.rounds):
    for name, tree in trees:
      runs[name].append(_measure(tree, args.repeats, not args.no_rollout))
      print(f"round {r + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
  best = {name: {k: min(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
  keys = list(best["after"])
  print("\n| | " + " | ".join(k.replace("_", " ") for k in keys) + " |")
  print("|---|" + "---|" * len(keys))
  for name, row in best.items():
    print(f"| {name} | " + " | ".join(f"{row[k]:.1f}" for k in keys) + " |")
  os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(
      {
        "date": time.strftime("%Y-%m-%d"),
        "rows": ROWS,
        "prompt": PROMPT,
        "steps": STEPS,
        "baseline": args.baseline,
        "commits": {name: _commit(tree) for name, tree in trees},
        "best": best,
        "runs": runs,
      },
      f,
      indent=1,
    )
  print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
