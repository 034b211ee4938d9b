"""The library's choices as registries of small typed parts: the policy-loss forms and the advantage
estimators, each a registered function with a frozen config of its own keys (a tagged union). A new one
is one function, its config and a registration; a duplicate or unknown name is an error that names the
registered ones; every choice's keys are checked with errors naming the key; and the flat spellings of
the form keys that were LossConfig keys still work, with a DeprecationWarning, or fail naming the new one."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import mis_jax
from mis_jax import estimators, forms
from mis_jax.config import config_key, loss_config_from_args

BUILTIN_FORMS = {
  "vanilla": ("eps_clip_c",),
  "dppo_tv": ("eps_clip_c",),
  "dppo_kl": ("eps_clip_c",),
  "gspo": (),
  "sapo": ("tau_pos", "tau_neg"),
  "gpg": (),
  "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
  "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
  "geo_mean": (),
  "dro": ("dro_beta",),
  "cispo": (),
}
REQUIRED = {"dro": {"dro_beta": 0.1}}


def test_the_builtin_forms_are_registered_with_their_own_keys():
  assert dict(forms.POLICY_LOSS_KEYS) == BUILTIN_FORMS
  assert list(forms.POLICY_LOSSES) == list(BUILTIN_FORMS)  # registration order: the order errors list them
  for name, form in forms.POLICY_LOSSES.items():
    assert form.config.name == name and issubclass(form.config, forms.PolicyLossConfig)
    for field in dataclasses.fields(form.config):
      assert field.metadata["doc"], (name, field.name)  # each key says what it means
  assert {n for n, f in forms.POLICY_LOSSES.items() if f.ratio_free} == {"vanilla", "gpg"}
  assert {n for n, f in forms.POLICY_LOSSES.items() if f.select is not None} == {"clip_cov", "kl_cov"}
  # LossConfig keeps what every form shares: no form's key is one of its fields.
  assert not {k for keys in BUILTIN_FORMS.values() for k in keys} & set(mis_jax.LossConfig.keys())


@pytest.mark.parametrize("name", list(BUILTIN_FORMS))
def test_a_form_config_round_trips_and_stays_a_static_argument(name):
  cfg = mis_jax.LossConfig(policy_loss={"name": name, **REQUIRED.get(name, {})})
  assert cfg.policy_loss == forms.POLICY_LOSSES[name].config(**REQUIRED.get(name, {}))
  d = cfg.to_dict()
  assert d["policy_loss"] == {"name": name, **{k: getattr(cfg.policy_loss, k) for k in BUILTIN_FORMS[name]}}
  again = mis_jax.LossConfig.from_dict(yaml.safe_load(yaml.safe_dump(d)))
  assert again == cfg and hash(again) == hash(cfg)
  assert mis_jax.LossConfig(policy_loss=cfg.policy_loss) == mis_jax.LossConfig(policy_loss=cfg.policy_loss.to_dict())
  if not REQUIRED.get(name):
    assert mis_jax.LossConfig(policy_loss=name) == cfg  # a bare name: the form with its defaults


def test_unknown_form_names_and_bad_values_list_the_registered_forms():
  listed = ", ".join(BUILTIN_FORMS)
  with pytest.raises(
    mis_jax.ConfigError,
    match=f"key 'policy_loss' has invalid value 'sapoo'; allowed values: {listed}. Did you mean 'sapo'?",
  ):
    mis_jax.LossConfig(policy_loss="sapoo")
  with pytest.raises(
    mis_jax.ConfigError, match="key 'policy_loss.name' has invalid value 'ppo'; allowed values: vanilla"
  ):
    mis_jax.LossConfig(policy_loss={"name": "ppo"})
  with pytest.raises(mis_jax.ConfigError, match=f"key 'policy_loss' needs name: one of {listed}"):
    mis_jax.LossConfig(policy_loss={"tau_pos": 1.0})
  with pytest.raises(mis_jax.ConfigError, match="key 'policy_loss' must be a policy-loss form's name, a mapping"):
    mis_jax.LossConfig(policy_loss=3)

  @dataclasses.dataclass(frozen=True)
  class NotSapo(forms.SapoConfig):  # inherits sapo's name, is not its config
    pass

  with pytest.raises(mis_jax.ConfigError, match=r"a NotSapo is not the config of 'sapo' \(SapoConfig\)"):
    mis_jax.LossConfig(policy_loss=NotSapo())


BAD_KEYS = [  # (form, key, value, what the error says)
  ("sapo", "tau_pos", -1.0, "must be > 0, got -1.0"),
  ("sapo", "tau_neg", "warm", "must be a number, got the string"),
  ("vanilla", "eps_clip_c", 1.0, "must be > 1"),
  ("dppo_tv", "eps_clip_c", 0.5, "must be > 1"),
  ("dppo_kl", "eps_clip_c", True, "must be a number, got the boolean"),
  ("clip_cov", "clip_cov_ratio", 1.5, "must be <= 1"),
  ("clip_cov", "clip_cov_lb", 9.0, "must be below 'clip_cov_ub'"),
  ("kl_cov", "kl_cov_ratio", 0.0, "must be > 0"),
  ("kl_cov", "ppo_kl_coef", -0.1, "must be >= 0"),
  ("clip_cov", "clip_cov_ub", "wide", "must be a number"),
  ("dro", "dro_beta", 0.0, "must be > 0"),
]


@pytest.mark.parametrize("form,key,value,message", BAD_KEYS, ids=[f"{f}.{k}={v}" for f, k, v, _ in BAD_KEYS])
def test_each_forms_keys_are_checked_naming_the_key(form, key, value, message):
  with pytest.raises(mis_jax.ConfigError, match=f"key 'policy_loss.{key}'.*{message}"):
    mis_jax.LossConfig(policy_loss={"name": form, **REQUIRED.get(form, {}), key: value})


def test_every_form_key_has_a_bad_value_above():
  assert {(f, k) for f, k, _, _ in BAD_KEYS} == {(f, k) for f, keys in BUILTIN_FORMS.items() for k in keys}


def test_a_key_beside_the_wrong_form_names_the_forms_that_have_it():
  with pytest.raises(
    mis_jax.ConfigError,
    match=r"key 'policy_loss.tau_pos' is a key of policy_loss sapo, not of "
    r"gspo \(gspo has no keys of its own\)",
  ):
    mis_jax.LossConfig(policy_loss={"name": "gspo", "tau_pos": 1.0})
  with pytest.raises(
    mis_jax.ConfigError,
    match=r"key 'policy_loss.eps_clip_c' is a key of policy_loss vanilla / "
    r"dppo_tv / dppo_kl, not of sapo",
  ):
    mis_jax.LossConfig(policy_loss={"name": "sapo", "eps_clip_c": 3.0})
  with pytest.raises(
    mis_jax.ConfigError,
    match="unknown key 'policy_loss.tau'. Did you mean 'tau_pos'.*sapo's keys: tau_pos, tau_neg, beside name",
  ):
    mis_jax.LossConfig(policy_loss={"name": "sapo", "tau": 1.0})
  with pytest.raises(mis_jax.ConfigError, match="policy_loss 'dro' needs key 'dro_beta'"):
    mis_jax.LossConfig(policy_loss="dro")


# --- a form registered here: one function, its config, one registration -----------------------------------


@dataclasses.dataclass(frozen=True)
class HalfConfig(forms.PolicyLossConfig):
  """``half_pg``'s keys."""

  half: float = config_key(0.5, "the factor of -A·lp", gt=0, le=1)


