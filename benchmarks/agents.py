"""Multi-turn rollouts against single-turn rollouts of the same model tokens, side by side in one
run on the embedded server and on sglang-jax (`make bench-agents`; issue 48's throughput figure).

    python -m benchmarks.agents [--engine embedded|sglang-jax|both] [--quick] [--json PATH]

Each engine (a real process on 127.0.0.1, float32, the same fresh tiny Qwen3 with head_dim 128,
which sglang-jax's CPU attention needs) is driven by the trainer's own client (`http_client`: 4
requests in flight, `prompts_per_request` 8, the trainer's default) to generate, for
`prompts × n` trajectories:

- **single-turn**: one `/generate` batch of `turns × turn_tokens` new tokens per sample
  (8 prompts × n 4 = 32 rows in one request);
- **multi-turn**: the episode driver (`trainers.agents.episodes.Episodes`) for `turns` model turns
  of `turn_tokens` tokens each, a turn's contexts batched `rows_per_request = prompts_per_request
  × n` per `/generate` as the trainer does (`train.py`'s `episodes()`: the single-turn requests'
  rows), and on the embedded engine also 8 contexts per request (the client's prompt chunking, the
  driver's behaviour before `rows_per_request`). The environment answers every turn with a fixed
  3-token observation after a simulated tool latency (a sleep), and is done after the last turn;
  its steps run in the driver's pool of `env_concurrency` threads.

Every sample is `ignore_eos` (temperature 1), so both sides sample exactly the same number of
model tokens. Each setting is warmed up once (the engine compiles its shape buckets), then timed
in `repeats` rounds that run every setting once each (a load on the machine hits them alike); the
table shows each setting's median. Model tokens/s counts the model's tokens only (the
environment's are context); the ratio is single-turn tokens/s over the setting's, the median of
the rounds' paired ratios. Columns split a multi-turn rollout's wall time into the batched
`/generate` calls (one per turn, the client's requests inside), the environment pool
(`agent/env_s`) and the rest (the driver's bookkeeping).

sglang-jax (SGLang's JAX port; `trainers.serving.sglang_jax.launcher`, its own venv) keeps
SGLang's radix prefix cache, so a turn should prefill only its new tokens: the benchmark reads the
engine's own per-batch prefill log (`#new-token`, `#cached-token`) over each setting's timed runs
(`prefill_new_tokens`, `prefill_cached_tokens` per rollout), and times a 1-token `/generate` of 32
rows (8 on sglang-jax) at the first and the last turn's context length, fresh and repeated
(`turn_fixed_cost_s`: a repeat is a prefix-cache hit on sglang-jax, the same prefill again on the embedded engine). Its
KV pool is raised to 16384 tokens (`--max-total-tokens`; the launcher's CPU default of 4096 cannot
hold 32 single-turn rows of 260 tokens or 32 trajectories of 205, so it retracts requests and
evicts the cached turns). Its tool-latency settings are left out: on this CPU a sglang-jax turn
takes seconds, and the environment's 40–80 ms would be lost in the noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import tempfile
import time

OBS = 3  # observation tokens per turn
ENGINES = ("embedded", "sglang-jax")
SGLANG_JAX_EXTRA = ("--max-total-tokens", "16384")
PREFILL_LOG = re.compile(r"Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")


class ToolEnv:
  """Answers turn t with `[13, 40 + t, 13]` after `latency_s` (a tool call); done after `turns`."""

  def __init__(self, turns: int, latency_s: float):
    self.turns, self.latency_s = turns, latency_s

  def step(self, turn):
    from trainers.tasks.env import Observation

    if self.latency_s:
      time.sleep(self.latency_s)
    done = turn.index >= self.turns
    return Observation(
      ids=() if done else (13, 40 + turn.index % 10, 13), reward=0.0, done=done, counts={"tool_calls": 1}
    )


class TimedGenerate:
  """The client's `generate`, timing each call (the driver makes one per turn)."""

  def __init__(self, generate):
    self.generate, self.seconds, self.calls = generate, 0.0, 0

  def __call__(self, *args, **kwargs):
    t0 = time.perf_counter()
    try:
      return self.generate(*args, **kwargs)
    finally:
      self.seconds += time.perf_counter() - t0
      self.calls += 1


