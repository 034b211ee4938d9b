"""`mis-jax analyze DIR`: the train–rollout mismatch of saved rollout records, offline.

Reads the records of a run (`rollout_records`), takes the trainer's log-probs from their
`old_logprobs` column or recomputes them with `--model PATH` (teacher-forced, at the run's
sampling temperature), and writes `report.md`, `report.json` and PNG figures:

- the distribution of the token log-ratio `r = log π_train − log π_rollout` (quantiles, histogram);
- the mismatch by position in the response and by response length;
- the tokens that carry most of it (total `|r|` by token id);
- the mismatch metrics of the reference page (`mis_jax.compute_mis_weights` without correction);
- for a grid of settings (IS level × bound `C` in truncate and mask modes, veto thresholds), the
  fraction of tokens truncated or masked, the tokens and sequences kept, and the effective sample
  size left — so thresholds are chosen from one's own data.
- what the threshold controller (`auto` bounds, contract §3.1) would have chosen at each recorded
  step, for a few targets (ESS ratios, masked shares), with what each reaches;
- the advantages every per-sequence estimator (`mis_jax.estimators.SEQUENCE_ESTIMATORS` but `gdpo`, which
  needs several rewards) gives the recorded rewards, step by step over the recorded groups: their
  spread, the share of sequences left without signal, and for the run's own estimator the largest
  difference to the recorded advantages.

Every weight and metric is computed by the library (`compute_mis_weights` on the records packed
one sequence per segment); this module only arranges the records and the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from trainers.rollout import records as rollout_records

BOUNDS = (1.5, 2.0, 5.0, 10.0)
# The targets of the controller's table: (level, tis_mode, target key, value).
AUTO_TARGETS = (
  ("token", "truncate", "target_ess_ratio", 0.9),
  ("sequence", "truncate", "target_ess_ratio", 0.5),
  ("token", "mask", "max_masked_fraction", 0.01),
  ("geometric", "mask", "max_masked_fraction", 0.05),
)
VETO_THRESHOLDS = (1e-2, 1e-4, 1e-6)
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


def load(directory: str, steps: tuple[int, int] | None = None) -> tuple[list[dict], dict]:
  """Per-sequence rows of the chosen steps (`steps`: inclusive range) and the last file's metadata."""
  files = rollout_records.list_steps(directory)
  chosen = [k for k in sorted(files) if steps is None or steps[0] <= k <= steps[1]]
  if not chosen:
    raise rollout_records.RecordError(f"rollout records {directory!r}: no step in {steps[0]}..{steps[1]}")
  rows, meta = [], {}
  for k in chosen:
    cols, meta = rollout_records.read_step(files[k])
    for i in range(len(cols["step"])):
      rows.append({name: cols[name][i] for name in cols})
  return rows, meta


def trainer_logprobs(rows: list[dict], model_path: str, temperature: float, *, batch_rows: int = 64) -> None:
  """Fills each row's `old_logprobs` with `model_path`'s teacher-forced log-probs (float32), one
  sequence per batch row, `batch_rows` rows per call of one jitted forward."""
  import jax.numpy as jnp
  from flax import nnx
  from trainers.models import load_hf_checkpoint, teacher_forced_logprobs

  model = load_hf_checkpoint(model_path)
  forward = nnx.jit(teacher_forced_logprobs, static_argnames="temperature")
  seqs = [list(r["prompt_ids"]) + list(r["response_ids"]) for r in rows]
  width = 1 << max(max(map(len, seqs)) - 1, 0).bit_length()  # one compiled shape
  for start in range(0, len(rows), batch_rows):
    chunk = seqs[start : start + batch_rows]
    ids = np.zeros((batch_rows, width), np.int32)
    seg = np.full((batch_rows, width), -1, np.int32)
    for i, seq in enumerate(chunk):
      ids[i, : len(seq)], seg[i, : len(seq)] = seq, 0
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), ids.shape)
    lp = np.asarray(
      forward(
        model,
        jnp.asarray(ids),
        jnp.asarray(pos),
        jnp.asarray(seg),
        jnp.asarray(np.roll(ids, -1, axis=1)),
        temperature=temperature,
      )
    )
    for i, r in enumerate(rows[start : start + batch_rows]):
      p, n = len(r["prompt_ids"]), len(r["response_ids"])
      r["old_logprobs"] = lp[i, p - 1 : p - 1 + n].tolist()