def half_pg(x: forms.FormInputs, cfg: HalfConfig) -> forms.FormLoss:
  """``-half · A · lp``, weighted by the correction where the algorithm has weights."""
  return forms.FormLoss(
    x.weighted(-cfg.half * x.adv * x.lp), jnp.zeros_like(x.lp), {"half_positive": (x.adv > 0).astype(jnp.float32)}
  )


@pytest.fixture
def half_form():
  forms.register_policy_loss("half_pg", HalfConfig, metrics=("half_positive",))(half_pg)
  yield forms.POLICY_LOSSES["half_pg"]
  forms.POLICY_LOSSES.unregister("half_pg")


def test_a_registered_form_is_a_choice_everywhere(half_form):
  assert half_form.fn is half_pg and half_form.config is HalfConfig and HalfConfig.name == "half_pg"
  assert forms.POLICY_LOSS_KEYS["half_pg"] == ("half",)  # the derived views show it at once
  cfg = mis_jax.LossConfig(
    use_rollout_logprobs=True, policy_loss={"name": "half_pg", "half": 0.25}, loss_agg_mode="token-sum"
  )
  assert mis_jax.LossConfig.from_dict(cfg.to_dict()) == cfg
  from_flags = loss_config_from_args({"policy_loss": "half_pg"}, base={"use_rollout_logprobs": True})
  assert from_flags.policy_loss == HalfConfig()
  with pytest.raises(mis_jax.ConfigError, match="key 'policy_loss.half' must be <= 1"):
    mis_jax.LossConfig(policy_loss={"name": "half_pg", "half": 2.0})
  seg = np.array([[0, 0, 0, 1, 1, -1]], np.int32)
  mask = np.array([[0, 1, 1, 1, 1, 0]], bool)
  adv = np.array([[0.5, 0.5, 0.5, -2.0, -2.0, 0.0]], np.float32)
  lp = np.array([[-1.0, -0.5, -2.0, -0.1, -3.0, 0.0]], np.float32)
  batch = mis_jax.PackedBatch(seg, mask, adv, rollout_logprobs=lp - 0.1, num_segments=2)
  loss, metrics = jax.jit(lambda x: mis_jax.policy_loss(x, batch, cfg))(lp)
  np.testing.assert_allclose(float(loss), np.sum(np.where(mask, -0.25 * adv * lp, 0.0)), rtol=1e-6)
  assert float(metrics["half_positive"]) == 0.5 and mis_jax.microbatch_reduction("half_positive") == "kept"
  assert mis_jax.engine.MICROBATCH_REDUCTIONS["half_positive"] == "kept"  # declared with the form
  grad = jax.grad(lambda x: mis_jax.policy_loss(x, batch, cfg)[0])(lp)
  np.testing.assert_allclose(np.asarray(grad), np.where(mask, -0.25 * adv, 0.0), rtol=1e-6)


