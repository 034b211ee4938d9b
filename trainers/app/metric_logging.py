"""Where the trainer's step metrics go: `metrics.jsonl` (always), TensorBoard (tensorboardX, no
PyTorch), Weights & Biases (when installed and asked for), and a progress display that is a live
bar on a terminal and one line every `progress_every` steps otherwise (a CI log or `nohup`
output is not flooded with carriage returns)."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

PROGRESS_KEYS = ("reward_mean", "loss", "mis_k3_kl")


class MetricLogger:
  """Process 0's sinks for one run. `log(step, metrics)` after every step; `close()` at the end.
  `metrics.jsonl` keeps only its rows up to `initial_step` (each step logged once across resumes).

  Args:
    run_dir: the run directory (`metrics.jsonl`, `tensorboard/`).
    logging_cfg: the config's `logging` section.
    total_steps, initial_step: for the progress display.
    progress: False: no progress display at all.
    stream: where progress goes (default stdout); a TTY gets a tqdm bar.
  """

  def __init__(
    self, run_dir: str, logging_cfg, *, total_steps: int, initial_step: int = 0, progress: bool = True, stream=None
  ):
    self.path = os.path.join(run_dir, "metrics.jsonl")
    _keep_rows_up_to(self.path, initial_step)
    self.cfg = logging_cfg
    self.stream = stream or sys.stdout
    self.total, self.start_step, self.t0 = total_steps, initial_step, time.perf_counter()
    self.tensorboard = _tensorboard(run_dir) if logging_cfg.tensorboard else None
    self.wandb = _wandb(run_dir, logging_cfg) if logging_cfg.wandb else None
    self.bar = None
    self.progress = progress
    if progress and _isatty(self.stream):
      from tqdm import tqdm

      self.bar = tqdm(total=total_steps, initial=initial_step, desc="train", file=self.stream)

  def log(self, step: int, metrics: dict) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(metrics) + "\n")
    scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if self.tensorboard is not None:  # one event of all the step's scalars (one per scalar: ~3 ms a step)
      self.tensorboard.add_summary(_summary(scalars), step)
    if self.wandb is not None:
      self.wandb.log(scalars, step=step)
    shown = {k: metrics[k] for k in PROGRESS_KEYS if isinstance(metrics.get(k), (int, float))}
    if self.bar is not None:
      self.bar.update(1)
      self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})
    elif self.progress and (step % self.cfg.progress_every == 0 or step == self.total):
      rate = (step - self.start_step) / max(time.perf_counter() - self.t0, 1e-9)
      text = " ".join(f"{k}={v:.4g}" for k, v in shown.items())
      print(f"train step {step}/{self.total} ({rate:.2f} steps/s) {text}", file=self.stream, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    if self.tensorboard is not None:
      self.tensorboard.close()
    if self.wandb is not None:
      self.wandb.finish()


def _keep_rows_up_to(path: str, step: int) -> None:
  """Drops the rows of `metrics.jsonl` past `step` (the step a run starts or resumes from), and a
  last line cut short by a kill: every step appears once, written by the run that trained it."""
  if not os.path.isfile(path):
    return
  with open(path) as f:
    lines = f.read().splitlines()
  kept = []
  for line in lines:
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
      kept.append(line)
  if len(kept) != len(lines):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.write("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _isatty(stream) -> bool:
  try:
    return stream.isatty()
  except (AttributeError, ValueError):
    return False


def _tensorboard(run_dir: str):
  try:
    from tensorboardX.writer import FileWriter
  except ImportError:
    warnings.warn(
      "logging.tensorboard is on but tensorboardX is not installed (pip install 'mis_jax[train]'); "
      "metrics go to metrics.jsonl only"
    )
    return None
  return FileWriter(os.path.join(run_dir, "tensorboard"))


def _summary(scalars: dict):
  """One TensorBoard `Summary` holding every scalar (each the value tensorboardX's `scalar` makes)."""
  from tensorboardX.proto.summary_pb2 import Summary
  from tensorboardX.summary import scalar

  return Summary(value=[v for k, x in scalars.items() for v in scalar(k, float(x)).value])


def _wandb(run_dir: str, cfg):
  try:
    import wandb
  except ImportError:
    raise RuntimeError(
      "logging.wandb is true but wandb is not installed: pip install wandb (or set logging.wandb: false)"
    ) from None
  return wandb.init(
    project=cfg.wandb_project or "mis-jax",
    name=cfg.wandb_run_name or os.path.basename(run_dir),
    dir=run_dir,
    resume="allow",
  )
