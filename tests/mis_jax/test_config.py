"""Config loading, validation, flags and every bad-input error (contract §9)."""

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mis_jax
from helpers import pack, random_seqs

SEQS = random_seqs(np.random.default_rng(2), n_seqs=5)
BATCH, EXTRA, _ = pack(SEQS, row_len=16, num_rows=4)


def write(tmp_path, text, name="mis.yaml"):
  p = tmp_path / name
  p.write_text(text)
  return str(p)


def test_reference_yaml_values():
  cfg = mis_jax.MISConfig.from_yaml("configs/mis.yaml")
  assert cfg.use_tis is True and cfg.use_rs is True
  assert (cfg.tis_level, cfg.rs_level, cfg.tis_mode) == ("token", "token", "truncate")
  assert (cfg.tis_lower_bound, cfg.tis_upper_bound) == (0.5, 2.0)
  assert cfg.rs_lower_bound is None and cfg.rs_upper_bound is None
  assert cfg.rs_veto_threshold == 1e-4 and cfg.tis_batch_normalize
  assert (cfg.rs_lower, cfg.rs_upper) == (0.5, 2.0)


def test_defaults_and_yaml_1_1_float_string(tmp_path):
  cfg = mis_jax.MISConfig.from_yaml(write(tmp_path, "rs_veto_threshold: 1e-4\ntis_upper_bound: 4\n"))
  assert cfg.rs_veto_threshold == 1e-4 and isinstance(cfg.rs_veto_threshold, float)
  assert cfg.lower == 0.25 and cfg.rs_lower == 0.25 and cfg.rs_upper == 4.0
  assert not cfg.use_rs and cfg.tis_level == "token" and cfg.tis_mode == "truncate"
  assert mis_jax.MISConfig.from_yaml(write(tmp_path, "", "empty.yaml")) == mis_jax.MISConfig()


@pytest.mark.parametrize(
  "text,pattern",
  [
    ("tis_levl: token\n", r"key 'tis_levl'.*Did you mean 'tis_level'"),
    ("tis_mode: trunc\n", r"key 'tis_mode'.*'trunc'.*truncate, clip, mask, none"),
    ("tis_level: tokens\n", r"key 'tis_level'.*token, sequence, geometric"),
    ("use_rs: yes please\n", r"key 'use_rs' must be true or false"),
    ("tis_upper_bound: -1\n", r"key 'tis_upper_bound' must be > 0"),
    ("tis_upper_bound: 2\ntis_lower_bound: 3\n", r"key 'tis_lower_bound' must satisfy"),
    ("rs_lower_bound: 2\nrs_upper_bound: 1\n", r"key 'rs_lower_bound' must satisfy"),
    ("rs_veto_threshold: 2\n", r"key 'rs_veto_threshold' must be in \(0, 1\)"),
    ("tis_upper_bound: two\n", r"key 'tis_upper_bound' must be a number, got the string 'two'"),
    ("- 1\n- 2\n", r"must be a mapping"),
    ("tis_mode: [1\n", r"invalid YAML"),
  ],
)
def test_invalid_yaml_names_file_and_key(tmp_path, text, pattern):
  path = write(tmp_path, text)
  with pytest.raises(mis_jax.ConfigError, match=pattern) as e:
    mis_jax.MISConfig.from_yaml(path)
  assert path in str(e.value)


def test_missing_file():
  with pytest.raises(mis_jax.ConfigError, match="not found: nope.yaml"):
    mis_jax.MISConfig.from_yaml("nope.yaml")


@pytest.mark.parametrize(
  "kwargs,pattern",
  [
    (dict(loss_agg_mode="mean"), r"loss_agg_mode.*token-mean, seq-mean-token-mean, seq-mean-token-sum"),
    (dict(denominator="all"), r"denominator.*kept, original"),
    (dict(kl_type="k4"), r"kl_type.*k1, k2, k3, low_var_kl"),
    (dict(policy_loss={"name": "vanilla", "eps_clip_c": 1.0}), r"key 'policy_loss.eps_clip_c' must be > 1"),
    (dict(eps_clip=0.0), r"eps_clip"),
    (dict(tis_clip=2.0, tis_clip_low=3.0), r"tis_clip_low"),
    (dict(correction_fn="no_such_module.fn", use_tis=True), r"cannot import module 'no_such_module'"),
    (dict(correction_fn="mis_jax.nope", use_tis=True), r"has no attribute 'nope'"),
    (dict(correction_fn="mis_jax.policy_loss"), r"use_tis is false"),
  ],
)
def test_invalid_loss_config(kwargs, pattern):
  with pytest.raises(mis_jax.ConfigError, match=pattern):
    mis_jax.LossConfig(**kwargs)


