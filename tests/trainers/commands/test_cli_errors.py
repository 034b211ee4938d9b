"""Bad input to `mis-jax train` and `mis-jax serve`: for every config key (wrong type, out of
range, invalid choice), every flag/config contradiction, bad paths, URLs and ports — exit
status 2, one line naming the key, no traceback, nothing started or written. The docs'
config reference is generated from the typed sections, and `--help` shows every default."""

import os
import types
import typing

import pytest

from mis_jax.config import LOSS_FLAG_KEYS
from trainers import cli
from trainers.app import load
from trainers.commands import train as train_command
from trainers import config as config_lib
from trainers.models import init_checkpoint


def _bad_values(typ, meta) -> list[str]:
  """`--set` values (YAML text) that a key of this type and these constraints must reject."""
  base = typ.__args__[0] if isinstance(typ, types.UnionType) else typ
  if typing.get_origin(base) is tuple:  # a list of ints: each item is checked like an int key
    return ["abc", "[1, x]", "[1.5]", "{a: 1}"] + ([f"[{meta['ge'] - 1}]"] if meta.get("ge") is not None else [])
  wrong_type = {
    int: ["abc", "1.5", "true"],
    float: ["abc", "true", "[1]"],
    str: ["5", "[a, b]"],
    bool: ["maybe", "3"],
    dict: ["abc", "[1, 2]", "{1: x}"],
  }[base]
  out = list(wrong_type)
  if meta.get("choices"):
    out.append("not-a-choice")
  if meta.get("ge") is not None:
    out.append(str(meta["ge"] - 1))
  if meta.get("gt") is not None:
    out.append(str(meta["gt"]))
  if meta.get("le") is not None:
    out.append(str(meta["le"] + 1))
  return out


CASES = [
  (path, bad)
  for section, cls in config_lib.SECTIONS.items()
  for path, field, typ in config_lib.config_keys(cls, section)
  for bad in _bad_values(typ, field.metadata)
]
CASES += [("loss.algorithm", bad) for bad in ("5", "[a, b]", "not-a-choice", "decoupled")]
CASES += [("loss.policy_loss.name", bad) for bad in ("5", "[a, b]", "not-a-choice")]


def _train(tmp_path, *argv, config="configs/demo.yaml"):
  run_dir = tmp_path / "run"
  return cli.main(["train", "--config", str(config), "--run-dir", str(run_dir), *argv]), run_dir


def _assert_clean_error(capsys, code, run_dir, *needles):
  captured = capsys.readouterr()
  assert code == 2, captured
  lines = [line for line in captured.err.splitlines() if line.strip()]
  assert len(lines) == 1 and "Traceback" not in captured.err + captured.out, captured.err
  for needle in needles:
    assert needle in lines[0], (needle, lines[0])
  assert run_dir is None or not run_dir.exists(), "a bad config wrote into the run directory"