def model_tokens(row: dict) -> np.ndarray:
  """Which of a row's response tokens the model sampled: all of them, but in a multi-turn
  trajectory (its `turn` column) not the environment's (turn 0), which no ratio ever reads."""
  turn = row.get("turn")
  return np.ones(len(row["response_ids"]), bool) if turn is None else np.asarray(turn) > 0


def packed(rows: list[dict]):
  """The model's response tokens of every row as one flat batch: `(o, q, mask, segment_ids,
  num_segments)`, one segment per sequence."""
  keep = [model_tokens(r) for r in rows]
  o = np.concatenate([np.asarray(r["old_logprobs"], np.float32)[k] for r, k in zip(rows, keep)])
  q = np.concatenate([np.asarray(r["rollout_logprobs"], np.float32)[k] for r, k in zip(rows, keep)])
  seg = np.concatenate([np.full(int(k.sum()), i, np.int32) for i, k in enumerate(keep)])
  return o, q, np.ones(o.shape, bool), seg, len(rows)


def _metrics(o, q, mask, seg, num_segments, cfg, mode):
  """`compute_mis_weights`' metrics, run eagerly: op by op, each primitive's kernel compiled once
  serves every setting of the grid, where a jit per setting would compile ~30 programs (17 s
  against 6 s for the whole analysis of the committed example on 2 cores)."""
  import mis_jax

  metrics = mis_jax.compute_mis_weights(o, q, mask, seg, cfg, num_segments=num_segments, metric_reduction=mode)[2]
  return {k: float(v) for k, v in metrics.items()}


def settings_grid(o, q, mask, seg, num_segments, mode) -> list[dict]:
  """What each setting would do to these records (the library's own metrics of it)."""
  import mis_jax

  out = []
  for level in mis_jax.config.LEVELS:
    for bound in BOUNDS:
      for tis_mode in ("truncate", "mask"):
        m = _metrics(
          o,
          q,
          mask,
          seg,
          num_segments,
          mis_jax.MISConfig(tis_level=level, tis_mode=tis_mode, tis_upper_bound=bound),
          mode,
        )
        affected = (
          m["mis_tis_truncate_fraction"]
          if tis_mode == "truncate"
          else m["mis_tis_mask_fraction_low"] + m["mis_tis_mask_fraction_high"]
        )
        out.append(
          {
            "setting": f"{level} {tis_mode} C={bound:g}",
            "level": level,
            "tis_mode": tis_mode,
            "bound": bound,
            "affected_token_fraction": affected,
            "kept_token_fraction": m["mis_kept_token_fraction"],
            "kept_seq_fraction": m["mis_kept_seq_fraction"],
            "ess_ratio": m["mis_ess_ratio"],
          }
        )
  for threshold in VETO_THRESHOLDS:
    m = _metrics(o, q, mask, seg, num_segments, mis_jax.MISConfig(rs_veto_threshold=threshold), mode)
    out.append(
      {
        "setting": f"veto C={threshold:g}",
        "level": "token",
        "tis_mode": "truncate",
        "bound": 2.0,
        "veto": threshold,
        "affected_token_fraction": m["mis_rs_catastrophic_token_fraction"],
        "kept_token_fraction": m["mis_kept_token_fraction"],
        "kept_seq_fraction": m["mis_kept_seq_fraction"],
        "ess_ratio": m["mis_ess_ratio"],
      }
    )
  return out


