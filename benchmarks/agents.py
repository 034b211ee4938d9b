"""Multi-turn rollouts against single-turn rollouts of the same model tokens, side by side in one
run on the embedded server (`make bench-agents`; issue 48's throughput figure).

    python -m benchmarks.agents [--quick] [--json PATH]

`mis-jax serve` (a real process on 127.0.0.1, float32, a fresh tiny Qwen3) and the trainer's own
client (`http_client`: 4 requests in flight; `prompts_per_request` 8, the trainer's default, or
every context of a turn in one request) generate, for `prompts × n` trajectories:

- **single-turn**: one `/generate` batch of `turns × turn_tokens` new tokens per sample;
- **multi-turn**: the episode driver (`trainers.agents.episodes.Episodes`) for `turns` model turns
  of `turn_tokens` tokens each. The environment answers every turn with a fixed 3-token
  observation after a simulated tool latency (a sleep), and is done after the last turn; its
  steps run in the driver's pool of `env_concurrency` threads.

Every sample is `ignore_eos` (temperature 1), so both sides sample exactly the same number of
model tokens. Each setting is warmed up once (the engine compiles its shape buckets), then timed
in `repeats` rounds that run every setting once each (a load on the machine hits them alike); the
table shows each setting's median. Model tokens/s counts the model's tokens only (the
environment's are context); the ratio is single-turn tokens/s over the setting's, the median of
the rounds' paired ratios. Columns split a
multi-turn rollout's wall time into the batched `/generate` calls (one per turn, the client's
chunks inside), the environment pool (`agent/env_s`) and the rest (the driver's bookkeeping).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

OBS = 3  # observation tokens per turn


class ToolEnv:
  """Answers turn t with `[13, 40 + t, 13]` after `latency_s` (a tool call); done after `turns`."""

  def __init__(self, turns: int, latency_s: float):
    self.turns, self.latency_s = turns, latency_s

  def step(self, turn):
    from trainers.agents.env import Observation
    if self.latency_s:
      time.sleep(self.latency_s)
    done = turn.index >= self.turns
    return Observation(ids=() if done else (13, 40 + turn.index % 10, 13), reward=0.0, done=done,
                       counts={"tool_calls": 1})


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


def _params(max_new_tokens: int) -> dict:
  return {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True, "no_stop_trim": True,
          "skip_special_tokens": False}


def single_turn(client, prompts, *, n: int, tokens: int, seed: int) -> dict:
  timed = TimedGenerate(client.generate)
  t0 = time.perf_counter()
  result = timed([p.ids for p in prompts], _params(tokens), n=n, seed=seed)
  seconds = time.perf_counter() - t0
  assert len(result.samples) == len(prompts) * n, result.rejection_reasons
  return {"seconds": seconds, "model_tokens": sum(len(s.response_ids) for s in result.samples), "env_tokens": 0,
          "generate_s": timed.seconds, "generate_calls": timed.calls, "env_s": 0.0}


def multi_turn(client, prompts, *, n: int, turns: int, turn_tokens: int, latency_s: float, env_concurrency: int,
               seed: int) -> dict:
  from trainers.agents.episodes import Episodes
  driver = Episodes(max_turns=turns, env_concurrency=env_concurrency)
  timed = TimedGenerate(client.generate)
  t0 = time.perf_counter()
  result = driver.run(timed, prompts, lambda prompt: ToolEnv(turns, latency_s), sampling_params=_params(turn_tokens),
                      n=n, seed=seed, extras=Episodes.extras)
  seconds = time.perf_counter() - t0
  m = result.metrics
  assert len(result.samples) == len(prompts) * n and m["agent/turns_mean"] == turns, (m, result.rejection_reasons)
  return {"seconds": seconds, "model_tokens": int(m["agent/model_tokens"]), "env_tokens": int(m["agent/env_tokens"]),
          "generate_s": timed.seconds, "generate_calls": timed.calls, "env_s": float(m["agent/env_s"])}


def _summary(runs: list[dict]) -> dict:
  """The median run (by wall time) of one setting, with every run's wall time."""
  mid = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
  return {**mid, "tokens_per_s": mid["model_tokens"] / mid["seconds"],
          "seconds_all": [r["seconds"] for r in runs]}


