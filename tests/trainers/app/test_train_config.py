"""The trainer config's nested form: the rollout section's own sections, the loss section's
`algorithm` and tagged `policy_loss`, every former flat key an error naming its new place (in a
file and on the command line), `to_dict` read back by `from_dict`, and each enum defined once,
by the module that owns it."""

import glob

import pytest
import yaml

import mis_jax
from trainers import cli
from trainers.app import load
from trainers.commands import train as train_command
from trainers import config as config_lib
from trainers.config import TrainConfig

# Every former flat rollout key and where it lives now (the rollout section's keys before the split).
FLAT_ROLLOUT = {
  "temperature": "sampling",
  "top_p": "sampling",
  "top_k": "sampling",
  "min_p": "sampling",
  "max_new_tokens": "sampling",
  "sampling_replay": "sampling",
  "sampling_mask_max_tokens": "sampling",
  "routing_replay": "sampling",
  "record_routing": "sampling",
  "max_concurrency": "transport",
  "prompts_per_request": "transport",
  "timeout_s": "transport",
  "max_retries": "transport",
  "backoff_s": "transport",
  "health_attempts": "transport",
  "server_restart_timeout_s": "transport",
  "max_rejected_fraction": "transport",
  "colocated_devices": "placement",
  "engine": "placement",
  "server_dtype": "placement",
  "server_quantize": "placement",
  "sync_every": "sync",
  "max_staleness": "sync",
  "max_token_staleness": "sync",
  "pause_mode": "sync",
  "weight_dtype": "sync",
  "initial_sync": "sync",
  "cache_salt": "sync",
  "mismatch_check": "sync",
  "save_dir": "records",
  "load_dir": "records",
}


def _error(d) -> str:
  with pytest.raises(mis_jax.ConfigError) as e:
    TrainConfig.from_dict(d)
  return str(e.value)


def test_nested_rollout_sections_parse_into_typed_sections():
  cfg = TrainConfig.from_dict(
    {
      "rollout": {
        "prompts_per_step": 4,
        "n": 2,
        "sampling": {"temperature": 0.7, "top_k": 20, "routing_replay": "none"},
        "transport": {"timeout_s": 30, "max_retries": 0},
        "placement": {"mode": "colocated", "server_dtype": "float32"},
        "sync": {"sync_every": 2, "pause_mode": "retract"},
        "records": {"save_dir": "/tmp/records"},
      },
      "checkpoint": {"every": 4},
    }
  )
  r = cfg.rollout
  assert (r.prompts_per_step, r.n) == (4, 2)
  assert (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) == (0.7, 20, 1.0)
  assert (r.transport.timeout_s, r.transport.max_retries, r.transport.max_concurrency) == (30.0, 0, 4)
  assert (r.placement.mode, r.placement.server_dtype, r.placement.engine) == ("colocated", "float32", "embedded")
  assert (r.sync.sync_every, r.sync.pause_mode, r.sync.max_staleness) == (2, "retract", 0)
  assert (r.records.save_dir, r.records.load_dir) == ("/tmp/records", None)
  assert isinstance(r.transport.timeout_s, float)
  # The defaults are the sections' own; a null section is its defaults.
  assert TrainConfig.from_dict({"rollout": {"sampling": None}}).rollout == config_lib.RolloutSection()
  # Errors in a nested section name the whole path.
  assert "rollout.sampling.top_p must be <= 1" in _error({"rollout": {"sampling": {"top_p": 2}}})
  assert "unknown key 'rollout.sync.sync_evry'. Did you mean 'sync_every'?" in _error(
    {"rollout": {"sync": {"sync_evry": 2}}}
  )
  assert "rollout.sync must be a mapping" in _error({"rollout": {"sync": 3}})
  assert "unknown key 'rollout.temprature'. Did you mean 'sampling.temperature'?" in _error(
    {"rollout": {"temprature": 1.0}}
  )
  assert "unknown key 'rollout.nn'. Did you mean 'n'?" in _error({"rollout": {"nn": 1}})
  assert "checkpoint.every (5) must be a multiple of rollout.sync.sync_every (2)" in _error(
    {"rollout": {"sync": {"sync_every": 2}}, "checkpoint": {"every": 5}}
  )