def test_loss_config_is_hashable_and_static():
  a = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig.from_yaml("configs/mis.yaml"))
  b = mis_jax.LossConfig(use_tis=True, mis=mis_jax.MISConfig.from_yaml("configs/mis.yaml"))
  assert hash(a) == hash(b) and a == b
  assert a.algorithm == "decoupled_ppo" and a.correction == "mis" and a.needs_old_logprobs


def parse(argv):
  parser = mis_jax.config.add_loss_flags(argparse.ArgumentParser())
  return mis_jax.config.loss_config_from_args(parser.parse_args(argv))


def test_flags(tmp_path):
  cfg = parse(
    [
      "--use-tis",
      "--custom-config-path",
      "configs/mis.yaml",
      "--eps-clip",
      "0.1",
      "--loss-agg-mode",
      "token-mean",
      "--denominator",
      "original",
    ]
  )
  assert cfg.use_tis and cfg.mis.use_rs and cfg.eps_clip == 0.1 and cfg.loss_agg_mode == "token-mean"
  assert parse([]).algorithm == "ppo"
  assert parse(["--use-rollout-logprobs"]).algorithm == "bypass_ppo"
  assert parse(["--use-rollout-logprobs", "--use-tis"]).algorithm == "reinforce_is"
  # A file that sets use_tis: true turns correction on without the flag.
  assert parse(["--custom-config-path", "configs/mis.yaml"]).use_tis
  off = write(tmp_path, "use_tis: false\n")
  assert not parse(["--custom-config-path", off]).use_tis
  fn = parse(["--use-tis", "--custom-tis-function-path", "mis_jax.compute_mis_weights"])
  assert fn.correction == "custom"


def test_flag_file_contradiction_names_both(tmp_path):
  off = write(tmp_path, "use_tis: false\n")
  with pytest.raises(mis_jax.ConfigError, match=r"--use-tis contradicts use_tis: false in .*mis.yaml"):
    parse(["--use-tis", "--custom-config-path", off])
  with pytest.raises(mis_jax.ConfigError, match=r"contradicts use_tis: true in configs/mis.yaml"):
    mis_jax.LossConfig(use_tis=False, mis=mis_jax.MISConfig.from_yaml("configs/mis.yaml"))


def test_bad_flag_value_is_rejected_by_argparse(capsys):
  with pytest.raises(SystemExit):
    parse(["--loss-agg-mode", "mean"])
  assert "invalid choice" in capsys.readouterr().err


# --- bad arrays: clear Python errors before tracing ------------------------------------

CFG = mis_jax.LossConfig()


def test_shape_mismatch_names_the_field():
  with pytest.raises(ValueError, match=r"'advantages' has shape \(3, 16\) but 'segment_ids' has shape \(4, 16\)"):
    mis_jax.policy_loss(EXTRA["lp"], BATCH.replace(advantages=BATCH.advantages[:3]), CFG)
  with pytest.raises(ValueError, match=r"'logprobs' has shape"):
    mis_jax.policy_loss(EXTRA["lp"][:, :5], BATCH, CFG)
  with pytest.raises(ValueError, match=r"'rollout_logprobs' has shape"):
    mis_jax.compute_mis_weights(
      BATCH.old_logprobs,
      BATCH.rollout_logprobs[:2],
      BATCH.loss_mask,
      BATCH.segment_ids,
      mis_jax.MISConfig(),
      num_segments=5,
    )


def test_wrong_dtypes():
  with pytest.raises(TypeError, match=r"'segment_ids' must be an integer array, got dtype float32"):
    mis_jax.policy_loss(EXTRA["lp"], BATCH.replace(segment_ids=BATCH.segment_ids.astype(np.float32)), CFG)
  with pytest.raises(TypeError, match=r"'old_logprobs' must be a floating-point array, got dtype int32"):
    mis_jax.policy_loss(EXTRA["lp"], BATCH.replace(old_logprobs=np.zeros(BATCH.shape, np.int32)), CFG)
  with pytest.raises(TypeError, match=r"'logprobs' must be a floating-point array"):
    mis_jax.policy_loss(np.zeros(BATCH.shape, np.int32), BATCH, CFG)


def test_segment_ids_out_of_range():
  bad = np.array(BATCH.segment_ids)
  bad[0, 0] = 5
  with pytest.raises(ValueError, match=r"'segment_ids' holds 5, which is >= num_segments=5"):
    mis_jax.policy_loss(EXTRA["lp"], BATCH.replace(segment_ids=bad), CFG)
  bad[0, 0] = -3
  with pytest.raises(ValueError, match=r"only negative id allowed is -1"):
    mis_jax.policy_loss(EXTRA["lp"], BATCH.replace(segment_ids=bad), CFG)
  with pytest.raises(TypeError, match=r"num_segments must be a Python int"):
    mis_jax.compute_mis_weights(
      BATCH.old_logprobs,
      BATCH.rollout_logprobs,
      BATCH.loss_mask,
      BATCH.segment_ids,
      mis_jax.MISConfig(),
      num_segments=5.0,
    )