def run(url: str, *, prompts: int, n: int, turns: int, turn_tokens: int, latency_ms: float,
        concurrencies: tuple[int, ...], repeats: int, log=print) -> list[dict]:
  """Every setting warmed up once (compiles its shapes), then `repeats` rounds that run each
  setting once in turn (a load on the machine hits them all alike): each setting's median, and
  its ratio to single-turn as the median of the rounds' paired ratios."""
  from trainers.tasks.base import Prompt
  from trainers.training.sglang_client import http_client
  rows_per_turn = prompts * n
  clients = {8: http_client([url], timeout_s=600),  # the trainer's default: 8 prompts per request
             rows_per_turn: http_client([url], timeout_s=600, prompts_per_request=rows_per_turn)}
  batch = [Prompt(ids=(1, 3 + i % 10, 3 + (i * 7) % 10, 13)) for i in range(prompts)]
  multi = dict(prompts=batch, n=n, turns=turns, turn_tokens=turn_tokens)
  latency_s, full = latency_ms / 1e3, concurrencies[-1]
  settings = [("single-turn", 8, None, 0.0), ("multi-turn, no tool latency", 8, full, 0.0),
              ("multi-turn, no tool latency", rows_per_turn, full, 0.0)]
  settings += [(f"multi-turn, tool {latency_ms:g} ms", 8, c, latency_s) for c in concurrencies]
  settings.append((f"multi-turn, tool {latency_ms:g} ms", rows_per_turn, full, latency_s))

  def once(setting, seed):
    name, chunk, concurrency, latency = setting
    if concurrency is None:
      return single_turn(clients[chunk], batch, n=n, tokens=turns * turn_tokens, seed=seed)
    return multi_turn(clients[chunk], **multi, latency_s=latency, env_concurrency=concurrency, seed=seed)

  for setting in settings:
    once(setting, 10_000)
  runs = [[] for _ in settings]
  for i in range(repeats):
    for k, setting in enumerate(settings):
      runs[k].append(once(setting, i))
  # A turn's fixed cost: one 1-token /generate of every trajectory (one request), at the first
  # turn's context and at the last's (the embedded engine prefills each turn's whole context).
  last = 4 + (turns - 1) * (turn_tokens + OBS)
  probes = {f"1 token, context {length}": [tuple([1] + [3 + (i + k) % 10 for k in range(length - 1)])
                                          for i in range(rows_per_turn)] for length in (4, last)}
  probe_s = {k: [] for k in probes}
  for i in range(repeats + 1):
    for k, contexts in probes.items():
      t0 = time.perf_counter()
      clients[rows_per_turn].generate(contexts, _params(1), n=1, seed=i)
      probe_s[k].append(time.perf_counter() - t0)
  overhead = {k: statistics.median(v[1:]) for k, v in probe_s.items()}
  log("a turn's fixed cost: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in overhead.items()))
  rows = []
  for (name, chunk, concurrency, latency), rs in zip(settings, runs):
    contexts = prompts if concurrency is None else prompts * n  # one per prompt (n each), one per trajectory
    r = {"setting": name, "turns": turns, "turn_tokens": turn_tokens, "prompts_per_request": chunk, "requests_per_generate": -(-contexts // chunk),
         "env_concurrency": concurrency, "tool_latency_ms": latency * 1e3, **_summary(rs),
         "turn_fixed_cost_s": overhead}
    r["driver_s"] = max(r["seconds"] - r["generate_s"] - r["env_s"], 0.0)
    # single-turn tokens/s over this setting's, paired by round
    r["ratio"] = statistics.median((b["model_tokens"] / b["seconds"]) / (x["model_tokens"] / x["seconds"])
                                   for b, x in zip(runs[0], rs))
    rows.append(r)
    log(f"{name:30s} chunk {chunk:3d} pool {concurrency!s:>4s}: {r['tokens_per_s']:8.0f} model tok/s, "
        f"x{r['ratio']:.2f} ({r['model_tokens']} tok in {r['seconds']:.3f} s; generate {r['generate_s']:.3f} s in "
        f"{r['generate_calls']} calls, env {r['env_s']:.3f} s)")
  return rows


def table(rows: list[dict]) -> str:
  out = ["| model tokens | rollout | prompts per request | env pool | model tok/s | single-turn ÷ this | wall (median) | "
         "/generate | environment | driver |", "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    pool = "—" if r["env_concurrency"] is None else str(r["env_concurrency"])
    out.append(f"| {r['turns']} × {r['turn_tokens']} | {r['setting']} | {r['prompts_per_request']} | {pool} | {r['tokens_per_s']:.0f} | "
               f"{r['ratio']:.2f} | {r['seconds'] * 1e3:.0f} ms | {r['generate_s'] * 1e3:.0f} ms "
               f"({r['generate_calls']} × {r['requests_per_generate']} requests) | {r['env_s'] * 1e3:.0f} ms | "
               f"{r['driver_s'] * 1e3:.0f} ms |")
  return "\n".join(out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run: small shapes, one repeat, no JSON written")
  parser.add_argument("--json", default="benchmarks/results/agents.json")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--n", type=int, default=4)
  parser.add_argument("--turns", type=int, default=4)
  parser.add_argument("--turn-tokens", default="16,64", help="model tokens per turn: one table section each")
  parser.add_argument("--tool-latency-ms", type=float, default=10.0)
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args(argv)
  import jax
  from trainers.models import init_checkpoint
  from trainers.serving.embedded.server import EmbeddedServer
  config = {"prompts": args.prompts, "n": args.n, "turns": args.turns,
            "turn_tokens": [int(t) for t in args.turn_tokens.split(",")],
            "latency_ms": args.tool_latency_ms, "concurrencies": (1, 16, args.prompts * args.n), "repeats": args.repeats}
  if args.quick:
    config.update(prompts=2, n=2, turns=2, turn_tokens=[16], concurrencies=(1, 4), repeats=1)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "model")
    init_checkpoint(path, preset="tiny-qwen3", seed=0)
    with EmbeddedServer(path, dtype="float32", seed=0) as srv:
      rows = [r for t in config["turn_tokens"] for r in run(srv.url, **{**config, "turn_tokens": t})]
  out = {"date": time.strftime("%Y-%m-%d"),
         "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
                     "backend": "cpu (the embedded server's process)"},
         "config": {**config, "model": "tiny-qwen3 (float32, random init)", "engine": "mis-jax serve (embedded)",
                    "client": "http_client: 4 requests in flight; 8 prompts per request (the default) or a turn's every context",
                    "observation_tokens": OBS, "sampling": _params(0) |
                    {"max_new_tokens": "turns × turn_tokens (single-turn) / turn_tokens per turn (multi-turn)"}},
         "seconds": round(time.perf_counter() - start, 1), "rows": rows}
  if not args.quick:
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {args.json}")
  print()
  print(table(rows))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
