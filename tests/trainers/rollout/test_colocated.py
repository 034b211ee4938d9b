"""Colocated rollouts (`rollout.placement.mode: colocated`): the embedded engine in the trainer's
process, its weights handed over in memory. The same run with the engine behind `mis-jax serve`
(a real process, HTTP, safetensors on disk) is the reference: every step's samples, rewards,
losses and the parameters after the steps are equal."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import mis_jax
from test_train import make_cfg
from trainers.models import init_checkpoint
from trainers.serving.embedded.server import EmbeddedServer
from trainers.app import trainer as train_lib
from trainers.config import TrainConfig

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

MIS = mis_jax.LossConfig(
  use_tis=True, mis=mis_jax.MISConfig(tis_mode="mask", tis_lower_bound=0.5, tis_upper_bound=2.0, rs_veto_threshold=1e-4)
)


def _run(cfg, urls, loss_cfg=MIS, trainer=None):
  """A run's per-step rollouts (what the trainer took), metrics, and final parameters (host)."""
  trainer = trainer or train_lib.Trainer(cfg, loss_cfg, urls=urls)
  rollouts = []
  take = trainer.source.next
  trainer.source.next = lambda step: rollouts.append(take(step)) or rollouts[-1]
  history = trainer.run(progress=False)
  return trainer, rollouts, history, jax.device_get(trainer.params)


def _assert_same_runs(a, b):
  (_, ra, ha, pa), (_, rb, hb, pb) = a, b
  assert len(ra) == len(rb) == len(ha) == len(hb)
  for step, (x, y) in enumerate(zip(ra, rb)):
    sx, sy = x.result.samples, y.result.samples
    assert [s.response_ids for s in sx] == [s.response_ids for s in sy], f"step {step + 1}: samples differ"
    np.testing.assert_array_equal(
      [v for s in sx for v in s.rollout_logprobs], [v for s in sy for v in s.rollout_logprobs]
    )
    assert [s.weight_versions for s in sx] == [s.weight_versions for s in sy]
    assert [s.sampling_mask for s in sx] == [s.sampling_mask for s in sy]
    for u, v in zip(sx, sy):
      assert (u.routed_experts is None) == (v.routed_experts is None)
      if u.routed_experts is not None:
        np.testing.assert_array_equal(u.routed_experts, v.routed_experts)
  for key in ("reward_mean", "loss", "pg_loss", "grad_norm", "mis_k3_kl"):
    np.testing.assert_allclose([h[key] for h in ha], [h[key] for h in hb], rtol=1e-6, atol=1e-9, err_msg=key)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("case", ["dense", "moe-r3-replay"])
def test_colocated_equals_server_mode(tmp_path, case):
  """Decoupled PPO + MIS on a bf16 engine, 3 steps of 2 epochs; the MoE case also replays the
  engine's routed experts (R3) and its top-k sampling masks."""
  init = str(tmp_path / "init")
  preset = "tiny-qwen3" if case == "dense" else "tiny-qwen3-moe"
  init_checkpoint(init, preset=preset, seed=3)
  rollout = {"prompts_per_step": 4, "n": 4}
  if case != "dense":
    rollout.update(sampling={"routing_replay": "r3", "top_k": 8})
  runs = {}
  with EmbeddedServer(
    init, dtype="bfloat16", seed=0, extra_args=("--enable-return-routed-experts", "--weight-version", "0")
  ) as server:
    for placement in ("server", "colocated"):
      cfg = make_cfg(
        tmp_path,
        placement,
        model={"path": init},
        train={"steps": 3},
        rollout={**rollout, "placement": {"mode": placement}},
      )
      runs[placement] = _run(cfg, [server.url] if placement == "server" else [])
  _assert_same_runs(runs["server"], runs["colocated"])
  trainer, rollouts, history, _ = runs["colocated"]
  assert [h["server_weight_version"] for h in history] == ["0", "1", "2"]
  assert trainer.servers.weight_sync.engine.inner.weight_version == "3"
  assert all("sync/handover_s" in h and "sync/write_s" not in h for h in history)
  if case != "dense":
    assert all(s.routed_experts is not None and s.sampling_mask is not None for r in rollouts for s in r.result.samples)
    assert all(h["sampling_replay"] == 1.0 for h in history)


def test_float32_engine_holds_the_trainers_current_weights(tmp_path):
  """A float32 engine colocated with a float32 trainer: at every step the rollout log-probs are
  the trainer's to rounding (`mis_k3_kl` < 1e-6), so the weights handed over are the ones just
  trained. The engine's copy is freed while the step trains (nothing else generates then). A
  step's prompts reach the engine in one call, whatever `prompts_per_request` says (no HTTP body
  to bound): one batch of all 16 rows, not requests racing into batches of their own."""
  cfg = make_cfg(
    tmp_path,
    model={"dtype": "float32"},
    train={"steps": 3},
    rollout={
      "prompts_per_step": 4,
      "n": 4,
      "transport": {"prompts_per_request": 1},
      "placement": {"mode": "colocated", "server_dtype": "float32"},
    },
  )
  trainer = train_lib.Trainer(cfg, MIS, urls=[])
  engine, train = trainer.servers.weight_sync.engine.inner, trainer.fns.train
  seen, batches, generate = [], [], engine.sampler.generate
  engine.sampler.generate = lambda prompts, *args, **kwargs: (
    batches.append(len(prompts)) or generate(prompts, *args, **kwargs)
  )

  def train_step(params, *args):
    leaves = jax.tree.leaves(engine.sampler.params)
    seen.append(engine.released and not any(isinstance(x, jax.Array) for x in leaves))
    return train(params, *args)

  trainer.fns.train = train_step
  history = trainer.run(progress=False)
  assert all(h["mis_k3_kl"] < 1e-6 for h in history), [h["mis_k3_kl"] for h in history]
  assert [h["server_weight_version"] for h in history] == ["0", "1", "2"]
  assert seen == [True] * 6  # 3 steps x 2 epochs, each with the engine's weights freed
  assert batches == [16] * 3  # one sampler call per step, of its 4 prompts x n = 4 rows
  assert not engine.released  # the last push brought them back