def auto_choices(rows: list[dict], mode: str) -> list[dict]:
  """At each recorded step, the bound `auto` would have chosen for each of `AUTO_TARGETS` from that
  step's own ratios, and the ESS ratio / masked share and kept tokens it reaches (the library's
  controller, as the trainer runs it once per step)."""
  import jax
  import mis_jax

  steps = sorted({int(r["step"]) for r in rows})
  batches = [packed([r for r in rows if int(r["step"]) == k]) for k in steps]
  # Every step padded to one shape: one compiled controller per target serves all steps.
  width, num_segments = max(b[0].size for b in batches), max(b[4] for b in batches)
  pad = lambda x, fill: np.concatenate([x, np.full(width - x.size, fill, x.dtype)])
  batches = [(pad(o, 0.0), pad(q, 0.0), pad(m, False), pad(seg, -1)) for o, q, m, seg, _ in batches]
  out = []
  for level, tis_mode, target, value in AUTO_TARGETS:  # the table is step-major below
    cfg = mis_jax.MISConfig(tis_level=level, tis_mode=tis_mode, tis_upper_bound="auto", **{target: value})
    run = jax.jit(
      lambda o, q, m, seg, cfg=cfg: mis_jax.compute_mis_weights(
        o, q, m, seg, cfg, num_segments=num_segments, metric_reduction=mode
      )[2]
    )
    for k, batch in zip(steps, batches):
      m = {name: float(v) for name, v in run(*batch).items()}
      reached = m["mis_auto_ess_ratio"] if target == "target_ess_ratio" else m["mis_auto_tis_masked_fraction"]
      out.append(
        {
          "step": k,
          "setting": f"{level} {tis_mode} {target}={value:g}",
          "bound": m["mis_auto_tis_upper_bound"],
          "reached": reached,
          "target_met": bool(m["mis_auto_target_met"]),
          "kept_token_fraction": m["mis_kept_token_fraction"],
          "ess_ratio": m["mis_ess_ratio"],
        }
      )
  return sorted(out, key=lambda a: a["step"])


def advantages_report(rows: list[dict], run_estimator: str | None = None) -> list[dict]:
  """Per sequence estimator, the advantages of the recorded rewards (each step's groups): mean,
  std, mean |A|, the share of sequences with |A| < 1e-6 (no signal), and for `run_estimator`
  the largest |A - recorded advantage|. `optimal_token_baseline` needs the policy's `Σπ²` per
  token, which records do not hold; `gdpo` needs several rewards."""
  import mis_jax

  steps = sorted({int(r["step"]) for r in rows})
  out = []
  for estimator in mis_jax.estimators.SEQUENCE_ESTIMATORS:
    if estimator == "gdpo":
      continue
    got, recorded = [], []
    for k in steps:
      step_rows = [r for r in rows if int(r["step"]) == k]
      groups = np.array([r["group"] for r in step_rows], np.int32)
      adv = mis_jax.compute_advantages(
        np.array([r["reward"] for r in step_rows], np.float32),
        groups,
        num_groups=int(groups.max()) + 1,
        estimator=estimator,
        lengths=np.array([len(r["response_ids"]) for r in step_rows], np.int32),
      )
      got.append(np.asarray(adv, np.float64))
      recorded.append(np.array([r["advantage"] for r in step_rows], np.float64))
    a = np.concatenate(got)
    row = {
      "estimator": estimator,
      "mean": float(a.mean()),
      "std": float(a.std()),
      "mean_abs": float(np.abs(a).mean()),
      "zero_fraction": float((np.abs(a) < 1e-6).mean()),
    }
    if estimator == run_estimator:
      row["max_abs_diff_to_recorded"] = float(np.abs(a - np.concatenate(recorded)).max())
    out.append(row)
  return out


