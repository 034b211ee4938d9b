"""The rollout servers from the trainer's side: what it asks them before step 1 (health, the
per-token extras, the initial weight push), the weights it pushes after each step,
the mismatch sanity check, and the wait for a server that went away (contract §11).

`Servers` is composed by `trainers.rollout.backend.build_rollout` from a client
(`trainers.rollout.client.SGLangClient` over its engines, on process 0) and a weight-sync
strategy (`trainers.rollout.weight_sync`: `DiskSync` for servers over HTTP, `MemorySync` for
an engine colocated in this process). Rollouts replayed from records have no servers' side.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import jax.numpy as jnp

import mis_jax
from trainers.models import DTYPES
from trainers.runtime import distributed
from trainers.runtime.errors import NoServerUp, Preempted, TrainingError, on_primary
from trainers.rollout.samples import RolloutResult, ServerError
from trainers.rollout.client import SGLangClient
from trainers.rollout.weight_sync import WeightSync

# The mismatch sanity check's limits (mean |Δ log p| over response tokens, mis_k3_kl) when server
# and trainer hold the same weights. Measured on the tiny models (docs/guides/trainer.md): float32 on both sides
# 3e-7 / 0; bf16 engine 7e-3–1.2e-2 / 4e-5–7e-4; fp8 weights 5e-2–6e-2 / 2e-3–4e-3; a batch
# garbled by sglang-jax's overlap scheduler 1.78 / 1.23; log-probs shifted by one token ~2 / ~1.
MISMATCH_LIMITS = {"float32": (1e-3, 1e-4), "low": (0.25, 0.1)}
NO_RESTARTS = {"rollout/server_restarts": 0, "rollout/unavailable_s": 0.0}  # a step's metrics when none went away


@dataclasses.dataclass(frozen=True)
class Sampling:
  """What every `/generate` of the run asks: the sampling params, `n` per prompt, the seed, and
  the run's per-token extras (`trainers.rollout.extras`: sampling masks, routed experts, ...)."""

  params: dict
  n: int
  seed: int
  extras: tuple = ()


