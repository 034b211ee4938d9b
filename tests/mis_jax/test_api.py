"""The public surface: the top level holds what a user composes (at most 35 names); the tables, the
registries, the config plumbing and the pass engine live in public submodules; every name that moved
still resolves at the top level for one release, to the same object, with a DeprecationWarning naming
its new place; and the library's modules import downward only."""

import ast
import importlib
import pathlib
import warnings

import pytest

import mis_jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The top-level names of the last release that moved, and where they live now.
MOVED = {
  "mis_jax.config": (
    "AGGREGATIONS",
    "ALGORITHMS",
    "DENOMINATORS",
    "DIVERGENCES",
    "KL_TYPES",
    "LEVELS",
    "LOSS_AGG_MODES",
    "TIS_MODES",
    "PRESETS",
    "PRESET_NAMES",
    "Preset",
    "LOSS_FLAG_KEYS",
    "add_loss_flags",
    "config_fields",
    "config_key",
    "load_yaml",
    "loss_config_from_args",
    "parse_config_value",
    "same_value",
  ),
  "mis_jax.engine": (
    "PassOptions",
    "pass_options",
    "Segments",
    "MaskStats",
    "LOG_BOUND",
    "LM_HEAD_LAYOUTS",
    "MICROBATCH_REDUCTIONS",
  ),
  "mis_jax.forms": ("POLICY_LOSSES", "POLICY_LOSS_KEYS"),
  "mis_jax.estimators": ("ESTIMATORS", "SEQUENCE_ESTIMATORS"),
}


def test_the_top_level_is_what_a_user_composes():
  assert len(mis_jax.__all__) <= 35 and len(set(mis_jax.__all__)) == len(mis_jax.__all__)
  for name in mis_jax.__all__:
    assert getattr(mis_jax, name) is not None, name
  assert {
    "LossConfig",
    "MISConfig",
    "ConfigError",
    "policy_loss",
    "prepare_step",
    "compute_advantages",
    "PackedBatch",
    "token_logprobs",
    "preset",
  } <= set(mis_jax.__all__)
  for module in ("config", "engine", "forms", "estimators"):
    sub = getattr(mis_jax, module)
    for name in sub.__all__:
      assert getattr(sub, name) is not None, (module, name)
      assert name not in mis_jax.__all__, name  # one public place each


@pytest.mark.parametrize("module,name", [(m, n) for m, names in MOVED.items() for n in names])
def test_a_moved_name_resolves_with_a_warning_naming_its_new_place(module, name):
  assert name not in mis_jax.__all__
  new = getattr(importlib.import_module(module), name)
  with pytest.warns(DeprecationWarning, match=f"mis_jax.{name} moved to {module}.{name}"):
    assert getattr(mis_jax, name) is new
  with pytest.warns(DeprecationWarning):
    exec(f"from mis_jax import {name}", {})


def test_an_unknown_name_is_an_attribute_error_and_current_names_do_not_warn():
  with pytest.raises(AttributeError, match="module 'mis_jax' has no attribute 'nope'"):
    mis_jax.nope
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for name in mis_jax.__all__:
      getattr(mis_jax, name)
    for module in ("config", "engine", "estimators", "forms"):
      importlib.import_module(f"mis_jax.{module}")


def test_the_old_tables_read_as_before():
  """A moved table is the registry (a mapping of names) or the tuple it was: iterating gives the same
  names, in the same order; the algorithms' rows compare equal to the flag pairs."""
  assert tuple(mis_jax.forms.POLICY_LOSSES) == (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
  )
  assert "sapo" in mis_jax.forms.POLICY_LOSSES and mis_jax.forms.POLICY_LOSS_KEYS["sapo"] == ("tau_pos", "tau_neg")
  assert tuple(mis_jax.estimators.ESTIMATORS)[-1] == "optimal_token_baseline"
  assert "optimal_token_baseline" not in mis_jax.estimators.SEQUENCE_ESTIMATORS
  assert mis_jax.config.ALGORITHMS == {
    "ppo": (False, False),
    "bypass_ppo": (True, False),
    "decoupled_ppo": (False, True),
    "reinforce_is": (True, True),
  }
  assert [row.anchor for row in mis_jax.config.ALGORITHMS.values()] == ["old", "rollout", "old", "rollout"]
  assert mis_jax.config.LEVELS == ("token", "sequence", "geometric")


def _imports_of(path: pathlib.Path) -> set[str]:
  """The mis_jax modules a module imports, function-level imports and `if TYPE_CHECKING:` ones included."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mis_jax") and node.level == 0:
      out.add(node.module)
      out |= {f"{node.module}.{a.name}" for a in node.names if node.module == "mis_jax"}
    elif isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("mis_jax")}
  return {m for m in out if m != "mis_jax"}


def test_the_library_has_no_import_cycle():
  """Imports point down only: from the vocabulary tables to the configs, the formulas that consume them
  and the public submodules; a function-level import counts (the layers of issue 63)."""
  modules = {p.stem: p for p in (ROOT / "mis_jax").glob("*.py")}
  graph = {
    f"mis_jax.{name}": {m for m in _imports_of(p) if m.removeprefix("mis_jax.") in modules}
    for name, p in modules.items()
    if name != "__init__"
  }
  done, active = set(), []

  def visit(node):
    assert node not in active, f"import cycle: {' -> '.join(active[active.index(node) :] + [node])}"
    if node in done:
      return
    active.append(node)
    for dep in graph.get(node, ()):
      visit(dep)
    active.pop()
    done.add(node)

  for node in graph:
    visit(node)
  # The layers: the configs import no formula that consumes them, the vocabulary no config.
  assert not {
    m
    for m in graph["mis_jax._config"]
    if m.removeprefix("mis_jax.")
    in ("_correction", "_losses", "_policy_losses", "_weights", "_stages", "_metrics", "_flags")
  }
  assert graph["mis_jax._vocabulary"] == {"mis_jax._correction"}
  assert graph["mis_jax._presets"] == {"mis_jax._keys"} and graph["mis_jax._registry"] == {"mis_jax._keys"}
