"""Sampling-mask replay in the trainer: with a float32 engine on the trainer's own weights, the
only difference between engine and trainer is the truncation, so with replay on the step-1
mismatch is float32 rounding for top-k, top-p, min-p and their combination, while the ratio
without renormalisation carries exactly the kept mass; the step with supports on a mesh and
over micro-batches equals the one-device, one-micro-batch step; a server without masks and
configs that cannot replay are clear errors."""

import json
import types

import numpy as np
import pytest

import mis_jax
from fake_sglang import FakeSGLang
from trainers import cli
from trainers.app import trainer as train_lib
from trainers.rollout import settings
from trainers.models import init_checkpoint
from trainers.rollout.extras import SamplingSupport
from trainers.rollout.samples import ServerError
from trainers.serving.embedded.server import EmbeddedServer

from test_step import (
  ALGORITHMS,
  ROW_LEN,
  TINY,
  _assert_metrics_close,
  _assert_trees_close,
  _functions,
  _mesh,
  _samples,
  _step_batch,
)
from test_step import _run as run_steps
from test_train import make_cfg

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

K = 6  # support width of the step-level tests


def _with_supports(samples, seed=0):
  """Random supports of 1..K ids around each response token (the token anywhere in them)."""
  rng = np.random.default_rng(seed)
  out = []
  for s in samples:
    masks = []
    for tok in s.response_ids:
      others = [int(v) for v in rng.permutation(64) if v != tok][: int(rng.integers(0, K))]
      ids = others + [tok]
      masks.append(tuple(int(v) for v in rng.permutation(ids)))
    support = SamplingSupport(K).from_record(masks, len(s.prompt_ids), len(s.response_ids))
    out.append(types.SimpleNamespace(**{**vars(s), "extras": {**getattr(s, "extras", {}), "sampling_mask": support}}))
  return out


def _run(mesh, loss_cfg, sb, fns=None):
  """test_step's run of one update (the supports go in the model inputs): `(state, metrics)`."""
  states, history, _ = run_steps(mesh, loss_cfg, sb, 1, fns)
  return states[0], history[0]


def _assert_metrics_match(got, want):
  """test_step's comparison, except chi2_seq = exp(2 Σ r) - 1 (here ~5e14: it multiplies the
  float32 rounding of Σ r, summed in another order, by 2 Σ r ≈ 34)."""
  got, want = dict(got), dict(want)
  np.testing.assert_allclose(got.pop("mis_chi2_seq"), want.pop("mis_chi2_seq"), rtol=1e-4)
  _assert_metrics_close(got, want)


def _support_batch(tokens_per_micro_batch, batch_devices, num=24):
  """test_step's step batch of `num` samples, with random supports packed (width K)."""
  from trainers.learner.batch import build_step_batch

  samples = _with_supports(_samples(num))
  ref = _step_batch(tokens_per_micro_batch, batch_devices, samples)
  adv = np.asarray(mis_jax.compute_advantages(ref.rewards, ref.groups, num_groups=int(ref.groups.max()) + 1))
  return build_step_batch(
    samples,
    ref.rewards,
    adv,
    ref.groups,
    num_segments=num,
    row_len=ROW_LEN,
    tokens_per_micro_batch=tokens_per_micro_batch,
    batch_devices=batch_devices,
    extras=(SamplingSupport(K),),
  )


def test_supports_are_packed_with_their_tokens():
  sb = _support_batch(4 * ROW_LEN, 1)
  sup, targets = sb.extras["sampling_mask"], sb.targets
  assert sup.shape == sb.input_ids.shape + (K,) and sup.dtype == np.int32
  mask = np.asarray(sb.batch.loss_mask)
  assert np.all(sup[~mask] == -1)  # prompt tokens and padding: the whole vocabulary
  assert np.all((sup[mask] == targets[mask][:, None]).any(-1))  # every trained token in its support


