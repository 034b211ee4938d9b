"""The package boundaries the layout shows: serving never imports training, the trainer reaches
the server only through the wire schema (`trainers.serving.protocol`) — but for colocated
rollouts, which host an engine (ours or sglang-jax's) in the trainer's process — models and
tasks import neither, and the library imports no trainer code."""

import ast
import pathlib

import pytest

from helpers import parse_source

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imports(package: str) -> dict[str, set[str]]:
  out = {}
  for path in (ROOT / package).rglob("*.py"):
    names = set()
    for node in ast.walk(parse_source(path.read_text())):
      if isinstance(node, ast.Import):
        names |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    out[str(path.relative_to(ROOT))] = names
  return out


def _offenders(package, forbidden, allowed=()):
  return {f: sorted(n for n in names if n.startswith(forbidden) and n not in allowed)
          for f, names in _imports(package).items()
          if any(n.startswith(forbidden) and n not in allowed for n in names)}


def test_package_boundaries():
  assert _offenders("trainers/serving", ("trainers.training", "trainers.tasks", "trainers.cli")) == {}
  assert _offenders("trainers/models", ("trainers.training", "trainers.serving", "trainers.tasks")) == {}
  assert _offenders("trainers/tasks", ("trainers.training", "trainers.serving", "trainers.models")) == {}
  # The one exception: colocated rollouts host the engine in the trainer's process.
  assert _offenders("trainers/training", ("trainers.serving",),
                    allowed=("trainers.serving", "trainers.serving.protocol")) == {
      "trainers/training/colocated.py": [
          "trainers.serving.embedded.generation", "trainers.serving.embedded.generation.GenerationEngine",
          "trainers.serving.sglang_jax", "trainers.serving.sglang_jax.launcher", "trainers.serving.sglang_jax.routes",
          "trainers.serving.sglang_jax.routes.InProcessEngine"]}
  assert _offenders("mis_jax", ("trainers",)) == {}
  assert {p.name for p in (ROOT / "trainers").iterdir() if (p / "__init__.py").exists()} >= {
      "training", "serving", "models", "tasks"}
  # The two engines, one folder each; the wire schema they share with the client beside them.
  assert {p.name for p in (ROOT / "trainers/serving").iterdir() if (p / "__init__.py").exists()} == {
      "embedded", "sglang_jax"}
  assert (ROOT / "trainers/serving/protocol.py").exists()


def test_a_step_returns_a_value():
  """`Trainer.train_on` runs the plan it was given and returns a `StepOutcome`: on `self` it sets
  only the state the trainer owns (the policy, the optimiser state, the pass counter), never a
  result parked for others to read; and the passes return `Heads`, not a tuple whose length
  depends on flags."""
  tree = parse_source((ROOT / "trainers/training/train.py").read_text())
  (train_on,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_on"]
  assert ast.unparse(train_on.returns) == "StepOutcome"
  targets = [t for n in ast.walk(train_on) if isinstance(n, (ast.Assign, ast.AugAssign))
             for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
  set_on_self = {e.attr for t in targets for e in ast.walk(t)
                 if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"}
  assert set_on_self == {"params", "opt_state", "num_old_logprob_passes"}, set_on_self
  step = parse_source((ROOT / "trainers/training/step.py").read_text())
  (model_logprobs,) = [n for n in step.body if isinstance(n, ast.FunctionDef) and n.name == "model_logprobs"]
  assert ast.unparse(model_logprobs.returns) == "Heads"


def test_one_rollout_backend():
  """The rollout backend is composed in one place (`backend.build_rollout`): the Trainer imports
  no engine, client, weight-sync or colocated module; an in-process engine is an `Engine`, not a
  client: the one subclass of the SGLang client is the router's fleet (`fleet.RouterClient`, the
  same client whose engines are the router's workers), and it runs its parent's `__init__`; and
  no code in the trainer dispatches on a route string (`path == "/generate"`): an engine's routes
  are typed methods."""
  train_imports = _imports("trainers/training")["trainers/training/train.py"]
  composed = ("trainers.training.colocated", "trainers.training.engines", "trainers.training.sglang_client",
              "trainers.training.weight_sync", "trainers.training.sources.ServerRollouts",
              "trainers.training.sources.AsyncServerRollouts", "trainers.training.sources.RecordedRollouts",
              "trainers.training.servers.Servers")
  assert sorted(n for n in train_imports if n.startswith(composed)) == []
  assert "trainers.training.backend.build_rollout" in train_imports
  for path in (ROOT / "trainers").rglob("*.py"):
    tree = parse_source(path.read_text())
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
      if any(ast.unparse(b).endswith("SGLangClient") for b in cls.bases):
        assert (path.name, cls.name) == ("fleet.py", "RouterClient"), (path, cls.name)
        init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
        assert "super().__init__(" in ast.unparse(init), f"{cls.name} skips SGLangClient.__init__"
    if "trainers/training" in str(path):
      routes = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                for c in [n.left, *n.comparators] if isinstance(c, ast.Constant) and isinstance(c.value, str)
                and c.value.startswith("/")]
      assert routes == [], (path, routes)


@pytest.mark.slow  # ~14 s: every module imported from scratch
def test_every_module_imports_first():
  """Each module of `trainers` and `mis_jax` imports in an interpreter that has imported no other
  of them: an import cycle (a module taking a name from one still being initialised) breaks only
  the entry points that reach the cycle from its other end, so each module is tried first (one
  subprocess that forgets both packages between modules; a missing optional dependency is not
  ours to report)."""
  import subprocess
  import sys
  names = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for package in ("trainers", "mis_jax") for p in (ROOT / package).rglob("*.py")
                 if "sglang_jax" not in p.parts or p.name == "__init__.py")
  script = (
      "import importlib, sys, traceback\n"
      "failed = []\n"
      f"for name in {names!r}:\n"
      "  for m in [m for m in sys.modules if m.split('.')[0] in ('trainers', 'mis_jax')]:\n"
      "    del sys.modules[m]\n"
      "  try:\n"
      "    importlib.import_module(name)\n"
      "  except ModuleNotFoundError as e:  # an optional dependency (sgl_jax, tunix) is not ours\n"
      "    if (e.name or '').split('.')[0] in ('trainers', 'mis_jax'):\n"
      "      failed.append(f'{name}: {e}')\n"
      "  except ImportError as e:\n"
      "    failed.append(f'{name}: {e}')\n"
      "print('\\n'.join(failed))\n")
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "", out.stdout