class PrefillLog:
  """sglang-jax's prefill batches (`#new-token`, `#cached-token`) logged since the last `take()`."""

  def __init__(self, path: str | None):
    self.path, self.offset = path, 0
    self.take()

  def take(self) -> tuple[int, int] | None:
    if self.path is None:
      return None
    time.sleep(0.05)  # the drain thread writes the engine's lines as they come
    with open(self.path, encoding="utf-8", errors="replace") as f:
      f.seek(self.offset)
      text = f.read()
      self.offset = f.tell()
    batches = [tuple(map(int, m.groups())) for m in PREFILL_LOG.finditer(text)]
    return sum(b[1] for b in batches), sum(b[2] for b in batches)


def _params(max_new_tokens: int) -> dict:
  return {
    "temperature": 1.0,
    "max_new_tokens": max_new_tokens,
    "ignore_eos": True,
    "no_stop_trim": True,
    "skip_special_tokens": False,
  }


def single_turn(client, prompts, *, n: int, tokens: int, seed: int) -> dict:
  timed = TimedGenerate(client.generate)
  t0 = time.perf_counter()
  result = timed([p.ids for p in prompts], _params(tokens), n=n, seed=seed)
  seconds = time.perf_counter() - t0
  assert len(result.samples) == len(prompts) * n, result.rejection_reasons
  return {
    "seconds": seconds,
    "model_tokens": sum(len(s.response_ids) for s in result.samples),
    "env_tokens": 0,
    "generate_s": timed.seconds,
    "generate_calls": timed.calls,
    "env_s": 0.0,
  }


def multi_turn(
  client,
  prompts,
  *,
  n: int,
  turns: int,
  turn_tokens: int,
  latency_s: float,
  env_concurrency: int,
  rows_per_request: int | None,
  seed: int,
) -> dict:
  from trainers.agents.episodes import Episodes

  driver = Episodes(max_turns=turns, env_concurrency=env_concurrency, rows_per_request=rows_per_request)
  timed = TimedGenerate(client.generate)
  t0 = time.perf_counter()
  result = driver.run(
    timed,
    prompts,
    lambda prompt: ToolEnv(turns, latency_s),
    sampling_params=_params(turn_tokens),
    n=n,
    seed=seed,
    extras=Episodes.extras,
  )
  seconds = time.perf_counter() - t0
  m = result.metrics
  assert len(result.samples) == len(prompts) * n and m["agent/turns_mean"] == turns, (m, result.rejection_reasons)
  return {
    "seconds": seconds,
    "model_tokens": int(m["agent/model_tokens"]),
    "env_tokens": int(m["agent/env_tokens"]),
    "generate_s": timed.seconds,
    "generate_calls": timed.calls,
    "env_s": float(m["agent/env_s"]),
  }


def _summary(runs: list[dict]) -> dict:
  """The median run (by wall time) of one setting, with every run's wall time."""
  mid = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
  return {**mid, "tokens_per_s": mid["model_tokens"] / mid["seconds"], "seconds_all": [r["seconds"] for r in runs]}


def settings_for(engine: str, *, rows: int, latency_ms: float, concurrencies: tuple[int, ...]) -> list[tuple]:
  """(name, rows per multi-turn request (None: the client's 8 contexts), env pool, tool latency s)."""
  full = concurrencies[-1]
  out = [("single-turn", None, None, 0.0), ("multi-turn, no tool latency", rows, full, 0.0)]
  if engine == "sglang-jax":
    return out
  out.append(("multi-turn, no tool latency", None, full, 0.0))
  out += [(f"multi-turn, tool {latency_ms:g} ms", rows, c, latency_ms / 1e3) for c in concurrencies]
  return out