def test_an_unregistered_form_is_no_choice():
  forms.register_policy_loss("half_pg", HalfConfig)(half_pg)
  assert mis_jax.LossConfig(policy_loss="half_pg").policy_loss == HalfConfig()
  assert forms.POLICY_LOSSES.unregister("half_pg").fn is half_pg
  with pytest.raises(mis_jax.ConfigError, match="key 'policy_loss' has invalid value 'half_pg'"):
    mis_jax.LossConfig(policy_loss="half_pg")
  assert list(forms.POLICY_LOSSES) == list(BUILTIN_FORMS) and HalfConfig.name == ""
  forms.register_policy_loss("half_pg", HalfConfig, metrics=("half_positive", "pg_clipfrac_lower"))(half_pg)
  forms.POLICY_LOSSES.unregister("half_pg")  # its metric goes with it; one dppo_tv emits too stays
  assert "half_positive" not in mis_jax.engine.MICROBATCH_REDUCTIONS
  assert mis_jax.engine.MICROBATCH_REDUCTIONS["pg_clipfrac_lower"] == "kept"


def test_registering_a_taken_name_or_a_bad_config_is_an_error(half_form):
  with pytest.raises(
    ValueError, match=r"policy-loss form 'sapo' is registered already \(by mis_jax._policy_losses.sapo\)"
  ):
    forms.register_policy_loss("sapo")(half_pg)
  with pytest.raises(ValueError, match="'half_pg' is registered already"):
    forms.register_policy_loss("half_pg", HalfConfig)(half_pg)
  with pytest.raises(ValueError, match="HalfConfig is the config of 'half_pg' already"):
    forms.register_policy_loss("other_pg", HalfConfig)(half_pg)

  @dataclasses.dataclass(frozen=True)
  class Shadowing(forms.PolicyLossConfig):
    eps_clip: float = config_key(0.1, "a key LossConfig has")

  with pytest.raises(ValueError, match="key.s. eps_clip are taken by the config that names it"):
    forms.register_policy_loss("shadowing", Shadowing)(half_pg)

  @dataclasses.dataclass(frozen=True)
  class Foreign:  # not a PolicyLossConfig
    half: float = 0.5

  with pytest.raises(TypeError, match="must be a frozen dataclass subclassing PolicyLossConfig"):
    forms.register_policy_loss("foreign", Foreign)(half_pg)
  with pytest.raises(ValueError, match="must be an identifier"):
    forms.register_policy_loss("half-pg")(half_pg)
  assert "shadowing" not in forms.POLICY_LOSSES and "foreign" not in forms.POLICY_LOSSES


