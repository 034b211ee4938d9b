"""The layers the layout shows, bottom to top, each importing only from the layers below it
(`LAYERS`; docs/development.md opens with the same table, checked here): the library, then
models / tasks / serving, the config schema, the runtime, rollouts, agents, the learner, the
composition root, the commands (and `mis-jax` itself, `trainers.cli`), the experiments. A function-level import is an
import; no import cycle anywhere.
Within rollouts, only the colocated engines and the backend that composes them reach the serving
engines beyond their wire schema (`trainers.serving.protocol`)."""

import ast
import pathlib
import re

import pytest

from helpers import parse_source

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Bottom to top: each package and what it may import besides itself (the library, `mis_jax`, is
# open to all; it imports nothing of `trainers`).
LAYERS = {
  "mis_jax": (),
  "trainers.models": (),
  "trainers.tasks": (),
  "trainers.serving": ("trainers.models",),
  "trainers.config": ("trainers.models", "trainers.tasks"),
  "trainers.runtime": ("trainers.models", "trainers.config"),
  "trainers.rollout": ("trainers.models", "trainers.tasks", "trainers.serving", "trainers.config", "trainers.runtime"),
  "trainers.agents": ("trainers.models", "trainers.tasks", "trainers.config", "trainers.runtime", "trainers.rollout"),
  "trainers.learner": ("trainers.models", "trainers.config", "trainers.runtime", "trainers.rollout"),
  "trainers.app": (
    "trainers.models",
    "trainers.tasks",
    "trainers.serving",
    "trainers.config",
    "trainers.runtime",
    "trainers.rollout",
    "trainers.agents",
    "trainers.learner",
  ),
  "trainers.commands": (
    "trainers.models",
    "trainers.tasks",
    "trainers.serving",
    "trainers.config",
    "trainers.runtime",
    "trainers.rollout",
    "trainers.agents",
    "trainers.learner",
    "trainers.app",
  ),
  "trainers.cli": ("trainers.commands",),
  "trainers.experiments": (
    "trainers.models",
    "trainers.tasks",
    "trainers.serving",
    "trainers.config",
    "trainers.runtime",
    "trainers.rollout",
    "trainers.agents",
    "trainers.learner",
    "trainers.app",
    "trainers.commands",
  ),
}


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for package in ("mis_jax", "trainers"):
    for path in (ROOT / package).rglob("*.py"):
      name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
      out[name.removesuffix(".__init__")] = path
  return out


def _imports(name: str, path: pathlib.Path, known) -> set[str]:
  """The project modules `name` imports anywhere in its file (function level and TYPE_CHECKING
  included), as the closest known module of each imported name."""
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(parse_source(path.read_text())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
      # `from pkg import mod` imports `pkg.mod` (and runs `pkg`'s __init__, which is pkg's own business)
      names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    else:
      continue
    for n in names:
      while n and n not in known:
        n = n.rpartition(".")[0]
      if n and n not in (name, "trainers") and not (path.name == "__init__.py" and n.startswith(name + ".")):
        found.add(n)
  return found


def _package(module: str) -> str:
  if module.startswith("mis_jax"):
    return "mis_jax"
  return ".".join(module.split(".")[:2])


GRAPH = None


def _graph():
  global GRAPH
  if GRAPH is None:
    modules = _modules()
    GRAPH = {name: _imports(name, path, modules) for name, path in modules.items()}
  return GRAPH


def test_every_package_has_a_layer():
  packages = {_package(m) for m in _graph()} - {"trainers"}
  assert packages == set(LAYERS), packages ^ set(LAYERS)


def test_imports_point_down_only():
  offenders = {}
  for module, imported in _graph().items():
    own = _package(module)
    if own == "trainers":
      continue
    allowed = {own, "mis_jax", *LAYERS[own]}
    bad = sorted(n for n in imported if _package(n) not in allowed)
    if bad:
      offenders[module] = bad
  assert offenders == {}


def test_no_import_cycle():
  """Tarjan's strongly connected components of the module graph (every import counts)."""
  graph, index, low, stack, on, cycles = _graph(), {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  assert cycles == []


def test_a_command_imports_no_other_command():
  for module, imported in _graph().items():
    if module.startswith("trainers.commands."):
      assert not any(n.startswith("trainers.commands") and n != module for n in imported), module


def test_rollouts_reach_the_engines_through_their_wire_schema():
  """Only the colocated engines (hosted in the trainer's process) and the backend that composes
  them import the serving engines; the rest of rollouts speaks the wire schema."""
  reach = {
    m: sorted(n for n in imported if n.startswith("trainers.serving") and n != "trainers.serving.protocol")
    for m, imported in _graph().items()
    if m.startswith("trainers.rollout")
  }
  assert {m for m, names in reach.items() if names} == {"trainers.rollout.colocated", "trainers.rollout.backend"}
  assert {p.name for p in (ROOT / "trainers/serving").iterdir() if (p / "__init__.py").exists()} == {
    "embedded",
    "sglang_jax",
  }
  assert (ROOT / "trainers/serving/protocol.py").exists()


def test_the_map_in_development_md_is_the_code():
  """docs/development.md opens with the layers: its table lists each package, bottom to top, with
  what it may import, as `LAYERS` does."""
  text = (ROOT / "docs/development.md").read_text()
  rows = re.findall(r"^\| `([\w.]+)` \|([^|]*)\|", text, re.M)
  table = {pkg: tuple(re.findall(r"`([\w.]+)`", imports)) for pkg, imports in rows if pkg in LAYERS}
  assert list(table) == list(LAYERS)
  assert table == {pkg: tuple(sorted(allowed, key=list(LAYERS).index)) for pkg, allowed in LAYERS.items()}


def test_a_step_returns_a_value():
  """`Learner.step` runs the parts its plan was composed into and returns a `StepOutcome`: outside
  its constructor the learner sets on `self` only the state it owns (the policy, the optimiser
  state, the pass counter), never a result parked for others to read; and the passes return
  `Heads`, not a tuple whose length depends on flags."""
  tree = parse_source((ROOT / "trainers/learner/learner.py").read_text())
  (learner,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Learner"]
  (step,) = [n for n in learner.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
  assert ast.unparse(step.returns) == "StepOutcome"
  set_on_self = set()
  for method in (n for n in learner.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"):
    targets = [
      t
      for n in ast.walk(method)
      if isinstance(n, (ast.Assign, ast.AugAssign))
      for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
    ]
    set_on_self |= {
      e.attr
      for t in targets
      for e in ast.walk(t)
      if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self"
    }
  assert set_on_self == {"params", "opt_state", "num_old_logprob_passes"}, set_on_self
  step_module = parse_source((ROOT / "trainers/learner/step.py").read_text())
  (model_logprobs,) = [n for n in step_module.body if isinstance(n, ast.FunctionDef) and n.name == "model_logprobs"]
  assert ast.unparse(model_logprobs.returns) == "Heads"


def _hands_out_closures(fn) -> bool:
  """Whether `fn` is a closure factory: a function it defines is returned, registered by a decorator,
  or stored on an object (`x.attr = inner`, `x.attr = jit(inner)`), rather than only called or passed
  to a loop or a transform inside `fn`."""
  inner = {n.name for n in ast.walk(fn) if n is not fn and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
  if any(
    n.decorator_list for n in ast.walk(fn) if n is not fn and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
  ):
    return True

  def handed_out(value) -> bool:  # `inner`, a container of it, or a wrapper of it (jit, partial)
    if isinstance(value, ast.Name):
      return value.id in inner
    if isinstance(value, (ast.Tuple, ast.List)):
      return any(handed_out(v) for v in value.elts)
    if isinstance(value, ast.Dict):
      return any(handed_out(v) for v in value.values)
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in ("jit", "partial", "shard_map"):
      return any(handed_out(v) for v in value.args[:1])
    return False

  for node in ast.walk(fn):
    if isinstance(node, ast.Return) and node.value is not None and handed_out(node.value):
      return True
    if (
      isinstance(node, ast.Assign)
      and any(isinstance(t, ast.Attribute) for t in node.targets)
      and handed_out(node.value)
    ):
      return True
  return False


def test_the_step_reads_in_one_screen():
  """The learner's step is at most 25 lines and branches only on the step's own shape (which of the
  plan's two compositions: fused or separate), never on a plan option inside it; no function that
  builds closures (a factory) is over 40 lines anywhere."""
  tree = parse_source((ROOT / "trainers/learner/learner.py").read_text())
  (learner,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Learner"]
  (step,) = [n for n in learner.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
  assert step.end_lineno - step.lineno + 1 <= 25
  plan_reads = {
    ast.unparse(n) for n in ast.walk(step) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "self.plan"
  }
  assert plan_reads <= {"self.plan.fuses", "self.plan.old_logprobs"}, plan_reads
  long_factories = []
  for package in ("mis_jax", "trainers"):
    for path in (ROOT / package).rglob("*.py"):
      for fn in ast.walk(parse_source(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno + 1 > 40:
          if _hands_out_closures(fn):
            long_factories.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}")
  assert long_factories == []


def test_one_rollout_backend():
  """The rollout backend is composed in one place (`backend.build_rollout`): the Trainer imports
  no engine, client, weight-sync or colocated module; an in-process engine is an `Engine`, not a
  client: the one subclass of the SGLang client is the router's fleet (`fleet.RouterClient`, the
  same client whose engines are the router's workers), and it runs its parent's `__init__`; and
  no code in the trainer dispatches on a route string (`path == "/generate"`): an engine's routes
  are typed methods."""
  train_imports = _graph()["trainers.app.trainer"]
  composed = (
    "trainers.rollout.colocated",
    "trainers.rollout.engines",
    "trainers.rollout.client",
    "trainers.rollout.weight_sync",
    "trainers.rollout.fleet",
  )
  assert sorted(n for n in train_imports if n.startswith(composed)) == []
  assert "trainers.rollout.backend" in train_imports
  for path in (ROOT / "trainers").rglob("*.py"):
    tree = parse_source(path.read_text())
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
      if any(ast.unparse(b).endswith("SGLangClient") for b in cls.bases):
        assert (path.name, cls.name) == ("fleet.py", "RouterClient"), (path, cls.name)
        init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
        assert "super().__init__(" in ast.unparse(init), f"{cls.name} skips SGLangClient.__init__"
    if "trainers/rollout" in str(path) or "trainers/app" in str(path) or "trainers/learner" in str(path):
      routes = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, ast.Compare)
        for c in [n.left, *n.comparators]
        if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith("/")
      ]
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

  names = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for package in ("trainers", "mis_jax")
    for p in (ROOT / package).rglob("*.py")
    if "sglang_jax" not in p.parts or p.name == "__init__.py"
  )
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
    "print('\\n'.join(failed))\n"
  )
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "", out.stdout
