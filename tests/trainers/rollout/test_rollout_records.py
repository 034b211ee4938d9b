"""Rollout records: a saving run killed with -9 and resumed leaves one record file per step; a
replay of those records with no server reproduces the run's metrics.jsonl (every non-timing
value, bitwise on CPU); `mis-jax analyze` equals an independent NumPy loop (the oracle of the
library tests) on the same records and renders the committed example; bad records are one-line
errors naming the file and the column, before anything is trained."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import oracle
from helpers import cpu_process_env
from trainers import cli
from trainers.models import init_checkpoint
from trainers.serving.embedded.server import EmbeddedServer
from trainers.commands import analyze as analysis
from trainers.rollout import records as rollout_records

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SMALL = [
  "--set",
  "rollout.prompts_per_step=4",
  "--set",
  "rollout.n=4",
  "--set",
  "train.row_len=32",
  "--set",
  "checkpoint.every=1",
  "--no-progress",
]
TIMING = ("rollout_s", "train_s", "sync_s", "step_s", "tokens_per_s")


def _is_timing(key):
  return key in TIMING or key.startswith(("sync/", "rollout/wait"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
  path = tmp_path_factory.mktemp("records-server")
  init_checkpoint(path, preset="tiny-qwen3", seed=1)
  with EmbeddedServer(str(path), dtype="bfloat16", seed=0) as srv:
    yield srv


def _metrics_by_step(path):
  """The last line of each step (a resumed run repeats the steps after its checkpoint)."""
  out = {}
  for line in open(path):
    m = json.loads(line)
    out[m["step"]] = m
  return out


def test_save_kill_resume_then_replay_reproduces_the_metrics(server, tmp_path, capsys):
  run, records = tmp_path / "run", tmp_path / "records"
  argv = [
    "train",
    "--config",
    "configs/demo.yaml",
    "--steps",
    "3",
    "--run-dir",
    str(run),
    "--save-rollouts",
    str(records),
    "--sglang-url",
    server.url,
    *SMALL,
  ]
  # The same 8 CPU devices as this process (the suite's), so the replay below runs the same programs.
  proc = subprocess.Popen(
    [sys.executable, "-m", "trainers.cli", *argv],
    cwd=ROOT,
    env=cpu_process_env(8),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline and proc.poll() is None:
    if (run / "metrics.jsonl").exists() and len((run / "metrics.jsonl").read_text().splitlines()) >= 2:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert len((run / "metrics.jsonl").read_text().splitlines()) >= 2, "the saving run did not reach step 2"
  assert cli.main([*argv, "--resume"]) == 0
  assert sorted(os.listdir(records)) == ["step_000001.parquet", "step_000002.parquet", "step_000003.parquet"]
  original = _metrics_by_step(run / "metrics.jsonl")
  assert sorted(original) == [1, 2, 3]
  # Records are one row per sample with the documented columns, readable by pyarrow alone.
  table = pq.read_table(records / "step_000002.parquet")
  assert set(rollout_records.REQUIRED) <= set(table.column_names) and "old_logprobs" in table.column_names
  assert table.num_rows == 16 and set(table.column("step").to_pylist()) == {2}
  meta = json.loads(table.schema.metadata[b"mis_jax"])
  assert meta["format_version"] == 1 and meta["sampling_params"]["temperature"] == 1.0
  # Replay with no server: the same steps in the same order, the same metrics.
  replay = tmp_path / "replay"
  capsys.readouterr()
  assert (
    cli.main(
      [
        "train",
        "--config",
        "configs/demo.yaml",
        "--steps",
        "3",
        "--run-dir",
        str(replay),
        "--load-rollouts",
        str(records),
        *SMALL,
      ]
    )
    == 0
  )
  # model.remat / model.attention auto: the tiny step fits, so no remat and dense attention, said at start-up
  assert "model: float32 compute, float32 weights, remat none, attention dense (auto: " in capsys.readouterr().out
  replayed = _metrics_by_step(replay / "metrics.jsonl")
  for step in (1, 2, 3):
    want = {k: v for k, v in original[step].items() if not _is_timing(k)}
    got = {k: v for k, v in replayed[step].items() if not _is_timing(k)}
    assert got == want, step


def _oracle_sequences(rows):
  return [
    {
      "o": np.asarray(r["old_logprobs"], np.float64),
      "q": np.asarray(r["rollout_logprobs"], np.float64),
      "m": np.ones(len(r["response_ids"]), bool),
    }
    for r in rows
  ]


def test_analysis_equals_a_numpy_loop_on_the_committed_example(tmp_path):
  """`mis-jax analyze` on the committed records (one analysis: its report.json is checked)."""
  example = os.path.join(ROOT, "data", "rollout_records_example")
  rows, meta = analysis.load(example)
  mode = meta["loss"]["loss_agg_mode"]
  assert cli.main(["analyze", example, "--out", str(tmp_path / "report")]) == 0
  report = json.loads((tmp_path / "report" / "report.json").read_text())
  seqs = _oracle_sequences(rows)
  want = oracle.mismatch(seqs, mode)
  for name, value in want.items():
    np.testing.assert_allclose(report["mismatch_metrics"][name], value, rtol=2e-4, atol=1e-6, err_msg=name)
  r = np.concatenate([s["o"] - s["q"] for s in seqs])
  np.testing.assert_allclose(report["log_ratio"]["quantiles"]["0.5"], np.quantile(r, 0.5), rtol=1e-5, atol=1e-7)
  rows_by_setting = {s["setting"]: s for s in report["settings"]}
  for level, tis_mode, bound in (("token", "truncate", 1.5), ("sequence", "mask", 2.0), ("geometric", "mask", 5.0)):
    _, _, m = oracle.mis(seqs, {"tis_level": level, "tis_mode": tis_mode, "tis_upper_bound": bound}, mode)
    got = rows_by_setting[f"{level} {tis_mode} C={bound:g}"]
    affected = (
      m["mis_tis_truncate_fraction"]
      if tis_mode == "truncate"
      else m["mis_tis_mask_fraction_low"] + m["mis_tis_mask_fraction_high"]
    )
    np.testing.assert_allclose(got["affected_token_fraction"], affected, atol=1e-6)
    np.testing.assert_allclose(got["kept_seq_fraction"], m["mis_kept_seq_fraction"], atol=1e-6)
    np.testing.assert_allclose(got["ess_ratio"], m["mis_ess_ratio"], rtol=1e-4)
  # What `auto` would have chosen at each step: the token mask band by sorting each step's
  # extremeness max(w, 1/w); the token ESS bound is the largest weight when the raw weights meet it.
  auto = {(a["step"], a["setting"]): a for a in report["auto"]}
  for k in sorted({int(row["step"]) for row in rows}):
    w = np.exp(np.concatenate([s["o"] - s["q"] for s, row in zip(seqs, rows) if int(row["step"]) == k]))
    extreme = np.sort(np.maximum(w, 1 / w))[::-1]
    got = auto[(k, "token mask max_masked_fraction=0.01")]
    np.testing.assert_allclose(got["bound"], max(extreme[int(np.floor(0.01 * w.size))], 1.0), rtol=1e-5)
    assert got["target_met"] and got["reached"] <= 0.01
    got = auto[(k, "token truncate target_ess_ratio=0.9")]
    if w.sum() ** 2 / (w.size * (w * w).sum()) >= 0.9:
      np.testing.assert_allclose(got["bound"], w.max(), rtol=1e-5)
    assert got["target_met"] and got["reached"] >= 0.9
  # Each estimator's advantages of the recorded rewards, per step and group (a loop for grpo and
  # rloo); the run's own estimator gives the recorded advantages back.
  by_estimator = {a["estimator"]: a for a in report["advantages"]}
  for estimator in ("grpo", "rloo"):
    adv = []
    for row in rows:
      group = [x["reward"] for x in rows if x["step"] == row["step"] and x["group"] == row["group"]]
      others = list(group)
      others.remove(row["reward"])
      adv.append(
        (row["reward"] - np.mean(group)) / (np.std(group, ddof=1) + 1e-6)
        if estimator == "grpo"
        else row["reward"] - np.mean(others)
      )
    np.testing.assert_allclose(by_estimator[estimator]["mean_abs"], np.mean(np.abs(adv)), rtol=1e-4)
    np.testing.assert_allclose(by_estimator[estimator]["zero_fraction"], np.mean(np.abs(adv) < 1e-6))
  assert report["run_estimator"] == "grpo" and by_estimator["grpo"]["max_abs_diff_to_recorded"] < 1e-5
  # The report renders from the committed records.
  text = (tmp_path / "report" / "report.md").read_text()
  assert "## What each setting would do" in text and "mis_k3_kl" in text
  assert "## Advantages each estimator would give these rewards" in text
  assert "## What `auto` would have chosen at each step" in text
  assert {p.name for p in (tmp_path / "report" / "figures").iterdir()} == {"mismatch.png", "settings.png"}
  assert report["tokens"] == r.size


def _copy_records(tmp_path, edit=None, name="bad"):
  """The committed example's first 2 steps, `edit(table) -> table` applied to step 2."""
  out = tmp_path / name
  out.mkdir()
  for k in (1, 2):
    table = pq.read_table(os.path.join(ROOT, "data", "rollout_records_example", f"step_{k:06d}.parquet"))
    if k == 2 and edit is not None:
      table = edit(table)
    pq.write_table(table, out / f"step_{k:06d}.parquet")
  return out