# --- the form keys that were LossConfig keys -------------------------------------------------------------


def test_flat_form_keys_map_onto_the_form_with_a_warning():
  with pytest.warns(
    DeprecationWarning,
    match=r"LossConfig's tau_pos moved into the form's config: write "
    r"policy_loss=\{'name': 'sapo', 'tau_pos': \.\.\.\}",
  ):
    old = mis_jax.LossConfig(policy_loss="sapo", tau_pos=2.0)
  assert old == mis_jax.LossConfig(policy_loss={"name": "sapo", "tau_pos": 2.0})
  with pytest.warns(DeprecationWarning, match="read LossConfig.policy_loss.tau_pos"):
    assert old.tau_pos == 2.0
  with pytest.warns(DeprecationWarning):
    assert mis_jax.LossConfig(eps_clip_c=3.0).policy_loss == forms.VanillaConfig(eps_clip_c=3.0)  # vanilla's key
  with pytest.warns(DeprecationWarning):
    assert dataclasses.replace(mis_jax.LossConfig(), policy_loss="dro", dro_beta=0.2).policy_loss.dro_beta == 0.2
  # Another form's key: at that form's default it meant nothing and still does; set, it names where it lives.
  with pytest.warns(DeprecationWarning):
    assert mis_jax.LossConfig(tau_pos=1.0, dro_beta=None) == mis_jax.LossConfig()
  with pytest.raises(
    mis_jax.ConfigError,
    match=r"key 'tau_pos' is a key of policy_loss sapo, not of vanilla: it "
    r"moved into its form's config, policy_loss=\{'name': 'sapo', "
    r"'tau_pos': 2.0\}",
  ):
    mis_jax.LossConfig(tau_pos=2.0)
  with pytest.raises(
    AttributeError, match="'tau_pos' is a key of policy_loss sapo, not of this config's form 'vanilla'"
  ):
    mis_jax.LossConfig().tau_pos
  with pytest.raises(AttributeError, match="has no attribute 'nope'"):
    mis_jax.LossConfig().nope


