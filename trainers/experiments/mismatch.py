"""The mismatch experiment: rollout corrections compared under controlled mismatch, over seeds.

Design (`python -m trainers.experiments.mismatch --out DIR`, the committed run; `--quick` is the
CI-sized version of the same pipeline):

- **Arms** (`ARMS`): standard PPO (no correction), bypass PPO, decoupled PPO + token TIS,
  decoupled PPO + MIS (token mask [0.5, 2] + veto 1e-4), REINFORCE + token IS.
- **Mismatch settings** (`SETTINGS`): the embedded server's precision and weight-only
  quantisation (`trainers.models.quantize`) against a float32 trainer, and staleness
  (`sync_every`): fp32 (no mismatch), bf16, fp8 weights, fp8 weights synced every 4 steps.
- **Mixture of experts** (`MOE`, `--design moe`): the tiny Qwen3-MoE preset (8 experts, top-2)
  under a bf16 and an fp8 engine, standard PPO, token TIS and MIS each without and with
  rollout routing replay (`+ R3`); every run records the server's routed experts, so the
  router disagreement (`routing_mismatch_frac`, `..._token_frac`) is measured in every arm.
- **Policy-loss forms** (`FORMS`, `--design forms`): verl's GSPO and CISPO (contract §6.2),
  alone and under decoupled PPO with the MIS arm's correction, beside standard PPO and that MIS
  arm, under a bf16 and an fp8 engine.
- **Threshold controller** (`CONTROLLER`, `--design controller`): decoupled PPO with bounds
  set each step (contract §3.1; `AUTO_ESS`, `AUTO_MASKED`) beside fixed token TIS and MIS and
  standard PPO, under the fp8 engine; every step records the bound chosen and what it reached.
- **Proximal policy** (`PROXIMAL`, `--design proximal`): decoupled PPO (token TIS, MIS) with
  the old log-probs recomputed or interpolated by weight versions (`, loglinear`, contract
  §6.3), under the fp8 engine synchronous and synced every 4 steps; `train_s` per step.
- **Exact mode** (`EXACT`, `--design exact`): standard PPO (no correction) and the MIS arm under a
  bf16 engine, with and without exact mode (`rollout.placement.exact`: the engine and the trainer's
  old-log-prob pass in batch-invariant arithmetic, contract §13), fresh and synced every 4 steps
  (stale rollouts, which exactness cannot make on-policy); `exact_table` pairs each arm's exact runs
  with its default ones, seed by seed.
- **Score centering** (`CENTERING`, `--design centering`): standard PPO and the MIS arm, each
  without and with score centering (`+ centering`, contract §6.6; the sampler's top-`TOP_K`
  log-probs asked for), under the bf16 and fp8 engines and fp8 synced every 4 steps; the
  centred runs record the drift term's size before centring and a bound on it after.
- **Seeds**: each seed draws its own initial weights (`init_seed`), prompts and sampling seeds;
  every arm and setting sees the same seeds (a paired design).

One embedded server per setting serves every run of that setting (its weights are replaced at
the start of each run). Every run's per-step metrics go to `OUT/results.json` (written after
each run, so an interrupted experiment keeps what finished and `--resume` continues it);
`summarize` computes, per arm and setting, the mean and a 95% t-interval over seeds of the
final reward (mean of the last `final_window` steps of the budget) and of the area under the
reward curve (mean reward over all steps), and the paired difference to standard PPO; `plot`
draws the curves with 95% bands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time

import numpy as np

import mis_jax

# Per-step metrics kept for every run (absent ones are recorded as null).
RECORDED = (
  "reward_mean",
  "mis_k3_kl",
  "train_rollout_logprob_abs_diff",
  "grad_norm",
  "mis_kept_token_fraction",
  "response_length",
  "pg_clipfrac",
  "routing_mismatch_frac",
  "routing_mismatch_token_frac",
  "mis_ess_ratio",
  "mis_auto_tis_upper_bound",
  "mis_auto_ess_ratio",
  "mis_auto_tis_masked_fraction",
  "mis_auto_target_met",
  "train_s",
  "score_centering_tv",
  "score_centering_tail_mass",
  "score_centering_drift",
  "score_centering_residual_bound",
)
R3 = " + R3"  # an arm name ending with it replays the server's routed experts (rollout.sampling.routing_replay r3)
LOGLINEAR = ", loglinear"  # an arm name ending with it approximates the proximal policy (loss.proximal loglinear)
CENTERED = " + centering"  # an arm name ending with it centres the scores (loss.score_centering, contract §6.6)
# The sampler's top-k a centred arm asks for (rollout.sampling.top_logprobs_num): the toy model's
# vocabulary is 64 tokens, so the top-20 hold all but a small tail (`score_centering_tail_mass`).
TOP_K = 20


def arms() -> dict[str, mis_jax.LossConfig]:
  """The loss of every arm; `<arm> + R3` is `<arm>` with routing replay (MoE designs), `<arm>,
  loglinear` with the interpolated proximal policy, `<arm> + centering` with score centering; the
  policy-loss forms' and the controller's arms among them."""
  base = _base_arms()
  return {
    **base,
    **{name + R3: base[name] for name in ("standard PPO", "decoupled + token TIS", "decoupled + MIS")},
    **_form_arms(base["decoupled + MIS"].mis),
    **_controller_arms(),
    **{
      name + LOGLINEAR: dataclasses.replace(base[name], proximal="loglinear")
      for name in ("decoupled + token TIS", "decoupled + MIS")
    },
    **{
      name + CENTERED: dataclasses.replace(base[name], score_centering=True)
      for name in ("standard PPO", "decoupled + MIS")
    },
  }


def _form_arms(mis: mis_jax.MISConfig) -> dict[str, mis_jax.LossConfig]:
  """GSPO and CISPO (contract §6.2) alone (standard PPO's anchor: the recomputed old log-probs)
  and under decoupled PPO with the MIS arm's correction. GSPO with its paper's sequence-ratio
  clip (3e-4 / 4e-4, verl's recipe); CISPO with the default ε = 0.2 on its weight."""
  forms = {"GSPO": dict(policy_loss="gspo", eps_clip=3e-4, eps_clip_high=4e-4), "CISPO": dict(policy_loss="cispo")}
  out = {}
  for name, kw in forms.items():
    out[name] = mis_jax.LossConfig(**kw)
    out[f"{name} + MIS"] = mis_jax.LossConfig(use_tis=True, mis=mis, **kw)
  return out


# The threshold controller's targets (contract §3.1) in the `controller` design: set so that they
# bind under the fp8 engine (its token weights: ESS ratio 0.999 on average, down to 0.991 on the worst steps).
AUTO_ESS, AUTO_MASKED = 0.999, 0.02


def _controller_arms() -> dict[str, mis_jax.LossConfig]:
  """Decoupled PPO with a bound set each step: token truncation at the loosest bound whose ESS
  ratio is `AUTO_ESS`, and a token mask band masking the `AUTO_MASKED` most extreme tokens."""
  return {
    "decoupled + auto TIS": mis_jax.LossConfig(
      use_tis=True, mis=mis_jax.MISConfig(tis_mode="truncate", tis_upper_bound="auto", target_ess_ratio=AUTO_ESS)
    ),
    "decoupled + auto MIS": mis_jax.LossConfig(
      use_tis=True, mis=mis_jax.MISConfig(tis_mode="mask", tis_upper_bound="auto", max_masked_fraction=AUTO_MASKED)
    ),
  }


def _base_arms() -> dict[str, mis_jax.LossConfig]:
  token_tis = mis_jax.MISConfig(tis_level="token", tis_mode="truncate", tis_upper_bound=2.0)
  return {
    "standard PPO": mis_jax.LossConfig(),
    "bypass PPO": mis_jax.LossConfig(use_rollout_logprobs=True),
    "decoupled + token TIS": mis_jax.LossConfig(use_tis=True, mis=token_tis),
    "decoupled + MIS": mis_jax.LossConfig(
      use_tis=True,
      mis=mis_jax.MISConfig(
        tis_level="token", tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4
      ),
    ),
    "REINFORCE + IS": mis_jax.LossConfig(use_rollout_logprobs=True, use_tis=True, mis=token_tis),
  }


@dataclasses.dataclass(frozen=True)
class Setting:
  server_dtype: str = "bfloat16"
  server_quantize: str = "none"
  sync_every: int = 1
  exact: bool = False  # rollout.placement.exact: the engine in batch-invariant arithmetic, the exact pass


SETTINGS = {
  "fp32": Setting("float32", "none", 1),
  "bf16": Setting("bfloat16", "none", 1),
  "bf16, exact": Setting("bfloat16", "none", 1, exact=True),
  "int8": Setting("bfloat16", "int8", 1),
  "fp8": Setting("bfloat16", "fp8", 1),
  "bf16, sync 4": Setting("bfloat16", "none", 4),
  "bf16, exact, sync 4": Setting("bfloat16", "none", 4, exact=True),
  "fp8, sync 4": Setting("bfloat16", "fp8", 4),
  "fp8, sync 8": Setting("bfloat16", "fp8", 8),
}
EXACT_PAIRS = {"bf16, exact": "bf16", "bf16, exact, sync 4": "bf16, sync 4"}  # exact mode's setting: its default


@dataclasses.dataclass(frozen=True)
class Design:
  """What one experiment runs. The full design's step budget and learning rate were chosen
  from pilot runs so that no arm saturates (max reward 1.25) or fails within the budget."""

  arms: tuple[str, ...] = tuple(_base_arms())
  settings: tuple[str, ...] = ("fp32", "bf16", "fp8", "fp8, sync 4", "fp8, sync 8")
  # Settings run with the first arm only, to measure their mismatch (standard PPO recomputes
  # the trainer's log-probs, so it reports mis_k3_kl).
  probe_settings: tuple[str, ...] = ("int8",)
  seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
  steps: int = 60
  learning_rate: float = 3e-3
  prompts_per_step: int = 16
  n: int = 8
  ppo_epochs: int = 2
  num_digits: int = 3
  initializer_range: float = 0.1
  final_window: int = 5  # "reward at the step budget": mean over its last steps
  preset: str = "tiny-qwen3"  # the model (trainers.models.PRESETS); a MoE preset records routed experts

  def __post_init__(self):
    unknown = [a for a in self.arms if a not in arms()]
    if unknown:
      raise ValueError(f"unknown arm(s) {unknown}; arms: {', '.join(arms())}")
    unknown = [s for s in self.settings + self.probe_settings if s not in SETTINGS]
    if unknown:
      raise ValueError(f"unknown setting(s) {unknown}; settings: {', '.join(SETTINGS)}")
    if len(self.seeds) < 2:
      raise ValueError(f"seeds: a confidence interval needs at least 2 seeds, got {list(self.seeds)}")
    if not 1 <= self.final_window <= self.steps:
      raise ValueError(f"final_window ({self.final_window}) must be in 1..steps ({self.steps})")


FULL = Design()
# The search for the collapse the literature reports (training drifts or collapses without
# correction under large mismatch): the largest mismatch of the grid (fp8 weights, 8 steps
# stale), longer responses (6 digits) and 3x the learning rate, so the policy moves further
# between weight pushes. Uncorrected vs corrected, five seeds.
STRESS = Design(
  arms=("standard PPO", "bypass PPO", "decoupled + MIS"),
  settings=("fp8, sync 8",),
  probe_settings=(),
  learning_rate=1e-2,
  num_digits=6,
)
MOE = Design(
  arms=(
    "standard PPO",
    "standard PPO" + R3,
    "decoupled + token TIS",
    "decoupled + token TIS" + R3,
    "decoupled + MIS",
    "decoupled + MIS" + R3,
  ),
  settings=("bf16", "fp8"),
  probe_settings=(),
  preset="tiny-qwen3-moe",
)
# verl's policy-loss forms under the fresh quantised engines, alone and with MIS, beside
# standard PPO and the MIS arm (the same seeds: the paired differences are to standard PPO).
FORMS = Design(
  arms=("standard PPO", "decoupled + MIS", "GSPO", "GSPO + MIS", "CISPO", "CISPO + MIS"),
  settings=("bf16", "fp8"),
  probe_settings=(),
)
# The threshold controller under the fp8 engine, beside fixed token TIS / MIS and no correction.
CONTROLLER = Design(
  arms=("standard PPO", "decoupled + token TIS", "decoupled + MIS", "decoupled + auto TIS", "decoupled + auto MIS"),
  settings=("fp8",),
  probe_settings=(),
)
# Decoupled PPO's proximal policy recomputed (a forward pass per step) or interpolated by weight
# versions (contract §6.3), under the fp8 engine synchronous (every token fresh: loglinear is bypass
# PPO) and synced every 4 steps (tokens 0–3 versions stale).
PROXIMAL = Design(
  arms=(
    "standard PPO",
    "decoupled + token TIS",
    "decoupled + token TIS" + LOGLINEAR,
    "decoupled + MIS",
    "decoupled + MIS" + LOGLINEAR,
  ),
  settings=("fp8", "fp8, sync 4"),
  probe_settings=(),
)
# Score centering alone (on standard PPO: the centred arm differs from the baseline by the centring
# only) and composed with the MIS arm, each beside its uncentred self, under the fresh bf16 and fp8
# engines and the stale fp8 one (the drift compounds across syncs, the paper's claim).
CENTERING = Design(
  arms=("standard PPO", "standard PPO" + CENTERED, "decoupled + MIS", "decoupled + MIS" + CENTERED),
  settings=("bf16", "fp8", "fp8, sync 4"),
  probe_settings=(),
)
# Exact mode against the default bf16 engine, without and with the MIS correction, fresh and stale.
EXACT = Design(
  arms=("standard PPO", "decoupled + MIS"),
  settings=("bf16", "bf16, exact", "bf16, sync 4", "bf16, exact, sync 4"),
  probe_settings=(),
  seeds=tuple(range(10)),
)
# The CI-sized pipeline (`--quick`); its centred arm runs the top-k request and the centring tables.
QUICK = Design(
  arms=("standard PPO", "decoupled + MIS", "decoupled + MIS" + CENTERED),
  settings=("fp8, sync 4",),
  probe_settings=(),
  seeds=(0, 1),
  steps=4,
  prompts_per_step=4,
  n=4,
  ppo_epochs=1,
  final_window=2,
)


# The designs run by `--design NAME` into OUT/NAME.
DESIGNS = {
  "moe": MOE,
  "forms": FORMS,
  "controller": CONTROLLER,
  "proximal": PROXIMAL,
  "centering": CENTERING,
  "exact": EXACT,
}


def _init_dir(out: str, design: Design, seed: int) -> str:
  from trainers.models import PRESETS, init_checkpoint

  path = os.path.join(out, "init", f"seed{seed}")
  if not os.path.isfile(os.path.join(path, "model.safetensors")):
    config = dataclasses.replace(PRESETS[design.preset], initializer_range=design.initializer_range)
    init_checkpoint(path, config=config, seed=seed)
  return path


def _is_moe(design: Design) -> bool:
  from trainers.models import PRESETS

  return PRESETS[design.preset].is_moe


def _train_config(out: str, design: Design, setting: Setting, seed: int, run_dir: str, arm: str = ""):
  from trainers.config import TrainConfig

  # One path for every seed's initial weights, so that every run of an arm has the same config
  # apart from the seed and reuses the step functions compiled for the first one.
  start = os.path.join(out, "init", "current")
  shutil.rmtree(start, ignore_errors=True)
  shutil.copytree(_init_dir(out, design, seed), start)
  every = setting.sync_every * max(1, design.steps // setting.sync_every)
  sampling = {"routing_replay": "r3" if arm.endswith(R3) else "none", "record_routing": True} if _is_moe(design) else {}
  if arm.endswith(CENTERED):
    sampling["top_logprobs_num"] = TOP_K
  row_len = max(16, 1 << (2 * design.num_digits + 2).bit_length())  # prompt k + 2, response k + 1
  return TrainConfig.from_dict(
    {
      "run_dir": run_dir,
      "seed": seed,
      "model": {"path": start},
      "task": {"name": "copy_digits", "num_digits": design.num_digits},
      "rollout": {
        "prompts_per_step": design.prompts_per_step,
        "n": design.n,
        "sampling": sampling,
        "sync": {"sync_every": setting.sync_every},
        "placement": {
          "server_dtype": setting.server_dtype,
          "server_quantize": setting.server_quantize,
          "exact": setting.exact,
        },
      },
      "train": {
        "steps": design.steps,
        "learning_rate": design.learning_rate,
        "ppo_epochs": design.ppo_epochs,
        "tokens_per_micro_batch": 128 * row_len,
        "row_len": row_len,
      },
      "checkpoint": {"every": every, "max_to_keep": 1},
    }
  )


def run_experiment(out: str, design: Design = FULL, *, resume: bool = False, log=print) -> dict:
  """Runs every arm × setting × seed of `design`; writes and returns `OUT/results.json`
  (`{"design", "runs": [{"arm", "setting", "seed", "seconds", "top_logprobs_num", <metric>: [per step]}],
  ...}`)."""
  from trainers.serving.embedded.server import EmbeddedServer
  from trainers.app.trainer import Trainer

  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, "results.json")
  runs, prior_s = [], 0.0
  if resume and os.path.isfile(path):
    with open(path) as f:
      old = json.load(f)
    if old.get("design") != json.loads(json.dumps(dataclasses.asdict(design))):
      raise ValueError(f"--resume: {path} was written by another design")
    runs, prior_s = old["runs"], old["seconds_total"]
  done = {(r["arm"], r["setting"], r["seed"]) for r in runs}
  start = time.perf_counter()
  loss_cfgs = arms()
  for setting_name in [s for s in SETTINGS if s in design.settings + design.probe_settings]:
    setting = SETTINGS[setting_name]
    setting_arms = design.arms if setting_name in design.settings else design.arms[:1]
    todo = [(a, s) for a in setting_arms for s in design.seeds if (a, setting_name, s) not in done]
    if not todo:
      continue
    with EmbeddedServer(
      _init_dir(out, design, design.seeds[0]),
      dtype=setting.server_dtype,
      quantize=setting.server_quantize,
      seed=0,
      arithmetic="batch_invariant" if setting.exact else "default",
      extra_args=("--enable-return-routed-experts",) if _is_moe(design) else (),
    ) as server:
      for arm, seed in todo:
        run_dir = os.path.join(out, "runs", "tmp")
        shutil.rmtree(run_dir, ignore_errors=True)
        t0 = time.perf_counter()
        cfg = _train_config(out, design, setting, seed, run_dir, arm)
        history = Trainer(cfg, loss_cfgs[arm], urls=[server.url]).run(progress=False, log=lambda *_: None)
        record = {
          "arm": arm,
          "setting": setting_name,
          "seed": seed,
          "seconds": time.perf_counter() - t0,
          "top_logprobs_num": cfg.rollout.sampling.top_logprobs_num,
          "step": [h["step"] for h in history],
        }
        record.update({k: [_float(h.get(k)) for h in history] for k in RECORDED})
        runs.append(record)
        _write(path, design, runs, prior_s + time.perf_counter() - start)
        log(
          f"[{time.perf_counter() - start:7.0f} s] {setting_name:12s} {arm:22s} seed {seed}: "
          f"reward {np.mean(record['reward_mean'][-design.final_window :]):.3f} "
          f"({record['seconds']:.0f} s)",
          flush=True,
        )
  for scratch in ("runs", "init"):  # run dirs and initial weights (re-created on --resume)
    shutil.rmtree(os.path.join(out, scratch), ignore_errors=True)
  return _write(path, design, runs, prior_s + time.perf_counter() - start)


def _float(x):
  return None if x is None else float(x)


def _write(path, design, runs, seconds) -> dict:
  """`results.json`: the design, every run, the wall time so far, the summary."""
  results = {"design": json.loads(json.dumps(dataclasses.asdict(design))), "runs": runs, "seconds_total": seconds}
  results["summary"] = summarize(results) if runs else []
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(results, f, indent=None, separators=(",", ":"))
  os.replace(tmp, path)
  return results


def t_interval(values, level: float = 0.95) -> tuple[float, float, float]:
  """`(mean, low, high)`: the mean over seeds and its two-sided t-interval
  `mean ± t_{(1+level)/2, n-1} · s / sqrt(n)` (`s` with ddof 1)."""
  from scipy import stats

  x = np.asarray(values, np.float64)
  if x.ndim != 1 or x.size < 2:
    raise ValueError(f"a t-interval needs a 1-D sample of at least 2 values, got shape {x.shape}")
  mean = float(x.mean())
  half = float(stats.t.ppf((1 + level) / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))
  return mean, mean - half, mean + half


def final_reward(record: dict, window: int) -> float:
  return float(np.mean(record["reward_mean"][-window:]))


def auc(record: dict) -> float:
  """Area under the reward curve, normalised by the steps: the mean reward over all steps."""
  return float(np.mean(record["reward_mean"]))


def drawdown(record: dict, window: int) -> float:
  """How far the reward fell from its best: max over steps of the `window`-step running mean
  reward, minus the final reward (0 for a run that ends at its best; collapse shows as > 0)."""
  r = np.asarray(record["reward_mean"], np.float64)
  running = np.convolve(r, np.ones(window) / window, mode="valid")
  return float(running.max() - running[-1])


def summarize(results: dict, baseline: str = "standard PPO") -> list[dict]:
  """Per setting and arm: mean and 95% t-interval over seeds of the final reward, the AUC and
  the drawdown, the paired difference to `baseline` (same setting and seeds), and the mean
  mismatch."""
  window = results["design"]["final_window"]
  runs = results["runs"]
  by = {}
  for r in runs:
    by.setdefault((r["setting"], r["arm"]), {})[r["seed"]] = r
  rows = []
  for (setting, arm), seeds in by.items():
    row = {"setting": setting, "arm": arm, "seeds": sorted(seeds)}
    if len(seeds) >= 2:
      for name, fn in (
        ("final_reward", lambda r: final_reward(r, window)),
        ("auc", auc),
        ("drawdown", lambda r: drawdown(r, window)),
      ):
        row[name] = t_interval([fn(seeds[s]) for s in sorted(seeds)])
        base = by.get((setting, baseline), {})
        common = sorted(set(seeds) & set(base))
        if arm != baseline and len(common) >= 2:
          row[f"{name}_minus_baseline"] = t_interval([fn(seeds[s]) - fn(base[s]) for s in common])
    for key in ("mis_k3_kl", "train_rollout_logprob_abs_diff"):
      vals = [v for r in seeds.values() for v in r[key] if v is not None]
      row[key] = float(np.mean(vals)) if vals else None
    rows.append(row)
  return rows


def _diff(ci) -> str:
  """A paired difference `(mean, low, high)` as `+m [+lo, +hi]`, starred when the interval excludes 0."""
  if ci is None:
    return "—"
  sig = "" if ci[1] <= 0 <= ci[2] else " *"
  return f"{ci[0]:+.3f} [{ci[1]:+.3f}, {ci[2]:+.3f}]{sig}"


def _cell(values, fmt: str) -> str:
  """Mean [95% t-interval] over seeds of per-seed `values`, each in `fmt` (the mean alone for one seed)."""
  if len(values) < 2:
    return format(float(np.mean(values)), fmt)
  m, lo, hi = t_interval(values)
  return f"{m:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def summary_table(results: dict) -> str:
  """The summary as a Markdown table: final reward, AUC and drawdown, mean [95% CI] over seeds,
  each with its paired difference to standard PPO; the mean mismatch."""

  def fmt(ci):
    return "n/a" if ci is None else f"{ci[0]:.3f} [{ci[1]:.3f}, {ci[2]:.3f}]"

  lines = [
    "| setting | arm | final reward | Δ vs standard PPO | AUC | Δ AUC | drawdown | Δ drawdown | mis_k3_kl | abs diff |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in results["summary"]:
    k3, ad = row["mis_k3_kl"], row["train_rollout_logprob_abs_diff"]
    lines.append(
      f"| {row['setting']} | {row['arm']} | {fmt(row.get('final_reward'))} | "
      f"{_diff(row.get('final_reward_minus_baseline'))} | {fmt(row.get('auc'))} | "
      f"{_diff(row.get('auc_minus_baseline'))} | {fmt(row.get('drawdown'))} | "
      f"{_diff(row.get('drawdown_minus_baseline'))} | {'n/a' if k3 is None else f'{k3:.2e}'} | "
      f"{'n/a' if ad is None else f'{ad:.2e}'} |"
    )
  return "\n".join(lines)


def drawdown_table(results: dict, settings=None) -> str:
  """Drawdown (best running-mean reward minus final) per setting and arm, mean [95% CI] over
  seeds, and its paired difference to standard PPO."""
  lines = [
    "| setting | arm | drawdown | Δ vs standard PPO | final grad norm | final mis_k3_kl |",
    "|---|---|---|---|---|---|",
  ]
  window = results["design"]["final_window"]
  for row in results["summary"]:
    if (settings is not None and row["setting"] not in settings) or row.get("drawdown") is None:
      continue
    runs = [r for r in results["runs"] if r["setting"] == row["setting"] and r["arm"] == row["arm"]]
    grad = np.mean([np.mean(r["grad_norm"][-window:]) for r in runs])
    k3 = np.mean([np.mean(r["mis_k3_kl"][-window:]) for r in runs])
    d, diff = row["drawdown"], row.get("drawdown_minus_baseline")
    shown = "—" if diff is None else f"{diff[0]:+.3f} [{diff[1]:+.3f}, {diff[2]:+.3f}]"
    lines.append(
      f"| {row['setting']} | {row['arm']} | {d[0]:.3f} [{d[1]:.3f}, {d[2]:.3f}] | {shown} | {grad:.3f} | {k3:.2e} |"
    )
  return "\n".join(lines)


def mismatch_table(results: dict, arm: str = "standard PPO") -> str:
  """Per setting, `mis_k3_kl` and `train_rollout_logprob_abs_diff` of `arm`'s runs (standard
  PPO recomputes the trainer's log-probs, so it measures them; bypass and REINFORCE do not):
  at step 1 (the initial weights) and averaged over all steps, mean [95% CI] over seeds."""
  lines = [
    "| setting | mis_k3_kl, step 1 | mis_k3_kl, all steps | abs diff, step 1 | abs diff, all steps | seeds |",
    "|---|---|---|---|---|---|",
  ]
  present = {r["setting"] for r in results["runs"]}
  for setting in [s for s in SETTINGS if s in present]:
    runs = [r for r in results["runs"] if r["setting"] == setting and r["arm"] == arm]
    if not runs:
      continue
    k3, ad = ([r[key] for r in runs] for key in ("mis_k3_kl", "train_rollout_logprob_abs_diff"))
    lines.append(
      f"| {setting} | {_cell([x[0] for x in k3], '.2e')} | {_cell([np.mean(x) for x in k3], '.2e')} | "
      f"{_cell([x[0] for x in ad], '.2e')} | {_cell([np.mean(x) for x in ad], '.2e')} | {len(runs)} |"
    )
  return "\n".join(lines)


def routing_table(results: dict) -> str:
  """MoE designs: per setting and arm, the router disagreement the trainer measures against the
  server's routed experts (fraction of (token, layer) choices and of tokens with any layer
  differing) and `mis_k3_kl`, at step 1 and over all steps, mean [95% CI] over seeds."""
  lines = [
    "| setting | arm | router choices differing, step 1 | tokens differing, step 1 | routing differing, all "
    "steps | mis_k3_kl, step 1 | mis_k3_kl, all steps |",
    "|---|---|---|---|---|---|---|",
  ]
  for setting in results["design"]["settings"]:
    for arm in results["design"]["arms"]:
      runs = [r for r in results["runs"] if r["setting"] == setting and r["arm"] == arm]
      if not runs or runs[0].get("routing_mismatch_frac", [None])[0] is None:
        continue
      frac, tok, k3 = (
        [r[k] for r in runs] for k in ("routing_mismatch_frac", "routing_mismatch_token_frac", "mis_k3_kl")
      )
      lines.append(
        f"| {setting} | {arm} | {_cell([x[0] for x in frac], '.2%')} | {_cell([x[0] for x in tok], '.2%')} | "
        f"{_cell([np.mean(x) for x in frac], '.2%')} | {_cell([x[0] for x in k3], '.2e')} | "
        f"{_cell([np.mean(x) for x in k3], '.2e')} |"
      )
  return "\n".join(lines)


def exact_table(results: dict) -> str:
  """Exact mode's own effect: per arm and staleness, the paired difference (same seeds) of the exact
  setting to its default one (`EXACT_PAIRS`) in final reward, AUC and drawdown, mean [95% CI], and
  both settings' mean `mis_k3_kl` and |Δ log p|."""
  rows = {(r["setting"], r["arm"]): r for r in results["summary"]}
  window = results["design"]["final_window"]
  lines = [
    "| arm | setting vs default | Δ final reward | Δ AUC | Δ drawdown | mis_k3_kl, exact / default "
    "| abs diff, exact / default |",
    "|---|---|---|---|---|---|---|",
  ]
  fns = {"final_reward": lambda r: final_reward(r, window), "auc": auc, "drawdown": lambda r: drawdown(r, window)}
  for arm in results["design"]["arms"]:
    for exact, default in EXACT_PAIRS.items():
      a = {r["seed"]: r for r in results["runs"] if r["arm"] == arm and r["setting"] == exact}
      b = {r["seed"]: r for r in results["runs"] if r["arm"] == arm and r["setting"] == default}
      common = sorted(set(a) & set(b))
      if len(common) < 2:
        continue
      cells = [_diff(t_interval([fn(a[s]) - fn(b[s]) for s in common])) for fn in fns.values()]
      k3 = " / ".join(f"{rows[(s, arm)]['mis_k3_kl']:.2e}" for s in (exact, default))
      ad = " / ".join(f"{rows[(s, arm)]['train_rollout_logprob_abs_diff']:.2e}" for s in (exact, default))
      lines.append(f"| {arm} | {exact} vs {default} | " + " | ".join(cells) + f" | {k3} | {ad} |")
  return "\n".join(lines)


CENTERING_METRICS = (
  "score_centering_drift",
  "score_centering_residual_bound",
  "score_centering_tv",
  "score_centering_tail_mass",
)


def _centred_arms(results: dict) -> list[str]:
  """The design's `<arm> + centering` arms whose uncentred `<arm>` it also ran."""
  design_arms = results["design"]["arms"]
  return [a for a in design_arms if a.endswith(CENTERED) and a[: -len(CENTERED)] in design_arms]


def centering_table(results: dict) -> str:
  """Score centering's own effect: per setting and centred arm (`<arm> + centering`), the paired
  difference (same seeds) to `<arm>` uncentred in final reward, AUC and drawdown, mean [95% CI]."""
  lines = [
    "| setting | arm | Δ final vs uncentred | Δ AUC vs uncentred | Δ drawdown vs uncentred |",
    "|---|---|---|---|---|",
  ]
  for arm in _centred_arms(results):
    rows = {r["setting"]: r for r in summarize(results, baseline=arm[: -len(CENTERED)]) if r["arm"] == arm}
    for setting in [s for s in results["design"]["settings"] if s in rows]:
      lines.append(
        f"| {setting} | {arm} | "
        + " | ".join(_diff(rows[setting].get(f"{m}_minus_baseline")) for m in ("final_reward", "auc", "drawdown"))
        + " |"
      )
  return "\n".join(lines)


def centering_metrics_table(results: dict) -> str:
  """The centred runs' centring metrics (contract §6.6), mean [95% CI] over seeds, at step 1, over
  all steps and over the last `final_window` steps: the drift term's size before centring
  (`score_centering_drift`), the bound on what is left of it after (`..._residual_bound`), the
  estimated total variation between sampler and trainer (`score_centering_tv`) and the sampler's
  mass outside its top-k (`score_centering_tail_mass`)."""
  window = results["design"]["final_window"]
  spans = {"step 1": slice(0, 1), "all steps": slice(None), "final": slice(-window, None)}
  lines = ["| setting | arm | metric | step 1 | all steps | last steps |", "|---|---|---|---|---|---|"]
  for arm in _centred_arms(results):
    for setting in results["design"]["settings"]:
      runs = [r for r in results["runs"] if r["setting"] == setting and r["arm"] == arm]
      if not runs:
        continue
      for key in CENTERING_METRICS:
        cells = [_cell([np.mean(r[key][span]) for r in runs], ".2e") for span in spans.values()]
        lines.append(f"| {setting} | {arm} | `{key}` | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _bands(runs, key):
  y = np.array([[np.nan if v is None else v for v in r[key]] for r in runs], float)
  mean = np.nanmean(y, axis=0)
  if len(runs) < 2:
    return mean, mean, mean
  from scipy import stats

  half = stats.t.ppf(0.975, len(runs) - 1) * np.nanstd(y, axis=0, ddof=1) / np.sqrt(len(runs))
  return mean, mean - half, mean + half


def plot(results: dict, out: str | None = None, *, key: str = "reward_mean"):
  """Per setting, mean `key` per step over seeds with 95% t-bands, one line per arm; saved to
  `out/curves_<key>.png` when `out` is given. Returns the figure."""
  import matplotlib

  if out is not None:
    matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt

  settings, arm_names = results["design"]["settings"], results["design"]["arms"]
  fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.4), dpi=80, sharey=True, squeeze=False)
  for ax, setting in zip(axes[0], settings):
    for arm in arm_names:
      runs = [r for r in results["runs"] if r["setting"] == setting and r["arm"] == arm]
      if not runs or all(v is None for v in runs[0][key]):
        continue
      mean, lo, hi = _bands(runs, key)
      steps = np.arange(1, len(mean) + 1)
      (line,) = ax.plot(steps, mean, label=arm, lw=1.3)
      ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_title(setting, fontsize=10)
    ax.set_xlabel("step")
    if key in ("mis_k3_kl", "grad_norm", "train_rollout_logprob_abs_diff") + CENTERING_METRICS:
      ax.set_yscale("log")
  axes[0, 0].set_ylabel(f"{key} (mean, 95% band)")
  axes[0, 0].legend(fontsize=7)
  fig.tight_layout()
  if out is not None:
    fig.savefig(os.path.join(out, f"curves_{key}.png"))
  return fig


def plot_intervals(results: dict, out: str | None = None):
  """Final reward and AUC per arm and setting: means with 95% t-intervals over seeds."""
  import matplotlib

  if out is not None:
    matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt

  settings, arm_names = results["design"]["settings"], results["design"]["arms"]
  rows = {(r["setting"], r["arm"]): r for r in results["summary"]}
  fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), dpi=80)
  width = 0.8 / len(arm_names)
  for ax, metric in zip(axes, ("final_reward", "auc")):
    for k, arm in enumerate(arm_names):
      xs, ys, err = [], [], [[], []]
      for i, setting in enumerate(settings):
        ci = rows.get((setting, arm), {}).get(metric)
        if ci is not None:
          xs.append(i - 0.4 + width * (k + 0.5))
          ys.append(ci[0])
          err[0].append(ci[0] - ci[1])
          err[1].append(ci[2] - ci[0])
      ax.errorbar(xs, ys, yerr=err, fmt="o", capsize=3, label=arm, ms=4)
    ax.set_xticks(range(len(settings)), settings)
    ax.set_title(
      {"final_reward": "final reward", "auc": "AUC (mean reward over steps)"}[metric] + " — mean, 95% CI", fontsize=10
    )
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  if out is not None:
    fig.savefig(os.path.join(out, "intervals.png"))
  return fig


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="runs/mismatch", help="results.json and the figures go here")
  parser.add_argument("--quick", action="store_true", help="the CI-sized design (seconds, not an hour)")
  parser.add_argument(
    "--design",
    choices=("default",) + tuple(DESIGNS),
    default="default",
    help="default: the grid (OUT) and the collapse search (OUT/stress); moe: the mixture-of-experts "
    "arm (OUT/moe); forms: GSPO and CISPO with and without MIS (OUT/forms); controller: auto "
    "bounds under fp8 (OUT/controller); proximal: the old log-probs recomputed or interpolated (OUT/proximal); "
    "centering: score centering alone and with MIS (OUT/centering); exact: exact mode against a bf16 "
    "engine, with and without MIS, fresh and stale (OUT/exact)",
  )
  parser.add_argument("--resume", action="store_true", help="keep the runs OUT/results.json already has")
  args = parser.parse_args(argv)
  # The full experiment is the grid (OUT) and the collapse search (OUT/stress).
  if args.quick:
    designs = [(args.out, QUICK)]
  elif args.design in DESIGNS:
    designs = [(os.path.join(args.out, args.design), DESIGNS[args.design])]
  else:
    designs = [(args.out, FULL), (os.path.join(args.out, "stress"), STRESS)]
  for out, design in designs:
    results = run_experiment(out, design, resume=args.resume)
    centred = any(a.endswith(CENTERED) for a in design.arms)
    for key in ("reward_mean", "mis_k3_kl", "grad_norm") + (("score_centering_drift",) if centred else ()):
      plot(results, out, key=key)
    plot_intervals(results, out)
    print(summary_table(results))
    print()
    print(mismatch_table(results))
    if _is_moe(design):
      print()
      print(routing_table(results))
    if any(s in EXACT_PAIRS for s in design.settings):
      print()
      print(exact_table(results))
    if centred:
      print()
      print(centering_table(results))
      print()
      print(centering_metrics_table(results))
    print(f"\n{len(results['runs'])} runs in {results['seconds_total']:.0f} s; wrote {out}/results.json and figures")


if __name__ == "__main__":
  main()