@pytest.mark.parametrize("algo", ["decoupled_ppo", pytest.param("reinforce_is", marks=pytest.mark.repeat)])
def test_replay_step_on_a_mesh_and_micro_batches_equals_one_device(algo):
  """The whole step (parameters, Adam state, every metric, the sampling ones included) with
  supports: a (2, 2, 2) mesh == one device, and 4 micro-batches == 1."""
  loss_cfg = ALGORITHMS[algo]
  one_mesh = _mesh((1, 1, 1))
  fns = _functions(one_mesh, loss_cfg)
  one = _support_batch(8 * ROW_LEN, 1)
  four = _support_batch(2 * ROW_LEN, 1)
  assert (one.layout.micro_batches, four.layout.micro_batches) == (1, 4)
  s1, h1 = _run(one_mesh, loss_cfg, one, fns)
  s4, h4 = _run(one_mesh, loss_cfg, four, fns)
  assert {
    "sampling_kept_mass_mean",
    "sampling_kept_mass_min",
    "sampling_ratio_mean_replay",
    "sampling_ratio_outside_full",
    "sampling_k3_kl_full",
  } <= set(h1)
  assert 0 < h1["sampling_kept_mass_min"] <= h1["sampling_kept_mass_mean"] < 1
  _assert_trees_close(s4, s1, "state, 4 micro-batches")
  h1.pop("mis_ess_ratio", None), h4.pop("mis_ess_ratio", None)
  _assert_metrics_match(h4, h1)
  if algo == "decoupled_ppo":
    mesh_batch = _support_batch(ROW_LEN, 8, num=40)
    s_mesh, h_mesh = _run(_mesh((2, 2, 2)), loss_cfg, mesh_batch)
    s_ref, h_ref = _run(one_mesh, loss_cfg, mesh_batch, fns)
    _assert_trees_close(s_mesh, s_ref, "state, (2, 2, 2) mesh")
    _assert_metrics_match(h_mesh, h_ref)


# ---- the trainer against a float32 engine on the trainer's own weights --------------------------

SETTINGS = {  # name: (top_k, top_p, min_p); top_k = vocab (64) cuts nothing
  "top_k 20": (20, 1.0, 0.0),
  "top_p 0.8": (64, 0.8, 0.0),
  "min_p 0.1": (64, 1.0, 0.1),
  "top_k 20 + top_p 0.95 + min_p 0.05": (20, 0.95, 0.05),
}


@pytest.fixture(scope="module")
def f32_server(tmp_path_factory):
  path = tmp_path_factory.mktemp("replay-weights")
  init_checkpoint(path, config=TINY, seed=0)
  with EmbeddedServer(str(path), dtype="float32", seed=0) as srv:
    yield str(path), srv


def _replay_cfg(tmp_path, model_path, name, top_k, top_p, min_p, replay="auto"):
  return make_cfg(
    tmp_path,
    name,
    model={"path": model_path},
    rollout={
      "sampling": {
        "temperature": 1.0,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "sampling_replay": replay,
        "max_new_tokens": 6,
      },
      "placement": {"server_dtype": "float32"},
    },
    train={"steps": 1, "ppo_epochs": 1, "row_len": 16},
  )


@pytest.mark.parametrize("setting", SETTINGS)
def test_float32_engine_replay_removes_the_truncation_bias(setting, f32_server, tmp_path):
  model_path, srv = f32_server
  top_k, top_p, min_p = SETTINGS[setting]
  cfg = _replay_cfg(tmp_path, model_path, "run", top_k, top_p, min_p)
  loss_cfg = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(use_rs=True, tis_mode="mask"))
  (h,) = train_lib.Trainer(cfg, loss_cfg, urls=[srv.url]).run(progress=False)
  print(setting, {k: round(v, 7) for k, v in h.items() if k.startswith(("sampling", "mis_k3", "train_rollout"))})
  assert h["sampling_replay"] == 1.0
  # Replay on: float32 rounding only.
  assert h["mis_k3_kl"] < 1e-9 and h["train_rollout_logprob_abs_diff"] < 2e-5
  assert abs(h["sampling_ratio_mean_replay"] - 1) < 1e-5 and h["sampling_ratio_outside_replay"] == 0
  assert h["mis_kept_token_fraction"] == 1.0
  # Without renormalisation the ratio is the kept mass (< 1: the filter cut something) and
  # k3 is its bias M - log M - 1 (> 0 wherever M < 1).
  assert h["sampling_kept_mass_mean"] < 0.995
  np.testing.assert_allclose(h["sampling_ratio_mean_full"], h["sampling_kept_mass_mean"], rtol=1e-5)
  assert h["sampling_k3_kl_full"] > 100 * max(h["mis_k3_kl"], 1e-9)