def test_a_config_written_for_the_flat_loss_config_still_loads(tmp_path):
  """What `LossConfig.to_dict()` wrote before the forms had configs (every form's keys, flat) reads back to
  the same config, with a DeprecationWarning; so does a preset file with a flat form key."""
  flat = {
    "use_tis": False,
    "use_rollout_logprobs": True,
    "proximal": "recompute",
    "get_mismatch_metrics": False,
    "eps_clip": 0.2,
    "eps_clip_high": None,
    "eps_clip_c": None,
    "loss_agg_mode": "seq-mean-token-mean",
    "loss_scale_factor": None,
    "policy_loss": "sapo",
    "tau_pos": 1.5,
    "tau_neg": 1.05,
    "clip_cov_ratio": 0.0002,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.0002,
    "ppo_kl_coef": 0.1,
    "dro_beta": None,
    "denominator": "kept",
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "mis": None,
    "correction_fn": None,
    "entropy_coef": 0.0,
    "kl_coef": 0.0,
    "kl_type": "k3",
    "sq_kl_coef": 0.0,
    "sq_kl_tokens": "trainable",
    "score_centering": False,
  }
  with pytest.warns(DeprecationWarning):
    cfg = mis_jax.LossConfig.from_dict(flat)
  assert cfg == mis_jax.LossConfig(use_rollout_logprobs=True, policy_loss={"name": "sapo", "tau_pos": 1.5})
  preset = tmp_path / "sapo.yaml"
  preset.write_text("use_rollout_logprobs: true\npolicy_loss: dro\ndro_beta: 0.3\n")
  with pytest.warns(DeprecationWarning):
    assert mis_jax.LossConfig.from_yaml(preset).policy_loss == forms.DroConfig(dro_beta=0.3)


def test_the_flags_set_the_forms_keys():
  """`--eps-clip-c` is the vanilla and DPPO forms' key: set in the form, no warning; a form without it is
  refused naming the forms that have it; a flag that contradicts the base's form names both."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert loss_config_from_args({"eps_clip_c": 3.0}).policy_loss == forms.VanillaConfig(eps_clip_c=3.0)
    cfg = loss_config_from_args({"policy_loss": "dppo_kl", "eps_clip_c": 4.0})
    assert cfg.policy_loss == forms.DppoKlConfig(eps_clip_c=4.0)
    cfg = loss_config_from_args({"eps_clip_c": 3.0}, base={"policy_loss": {"name": "vanilla", "eps_clip_c": 3.0}})
    assert cfg.policy_loss.eps_clip_c == 3.0
  with pytest.raises(
    mis_jax.ConfigError,
    match="key 'policy_loss.eps_clip_c' is a key of policy_loss vanilla / dppo_tv / dppo_kl, not of sapo",
  ):
    loss_config_from_args({"policy_loss": "sapo", "eps_clip_c": 3.0})
  with pytest.raises(mis_jax.ConfigError, match="--eps-clip-c 3.0 contradicts loss.policy_loss.eps_clip_c: 2.0"):
    loss_config_from_args({"eps_clip_c": 3.0}, base={"policy_loss": {"name": "vanilla", "eps_clip_c": 2.0}})
  with pytest.raises(mis_jax.ConfigError, match="--policy-loss gspo contradicts loss.policy_loss: cispo"):
    loss_config_from_args({"policy_loss": "gspo"}, base={"policy_loss": {"name": "cispo"}})
  with pytest.warns(DeprecationWarning):  # a base in the old flat spelling
    assert loss_config_from_args({}, base={"policy_loss": "sapo", "tau_pos": 2.0}).policy_loss.tau_pos == 2.0


# --- advantage estimators ----------------------------------------------------------------------------------

BUILTIN_ESTIMATORS = (
  "grpo",
  "dr_grpo",
  "rloo",
  "reinforce_plus_plus",
  "reinforce_plus_plus_baseline",
  "opo",
  "grpo_passk",
  "gpg",
  "gdpo",
  "optimal_token_baseline",
)


def test_the_builtin_estimators_are_registered():
  assert list(estimators.ESTIMATORS) == list(BUILTIN_ESTIMATORS)
  assert list(estimators.SEQUENCE_ESTIMATORS) == list(BUILTIN_ESTIMATORS[:-1])
  assert set(estimators.NEEDS_LENGTHS) == {"reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gdpo"}
  keys = {name: e.config.keys() for name, e in estimators.ESTIMATORS.items() if e.config.keys()}
  assert keys == {
    "grpo_passk": ("norm_by_std",),
    "gdpo": ("norm_by_std",),
    "optimal_token_baseline": ("handle_zero_tail", "epsilon"),
  }


@dataclasses.dataclass(frozen=True)
class ShrunkConfig(estimators.AdvantageConfig):
  """``shrunk``'s keys."""

  shrink: float = config_key(1.0, "added to the group size in the mean's divisor", ge=0)