def analyze(rows: list[dict], mode: str = "seq-mean-token-mean", run_estimator: str | None = None) -> dict:
  """The report's numbers (see the module doc)."""
  import mis_jax

  o, q, mask, seg, num_segments = packed(rows)
  r = (o - q).astype(np.float64)
  rc = np.clip(np.asarray(r, np.float64), -20, 20)
  k3 = np.maximum(np.expm1(rc) - rc, 0.0)  # float64, never negative
  keep = [model_tokens(x) for x in rows]
  lengths = np.array([int(k.sum()) for k in keep])
  positions = np.concatenate([np.arange(n) for n in lengths])
  # Sums by group with one bincount each (no pass over the tokens per group).
  count_at = np.bincount(positions)
  abs_at, k3_at = np.bincount(positions, np.abs(r)), np.bincount(positions, k3)
  by_position = [
    {
      "position": p,
      "tokens": int(count_at[p]),
      "mean_abs_log_ratio": float(abs_at[p] / count_at[p]),
      "mean_k3": float(k3_at[p] / count_at[p]),
    }
    for p in range(len(count_at))
  ]
  seq_k3 = np.bincount(seg, k3, minlength=num_segments) / lengths
  lens, which = np.unique(lengths, return_inverse=True)
  seqs_of_len, k3_of_len = np.bincount(which), np.bincount(which, seq_k3)
  by_length = [
    {"length": int(n), "sequences": int(seqs_of_len[i]), "mean_k3": float(k3_of_len[i] / seqs_of_len[i])}
    for i, n in enumerate(lens)
  ]
  tokens = np.concatenate([np.asarray(x["response_ids"])[k] for x, k in zip(rows, keep)])
  total = np.abs(r).sum()
  ids, inverse = np.unique(tokens, return_inverse=True)
  count_of, abs_by_id, r_by_id = np.bincount(inverse), np.bincount(inverse, np.abs(r)), np.bincount(inverse, r)
  top = np.argsort(-abs_by_id)[:10]
  top_tokens = [
    {
      "token_id": int(ids[i]),
      "count": int(count_of[i]),
      "mean_log_ratio": float(r_by_id[i] / count_of[i]),
      "share_of_abs_log_ratio": float(abs_by_id[i] / max(total, 1e-30)),
    }
    for i in top
  ]
  return {
    "sequences": int(num_segments),
    "tokens": int(r.size),
    "metric_reduction": mode,
    "log_ratio": {
      "mean": float(r.mean()),
      "std": float(r.std()),
      "mean_abs": float(np.abs(r).mean()),
      "fraction_abs_above_0.1": float((np.abs(r) > 0.1).mean()),
      "quantiles": {str(p): float(np.quantile(r, p)) for p in QUANTILES},
    },
    "mismatch_metrics": _metrics(o, q, mask, seg, num_segments, mis_jax.MISConfig(use_tis=False), mode),
    "by_position": by_position,
    "by_length": by_length,
    "top_tokens": top_tokens,
    "settings": settings_grid(o, q, mask, seg, num_segments, mode),
    "auto": auto_choices(rows, mode),
    "run_estimator": run_estimator,
    "advantages": advantages_report(rows, run_estimator),
    "by_turn": by_turn(rows, r),
  }


def by_turn(rows: list[dict], r: np.ndarray) -> list[dict]:
  """Multi-turn trajectories: the mismatch of each model turn index (its tokens' mean |r| and
  k3), from the rows' `turn` column; empty for single-turn records. `r`: the model tokens'
  log-ratios in `packed`'s order."""
  if not any(row.get("turn") is not None for row in rows):
    return []
  turns = np.concatenate(
    [
      np.asarray(row["turn"])[model_tokens(row)]
      if row.get("turn") is not None
      else np.ones(int(model_tokens(row).sum()), int)
      for row in rows
    ]
  )
  c = np.clip(np.asarray(r, np.float64), -20, 20)
  k3 = np.maximum(np.expm1(c) - c, 0.0)
  return [
    {
      "turn": int(t),
      "tokens": int((turns == t).sum()),
      "mean_abs_log_ratio": float(np.abs(r[turns == t]).mean()),
      "mean_k3": float(k3[turns == t].mean()),
    }
    for t in np.unique(turns)
  ]