def test_missing_inputs_for_algorithm():
  with pytest.raises(ValueError, match=r"'ppo'.*needs batch.old_logprobs"):
    mis_jax.policy_loss(EXTRA["lp"], BATCH.replace(old_logprobs=None), CFG)
  with pytest.raises(ValueError, match=r"'bypass_ppo' needs batch.rollout_logprobs"):
    mis_jax.policy_loss(
      EXTRA["lp"], BATCH.replace(rollout_logprobs=None), mis_jax.LossConfig(use_rollout_logprobs=True)
    )
  with pytest.raises(ValueError, match=r"kl_coef=0.1 > 0 needs batch.ref_logprobs"):
    mis_jax.policy_loss(EXTRA["lp"], BATCH, mis_jax.LossConfig(kl_coef=0.1))
  with pytest.raises(ValueError, match=r"entropy_coef=0.1 > 0 needs the per-token entropy"):
    mis_jax.policy_loss(EXTRA["lp"], BATCH, mis_jax.LossConfig(entropy_coef=0.1))
  with pytest.raises(ValueError, match=r"must be given together"):
    mis_jax.policy_loss(
      EXTRA["lp"], BATCH, mis_jax.LossConfig(use_tis=True), correction=mis_jax.Correction(is_weights=BATCH.old_logprobs)
    )


def test_errors_raise_before_tracing_under_jit():
  traced = []

  @jax.jit
  def f(lp, batch):
    traced.append(1)
    return mis_jax.policy_loss(lp, batch, CFG)[0]

  with pytest.raises(ValueError, match="'advantages' has shape"):
    f(EXTRA["lp"], BATCH.replace(advantages=jnp.zeros((4, 3), jnp.float32)))


def test_non_array_input():
  with pytest.raises(TypeError, match=r"'loss_mask' must be an array, got str"):
    mis_jax.compute_mis_weights(
      BATCH.old_logprobs, BATCH.rollout_logprobs, "mask", BATCH.segment_ids, mis_jax.MISConfig(), num_segments=5
    )


PRESETS = sorted(os.listdir("configs/presets"))


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_validates_and_runs(name):
  path = os.path.join("configs/presets", name)
  first = open(path).readline()
  assert first.startswith("# ") and len(first) > 20, "each preset starts with a one-line comment"
  cfg = mis_jax.LossConfig.from_yaml(path)
  assert cfg == parse(["--preset", path])
  batch = BATCH.replace(
    old_logprobs=np.nan_to_num(BATCH.old_logprobs), rollout_logprobs=np.nan_to_num(BATCH.rollout_logprobs)
  )
  loss, metrics = mis_jax.policy_loss(EXTRA["lp"], batch, cfg)
  assert np.isfinite(float(loss)) and all(np.isfinite(float(v)) for v in metrics.values())
  expected = {"bypass": "bypass_ppo", "reinforce": "reinforce_is"}
  assert cfg.algorithm == next((v for k, v in expected.items() if name.startswith(k)), "decoupled_ppo")


def test_preset_with_overrides_and_bad_presets(tmp_path):
  cfg = parse(["--preset", "configs/presets/icepop.yaml", "--denominator", "original"])
  assert cfg.mis.tis_mode == "mask" and cfg.denominator == "original"
  bad = tmp_path / "bad.yaml"
  bad.write_text("use_tis: true\nmis: {tis_mode: masked}\n")
  with pytest.raises(mis_jax.ConfigError, match=r"bad.yaml: mis: key 'tis_mode'.*'masked'"):
    parse(["--preset", str(bad)])
  bad.write_text("use_tiss: true\n")
  with pytest.raises(mis_jax.ConfigError, match=r"unknown loss key 'use_tiss'.*Did you mean 'use_tis'"):
    mis_jax.LossConfig.from_yaml(str(bad))
  with pytest.raises(mis_jax.ConfigError, match="loss preset not found"):
    parse(["--preset", "nope.yaml"])


def test_suite_runs_with_strict_dtype_promotion():
  """tests/conftest.py: the library's tests promote no dtype implicitly (and rank neither)."""
  with pytest.raises(jax.dtypes.TypePromotionError):
    jnp.ones(2, jnp.float32) + jnp.ones(2, jnp.bfloat16)
  with pytest.raises(ValueError, match="jax_numpy_rank_promotion"):
    jnp.ones((2, 3)) + jnp.ones(3)
