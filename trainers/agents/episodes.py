"""The episode driver: a batch of prompts → multi-turn trajectories, token in, token out.

Each prompt starts `n` trajectories (prompt-major, a GRPO group of trajectories). Turn by turn,
every live trajectory's context — its prompt and every id appended since, exactly as sampled or as
the environment tokenized it — goes to the engines in ONE batched `/generate` per turn (the
client's chunks and concurrency; contexts as `input_ids`, so an engine's prefix cache serves the
shared part), with every per-token extra the run asks for. The environments then step
concurrently in a bounded pool (`env_concurrency`) on the model's turns, and each observation's ids
are appended. Nothing sampled is decoded and re-encoded: the trainer gets the engine's ids.

A trajectory comes back as one `Sample`: `response_ids` hold the model's turns and the
observations between them; the `turn` extra (`TurnIndex`) says, per response token, the model turn
that sampled it (1, 2, …) or 0 for the environment's tokens, which the loss never trains on and
whose log-probs (stored as 0) never enter a ratio. Rollout log-probs, weight-version spans (each
turn's own version: turns of one trajectory may straddle weight updates) and sampling supports are
each turn's, placed at its tokens; routed experts (one row per input position) are, at each
position, those of the turn that computed it first — the routing that sampled each turn's tokens,
and for an observation, the next turn's prefill of it.

Budgets: `max_turns` model turns; each turn at most the run's `max_new_tokens`; the response (model
and environment tokens) at most `max_total_tokens`; the whole trajectory at most `max_context`
tokens (the trainer's row). A turn or an observation that would pass a budget truncates the
trajectory there (counted: `agent/truncated`): the tokens kept are a prefix of what was sampled.
A turn the engine aborts (a weight update's pause) is sent again, up to `max_turn_retries` times;
a malformed reply, an environment that raises, or a turn still aborted drops the trajectory
(counted as rejected / aborted; `agent/env_failures`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from trainers.tasks.env import Environment, Observation, Turn
from trainers.agents import rewards as agent_rewards
from trainers.tasks.base import Prompt
from trainers.rollout import extras as extras_lib
from trainers.runtime import distributed
from trainers.rollout.samples import Reply, RolloutResult, Sample


@extras_lib.register
class TurnIndex(extras_lib.TokenExtra):
  """Per response token of a trajectory: the model turn that sampled it (1, 2, …), or 0 for the
  environment's tokens. Declared by agent tasks (`AgentTask`); its record column keeps the turn
  boundaries and every token's source; `trainable` keeps the environment's tokens out of the loss."""

  name = "turn"
  span, fill, dtype = "response", 0, np.int32
  missing_column = "which a multi-turn run needs to tell the model's tokens from the environment's"

  @classmethod
  def activate(cls, rollout, model_config):
    return None  # declared by the task (`Episodes.extras`), not by a rollout setting

  @staticmethod
  def record_type():
    import pyarrow as pa

    return pa.list_(pa.int32())

  def parse(self, reply: Reply):
    return np.ones(len(reply.ids), np.int32)  # one reply: one model turn (the driver numbers them)

  def trainable(self, value) -> np.ndarray:
    return np.asarray(value) > 0

  def check_record(self, value, prompt_len, response_len):
    if value is None or len(value) != response_len:
      return f"column 'turn' has {0 if value is None else len(value)} entries for a response of {response_len} tokens"
    return None


@dataclasses.dataclass
class _Trajectory:
  prompt_index: int
  prompt: tuple[int, ...]
  env: Environment | None
  response: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  turn_of: list[int] = dataclasses.field(default_factory=list)
  spans: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
  parts: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(list))  # "response" extras
  sequence: dict = dataclasses.field(default_factory=dict)  # "sequence" extras: each row from the turn that computed it
  texts: list[str] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  turn_rewards: dict[int, float] = dataclasses.field(default_factory=dict)  # model turn → its observation's reward
  finish: str = "stop"
  version: str | None = None
  turns: int = 0
  done: bool = False
  dropped: str | None = None  # "aborted" / "rejected" / "env": why it is not returned
  truncated: bool = False

  @property
  def context(self) -> tuple[int, ...]:
    return self.prompt + tuple(self.response)


@dataclasses.dataclass(frozen=True)
class Episodes:
  """Multi-turn rollouts of an `AgentTask` (see the module doc): the budgets and the pool."""

  max_turns: int = 4
  max_total_tokens: int = 1 << 30
  max_context: int = 1 << 30
  env_concurrency: int = 64
  max_turn_retries: int = 2
  rows_per_request: int | None = None  # contexts per `/generate` of a turn (the run's prompts_per_request × n)

  extras = (TurnIndex(),)  # what every agent run adds to the run's per-token extras

  @classmethod
  def declared_extras(cls, per_turn_rewards: bool = False) -> tuple:
    """The per-token extras an agent run adds: the `turn` index, and with per-turn rewards
    (`agent.per_turn_rewards`) each turn's reward on its tokens (`TurnReward`)."""
    return cls.extras + ((agent_rewards.TurnReward(),) if per_turn_rewards else ())

  def run(
    self,
    generate: Callable[..., RolloutResult],
    prompts: Sequence[Prompt],
    make_env,
    *,
    sampling_params: dict,
    n: int,
    seed: int,
    extras=(),
  ) -> RolloutResult:
    """`n` trajectories per prompt (prompt-major). `generate(contexts, sampling_params, n=1, seed=,
    extras=)` is the client's batched generation (`SGLangClient.generate`); `make_env(prompt)` the
    task's environment. Returns the trajectories as samples, each with its `reward` (the sum of its
    observations'), and the batch's `agent/*` metrics in `RolloutResult.metrics`."""
    t_start = time.perf_counter()
    trajs, counts = [], collections.Counter()
    for p_idx, prompt in enumerate(prompts):
      for _ in range(n):
        trajs.append(_Trajectory(p_idx, tuple(prompt.ids), None))
    env_s = 0.0
    with ThreadPoolExecutor(max_workers=self.env_concurrency) as pool:
      t0 = time.perf_counter()
      envs = list(pool.map(lambda tr: _safe(lambda: make_env(prompts[tr.prompt_index])), trajs))
      env_s += time.perf_counter() - t0
      for tr, (env, error) in zip(trajs, envs):
        tr.env = env
        if error is not None:
          tr.dropped, tr.done = "env", True
          counts["env_failures"] += 1
      aborted = rejected = 0
      reasons: list[str] = []
      for turn in range(1, self.max_turns + 1):
        live = [tr for tr in trajs if not tr.done]
        for tr in live:  # no room left for a model token
          if self._room(tr) <= 0:
            tr.done = tr.truncated = True
        live = [tr for tr in live if not tr.done]
        if not live:
          break
        replies = self._generate(generate, live, sampling_params, seed, turn, extras, reasons)
        for tr in live:
          reply = replies.get(id(tr))
          if isinstance(reply, str):  # lost: aborted past the retries, or malformed
            tr.dropped, tr.done = reply, True
            aborted += reply == "aborted"
            rejected += reply == "rejected"
            continue
          self._append_turn(tr, reply, turn, extras)
        stepping = [tr for tr in live if not tr.done]
        t0 = time.perf_counter()
        observed = list(
          pool.map(
            lambda tr: _safe(
              lambda: tr.env.step(Turn(tuple(tr.response[-_turn_len(tr) :]), tr.texts[-1], tr.finish, turn))
            ),
            stepping,
          )
        )
        env_s += time.perf_counter() - t0
        for tr, (obs, error) in zip(stepping, observed):
          if error is not None or not isinstance(obs, Observation):
            tr.dropped, tr.done = "env", True
            counts["env_failures"] += 1
            reasons.append(f"environment failed at turn {turn}: {error or f'returned {type(obs).__name__}'}")
            continue
          self._observe(tr, obs, turn, counts)
    samples = [self._sample(tr, extras) for tr in trajs if tr.dropped is None and tr.turns > 0]
    result = RolloutResult(
      samples=samples, num_requested=len(trajs), num_aborted=aborted, num_rejected=rejected, rejection_reasons=reasons
    )
    result.metrics = self._metrics(trajs, samples, counts, env_s, time.perf_counter() - t_start)
    return result

  # --- one turn ------------------------------------------------------------------------------
  def _room(self, tr: _Trajectory) -> int:
    """Model tokens the trajectory may still take (the response and the context budgets)."""
    return min(self.max_total_tokens - len(tr.response), self.max_context - len(tr.context))

  def _generate(self, generate, live, sampling_params, seed, turn, extras, reasons) -> dict:
    """This turn's reply (a `Sample`) per live trajectory (by `id`), or why it has none. One batched
    request for every live trajectory; aborted ones are sent again (`max_turn_retries`)."""
    out: dict[int, Sample | str] = {}
    pending = list(live)
    for attempt in range(self.max_turn_retries + 1):
      result = generate(
        [tr.context for tr in pending],
        sampling_params,
        n=1,
        seed=(seed + 7_919 * turn + 104_729 * attempt) % 2**31,
        extras=extras,
        rows_per_request=self.rows_per_request,
      )
      reasons.extend(result.rejection_reasons)
      for s in result.samples:
        out[id(pending[s.prompt_index])] = s
      lost = dict(result.lost)
      retry = []
      for i, tr in enumerate(pending):
        if id(tr) in out:
          continue
        why = lost.get(i, "rejected")
        if why == "aborted" and attempt < self.max_turn_retries:
          retry.append(tr)
        else:
          out[id(tr)] = why
      if not retry:
        break
      pending = retry
    return out

  def _append_turn(self, tr: _Trajectory, s: Sample, turn: int, extras) -> None:
    ids, lps = list(s.response_ids), list(s.rollout_logprobs)
    room = self._room(tr)
    if len(ids) > room:  # past a budget: a prefix of what was sampled, and the trajectory ends
      ids, lps, tr.truncated, tr.done = ids[:room], lps[:room], True, True
    start, context_len = len(tr.response), len(tr.context)
    tr.response += ids
    tr.logprobs += lps
    tr.turn_of += [turn] * len(ids)
    spans = [(v, a, min(b, len(ids))) for v, a, b in s.weight_versions if a < len(ids)] or [
      (s.weight_version, 0, len(ids))
    ]
    tr.spans += [(v, start + a, start + b) for v, a, b in spans]
    for e in extras:
      if e.name in (TurnIndex.name, agent_rewards.TurnReward.name):  # the driver's own: composed in `_sample`
        continue
      value = np.asarray(s.extras[e.name])
      if e.span == "response":
        tr.parts[e.name].append((start, value[: len(ids)]))
      else:  # the input positions this turn computed first (its prefill of the new context, then the
        # positions that sampled its tokens); earlier ones keep the turn that computed them (R3: each
        # turn's own routing for the tokens it sampled, even when the weights moved between turns)
        rows, have = value[: context_len + len(ids) - 1], tr.sequence.get(e.name)
        tr.sequence[e.name] = rows if have is None else np.concatenate([have, rows[len(have) :]])
    tr.texts.append(s.text)
    tr.finish, tr.version, tr.turns = s.finish_reason, s.weight_version, tr.turns + 1

  def _observe(self, tr: _Trajectory, obs: Observation, turn: int, counts) -> None:
    tr.reward += float(obs.reward)
    tr.turn_rewards[turn] = float(obs.reward)
    counts.update({k: int(v) for k, v in obs.counts.items()})
    if obs.done or turn == self.max_turns:  # no model turn follows: the observation adds nothing
      tr.done = True
      return
    ids = [int(i) for i in obs.ids]
    if len(tr.response) + len(ids) >= self.max_total_tokens or len(tr.context) + len(ids) >= self.max_context:
      tr.done = tr.truncated = True  # no room for the observation and a model token after it
      return
    tr.response += ids
    tr.logprobs += [0.0] * len(ids)  # never read: the loss masks the environment's tokens
    tr.turn_of += [0] * len(ids)

  # --- the trajectory as a sample -------------------------------------------------------------
  def _sample(self, tr: _Trajectory, extras) -> Sample:
    length = len(tr.response)
    composed = {}
    for e in extras:
      if e.name == TurnIndex.name:
        composed[e.name] = np.asarray(tr.turn_of, np.int32)
      elif e.name == agent_rewards.TurnReward.name:  # a turn the budget ended before its observation earned 0
        composed[e.name] = np.array([tr.turn_rewards.get(t, 0.0) if t > 0 else 0.0 for t in tr.turn_of], np.float32)
      elif e.span == "response":
        parts = tr.parts[e.name]
        trailing = parts[0][1].shape[1:] if parts else ()
        value = np.full((length,) + trailing, e.fill, e.dtype)
        for start, part in parts:
          value[start : start + len(part)] = part
        composed[e.name] = value
      else:
        rows = tr.sequence[e.name]
        value = np.full((len(tr.prompt) + length - 1,) + rows.shape[1:], e.fill, e.dtype)
        value[: len(rows)] = rows
        composed[e.name] = value
    return Sample(
      prompt_index=tr.prompt_index,
      prompt_ids=tr.prompt,
      response_ids=tuple(tr.response),
      rollout_logprobs=tuple(tr.logprobs),
      finish_reason=tr.finish,
      text="".join(tr.texts),
      weight_version=tr.version,
      weight_versions=tuple(tr.spans),
      extras=composed,
      reward=tr.reward,
    )

  def _metrics(self, trajs, samples, counts, env_s, total_s) -> dict:
    kept = [tr for tr in trajs if tr.dropped is None and tr.turns > 0]
    model = sum(sum(1 for t in tr.turn_of if t > 0) for tr in kept)
    env = sum(sum(1 for t in tr.turn_of if t == 0) for tr in kept)
    out = {
      "agent/turns_mean": float(np.mean([tr.turns for tr in kept])) if kept else 0.0,
      "agent/turns_max": float(max((tr.turns for tr in kept), default=0)),
      "agent/truncated": sum(tr.truncated for tr in kept),
      "agent/env_failures": int(counts.pop("env_failures", 0)),
      "agent/model_tokens": model,
      "agent/env_tokens": env,
      "agent/env_s": env_s,
      "agent/rollout_s": total_s,
      "agent/env_concurrency": self.env_concurrency,
    }
    for name in ("tool_calls", "tool_errors", "malformed_calls"):
      out[f"agent/{name}"] = int(counts.pop(name, 0))
    out.update({f"agent/{k}": int(v) for k, v in counts.items()})
    return out