BAD = {
  "unknown column": (lambda t: t.append_column("score", pa.array([0.0] * t.num_rows)), "unknown column 'score'"),
  "missing column": (lambda t: t.drop(["reward"]), "missing column 'reward'"),
  "log-probs of the wrong length": (
    lambda t: t.set_column(
      t.column_names.index("rollout_logprobs"),
      "rollout_logprobs",
      pa.array([[-1.0]] * t.num_rows, pa.list_(pa.float32())),
    ),
    "column 'rollout_logprobs' has 1 values for",
  ),
  "token outside the vocabulary": (
    lambda t: t.set_column(
      t.column_names.index("response_ids"),
      "response_ids",
      pa.array([[99] * len(x) for x in t.column("response_ids").to_pylist()], pa.list_(pa.int32())),
    ),
    "column 'response_ids' holds token id 99, outside the model's vocabulary (64)",
  ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_records_are_one_line_errors(case, tmp_path, capsys):
  edit, needle = BAD[case]
  records = _copy_records(tmp_path, edit)
  run = tmp_path / "run"
  code = cli.main(
    ["train", "--config", "configs/demo.yaml", "--steps", "2", "--run-dir", str(run), "--load-rollouts", str(records)]
  )
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
  assert needle in err[0] and "step_000002.parquet" in err[0], err[0]
  assert not run.exists()


def test_missing_steps_and_missing_directory(tmp_path, capsys):
  records = _copy_records(tmp_path)
  code = cli.main(
    [
      "train",
      "--config",
      "configs/demo.yaml",
      "--steps",
      "3",
      "--run-dir",
      str(tmp_path / "r"),
      "--load-rollouts",
      str(records),
    ]
  )
  assert code == 2 and "have no step_000003.parquet (they cover steps 1..2)" in capsys.readouterr().err
  code = cli.main(
    [
      "train",
      "--config",
      "configs/demo.yaml",
      "--run-dir",
      str(tmp_path / "r"),
      "--load-rollouts",
      str(tmp_path / "nowhere"),
    ]
  )
  assert code == 2 and "no such directory" in capsys.readouterr().err
  assert cli.main(["analyze", str(tmp_path / "nowhere")]) == 2


def test_analyze_recomputes_trainer_logprobs_with_a_model(tmp_path):
  """`--model`: the example run's step-1 old log-probs came from its initial weights (the demo's
  preset, initializer_range 0.1, init seed 0); recomputed from that checkpoint they match."""
  import dataclasses
  from trainers.models import PRESETS

  init_checkpoint(tmp_path / "init", config=dataclasses.replace(PRESETS["tiny-qwen3"], initializer_range=0.1), seed=0)
  rows, meta = analysis.load(os.path.join(ROOT, "data", "rollout_records_example"), steps=(1, 1))
  recorded = [r.pop("old_logprobs") for r in rows]
  analysis.trainer_logprobs(rows, str(tmp_path / "init"), float(meta["temperature"]), batch_rows=48)
  for want, row in zip(recorded, rows):
    np.testing.assert_allclose(row["old_logprobs"], want, atol=2e-5)