class Servers:
  """The engines of `client` (SGLang servers or routers, or the colocated engine), their weights
  pushed by `weight_sync`. Process 0 holds the client (`client` is None on the others); the
  others take part in the collective weight writes and get process 0's answers.

  Bookkeeping: `served_version` is the step whose weights the servers hold, `served_path` the
  HF directory they were loaded from (what a restarted server gets back).
  """

  def __init__(
    self,
    cfg,
    *,
    client: SGLangClient | None,
    weight_sync: WeightSync,
    start_dir: str,
    model_config,
    sampling: Sampling,
    episodes=None,
    log=print,
  ):
    r = self.rollout = cfg.rollout
    self.cfg, self.model_config, self.sampling, self.log = cfg, model_config, sampling, log
    self.start_dir = start_dir
    self.client, self.weight_sync = client, weight_sync
    self.episodes = episodes  # an agent task's multi-turn driver and environments (`Episodes`, make_env), or None
    self.weight_dtype = (
      r.sync.weight_dtype or r.placement.server_dtype
    )  # refined from the servers' /server_info at start
    self.server_dtype, self.server_quantized = r.placement.server_dtype, r.placement.server_quantize != "none"
    self.served_version, self.served_path = 0, start_dir
    self._warned_versions = False
    self.at = "start"  # where the run is, for the fleet's events ("step 4", "the weight push after step 4")
    self._deadline: float | None = None  # when the servers' current absence stops the run (once per step)
    self._warned_exact = False
    self.step_events = dict(NO_RESTARTS)
    if client is not None:  # what happens to the engines is logged with where the run is
      client.log = lambda line: self.log(f"{self.at}: {line}")

  # --- before step 1 -------------------------------------------------------------------------
  def prepare(self, params, step: int, *, log=print, preempted=lambda: False) -> None:
    """Health, the probes a run's options need, and the initial push: afterwards the servers hold
    the trainer's weights (or, when the push is skipped, the very checkpoint it starts from). A
    push no server took waits for them as a step's does (`Preempted`: a stop was asked meanwhile)."""
    r, self.log, self.at = self.rollout, log, f"the weight push before step {step + 1}"
    on_primary(
      lambda: self.client.wait_until_healthy(attempts=r.transport.health_attempts, backoff_s=r.transport.backoff_s)
    )
    on_primary(lambda: self.weight_sync.check_reach(log=log))  # e.g. no shared filesystem: stop now, not at a push
    if self.sampling.extras:  # a server that cannot return an extra is found before any step
      on_primary(lambda: self.client.check_extras(self.sampling.extras, self.sampling.params))
    if self._first_push(step, log=log):
      self._push_until_taken(params, step, preempted)
    else:  # a fleet that admits workers during the run gives them these
      self.weight_sync.start(params, step, self.weight_dtype)
      on_primary(
        lambda: self.client.weights_served(self.weight_sync.served_load(self.served_path, str(step)), str(step))
      )
    self.served_version = step
    self.step_done()  # (its waits are not step 1's)

  def facts(self) -> dict:
    """What the servers say before training (process 0): whether every one serves the
    trainer's starting weights (`/model_info`'s `model_path` is `model.path`, or the preset's
    initial directory), the dtype the first reports (`/server_info`), and the URLs without a
    weight-update route."""
    start = os.path.realpath(self.start_dir)  # (process 0 only: no collective in here)
    serves_start, dtypes, quantized, inexact = True, set(), False, []
    for url in self.client.urls:
      info = self.client.model_info(url)
      path = info.get("model_path")
      serves_start &= isinstance(path, str) and os.path.realpath(path) == start
      try:
        sinfo = self.client.server_info(url)
      except ServerError:
        sinfo = {}
      dtypes.add(sinfo.get("dtype"))
      quantized |= sinfo.get("quantization") not in (None, "none", "")
      if sinfo.get("arithmetic") != "batch_invariant":  # exact mode's engines (contract §13)
        inexact.append(
          f"{url} ({sinfo.get('frontend') or 'an SGLang server'}, dtype {sinfo.get('dtype')}, arithmetic "
          f"{sinfo.get('arithmetic', 'not reported')})"
        )
    missing = [url for url in self.client.urls if not self.client.has_weight_update_route(url)]
    served = sorted(map(str, dtypes))
    dtype = dtypes.pop() if len(dtypes) == 1 else None
    return {
      "serves_start": serves_start,
      "dtype": dtype if dtype in DTYPES else None,
      "quantized": quantized,
      "missing_update_route": missing,
      "dtypes": served,
      "inexact": inexact,
    }

  def _first_push(self, step: int, *, log=print) -> bool:
    """Decides the first weight push (`rollout.sync.initial_sync`) and the pushed dtype, and checks
    that every server can load weights when the run will push any. Returns whether to push now.

    `auto` skips the push when the run is not resumed and every server reports `model.path`
    (or the preset's initial directory) as its `model_path`: it loaded the very checkpoint the
    trainer starts from, so a push would write the same values (cast to the same dtype). A
    resume always pushes (the servers must get the restored weights)."""
    r, resumed = self.rollout, step > 0
    facts = on_primary(self.facts)
    if r.placement.exact:
      self._check_exact(facts)
    self.server_dtype = facts["dtype"] or r.placement.server_dtype
    self.server_quantized = facts["quantized"] or r.placement.server_quantize != "none"
    self.weight_dtype = r.sync.weight_dtype or self.server_dtype
    push = resumed or r.sync.initial_sync == "always" or (r.sync.initial_sync == "auto" and not facts["serves_start"])
    # Exact mode: an engine serving the starting checkpoint holds it cast to its dtype only; the exact
    # pass's copy went through the pushed dtype first, which a narrower pushed dtype rounds.
    narrower = jnp.dtype(DTYPES[self.weight_dtype]).itemsize < jnp.dtype(DTYPES[self.server_dtype]).itemsize
    if r.placement.exact and narrower and r.sync.initial_sync == "auto":
      push = True
    first_sync = step + r.sync.sync_every - step % r.sync.sync_every  # the loop's first push
    will_sync = push or first_sync <= self.cfg.train.steps
    if facts["missing_update_route"] and will_sync:
      when = (
        "the resumed weights before step 1"
        if resumed
        else ("the starting weights before step 1" if push else f"the weights after step {first_sync}")
      )
      raise TrainingError(
        f"{', '.join(facts['missing_update_route'])} has no /update_weights_from_disk route (HTTP 404), so it "
        f"cannot load {when}. Settings that need no weight push: start the server on model.path with "
        f"rollout.sync.initial_sync: auto (or never) and rollout.sync.sync_every > train.steps (every step then "
        f"trains on "
        f"rollouts of the starting weights: decoupled PPO corrects the growing staleness), or train from records "
        f"(rollout.records.load_dir)"
      )
    if distributed.is_primary():
      warning = rounding_warning(self.cfg.model.dtype, self.weight_dtype)
      if warning:
        log(warning)
      if not push:
        log(
          f"initial weight push skipped (rollout.sync.initial_sync {r.sync.initial_sync}): "
          + ("every server already serves the starting weights" if facts["serves_start"] else "as configured")
        )
      if facts["missing_update_route"]:
        log(
          f"{', '.join(facts['missing_update_route'])} cannot load new weights; none will be pushed in "
          f"{self.cfg.train.steps} steps (rollout.sync.sync_every {r.sync.sync_every})"
        )
    return push

  def _check_exact(self, facts: dict) -> None:
    """Exact mode (`rollout.placement.exact`): every engine computes in batch-invariant arithmetic, in
    `rollout.placement.server_dtype` (the trainer's exact pass casts the weights to it), unquantised."""
    r = self.rollout
    if facts["inexact"]:
      raise mis_jax.ConfigError(
        f"rollout.placement.exact: {', '.join(facts['inexact'])} does not report batch-invariant arithmetic, so its "
        "log-probs cannot equal the trainer's exact pass; start `mis-jax serve --arithmetic batch_invariant` (or "
        "give no --sglang-url: the trainer starts one), or set rollout.placement.exact: false"
      )
    if facts["dtypes"] != [r.placement.server_dtype]:
      raise mis_jax.ConfigError(
        f"rollout.placement.exact: the servers serve {', '.join(facts['dtypes'])}, "
        f"rollout.placement.server_dtype is {r.placement.server_dtype}: the exact pass computes in "
        "the served dtype; set server_dtype to the servers'"
      )
    if facts["quantized"]:
      raise mis_jax.ConfigError(
        "rollout.placement.exact: a server serves quantised weights; exact mode needs unquantised ones"
      )

  # --- rollouts ---------------------------------------------------------------------------------
  def generate(self, prompts: list, batch: int) -> RolloutResult:
    """Rollout batch `batch` of the task's `prompts` (process 0): its per-sample seeds depend on
    (seed, batch) only, so a redone batch samples the same completions from the same weights. An
    agent task's prompts start multi-turn trajectories (`trainers.agents.episodes`), each turn of
    every trajectory in one batched request."""
    s, version = self.sampling, self.served_version
    seed = s.seed * 100_003 + batch
    if self.episodes is None:
      result = self.client.generate([p.ids for p in prompts], s.params, n=s.n, seed=seed, extras=s.extras)
    else:
      episodes, make_env = self.episodes
      result = episodes.run(
        self.client.generate, prompts, make_env, sampling_params=s.params, n=s.n, seed=seed, extras=s.extras
      )
    result = self._own_versions(result, version)
    self.weight_sync.rollouts_done()
    return result

  def _own_versions(self, result: RolloutResult, version: int) -> RolloutResult:
    """Samples whose server reports no usable weight version (none, or not a step number such as
    SGLang's "default") get the trainer's own bookkeeping: `version`, the last it pushed."""
    bad = [s for s in result.samples if not str(s.weight_version).isdigit()]
    if not bad:
      return result
    if not self._warned_versions:
      self._warned_versions = True
      warnings.warn(
        f"the server's replies carry no usable weight_version ({bad[0].weight_version!r}): using the "
        f"trainer's own bookkeeping (the version it last pushed)"
      )
    own = str(version)
    samples = [
      dataclasses.replace(s, weight_version=own, weight_versions=tuple((own, a, b) for _, a, b in s.weight_versions))
      if not str(s.weight_version).isdigit()
      else s
      for s in result.samples
    ]
    return dataclasses.replace(result, samples=samples)

  # --- after each step --------------------------------------------------------------------------
  def sync(self, params, step: int, *, preempted=lambda: False) -> dict:
    """Pushes the weights of `step` every `rollout.sync.sync_every` steps; its phase times."""
    if step % self.rollout.sync.sync_every:
      return {}
    self.at = f"the weight push after step {step}"
    try:
      return self._push_until_taken(params, step, preempted)
    except Preempted:
      return {}  # the step is done; a resume pushes its weights

  def _push_until_taken(self, params, step: int, preempted) -> dict:
    """`push`; when no server took the weights, waits for one to answer `/health` (the step's one
    deadline) and pushes again."""
    while True:
      try:
        return self.push(params, step)
      except NoServerUp as e:  # every server went away during the push: wait, then push again
        self._wait(e, preempted, f"a server to load the weights of step {step}", self._answering)

  def push(self, params, step: int) -> dict:
    """The weights of `step` into every engine (`weight_sync`); its phase times. Raises
    `NoServerUp` when no server is up."""
    metrics, path = self.weight_sync.push(params, step, self.weight_dtype)
    self.served_version, self.served_path = step, path
    return metrics

  def mismatch_limits(self) -> tuple[float, float, str]:
    """`(max mean |Δ log p|, max mis_k3_kl, what)` for the sanity check, by dtype pair: float32
    on both sides (no quantisation) vs anything lower (`MISMATCH_LIMITS`)."""
    exact = (
      self.server_dtype == "float32"
      and not self.server_quantized
      and self.weight_dtype == "float32"
      and self.cfg.model.dtype == "float32"
    )
    key = "float32" if exact else "low"
    pair = f"server {self.server_dtype}{' quantised' if self.server_quantized else ''}, trainer {self.cfg.model.dtype}"
    return (*MISMATCH_LIMITS[key], pair)

  def check_mismatch(self, step: int, metrics: dict, result: RolloutResult) -> None:
    """When the servers held the trainer's weights for this step's samples (all fresh), a
    mismatch far beyond numerics stops the run before anything is saved or pushed."""
    if not self.rollout.sync.mismatch_check:
      return
    if self.served_version != step or any(s.oldest_version != str(step) for s in result.samples):
      return
    max_abs, max_k3, pair = self.mismatch_limits()
    diff, k3 = metrics.get("train_rollout_logprob_abs_diff"), metrics.get("mis_k3_kl")
    if self.rollout.placement.exact and diff and not self._warned_exact:  # fresh samples: equal bit for bit
      self._warned_exact = True
      warnings.warn(
        f"step {step + 1}: rollout.placement.exact, the engine held the trainer's weights, yet the old and "
        f"the rollout log-probs differ (mean |Δ log p| {diff:.3g}, mis_k3_kl {k3:.3g}): exactness is "
        "broken (contract §13 lists what breaks it, e.g. a pause in place across this step's update)"
      )
    if diff is None or k3 is None or (diff <= max_abs and k3 <= max_k3):
      return
    raise TrainingError(
      f"step {step + 1}: the server and the trainer hold the same weights, yet their log-probs differ far "
      f"beyond numerics: mean |Δ log p| {diff:.3g} (limit {max_abs:g}), mis_k3_kl {k3:.3g} (limit {max_k3:g}) for "
      f"{pair}. Likely causes: the server runs another model or tokenizer than model.path, or an engine bug that "
      f"garbles batches (e.g. sglang-jax's overlap scheduler: start it with --disable-overlap-schedule). Nothing "
      f"of this step was saved or pushed; set rollout.sync.mismatch_check: false to train anyway"
    )

  # --- servers that go away -----------------------------------------------------------------
  def readmit(self, step: int | None = None) -> None:
    """Servers marked down that answer `/health` again get the served weights, then serve again
    (the live ones carried on without them). Process 0; cheap when none is down. `step`: the step
    about to run (where the fleet's events are logged)."""
    if step is not None:
      self.at = f"step {step}"
    self._count_back(on_primary(lambda: self._readmit_down()[0]))

  def _readmit_down(self) -> tuple[int, dict[str, str]]:
    """(process 0) Each server marked down that answers `/health` is given the served weights (a
    restarted server holds its starting weights, not the run's) and serves again. Returns how many
    came back and, for the others, why not."""
    back, why = 0, {}
    for url in self.client.down_urls():
      if not self.client.is_healthy(url):
        why[url] = "no answer to /health"
        continue
      try:
        version = str(self.served_version)  # a restarted server holds its starting weights, not the run's
        self.client.update_weights(
          self.weight_sync.served_load(self.served_path, version),
          version,
          urls=[url],
          pause_mode=self.rollout.sync.pause_mode,
        )
      except ServerError as e:  # (ServerUnavailable included) not ready after all, or the weights are not loadable
        why[url] = f"answers /health, but did not take the weights of step {self.served_version} ({e})"
        continue
      back += 1  # (a server that took the weights is readmitted by the push)
    return back, why

  def _count_back(self, restarted: int) -> None:
    self.step_events["rollout/server_restarts"] += restarted
    if restarted and distributed.is_primary():
      self.log(f"{self.at}: {restarted} server(s) back: they serve the weights of step {self.served_version} again")

  def wait_for_restart(self, error: NoServerUp, *, preempted=lambda: False) -> None:
    """No server could generate: waits until one that went away serves the served weights again
    (readmitted: it answers `/health` and took them), with backoff, up to the step's deadline
    (`_wait`). A stop asked meanwhile (`preempted()`) abandons the step (`Preempted`)."""

    def served() -> tuple[tuple[bool, int], str]:
      back, why = self._readmit_down()
      serving, reason = self.client.serving()
      return (serving, back), "; ".join([*(f"{url}: {w}" for url, w in why.items()), *([reason] if reason else [])])

    back = self._wait(
      error, preempted, f"a server to serve the weights of step {self.served_version} ({self.served_path})", served
    )
    self._count_back(back)

  def _answering(self) -> tuple[tuple[bool, int], str]:
    """(process 0) Whether a server answers `/health` (a push can be tried again), and if not, why."""
    if any(self.client.is_healthy(url) for url in self.client.urls):
      return (True, 0), ""
    return (False, 0), f"no answer to /health from {', '.join(self.client.urls) or 'any server'}"

  def _wait(self, error: NoServerUp, preempted, what: str, ready) -> int:
    """Polls `ready()` (process 0: `((done, servers readmitted), why not)`) with backoff until it is
    done, for at most `rollout.transport.server_restart_timeout_s` since the step first found no
    server: one deadline, computed then and never extended by a retry, checked before every poll.
    Past it, a `TrainingError` naming what was waited for and why it never came; a timeout of 0
    stops at once, with the failure as it was. Returns the servers readmitted."""
    timeout = self.rollout.transport.server_restart_timeout_s
    if timeout <= 0:
      raise error.error
    now = time.monotonic()
    if self._deadline is None:
      self._deadline = now + timeout
    deadline = self._deadline
    if distributed.is_primary():
      self.log(
        f"{self.at}: servers unavailable ({error}); waiting up to {max(deadline - now, 0):.0f} s more for "
        f"{what} (rollout.transport.server_restart_timeout_s {timeout:g})"
      )

    def wait():
      delay, why, readmitted = self.rollout.transport.backoff_s or 0.5, "the step failed again after they came back", 0
      while True:
        if preempted():
          raise Preempted(f"a stop was asked while waiting for {what}")
        if time.monotonic() >= deadline:
          raise TrainingError(
            f"{self.at}: {error}; waited rollout.transport.server_restart_timeout_s "
            f"({timeout:g} s) for {what}, in vain: {why}"
          )
        (done, back), why = ready()
        readmitted += back
        if done:
          return readmitted
        time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
        delay = min(delay * 2, 10.0)

    try:
      return on_primary(wait)
    finally:
      self.step_events["rollout/unavailable_s"] += time.monotonic() - now

  def step_done(self) -> dict:
    """The step's restart metrics (and a fresh wait budget for the next step)."""
    events, self._deadline = self.step_events, None
    self.step_events = dict(NO_RESTARTS)
    return events

  def close(self) -> None:
    if self.client is not None:
      self.client.close()