def test_replay_off_keeps_full_vocabulary_logprobs_with_a_warning(f32_server, tmp_path):
  model_path, srv = f32_server
  cfg = _replay_cfg(tmp_path, model_path, "off", 20, 0.8, 0.0, replay="off")
  with pytest.warns(UserWarning, match="biased by the kept mass"):
    trainer = train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[srv.url])
  (h,) = trainer.run(progress=False)
  assert h["sampling_replay"] == 0.0 and "sampling_kept_mass_mean" not in h
  assert h["mis_k3_kl"] < 1e-9  # full-vocabulary on both sides


def test_a_server_without_sampling_masks_is_a_clear_error(tmp_path):
  with FakeSGLang() as fake:
    cfg = make_cfg(tmp_path, rollout={"sampling": {"top_k": 10, "top_p": 0.9}})
    with pytest.raises(
      ServerError,
      match="/generate: the reply has no meta_info.output_token_sampling_mask .* rollout.sampling.sampling_replay: off",
    ):
      train_lib.Trainer(cfg, mis_jax.LossConfig(), urls=[fake.url]).run(progress=False)


@pytest.mark.parametrize(
  "sets,needle",
  [
    (
      ["rollout.sampling.top_p=0.9"],
      "rollout.sampling.sampling_replay auto (rollout.sampling.top_p 0.9, min_p 0.0) needs a finite "
      "rollout.sampling.top_k",
    ),
    (
      ["rollout.sampling.sampling_replay=on"],
      "rollout.sampling.sampling_replay on (untruncated sampling) needs a finite rollout.sampling.top_k",
    ),
    (
      ["rollout.sampling.top_k=5000"],
      "rollout.sampling.top_k 5000 exceeds rollout.sampling.sampling_mask_max_tokens 4096",
    ),
    (["rollout.sampling.temperature=0", "rollout.sampling.sampling_replay=on"], "greedy sampling"),
  ],
)
def test_configs_that_cannot_replay_are_errors(sets, needle, tmp_path, capsys):
  run_dir = tmp_path / "run"
  argv = ["train", "--config", "configs/demo.yaml", "--run-dir", str(run_dir)]
  for s in sets:
    argv += ["--set", s]
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert needle in err and "Traceback" not in err, err
  assert not run_dir.exists()


def test_replay_with_asynchronous_rollouts(f32_server, tmp_path, step_traces):
  """Async producer (max_staleness 1): samples one version old are trained with their own
  supports; the masks survive the JSON broadcast that feeds other trainer processes."""
  model_path, srv = f32_server
  cfg = make_cfg(
    tmp_path,
    "async",
    model={"path": model_path},
    rollout={
      "sampling": {"top_k": 20, "top_p": 0.9, "max_new_tokens": 6},
      "placement": {"server_dtype": "float32"},
      "sync": {"max_staleness": 1},
    },
    train={"steps": 2, "ppo_epochs": 1, "row_len": 16},
  )
  loss_cfg = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig(use_rs=True, tis_mode="mask"))
  trainer = train_lib.Trainer(cfg, loss_cfg, urls=[srv.url])
  result = trainer.servers.generate(trainer.prompts(0), 0)
  assert all(s.sampling_mask is not None and len(s.sampling_mask) == len(s.response_ids) for s in result.samples)
  again = type(result).from_json(json.loads(json.dumps(result.to_json())))
  assert again.samples == result.samples
  history = trainer.run(progress=False)
  assert [h["step"] for h in history] == [1, 2] and all(h["sampling_replay"] == 1.0 for h in history)
  # One epoch on one micro-batch a step: the update's own forward gives the old log-probs over the
  # supports (`train.old_logprobs: auto`); once per shape bucket, supports included.
  assert all(h["micro_batches"] == 1 for h in history)
  step_traces.check("train_fused", reused=())
  assert not {"train", "prepare", "logprobs"} & set(step_traces.calls)
  assert history[0]["mis_k3_kl"] < 1e-9 and abs(history[0]["sampling_ratio_mean_replay"] - 1) < 1e-5
  assert all(np.isfinite(h["loss"]) for h in history)


def test_shipped_sampling_replay_config():
  from trainers.config import TrainConfig

  cfg = TrainConfig.from_yaml("configs/sampling_replay.yaml")
  assert cfg.rollout.sampling.sampling_replay == "on" and settings.sampling_replay_width(cfg.rollout) == 20