def shrunk(x: estimators.EstimatorInputs, cfg: ShrunkConfig):
  """``R - Σ_g R / (n_g + shrink)``: a group mean shrunk toward 0."""
  return x.rewards - x.stats.sum(x.rewards) / (x.stats.count() + cfg.shrink)


@pytest.fixture
def shrunk_estimator():
  estimators.register_advantage_estimator("shrunk", ShrunkConfig)(shrunk)
  yield
  estimators.ESTIMATORS.unregister("shrunk")


def test_a_registered_estimator_is_taken_by_compute_advantages(shrunk_estimator):
  assert "shrunk" in estimators.SEQUENCE_ESTIMATORS
  rewards, groups = np.array([1.0, 0.0, 2.0, 3.0, 5.0], np.float32), np.array([0, 0, 0, 1, 1])
  got = mis_jax.compute_advantages(rewards, groups, num_groups=2, estimator={"name": "shrunk", "shrink": 2.0})
  want = rewards - np.array([3 / 5, 3 / 5, 3 / 5, 8 / 4, 8 / 4])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
  static = jax.jit(mis_jax.compute_advantages, static_argnames=("num_groups", "estimator"))  # a config is hashable
  got = static(rewards, groups, num_groups=2, estimator=ShrunkConfig(shrink=2.0))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
  with pytest.raises(mis_jax.ConfigError, match="key 'estimator.shrink' must be >= 0"):
    mis_jax.compute_advantages(rewards, groups, num_groups=2, estimator={"name": "shrunk", "shrink": -1})
  with pytest.raises(ValueError, match="advantage estimator 'grpo' is registered already"):
    estimators.register_advantage_estimator("grpo")(shrunk)


def test_estimator_keys_and_the_old_norm_by_std_keyword():
  rewards, groups = np.array([1.0, 0.0, 2.0, 3.0, 5.0], np.float32), np.array([0, 0, 0, 1, 1])
  run = lambda **kw: np.asarray(mis_jax.compute_advantages(rewards, groups, num_groups=2, **kw))
  with pytest.raises(mis_jax.ConfigError, match="estimator='grpoo' is invalid; allowed values: grpo, dr_grpo"):
    run(estimator="grpoo")
  with pytest.raises(mis_jax.ConfigError, match="key 'estimator.name' has invalid value 'grpoo'"):
    run(estimator={"name": "grpoo"})
  with pytest.raises(
    mis_jax.ConfigError, match="key 'estimator.norm_by_std' is a key of estimator grpo_passk / gdpo, not of grpo"
  ):
    run(estimator={"name": "grpo", "norm_by_std": False})
  with pytest.raises(mis_jax.ConfigError, match="key 'estimator.norm_by_std' must be true or false"):
    run(estimator={"name": "grpo_passk", "norm_by_std": "no"})
  new = run(estimator={"name": "grpo_passk", "norm_by_std": False})
  with pytest.warns(DeprecationWarning, match=r"pass estimator=\{'name': 'grpo_passk', 'norm_by_std': False\}"):
    np.testing.assert_array_equal(run(estimator="grpo_passk", norm_by_std=False), new)
  with pytest.raises(
    mis_jax.ConfigError, match="norm_by_std=False is a key of estimator grpo_passk / gdpo, not of grpo"
  ):
    run(estimator="grpo", norm_by_std=False)
  with pytest.warns(DeprecationWarning, match="norm_by_std"):
    np.testing.assert_array_equal(run(estimator="grpo", norm_by_std=True), run(estimator="grpo"))