def rounding_warning(compute_dtype: str, pushed_dtype: str) -> str | None:
  """The start-up warning of a float32 trainer pushing bfloat16 weights (None otherwise): after a
  small update most weights move by less than half a bfloat16 spacing, so the engine's copy keeps
  the old values while the trainer computes with the new ones (docs/guides/choosing.md)."""
  if compute_dtype != "float32" or pushed_dtype != "bfloat16":
    return None
  return (
    "warning: the trainer computes in float32 (model.dtype) with float32 weights, the servers get them in "
    "bfloat16: an update smaller than half a bfloat16 spacing leaves the servers' copy unchanged while the "
    "trainer's moves, so the two drift apart from step 2 (Qwen3-0.6B at lr 1e-5: mis_k3_kl 0.03 against ~1e-6 "
    "at step 1). Set model.dtype: bfloat16 (the master weights stay model.param_dtype): the trainer then "
    "computes with the very bfloat16 weights it pushes (docs/guides/choosing.md)"
  )


class NoServers:
  """The servers' side of a run that replays its rollouts from records: there is none — nothing to
  prepare, check, push or wait for."""

  def __init__(self, load_dir: str):
    self.load_dir = load_dir

  def prepare(self, params, step: int, *, log=print, preempted=lambda: False) -> None:
    if distributed.is_primary():
      log(f"replaying rollout records from {self.load_dir} (no server)")

  def readmit(self, step: int | None = None) -> None:
    pass

  def check_mismatch(self, step: int, metrics: dict, result: RolloutResult) -> None:
    pass

  def sync(self, params, step: int, *, preempted=lambda: False) -> dict:
    return {}

  def step_done(self) -> dict:
    return dict(NO_RESTARTS)

  def close(self) -> None:
    pass
