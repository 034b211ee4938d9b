"""A new policy-loss form is one file: this one. Its function, its config (one key of its own, with
its meaning and bounds) and one registration make it a choice of the library (`LossConfig`, the
loss flags) and of the trainer's YAML (`loss.policy_loss: {name: toy_scaled_pg, scale: ...}`); a
few steps of the tiny trainer then train with it (against the fake SGLang server), its loss equal to
the same formula in NumPy on the step's own log-probs, the weights moving every step; and its key is
checked with errors that name it. Nothing else in the library or the trainer names it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
from fake_sglang import FakeSGLang
from mis_jax.config import config_key
from mis_jax.forms import POLICY_LOSSES, FormInputs, FormLoss, PolicyLossConfig, register_policy_loss
from test_train import make_cfg, merged
from trainers import cli
from trainers.commands import train as train_command
from trainers.app import trainer as train_lib
from trainers.config import TrainConfig


# --- the form: its config, its function, its registration ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToyScaledConfig(PolicyLossConfig):
  """``toy_scaled_pg``'s keys."""

  scale: float = config_key(1.0, "toy_scaled_pg: the factor of the plain policy gradient -A·lp", gt=0, le=10)


def toy_scaled_pg(x: FormInputs, cfg: ToyScaledConfig) -> FormLoss:
  """``-scale · A · lp`` (no ratio, no clip), times the correction's weights where the algorithm has them;
  its own metric row: the share of kept tokens with a positive advantage."""
  return FormLoss(
    x.weighted(-cfg.scale * x.adv * x.lp),
    jnp.zeros_like(x.lp),
    {"toy_positive_fraction": (x.adv > 0).astype(jnp.float32)},
  )


@pytest.fixture(scope="module", autouse=True)
def toy_form():
  """Registered for this module's tests only (the registry is the process's: the config reference
  tests elsewhere list the built-in forms)."""
  register_policy_loss("toy_scaled_pg", ToyScaledConfig, metrics=("toy_positive_fraction",))(toy_scaled_pg)
  yield POLICY_LOSSES["toy_scaled_pg"]
  POLICY_LOSSES.unregister("toy_scaled_pg")


LOSS = {
  "algorithm": "bypass_ppo",
  "loss_agg_mode": "token-mean",
  "policy_loss": {"name": "toy_scaled_pg", "scale": 0.5},
}


def _numpy_loss(batch, lp, scale):
  """The toy's token-mean loss, written again in NumPy: ``Σ_t m_t (-scale · A_t · lp_t) / Σ_t m_t``."""
  m = np.asarray(batch.loss_mask, bool) & (np.asarray(batch.segment_ids) >= 0)
  m &= np.isfinite(np.asarray(batch.rollout_logprobs, np.float64))
  adv, lp = np.asarray(batch.advantages, np.float64), np.asarray(lp, np.float64)
  return float(np.sum(np.where(m, -scale * adv * lp, 0.0)) / max(m.sum(), 1))


@pytest.mark.integration  # a whole (tiny) training loop
def test_the_trainer_trains_with_a_form_registered_here(tmp_path):
  cfg = make_cfg(tmp_path, loss=LOSS, rollout={"sync": {"mismatch_check": False}}, train={"steps": 3, "ppo_epochs": 1})
  assert cfg.loss.policy_loss == ToyScaledConfig(scale=0.5) and cfg.loss.algorithm == "bypass_ppo"
  assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # the YAML round trip keeps the form and its key
  assert cfg.to_dict()["loss"]["policy_loss"] == {"name": "toy_scaled_pg", "scale": 0.5}
  seen = []
  with FakeSGLang() as fake:
    trainer = train_lib.Trainer(cfg, cfg.loss, urls=[fake.url])
    train = trainer.fns.train

    def observed(params, opt_state, inputs, batch, correction):
      """The step's own log-probs before its update, and whether the update moved the weights."""
      lp = trainer.fns.logprobs(params, inputs, batch.segment_ids).logprobs
      before = jax.tree.map(np.array, params)  # (the update donates them)
      out = train(params, opt_state, inputs, batch, correction)
      moved = max(
        float(np.max(np.abs(a - np.asarray(b)))) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(out[0]))
      )
      metrics = {k: float(v) for k, v in jax.device_get(out[2]).items()}
      seen.append((jax.device_get(batch), np.asarray(jax.device_get(lp)), metrics, moved))
      return out

    trainer.fns.train = observed
    history = trainer.run(progress=False, log=lambda *_: None)
  assert [h["step"] for h in history] == [1, 2, 3] and len(seen) == 3
  for (batch, lp, metrics, moved), h in zip(seen, history):
    np.testing.assert_allclose(metrics["loss"], _numpy_loss(batch, lp, 0.5), rtol=2e-5, atol=1e-6)
    assert metrics["pg_loss"] == metrics["loss"] and h["loss"] == metrics["loss"]
    assert h["grad_norm"] > 0 and moved > 0, (h["grad_norm"], moved)  # every step trains
    assert 0 <= h["toy_positive_fraction"] <= 1
    assert mis_jax.microbatch_reduction("toy_positive_fraction") == "kept"  # declared with the form


def test_the_forms_key_is_checked_where_it_is_written(tmp_path, capsys):
  assert train_command.train_parser().parse_args(["--policy-loss", "toy_scaled_pg"]).policy_loss == "toy_scaled_pg"
  bad = [
    ({"name": "toy_scaled_pg", "scale": 0}, "key 'policy_loss.scale' must be > 0, got 0.0"),
    ({"name": "toy_scaled_pg", "scale": 11}, "key 'policy_loss.scale' must be <= 10"),
    ({"name": "toy_scaled_pg", "scale": "big"}, "key 'policy_loss.scale' must be a number, got the string 'big'"),
    (
      {"name": "toy_scaled_pg", "scal": 2},
      "unknown key 'loss.policy_loss.scal'. Did you mean 'scale'? toy_scaled_pg's keys: scale, beside name",
    ),
    (
      {"name": "toy_scaled_pg", "tau_pos": 2},
      "loss.policy_loss.tau_pos is a key of policy_loss sapo, not of toy_scaled_pg (toy_scaled_pg's keys: scale)",
    ),
    ({"name": "sapo", "scale": 2}, "loss.policy_loss.scale is a key of policy_loss toy_scaled_pg, not of sapo"),
  ]
  for section, message in bad:
    with pytest.raises(mis_jax.ConfigError) as e:
      make_cfg(tmp_path, loss=merged(LOSS, {"policy_loss": section}))
    assert message in str(e.value), (message, str(e.value))
  code = cli.main(
    ["train", "--run-dir", str(tmp_path / "run"), "--set", "loss.policy_loss={name: toy_scaled_pg, scale: -1}"]
  )
  err = capsys.readouterr().err  # one line, naming the key (and the config the run started from)
  assert code == 2 and "key 'policy_loss.scale' must be > 0, got -1.0" in err and len(err.splitlines()) == 1, err
  assert not (tmp_path / "run").exists()
  with pytest.raises(mis_jax.ConfigError, match="key 'policy_loss.scale' must be > 0"):
    mis_jax.LossConfig(policy_loss={"name": "toy_scaled_pg", "scale": -1.0})