def _turn_len(tr: _Trajectory) -> int:
  """Tokens of the trajectory's last model turn (its tail)."""
  k = 0
  while k < len(tr.turn_of) and tr.turn_of[-1 - k] == tr.turns:
    k += 1
  return k


def _safe(fn):
  """`(fn(), None)`, or `(None, the exception's text)`: an environment's failure is counted, not raised."""
  try:
    return fn(), None
  except Exception as e:  # noqa: BLE001
    return None, f"{type(e).__name__}: {e}"


def turn_mismatch(sb, old_logprobs, max_turns: int) -> dict:
  """Per model turn index t: the mean k3 `exp(r) - r - 1`, `r = clip(o - q, ±20)` over its tokens
  (`agent/k3_turn_{t}`; contract §8.1's `mis_k3_kl` by turn), from the step batch `sb` (its
  rollout log-probs `q` and `turn` extra) and the trainer's old log-probs `o` (host, the batch's
  shape). Turns no trajectory reached report nothing."""
  turn = np.asarray(sb.extras[TurnIndex.name])
  r = np.clip(np.asarray(old_logprobs, np.float64) - np.asarray(sb.batch.rollout_logprobs, np.float64), -20, 20)
  k3 = np.expm1(r) - r
  mask = np.asarray(sb.batch.loss_mask, bool)
  out = {}
  for t in range(1, max_turns + 1):
    at = mask & (turn == t)
    if at.any():
      out[f"agent/k3_turn_{t}"] = float(k3[at].mean())
  return out


class TurnMismatch:
  """The side job of an agent run after each step: the mismatch by turn index (`turn_mismatch`),
  when the step computed old log-probs."""

  def __init__(self, max_turns: int):
    self.max_turns = max_turns

  def after_step(self, done) -> dict:
    old = done.outcome.old_logprobs
    return {} if old is None else turn_mismatch(done.sb, distributed.to_host(old), self.max_turns)