@pytest.mark.parametrize("key,bad", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_every_config_key_rejects_bad_values(key, bad, tmp_path, capsys):
  code, run_dir = _train(tmp_path, "--set", f"{key}={bad}")
  _assert_clean_error(capsys, code, run_dir, key, f"--set {key}={bad}:")  # names where it was written


def test_a_bad_value_in_the_file_names_the_file(tmp_path, capsys):
  config = tmp_path / "bad.yaml"
  config.write_text("train:\n  steps: abc\n")
  code, run_dir = _train(tmp_path, config=config)
  _assert_clean_error(capsys, code, run_dir, f"{config}: train.steps must be an integer")


def test_unknown_keys_suggest_the_closest(tmp_path, capsys):
  for assignment, needles in (
    ("train.stepz=3", ("train.stepz", "Did you mean 'steps'")),
    ("parallel.fdsp=2", ("parallel.fdsp", "Did you mean 'fsdp'")),
    ("rolout.n=2", ("rolout", "Did you mean 'rollout'")),
    ("seed.x=1", ("seed", "not a section")),
    ("train.steps=[", ("train.steps", "not valid YAML")),
  ):
    code, run_dir = _train(tmp_path, "--set", assignment)
    _assert_clean_error(capsys, code, run_dir, *needles)


KNOB_VALUES = {
  "eps_clip": ("0.3", "0.2"),
  "eps_clip_high": ("0.3", "0.28"),
  "eps_clip_c": ("3.0", "2.0"),
  "tis_clip": ("3.0", "2.5"),
  "tis_clip_low": ("0.1", "0.2"),
  "loss_agg_mode": ("token-mean", "seq-mean-token-sum"),
  "denominator": ("original", "kept"),
  "entropy_coef": ("0.01", "0.02"),
  "kl_coef": ("0.1", "0.2"),
  "kl_type": ("k1", "k2"),
  "policy_loss": ("gspo", "cispo"),
  "loss_scale_factor": ("64", "128"),
}
# The knobs whose key the trainer's loss section nests: `--set` writes them there.
NESTED_KNOBS = {"policy_loss": "loss.policy_loss.name", "eps_clip_c": "loss.policy_loss.eps_clip_c"}
CONTRADICTIONS = (
  [
    (
      ["--use-tis", "--set", "loss.algorithm=ppo", "--set", "loss.custom_config_path=null"],
      ("--use-tis", "loss.algorithm: ppo"),
    ),
    (["--use-rollout-logprobs"], ("--use-rollout-logprobs", "loss.algorithm: decoupled_ppo")),
    (
      ["--get-mismatch-metrics", "--set", "loss.get_mismatch_metrics=false"],
      ("--get-mismatch-metrics", "loss.get_mismatch_metrics"),
    ),
    (["--custom-config-path", "configs/presets/icepop.yaml"], ("--custom-config-path", "loss.custom_config_path")),
    (["--set", "loss.algorithm=ppo"], ("loss.algorithm: ppo", "configs/mis.yaml")),
    (["--set", "loss.algorithm=bypass_ppo"], ("loss.algorithm: bypass_ppo", "configs/mis.yaml")),
    (["--steps", "3", "--set", "train.steps=5"], ("--steps 3", "train.steps=5")),
  ]
  + [
    (["--" + k.replace("_", "-"), a, "--set", f"loss.{k}={b}"], (f"--{k.replace('_', '-')}", f"loss.{k}"))
    for k, (a, b) in KNOB_VALUES.items()
    if k not in NESTED_KNOBS
  ]
  + [
    (
      ["--policy-loss", "gspo", "--set", "loss.policy_loss.name=cispo"],
      ("--policy-loss gspo", "loss.policy_loss.name"),
    ),
    (
      ["--eps-clip-c", "3.0", "--set", "loss.policy_loss={name: vanilla, eps_clip_c: 2.0}"],
      ("--eps-clip-c 3.0", "loss.policy_loss.eps_clip_c: 2.0"),
    ),
  ]
)


@pytest.mark.parametrize("argv,needles", CONTRADICTIONS, ids=[" ".join(a) for a, _ in CONTRADICTIONS])
def test_a_flag_contradicting_the_config_names_both(argv, needles, tmp_path, capsys):
  code, run_dir = _train(tmp_path, *argv)
  _assert_clean_error(capsys, code, run_dir, *needles)


def test_run_dir_flag_against_an_explicit_set(tmp_path, capsys):
  code = cli.main(["train", "--run-dir", str(tmp_path / "a"), "--set", f"run_dir={tmp_path / 'b'}"])
  _assert_clean_error(capsys, code, tmp_path / "a", "--run-dir", "run_dir=")


def test_agreeing_flags_and_overrides_of_the_file_are_fine():
  args = train_command.train_parser().parse_args(
    ["--eps-clip", "0.2", "--steps", "7", "--set", "loss.eps_clip=0.2", "--set", "train.steps=7"]
  )
  cfg, _ = load.resolve_train_config(args)
  loss_cfg = cfg.loss
  assert cfg.train.steps == 7 and loss_cfg.eps_clip == 0.2
  cfg, _ = load.resolve_train_config(train_command.train_parser().parse_args(["--steps", "9"]))  # the file says 150
  assert cfg.train.steps == 9
  # YAML 1.1 reads 1e-3 as a string: still a number; an integral float is an int.
  cfg, _ = load.resolve_train_config(
    train_command.train_parser().parse_args(["--set", "train.learning_rate=1e-3", "--set", "train.row_len=128.0"])
  )
  assert cfg.train.learning_rate == 1e-3 and cfg.train.row_len == 128 and isinstance(cfg.train.row_len, int)


def test_paths_urls_and_cross_key_checks(tmp_path, capsys):
  (tmp_path / "not-hf").mkdir()
  (tmp_path / "file").write_text("x")
  (tmp_path / "task.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
  cases = [
    (["--set", f"model.path={tmp_path / 'missing'}"], ("model.path", "no such directory")),
    (["--set", f"model.path={tmp_path / 'not-hf'}"], ("model.path", "config.json")),
    (["--sglang-url", "not a url"], ("--sglang-url", "http(s)://HOST:PORT")),
    (["--sglang-url", "http://127.0.0.1:99999"], ("--sglang-url",)),
    (["--sglang-url", "ftp://127.0.0.1:30000"], ("--sglang-url",)),
    (["--set", "task.name=nope"], ("task", "nope")),
    (
      [
        "--set",
        "task.name=dataset",
        "--set",
        "task.num_digits=null",
        "--set",
        f"task.path={tmp_path / 'none.jsonl'}",
        "--set",
        "task.reward_fn=m:f",
      ],
      ("task", "none.jsonl"),
    ),
    (
      [
        "--set",
        "task.name=jsonl",
        "--set",
        "task.num_digits=null",
        "--set",
        f"task.path={tmp_path / 'task.jsonl'}",
        "--set",
        "task.reward_fn=no_such_module:f",
      ],
      ("task", "no_such_module"),
    ),
    (["--set", "rollout.sampling.max_new_tokens=100"], ("train.row_len (64)", "max_new_tokens (100)")),
    (["--set", "train.tokens_per_micro_batch=32"], ("train.tokens_per_micro_batch (32)", "train.row_len (64)")),
    (["--set", "checkpoint.every=5", "--set", "rollout.sync.sync_every=2"], ("checkpoint.every (5)", "sync_every (2)")),
    (["--set", "parallel.data=3"], ("parallel", "data=3", "does not divide")),
    (["--set", "parallel.tensor=8"], ("parallel.tensor=8", "num_attention_heads")),
    (
      ["--set", "rollout.placement.exact=true", "--set", "rollout.placement.engine=sglang-jax"],
      ("rollout.placement.exact needs rollout.placement.engine embedded", "sglang-jax"),
    ),
    (
      ["--set", "rollout.placement.exact=true", "--set", "rollout.placement.server_quantize=fp8"],
      ("rollout.placement.exact serves unquantised weights", "server_quantize 'fp8'"),
    ),
    (
      ["--set", "rollout.placement.exact=true", "--set", "train.old_logprobs=from_update"],
      ("train.old_logprobs: from_update with rollout.placement.exact",),
    ),
  ]
  for argv, needles in cases:
    code, run_dir = _train(tmp_path, *argv)
    _assert_clean_error(capsys, code, run_dir, *needles)
  code = cli.main(["train", "--run-dir", str(tmp_path / "file")])
  _assert_clean_error(capsys, code, None, "run_dir", "is a file")
  code = cli.main(["train", "--config", str(tmp_path / "missing.yaml")])
  _assert_clean_error(capsys, code, None, "missing.yaml")


def test_few_sequences_for_many_devices_is_a_warning():
  args = train_command.train_parser().parse_args(["--set", "rollout.prompts_per_step=1", "--set", "rollout.n=2"])
  with pytest.warns(UserWarning, match="2 sequences for 8 batch devices"):
    load.resolve_train_config(args)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = tmp_path_factory.mktemp("ckpt")
  init_checkpoint(path, preset="tiny-qwen3")
  return str(path)


def test_serve_rejects_bad_arguments_in_one_line(tmp_path, checkpoint, capsys):
  (tmp_path / "empty").mkdir()
  (tmp_path / "nocfg").mkdir()
  (tmp_path / "nocfg" / "model.safetensors").write_bytes(b"")
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "config.json").write_text('{"model_type": "mistral"}')
  (tmp_path / "bad" / "model.safetensors").write_bytes(b"")
  cases = [
    (["--model-path", str(tmp_path / "missing")], ("--model-path", "no such directory")),
    (["--model-path", str(tmp_path / "empty")], ("--model-path", "config.json")),
    (["--model-path", str(tmp_path / "nocfg")], ("--model-path", "config.json")),
    (["--model-path", str(tmp_path / "bad")], ("--model-path", "mistral")),
    (["--model-path", checkpoint, "--port", "99999"], ("--port 99999", "0..65535")),
    (["--model-path", checkpoint, "--port", "-1"], ("--port -1",)),
    (["--model-path", checkpoint, "--max-batch-size", "0"], ("--max-batch-size 0",)),
    (["--model-path", checkpoint, "--seed", "-2"], ("--seed -2",)),
    (["--model-path", checkpoint, "--sampling-mask-max-tokens", "0"], ("--sampling-mask-max-tokens 0",)),
    (
      ["--model-path", checkpoint, "--arithmetic", "batch_invariant", "--quantize", "int8"],
      ("--arithmetic batch_invariant serves unquantised weights", "--quantize int8"),
    ),
    (
      ["--engine", "sglang-jax", "--model-path", checkpoint, "--arithmetic", "batch_invariant"],
      ("--arithmetic is an option of the embedded engine",),
    ),
    # The cheap arguments come first: a bad port is reported as such whatever the model path.
    (["--model-path", str(tmp_path / "missing"), "--port", "99999"], ("--port 99999",)),
    (["--model-path", str(tmp_path / "empty"), "--max-batch-size", "0"], ("--max-batch-size 0",)),
  ]
  for argv, needles in cases:
    code = cli.main(["serve", *argv])
    _assert_clean_error(capsys, code, None, *needles)
  # Wrong types are argparse's: exit 2 with the option named, no traceback.
  for argv, needle in (
    (["--model-path", checkpoint, "--port", "abc"], "--port"),
    (["--model-path", checkpoint, "--dtype", "fp4"], "--dtype"),
    (["--model-path", checkpoint, "--layer-loop", "loop"], "--layer-loop"),
    (["--model-path", checkpoint, "--arithmetic", "exact"], "--arithmetic"),
    ([], "--model-path"),
  ):
    with pytest.raises(SystemExit) as exc:
      cli.main(["serve", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and "Traceback" not in err


def test_help_lists_every_option_and_config_key_with_its_default(capsys):
  raw = train_command.train_parser().format_help()
  text = " ".join(raw.split())  # argparse wraps lines
  for option in ("--config", "--sglang-url", "--run-dir", "--steps", "--set", "--eps-clip", "--kl-type"):
    assert option in text
  assert "(default: configs/demo.yaml)" in text
  assert "--eps-clip EPS_CLIP LossConfig.eps_clip (default: the config's)" in text
  for section, cls in config_lib.SECTIONS.items():
    for path, field, _ in config_lib.config_keys(cls, section):
      assert f"{path} (default: {'null' if field.default is None else field.default})" in text
  from trainers.serving.embedded.server import build_parser

  serve_help = " ".join(build_parser().format_help().split())
  for option, default in (
    ("--port", "30000"),
    ("--dtype", "bfloat16"),
    ("--max-batch-size", "64"),
    ("--seed", "0"),
    ("--layer-loop", "auto"),
  ):
    assert option in serve_help and f"(default: {default})" in serve_help


def test_docs_config_reference_is_generated_from_the_sections():
  page = open(os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "reference", "config.md")).read()
  assert config_lib.reference_table() in page
  assert set(KNOB_VALUES) == set(LOSS_FLAG_KEYS)