def figures(rows: list[dict], report: dict, out: str) -> list[str]:
  """PNG figures of the log-ratio distribution and the mismatch by position and by length."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  o, q, *_ = packed(rows)
  r = o - q
  os.makedirs(os.path.join(out, "figures"), exist_ok=True)
  paths = []
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
  axes[0].hist(r, bins=60, color="tab:blue")
  axes[0].set(title="token log-ratio log π_train − log π_rollout", xlabel="r", ylabel="tokens", yscale="log")
  pos = report["by_position"]
  axes[1].plot([p["position"] for p in pos], [p["mean_abs_log_ratio"] for p in pos], marker="o", ms=3)
  axes[1].set(title="mean |r| by response position", xlabel="position", ylabel="mean |r|")
  lens = report["by_length"]
  axes[2].plot([x["length"] for x in lens], [x["mean_k3"] for x in lens], marker="o", ms=3, color="tab:red")
  axes[2].set(title="sequence mean k3 by response length", xlabel="response tokens", ylabel="mean k3")
  fig.tight_layout()
  path = os.path.join(out, "figures", "mismatch.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  paths.append(path)
  grid = [s for s in report["settings"] if "veto" not in s]
  fig, ax = plt.subplots(figsize=(6.5, 3.4))
  for level in sorted({s["level"] for s in grid}):
    for tis_mode, style in (("truncate", "-"), ("mask", "--")):
      pts = [s for s in grid if s["level"] == level and s["tis_mode"] == tis_mode]
      ax.plot(
        [s["bound"] for s in pts],
        [s["affected_token_fraction"] for s in pts],
        style,
        marker="o",
        ms=3,
        label=f"{level} {tis_mode}",
      )
  ax.set(xscale="log", xlabel="bound C", ylabel="tokens truncated / masked", title="what each setting would do")
  ax.legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(out, "figures", "settings.png")
  fig.savefig(path, dpi=110)
  plt.close(fig)
  paths.append(path)
  return paths


def markdown(report: dict, figure_paths: list[str], source: str) -> str:
  lr = report["log_ratio"]
  lines = [
    f"# Rollout mismatch report: {source}",
    "",
    f"{report['sequences']} sequences, {report['tokens']} response tokens; metrics reduced "
    f"`{report['metric_reduction']}`.",
    "",
    "## Token log-ratio `r = log π_train − log π_rollout`",
    "",
    f"mean {lr['mean']:.4g}, std {lr['std']:.4g}, mean |r| {lr['mean_abs']:.4g}, "
    f"share with |r| > 0.1: {lr['fraction_abs_above_0.1']:.2%}",
    "",
    "| quantile | " + " | ".join(lr["quantiles"]) + " |",
    "|---" * (len(lr["quantiles"]) + 1) + "|",
    "| r | " + " | ".join(f"{v:.3g}" for v in lr["quantiles"].values()) + " |",
    "",
  ]
  lines += [f"![{os.path.basename(p)}](figures/{os.path.basename(p)})" for p in figure_paths] + [""]
  if report.get("by_turn"):
    lines += [
      "## Mismatch by turn (multi-turn trajectories; the model's tokens only)",
      "",
      "| turn | tokens | mean \\|r\\| | mean k3 |",
      "|---|---|---|---|",
    ]
    lines += [
      f"| {t['turn']} | {t['tokens']} | {t['mean_abs_log_ratio']:.4g} | {t['mean_k3']:.4g} |" for t in report["by_turn"]
    ] + [""]
  lines += ["## Mismatch metrics (the reference page's)", "", "| metric | value |", "|---|---|"]
  lines += [f"| `{k}` | {v:.4g} |" for k, v in report["mismatch_metrics"].items()] + [""]
  lines += [
    "## Tokens carrying the most mismatch",
    "",
    "| token id | count | mean r | share of Σ|r| |",
    "|---|---|---|---|",
  ]
  lines += [
    f"| {t['token_id']} | {t['count']} | {t['mean_log_ratio']:.3g} | {t['share_of_abs_log_ratio']:.1%} |"
    for t in report["top_tokens"]
  ] + [""]
  lines += [
    "## What each setting would do",
    "",
    "| setting | tokens truncated / masked / vetoed | kept tokens | kept sequences | ESS ratio |",
    "|---|---|---|---|---|",
  ]
  lines += [
    f"| {s['setting']} | {s['affected_token_fraction']:.2%} | {s['kept_token_fraction']:.2%} | "
    f"{s['kept_seq_fraction']:.2%} | {s['ess_ratio']:.3f} |"
    for s in report["settings"]
  ]
  lines += [
    "",
    "## What `auto` would have chosen at each step",
    "",
    "The threshold controller (contract §3.1) sets the bound from each step's own ratios: the loosest "
    "whose ESS ratio reaches the target (truncate), or the tightest masking at most the share (mask).",
    "",
    "| step | target | bound chosen | ESS / masked share reached | met | kept tokens | ESS ratio |",
    "|---|---|---|---|---|---|---|",
  ]
  lines += [
    f"| {a['step']} | {a['setting']} | {a['bound']:.4g} | {a['reached']:.4g} | {'yes' if a['target_met'] else 'no'} | "
    f"{a['kept_token_fraction']:.2%} | {a['ess_ratio']:.3f} |"
    for a in report["auto"]
  ]
  lines += [
    "",
    "## Advantages each estimator would give these rewards",
    "",
    f"Per step over the recorded groups; the run's estimator: `{report['run_estimator'] or 'unknown'}` "
    "(its row compares with the recorded advantages). `optimal_token_baseline` needs `Σπ²` per token, "
    "which records do not hold.",
    "",
    "| estimator | mean | std | mean abs | sequences without signal | max diff to recorded |",
    "|---|---|---|---|---|---|",
  ]
  lines += [
    f"| `{a['estimator']}` | {a['mean']:.3g} | {a['std']:.3g} | {a['mean_abs']:.3g} | {a['zero_fraction']:.1%} | "
    + (f"{a['max_abs_diff_to_recorded']:.2g} |" if "max_abs_diff_to_recorded" in a else "— |")
    for a in report["advantages"]
  ]
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="mis-jax analyze", description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument("records", metavar="DIR", help="a rollout record directory (rollout.records.save_dir)")
  parser.add_argument(
    "--model",
    default=None,
    metavar="PATH",
    help="an HF checkpoint to recompute the trainer's log-probs with (needed when the records "
    "have no old_logprobs column)",
  )
  parser.add_argument("--out", default=None, help="report directory (default: DIR/report)")
  parser.add_argument("--steps", default=None, metavar="A:B", help="an inclusive step range (default: all)")
  parser.add_argument(
    "--metric-reduction",
    default=None,
    choices=("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"),
    help="how metrics are reduced (default: the run's loss_agg_mode's reduction)",
  )
  args = parser.parse_args(argv)
  steps = None
  if args.steps:
    try:
      a, b = (int(x) for x in args.steps.split(":"))
      steps = (a, b)
    except ValueError:
      print(f"mis-jax analyze: --steps {args.steps!r} must look like A:B (an inclusive step range)", file=sys.stderr)
      return 2
  try:
    rows, meta = load(args.records, steps)
    if any(r.get("old_logprobs") is None for r in rows):
      if args.model is None:
        raise rollout_records.RecordError(
          f"{args.records}: the records have no column 'old_logprobs' (the run's "
          "algorithm did not recompute them); pass --model PATH to recompute them"
        )
      trainer_logprobs(rows, args.model, float(meta.get("temperature", 1.0)))
  except (rollout_records.RecordError, FileNotFoundError, ValueError) as e:
    print(f"mis-jax analyze: {e}", file=sys.stderr)
    return 2
  mode = args.metric_reduction or (meta.get("loss") or {}).get("loss_agg_mode") or "seq-mean-token-mean"
  report = analyze(rows, mode, ((meta.get("config") or {}).get("train") or {}).get("advantage_estimator"))
  out = args.out or os.path.join(args.records, "report")
  os.makedirs(out, exist_ok=True)
  paths = figures(rows, report, out)
  with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(out, "report.md"), "w") as f:
    f.write(markdown(report, paths, args.records))
  print(
    f"mis-jax analyze: {report['sequences']} sequences, {report['tokens']} tokens -> {os.path.join(out, 'report.md')}"
  )
  return 0
