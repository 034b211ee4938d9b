"""The trainer's metric sinks: metrics.jsonl, TensorBoard through tensorboardX (no PyTorch),
Weights & Biases through its `init` / `log` / `finish` API, and progress that is one line per
`progress_every` steps when stdout is not a terminal."""

import io
import json
import sys
import types

import pytest

import mis_jax
from trainers.config import LoggingSection
from trainers.app.metric_logging import MetricLogger

from test_train import make_cfg


def _run(tmp_path, cfg, steps=5, stream=None):
  logger = MetricLogger(str(tmp_path), cfg, total_steps=steps, stream=stream)
  for step in range(1, steps + 1):
    logger.log(
      step,
      {
        "step": step,
        "reward_mean": 0.1 * step,
        "loss": 1.0 / step,
        "mis_k3_kl": 1e-3,
        "server_weight_version": str(step - 1),
      },
    )
  logger.close()


def test_jsonl_tensorboardx_and_non_tty_progress(tmp_path):
  stream = io.StringIO()  # not a terminal
  _run(tmp_path, LoggingSection(progress_every=2), stream=stream)
  lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
  out = stream.getvalue()
  assert "\r" not in out and [ln.split()[2] for ln in out.splitlines()] == ["2/5", "4/5", "5/5"]
  assert "reward_mean=0.4" in out.splitlines()[1]
  events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
  assert len(events) == 1
  steps = {e.step: {v.tag: v.simple_value for v in e.summary.value} for e in _events(events[0]) if e.summary.value}
  assert sorted(steps) == [1, 2, 3, 4, 5]  # one event a step, holding every scalar
  for step, values in steps.items():
    assert values == pytest.approx({"step": step, "reward_mean": 0.1 * step, "loss": 1.0 / step, "mis_k3_kl": 1e-3})


def _events(path):
  """The `Event` records of a TensorBoard file (TFRecord framing: length, its CRC, data, its CRC)."""
  from tensorboardX.proto.event_pb2 import Event

  data, at, out = path.read_bytes(), 0, []
  while at < len(data):
    n = int.from_bytes(data[at : at + 8], "little")
    out.append(Event.FromString(data[at + 12 : at + 12 + n]))
    at += 12 + n + 4
  return out


def test_tensorboard_off_writes_no_events(tmp_path):
  _run(tmp_path, LoggingSection(tensorboard=False), stream=io.StringIO())
  assert not (tmp_path / "tensorboard").exists()


def test_wandb_when_asked(tmp_path, monkeypatch):
  calls = []

  class Run:
    def log(self, data, step):
      calls.append(("log", step, dict(data)))

    def finish(self):
      calls.append(("finish",))

  fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
  monkeypatch.setitem(sys.modules, "wandb", fake)
  _run(tmp_path, LoggingSection(wandb=True, wandb_project="p", tensorboard=False), steps=2, stream=io.StringIO())
  assert calls[0][0] == "init" and calls[0][1]["project"] == "p" and calls[0][1]["name"] == tmp_path.name
  assert [c[1] for c in calls if c[0] == "log"] == [1, 2]
  assert "server_weight_version" not in calls[1][2] and calls[1][2]["loss"] == 1.0  # scalars only
  assert calls[-1] == ("finish",)


def test_wandb_missing_is_a_config_error(tmp_path, monkeypatch):
  import importlib.util
  from trainers.app.spec import resolve

  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
  with pytest.raises(mis_jax.ConfigError, match="logging.wandb is true but wandb is not installed"):
    resolve(make_cfg(tmp_path, logging={"wandb": True})).task


@pytest.mark.integration
def test_tensorboard_writer_needs_no_pytorch(tmp_path):
  """With PyTorch made unimportable, tensorboardX still writes events (it only uses torch when present)."""
  import subprocess

  code = (
    "import sys; sys.modules['torch'] = None\n"
    "from tensorboardX import SummaryWriter\n"
    f"w = SummaryWriter({str(tmp_path)!r}); w.add_scalar('loss', 1.5, 1); w.close()\n"
  )
  subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
  assert b"loss" in next(tmp_path.glob("events.out.tfevents.*")).read_bytes()