def test_engine_over_the_mesh_equals_the_engine_on_one_device(tmp_path):
  """`rollout.placement.colocated_devices: mesh`: the engine's weights laid out as the trainer's over its 8
  devices (each handover lands there too) and each batch's rows split over them. float32: every
  step's samples are those of the engine on the first device, the log-probs agree to rounding, and
  the engine reproduces the trainer's (`mis_k3_kl` < 1e-6)."""
  runs = {}
  for devices in ("first", "mesh"):
    cfg = make_cfg(
      tmp_path,
      devices,
      model={"dtype": "float32"},
      train={"steps": 2},
      rollout={"placement": {"mode": "colocated", "server_dtype": "float32", "colocated_devices": devices}},
    )
    trainer = train_lib.Trainer(cfg, MIS, urls=[])
    sampler = trainer.servers.weight_sync.engine.inner.sampler
    rows, prefill = [], sampler._prefill
    sampler._prefill = lambda params, ids, *a, **k: (
      rows.append(getattr(ids, "sharding", None)) or prefill(params, ids, *a, **k)
    )
    runs[devices] = _run(cfg, [], trainer=trainer) + (rows,)
  (_, ra, ha, _, rows_first), (trainer, rb, hb, _, rows_mesh) = runs["first"], runs["mesh"]
  for x, y in zip(ra, rb):
    sx, sy = x.result.samples, y.result.samples
    assert [s.response_ids for s in sx] == [s.response_ids for s in sy]
    np.testing.assert_allclose(
      np.concatenate([s.rollout_logprobs for s in sx]), np.concatenate([s.rollout_logprobs for s in sy]), atol=2e-5
    )
  assert all(h["mis_k3_kl"] < 1e-6 for h in ha + hb), [h["mis_k3_kl"] for h in ha + hb]
  served = nnx.to_flat_state(trainer.servers.weight_sync.engine.inner.sampler.params)
  trained = dict(nnx.to_flat_state(trainer.fns.param_shardings))
  assert all(var.get_value().sharding == trained[path].get_value() for path, var in served)
  assert any(
    len(var.get_value().sharding.device_set) == 8 and not var.get_value().sharding.is_fully_replicated
    for _, var in served
  )
  assert rows_first and rows_first == [None] * len(rows_first)
  assert rows_mesh and all(
    r is not None and r.num_devices == 8 and r.spec[0] == ("data", "fsdp", "expert") for r in rows_mesh
  )


def test_colocated_asynchronous_rollouts(tmp_path):
  """The producer thread generates on the engine while the trainer trains and pushes (paused in
  place): every trained sample is within `max_staleness` and the engine keeps its weights."""
  cfg = make_cfg(
    tmp_path,
    train={"steps": 4, "ppo_epochs": 1},
    rollout={
      "prompts_per_step": 4,
      "n": 4,
      "placement": {"mode": "colocated"},
      "sync": {"max_staleness": 1, "pause_mode": "in_place", "mismatch_check": False},
    },
  )
  trainer = train_lib.Trainer(cfg, MIS, urls=[])
  history = trainer.run(progress=False)
  assert [h["step"] for h in history] == [1, 2, 3, 4]
  assert all(h["rollout/staleness_max"] <= 1 for h in history) and not trainer.servers.weight_sync.release_between_steps
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert len(rows) == 4 and trainer.servers.weight_sync.engine.inner.weight_version == "4"


def test_colocated_config_errors(tmp_path):
  with pytest.raises(mis_jax.ConfigError, match="colocated generates in the trainer: no server URL"):
    train_lib.Trainer(
      make_cfg(tmp_path, rollout={"placement": {"mode": "colocated"}}), MIS, urls=["http://127.0.0.1:9"]
    )
  with pytest.raises(mis_jax.ConfigError, match="placement"):
    make_cfg(tmp_path, rollout={"placement": {"mode": "remote"}})
  # sglang-jax colocated (the shipped configs/sglang_jax.yaml) runs its Engine in this process: here
  # (Python 3.11) it cannot, and says where it can.
  cfg = TrainConfig.from_yaml("configs/sglang_jax.yaml").replace(run_dir=str(tmp_path / "sglang-jax"))
  assert (cfg.rollout.placement.engine, cfg.rollout.placement.mode) == ("sglang-jax", "colocated")
  with pytest.raises(mis_jax.ConfigError, match=r"no sglang-jax .*run the trainer in its venv.*--prepare --trainer"):
    train_lib.Trainer(cfg, MIS, urls=[])
  with pytest.raises(mis_jax.ConfigError, match="colocated_devices mesh lays out the embedded engine"):
    train_lib.Trainer(
      make_cfg(
        tmp_path, rollout={"placement": {"mode": "colocated", "engine": "sglang-jax", "colocated_devices": "mesh"}}
      ),
      MIS,
      urls=[],
    )
  with pytest.raises(mis_jax.ConfigError, match="server_quantize 'int8' is the embedded engine's"):
    train_lib.Trainer(
      make_cfg(tmp_path, rollout={"placement": {"engine": "sglang-jax", "server_quantize": "int8"}}), MIS, urls=[]
    )