def test_the_moved_keys_are_every_former_flat_key():
  assert {k.removeprefix("rollout.") for k in config_lib.MOVED} == set(FLAT_ROLLOUT) | {"placement"}
  # Every key of the rollout section, flat before, is in exactly one of its sections now.
  nested = {path for path, _, _ in config_lib.config_keys(config_lib.RolloutSection, "rollout")}
  assert nested == (
    {f"rollout.{s}.{k}" for k, s in FLAT_ROLLOUT.items()}
    | {"rollout.prompts_per_step", "rollout.n", "rollout.placement.mode"}
    | config_lib.NEVER_FLAT
  )


@pytest.mark.parametrize("key,section", sorted(FLAT_ROLLOUT.items()))
def test_each_flat_rollout_key_names_its_new_key(key, section, tmp_path, capsys):
  value = {"engine": "embedded", "pause_mode": "abort", "sampling_replay": "auto"}.get(key, 1)
  message = _error({"rollout": {key: value}})
  assert f"rollout.{key} moved to rollout.{section}.{key}" in message, message
  # In a file: the file and the new key; on the command line: the --set and the new key.
  config = tmp_path / "flat.yaml"
  config.write_text(yaml.safe_dump({"rollout": {key: value}}))
  assert cli.main(["train", "--config", str(config), "--run-dir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert f"{config}: rollout.{key} moved to rollout.{section}.{key}" in err, err
  assert cli.main(["train", "--run-dir", str(tmp_path / "run"), "--set", f"rollout.{key}={value}"]) == 2
  err = capsys.readouterr().err
  assert f"--set rollout.{key}={value}: rollout.{key} moved to rollout.{section}.{key}" in err, err
  assert not (tmp_path / "run").exists()


def test_the_former_placement_string_names_placement_mode(tmp_path, capsys):
  assert "rollout.placement moved to rollout.placement.mode" in _error({"rollout": {"placement": "colocated"}})
  assert cli.main(["train", "--run-dir", str(tmp_path / "run"), "--set", "rollout.placement=colocated"]) == 2
  err = capsys.readouterr().err
  assert "--set rollout.placement=colocated: rollout.placement moved to rollout.placement.mode" in err, err
  cfg, _ = load.resolve_train_config(
    train_command.train_parser().parse_args(["--set", "rollout.placement.mode=colocated"])
  )
  assert cfg.rollout.placement.mode == "colocated"


@pytest.mark.parametrize("algorithm,flags", sorted(mis_jax.config.ALGORITHMS.items()))
def test_algorithm_sets_the_two_booleans(algorithm, flags):
  loss = {"algorithm": algorithm}
  if algorithm == "reinforce_is":
    loss["denominator"] = "original"
  cfg = TrainConfig.from_dict({"loss": loss})
  assert (cfg.loss.use_rollout_logprobs, cfg.loss.use_tis) == flags
  assert cfg.loss.algorithm == algorithm
  # The same LossConfig as the library's flat constructor builds.
  assert cfg.loss == mis_jax.LossConfig(
    use_rollout_logprobs=flags[0],
    use_tis=flags[1],
    **({"denominator": "original"} if algorithm == "reinforce_is" else {}),
  )


def test_no_algorithm_leaves_use_tis_to_the_mis_config():
  assert TrainConfig.from_dict({}).loss.algorithm == "ppo"
  cfg = TrainConfig.from_dict({"loss": {"custom_config_path": "configs/mis.yaml"}})  # use_tis: true in the file
  assert cfg.loss.algorithm == "decoupled_ppo" and cfg.loss.mis is not None
  with_algorithm = TrainConfig.from_dict(
    {"loss": {"algorithm": "decoupled_ppo", "custom_config_path": "configs/mis.yaml"}}
  )
  assert with_algorithm.loss == cfg.loss
  assert "loss.algorithm: ppo (use_tis false) contradicts use_tis: true in configs/mis.yaml" in _error(
    {"loss": {"algorithm": "ppo", "custom_config_path": "configs/mis.yaml"}}
  )
  assert "loss.algorithm has invalid value 'decoupled'; allowed values: ppo, bypass_ppo" in _error(
    {"loss": {"algorithm": "decoupled"}}
  )


@pytest.mark.parametrize(
  "flags,algorithm",
  [
    ({"use_tis": True}, "decoupled_ppo"),
    ({"use_tis": False}, "ppo"),
    ({"use_rollout_logprobs": True, "use_tis": False}, "bypass_ppo"),
    ({"use_rollout_logprobs": True, "use_tis": True}, "reinforce_is"),
    ({"use_rollout_logprobs": False}, "ppo"),
  ],
)
def test_the_flat_booleans_name_the_algorithm_key(flags, algorithm):
  message = _error({"loss": flags})
  assert "moved to loss.algorithm (ppo | bypass_ppo | decoupled_ppo | reinforce_is)" in message, message
  if len(flags) == 2 or "use_tis" in flags:
    assert f"is algorithm: {algorithm}" in message, message


def test_policy_loss_is_a_tagged_section():
  cfg = TrainConfig.from_dict({"loss": {"policy_loss": {"name": "sapo", "tau_pos": 2.0}}})
  form = cfg.loss.policy_loss
  assert (form.name, form.tau_pos, form.tau_neg) == ("sapo", 2.0, 1.05)
  assert cfg.loss == mis_jax.LossConfig(policy_loss={"name": "sapo", "tau_pos": 2.0})
  cfg = TrainConfig.from_dict({"loss": {"policy_loss": {"name": "dro", "dro_beta": 0.1}}})
  assert (cfg.loss.policy_loss.name, cfg.loss.policy_loss.dro_beta) == ("dro", 0.1)
  assert TrainConfig.from_dict({"loss": {"policy_loss": {"name": "gspo"}}}).loss.policy_loss.name == "gspo"
  # The library's own checks still run on the form's config: dro needs its beta.
  assert "policy_loss 'dro' needs key 'dro_beta'" in _error({"loss": {"policy_loss": {"name": "dro"}}})


@pytest.mark.parametrize(
  "form,key,owners",
  [
    ("gspo", "tau_pos", "sapo"),
    ("vanilla", "dro_beta", "dro"),
    ("sapo", "clip_cov_ratio", "clip_cov"),
    ("clip_cov", "ppo_kl_coef", "kl_cov"),
    ("gspo", "eps_clip_c", "vanilla / dppo_tv / dppo_kl"),
  ],
)
def test_a_key_of_another_form_names_its_form(form, key, owners):
  message = _error({"loss": {"policy_loss": {"name": form, key: 1.5}}})
  assert f"loss.policy_loss.{key} is a key of policy_loss {owners}, not of {form}" in message, message


def test_the_flat_loss_form_names_the_tagged_one(tmp_path, capsys):
  assert "loss.policy_loss is a tagged section: write policy_loss: {name: gspo}" in _error(
    {"loss": {"policy_loss": "gspo"}}
  )
  assert "loss.policy_loss needs name: one of vanilla" in _error({"loss": {"policy_loss": {"tau_pos": 1}}})
  assert "unknown key 'loss.policy_loss.tau'. Did you mean 'tau_pos'?" in _error(
    {"loss": {"policy_loss": {"name": "sapo", "tau": 1}}}
  )
  for key in sorted({k for keys in mis_jax.forms.POLICY_LOSS_KEYS.values() for k in keys}):
    message = _error({"loss": {key: 1.5}})
    assert f"loss.{key} moved to loss.policy_loss.{key}, a key of policy_loss" in message, message
  assert cli.main(["train", "--run-dir", str(tmp_path / "run"), "--set", "loss.tau_pos=2"]) == 2
  err = capsys.readouterr().err
  assert "--set loss.tau_pos=2: loss.tau_pos moved to loss.policy_loss.tau_pos, a key of policy_loss sapo" in err
  assert cli.main(["train", "--run-dir", str(tmp_path / "run"), "--set", "loss.use_tis=true"]) == 2
  assert "--set loss.use_tis=true: loss.use_tis moved to loss.algorithm" in capsys.readouterr().err
  assert "unknown key 'loss.eps_clp'. Did you mean 'eps_clip'?" in _error({"loss": {"eps_clp": 0.2}})


def test_the_library_flags_still_apply_over_the_nested_section():
  args = train_command.train_parser().parse_args(["--policy-loss", "gspo", "--eps-clip", "0.3"])
  cfg, _ = load.resolve_train_config(args)  # configs/demo.yaml: algorithm decoupled_ppo, no policy_loss
  assert (cfg.loss.policy_loss.name, cfg.loss.eps_clip, cfg.loss.algorithm) == ("gspo", 0.3, "decoupled_ppo")
  args = train_command.train_parser().parse_args(["--use-tis", "--set", "loss.algorithm=decoupled_ppo"])
  assert load.resolve_train_config(args)[0].loss.algorithm == "decoupled_ppo"  # agreeing: fine


TRAINER_CONFIGS = sorted(
  p for p in glob.glob("configs/*.yaml") + glob.glob("configs/train/*.yaml") if p != "configs/mis.yaml"
)  # the MIS file is the library's, not a trainer config


@pytest.mark.parametrize("path", TRAINER_CONFIGS)
def test_to_dict_round_trips_every_config(path):
  cfg = TrainConfig.from_yaml(path)
  d = cfg.to_dict()
  assert TrainConfig.from_dict(d) == cfg.replace(source=None)
  assert TrainConfig.from_dict(yaml.safe_load(yaml.safe_dump(d))) == cfg.replace(source=None)  # as YAML too
  assert set(d["rollout"]) == {"prompts_per_step", "n", "sampling", "transport", "placement", "sync", "records"}
  assert d["loss"]["algorithm"] == cfg.loss.algorithm and d["loss"]["policy_loss"] == {
    "name": "vanilla",
    "eps_clip_c": None,
  }
  assert not {"use_tis", "use_rollout_logprobs", "tau_pos"} & set(d["loss"])


def test_to_dict_round_trips_forms_and_inline_mis():
  for loss in (
    {"algorithm": "bypass_ppo", "policy_loss": {"name": "clip_cov", "clip_cov_ratio": 0.01}},
    {
      "algorithm": "decoupled_ppo",
      "policy_loss": {"name": "sapo", "tau_neg": 2.0},
      "mis": {
        "tis_mode": "mask",
        "use_rs": True,
        "rs_upper_bound": "auto",
        "max_masked_fraction": 0.1,
        "rs_criteria": [{"metric": "k3", "agg": "seq_mean", "upper": "auto"}],
      },
    },
    {"algorithm": "reinforce_is", "denominator": "original", "policy_loss": {"name": "gpg"}},
  ):
    cfg = TrainConfig.from_dict({"loss": loss})
    d = cfg.to_dict()
    assert d["loss"]["policy_loss"]["name"] == loss["policy_loss"]["name"]
    assert TrainConfig.from_dict(d) == cfg


def test_reference_table_is_generated_and_current():
  table = config_lib.reference_table()
  page = open("docs/reference/config.md").read()
  assert table in page
  for path in (
    "rollout.sampling.temperature",
    "rollout.placement.mode",
    "rollout.sync.sync_every",
    "rollout.records.load_dir",
    "loss.algorithm",
    "loss.policy_loss.name",
    "loss.policy_loss.tau_pos",
    "loss.custom_config_path",
  ):
    assert f"| `{path}` |" in table, path
  for flat in ("rollout.temperature", "loss.use_tis", "loss.tau_pos"):
    assert f"| `{flat}` |" not in table


def test_each_enum_is_the_owning_modules():
  """The sections' choices are the implementations' own objects, not copies."""
  from trainers.models import hf_io
  from trainers.models.attention import ATTENTION_BACKENDS
  from trainers.models.decoder import LAYER_LOOPS, REMAT_POLICIES
  from trainers.models.moe import MOE_DISPATCH
  from trainers.models.presets import PRESETS
  from trainers.tasks.rewards import REWARDS

  choices = lambda cls, name: config_lib.fields_of(cls)[name][0].metadata["choices"]
  assert choices(config_lib.ModelSection, "attention") == ATTENTION_BACKENDS + ("auto",)  # auto: memory_plan
  assert choices(config_lib.ModelSection, "moe_dispatch") is MOE_DISPATCH
  assert choices(config_lib.ModelSection, "remat") == tuple(REMAT_POLICIES) + ("auto",)
  assert choices(config_lib.ModelSection, "layer_loop") == LAYER_LOOPS + ("auto",)  # auto: by depth
  assert choices(config_lib.ModelSection, "preset") == tuple(sorted(PRESETS))
  for cls, name in (
    (config_lib.ModelSection, "dtype"),
    (config_lib.PlacementSection, "server_dtype"),
    (config_lib.SyncSection, "weight_dtype"),
  ):
    assert choices(cls, name) == tuple(hf_io.DTYPES)
  assert config_lib.REWARDS == tuple(REWARDS)
  assert set(mis_jax.forms.POLICY_LOSS_KEYS) == set(mis_jax.forms.POLICY_LOSSES)
  assert not any(k in mis_jax.LossConfig.keys() for keys in mis_jax.forms.POLICY_LOSS_KEYS.values() for k in keys)
  # The config module's source holds no list of these names of its own.
  source = open(config_lib.__file__).read()
  for literal in (
    '"fused"',
    '"ragged_dot"',
    '"unrolled"',
    '"tiny-qwen3-moe"',
    '"exact_match"',
    '"dots"',
    '("float32", "bfloat16")',
  ):
    assert literal not in source, literal