def run(
  url: str,
  *,
  engine: str = "embedded",
  prompts: int,
  n: int,
  turns: int,
  turn_tokens: int,
  latency_ms: float,
  concurrencies: tuple[int, ...],
  repeats: int,
  log_path: str | None = None,
  probe_rounds: int | None = None,
  log=print,
) -> list[dict]:
  """Every setting warmed up once (compiles its shapes), then `repeats` rounds that run each
  setting once in turn (a load on the machine hits them all alike): each setting's median, and
  its ratio to single-turn as the median of the rounds' paired ratios."""
  from trainers.tasks.base import Prompt
  from trainers.rollout.client import http_client

  chunk = 8  # the trainer's default prompts_per_request
  rows = chunk * n  # the trainer's rows_per_request for a turn: prompts_per_request × n
  client = http_client([url], timeout_s=600, prompts_per_request=chunk)
  batch = [Prompt(ids=(1, 3 + i % 10, 3 + (i * 7) % 10, 13)) for i in range(prompts)]
  multi = dict(prompts=batch, n=n, turns=turns, turn_tokens=turn_tokens)
  settings = settings_for(engine, rows=rows, latency_ms=latency_ms, concurrencies=concurrencies)
  prefill = PrefillLog(log_path)

  def once(setting, seed):
    name, per, concurrency, latency = setting
    if concurrency is None:
      return single_turn(client, batch, n=n, tokens=turns * turn_tokens, seed=seed)
    return multi_turn(client, **multi, latency_s=latency, env_concurrency=concurrency, rows_per_request=per, seed=seed)

  for setting in settings:
    once(setting, 10_000)
  runs = [[] for _ in settings]
  logged = [[0, 0] for _ in settings]
  for i in range(repeats):
    for k, setting in enumerate(settings):
      prefill.take()
      runs[k].append(once(setting, i))
      if (got := prefill.take()) is not None:
        logged[k] = [logged[k][0] + got[0], logged[k][1] + got[1]]
  # A turn's fixed cost: one 1-token /generate of every trajectory (one request), at the first
  # turn's context and at the last's; "fresh" contexts differ from every earlier request after
  # their first token, "repeat" sends the same contexts again (a prefix-cache hit, where there is one).
  last = 4 + (turns - 1) * (turn_tokens + OBS)
  probe_s, probe_rows = {}, rows if log_path is None else max(rows // 4, 1)  # sglang-jax: ~1 ms a prefilled token
  for i in range(probe_rounds or repeats + 1):  # the first round compiles, left out
    for length in (4, last):
      contexts = [
        tuple([1, 14 + (i * 7 + r) % 50] + [3 + (r + k) % 10 for k in range(length - 2)]) for r in range(probe_rows)
      ]
      for kind in ("fresh", "repeat"):
        t0 = time.perf_counter()
        client.generate(contexts, _params(1), n=1, seed=i, rows_per_request=probe_rows)
        probe_s.setdefault(f"1 token, context {length}, {kind}", []).append(time.perf_counter() - t0)
  overhead = {k: statistics.median(v[1:]) for k, v in probe_s.items()}
  log(f"[{engine}] a turn's fixed cost: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in overhead.items()))
  out = []
  for (name, per, concurrency, latency), rs, (new, cached) in zip(settings, runs, logged):
    if concurrency is None:  # one request of the prompts, n each
      per_request, requests = min(chunk, prompts) * n, -(-prompts // chunk)
    else:  # a turn: one context per trajectory, n 1
      per_request = min(per or chunk, prompts * n)
      requests = -(-prompts * n // per_request)
    r = {
      "engine": engine,
      "setting": name,
      "turns": turns,
      "turn_tokens": turn_tokens,
      "rows_per_request": per_request,
      "requests_per_generate": requests,
      "env_concurrency": concurrency,
      "tool_latency_ms": latency * 1e3,
      **_summary(rs),
      "turn_fixed_cost_s": overhead,
    }
    r["driver_s"] = max(r["seconds"] - r["generate_s"] - r["env_s"], 0.0)
    if log_path is not None:  # per rollout, over the timed rounds
      r["prefill_new_tokens"], r["prefill_cached_tokens"] = new / repeats, cached / repeats
    # single-turn tokens/s over this setting's, paired by round
    r["ratio"] = statistics.median(
      (b["model_tokens"] / b["seconds"]) / (x["model_tokens"] / x["seconds"]) for b, x in zip(runs[0], rs)
    )
    out.append(r)
    cache = (
      f", prefill {r['prefill_new_tokens']:.0f} new + {r['prefill_cached_tokens']:.0f} cached tokens"
      if log_path is not None
      else ""
    )
    log(
      f"[{engine}] {name:30s} rows {per_request:3d} pool {concurrency!s:>4s}: {r['tokens_per_s']:8.0f} model tok/s, "
      f"x{r['ratio']:.2f} ({r['model_tokens']} tok in {r['seconds']:.3f} s; generate {r['generate_s']:.3f} s in "
      f"{r['generate_calls']} calls, env {r['env_s']:.3f} s{cache})",
      flush=True,
    )
  return out


def table(rows: list[dict]) -> str:
  out = [
    "| model tokens | rollout | rows per request | env pool | model tok/s | single-turn ÷ this | wall (median) | "
    "/generate | environment | driver | prefill: new + cached tokens |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    pool = "—" if r["env_concurrency"] is None else str(r["env_concurrency"])
    cache = (
      f"{r['prefill_new_tokens']:.0f} + {r['prefill_cached_tokens']:.0f}"
      if "prefill_new_tokens" in r
      else "— (no prefix cache)"
    )
    out.append(
      f"| {r['turns']} × {r['turn_tokens']} | {r['setting']} | {r['rows_per_request']} | {pool} | "
      f"{r['tokens_per_s']:.0f} | {r['ratio']:.2f} | {r['seconds'] * 1e3:.0f} ms | {r['generate_s'] * 1e3:.0f} ms "
      f"({r['generate_calls']} × {r['requests_per_generate']} requests) | {r['env_s'] * 1e3:.0f} ms | "
      f"{r['driver_s'] * 1e3:.0f} ms | {cache} |"
    )
  return "\n".join(out)


def model_config():
  """tiny-qwen3 with head_dim 128 (sglang-jax's CPU attention pads to it; tests/trainers/serving/test_sglang_jax.py)."""
  from trainers.models import PRESETS

  return dataclasses.replace(PRESETS["tiny-qwen3"], head_dim=128, num_attention_heads=2, num_key_value_heads=1)


def bench_engine(engine: str, path: str, tmp: str, config: dict, log=print) -> dict:
  """Starts `engine` on the checkpoint at `path` and runs every turn length's settings on it."""
  t0 = time.perf_counter()
  if engine == "sglang-jax":
    from trainers.serving.sglang_jax import launcher

    log_path = os.path.join(tmp, "sglang-jax.log")
    server = launcher.SGLangJaxServer(
      path,
      python=launcher.venv_python(),
      weight_version="0",
      log_path=log_path,
      dtype="float32",
      extra=SGLANG_JAX_EXTRA,
    )
    about = {
      "engine": f"sglang-jax {launcher.VERSION} (SGLang's JAX port: radix prefix cache, continuous batching)",
      "server_args": launcher.engine_args(path, dtype="float32", extra=SGLANG_JAX_EXTRA)[2:],
    }
  else:
    from trainers.serving.embedded.server import EmbeddedServer

    log_path, server = None, EmbeddedServer(path, dtype="float32", seed=0)
    about = {"engine": "mis-jax serve (embedded; no prefix cache)", "server_args": ["--dtype", "float32"]}
  start_s = time.perf_counter() - t0
  with server:
    rows = [
      r
      for t in config["turn_tokens"]
      for r in run(
        server.url,
        engine=engine,
        log_path=log_path,
        log=log,
        probe_rounds=2 if engine == "sglang-jax" else None,  # its uncached prefill: seconds
        **{**config, "turn_tokens": t},
      )
    ]
  return {
    **about,
    "repeats": config["repeats"],
    "start_s": round(start_s, 1),
    "seconds": round(time.perf_counter() - t0, 1),
    "rows": rows,
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--engine", choices=(*ENGINES, "both"), default="both")
  parser.add_argument("--quick", action="store_true", help="a smoke run: small shapes, one repeat, no JSON written")
  parser.add_argument("--json", default="benchmarks/results/agents.json")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--n", type=int, default=4)
  parser.add_argument("--turns", type=int, default=4)
  parser.add_argument("--turn-tokens", default="16,64", help="model tokens per turn: one table section each")
  parser.add_argument("--tool-latency-ms", type=float, default=10.0)
  parser.add_argument(
    "--repeats",
    type=int,
    default=None,
    help="timed rounds (default 5 on the embedded engine, 2 on sglang-jax: seconds a turn on CPU)",
  )
  args = parser.parse_args(argv)
  import jax
  from trainers.models import init_checkpoint

  engines = ENGINES if args.engine == "both" else (args.engine,)
  config = {
    "prompts": args.prompts,
    "n": args.n,
    "turns": args.turns,
    "turn_tokens": [int(t) for t in args.turn_tokens.split(",")],
    "latency_ms": args.tool_latency_ms,
    "concurrencies": (args.prompts * args.n,),
  }
  repeats = {"embedded": args.repeats or 5, "sglang-jax": args.repeats or 2}
  if args.quick:
    config.update(prompts=2, n=2, turns=2, turn_tokens=[16], concurrencies=(4,))
    repeats = dict.fromkeys(ENGINES, 1)
  start = time.perf_counter()
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "model")
    init_checkpoint(path, config=model_config(), seed=0)
    for engine in engines:
      try:
        results[engine] = bench_engine(engine, path, tmp, {**config, "repeats": repeats[engine]})
      except Exception as e:  # noqa: BLE001 - `both` on a machine sglang-jax cannot run on: the embedded figures
        from trainers.serving.sglang_jax.launcher import EngineUnavailable

        if engine != "sglang-jax" or args.engine != "both" or not isinstance(e, EngineUnavailable):
          raise
        print(f"sglang-jax left out: {e}")
        results[engine] = {"engine": "sglang-jax", "unavailable": str(e), "rows": []}
  out = {
    "date": time.strftime("%Y-%m-%d"),
    "machine": {
      "platform": platform.platform(),
      "cpus": os.cpu_count(),
      "jax": jax.__version__,
      "backend": "cpu (each engine's own process)",
    },
    "config": {
      **config,
      "model": "tiny-qwen3 with head_dim 128, 2 heads, 1 KV head (float32, random init)",
      "client": "http_client: 4 requests in flight; prompts_per_request 8 (the trainer's default); "
      "a multi-turn turn's contexts rows_per_request = 8 × n per request (or 8: the client's chunking)",
      "observation_tokens": OBS,
      "sampling": _params(0)
      | {"max_new_tokens": "turns × turn_tokens (single-turn) / turn_tokens per turn (multi-turn)"},
    },
    "seconds": round(time.perf_counter() - start, 1),
    "engines": results,
  }
  if not args.quick:
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
  for engine, result in results.items():
    if "unavailable" in result:
      continue
    print(f"\n{engine} ({result['engine']}; {result['repeats']} rounds, {result['seconds']} s):\n")
    print(table(result["rows"]))
  print(f"\n{out['seconds']} s in all")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
