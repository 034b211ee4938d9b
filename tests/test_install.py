"""The lean library install: `import mis_jax` in a fresh interpreter loads none of the trainer's,
the server's or the dataset task's dependencies; the library's own imports are exactly its
declared dependencies; nothing outside `mis_jax/` imports a private `mis_jax._x` module."""

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

from helpers import parse_source

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOT_FOR_THE_LIBRARY = (
  "trainers",
  "flax",
  "optax",
  "orbax",
  "safetensors",
  "httpx",
  "msgspec",
  "tqdm",
  "tensorboardX",
  "fastapi",
  "uvicorn",
  "starlette",
  "tokenizers",
  "pyarrow",
  "transformers",
  "jinja2",
  "math_verify",
  "scipy",
  "matplotlib",
  "torch",
  "chex",
)


def test_import_mis_jax_loads_no_trainer_server_or_dataset_dependency():
  code = (
    "import sys, mis_jax; mis_jax.token_logprobs; "
    f"print(sorted(m for m in {NOT_FOR_THE_LIBRARY!r} if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
  assert out.stdout.strip() == "[]", out.stdout


def test_the_library_imports_exactly_its_declared_dependencies():
  imported = set()
  for path in (ROOT / "mis_jax").glob("*.py"):
    for node in ast.walk(parse_source(path.read_text())):
      if isinstance(node, ast.Import):
        imported |= {a.name.split(".")[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.level == 0:
        imported.add(node.module.split(".")[0])
  third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "mis_jax"}
  declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  names = {re.split(r"[<>=!~ \[]", d)[0].lower() for d in declared}
  distributions = {"yaml": "pyyaml"}  # import name -> distribution name, where they differ
  assert {distributions.get(m, m) for m in third_party} == names


def test_nothing_outside_the_library_imports_a_private_module():
  pattern = re.compile(r"^\s*(from\s+mis_jax\._\w+\s+import|import\s+mis_jax\._|from\s+mis_jax\s+import\s+_)", re.M)
  offenders = [
    str(p.relative_to(ROOT))
    for folder in ("trainers", "benchmarks", "notebooks")
    for p in (ROOT / folder).rglob("*")
    if p.suffix in (".py", ".ipynb") and pattern.search(p.read_text())
  ]
  assert offenders == []


def test_every_module_imports():
  """Every module of the trainer and the benchmarks imports (a stale import path fails here, not
  when someone runs a benchmark)."""
  import importlib

  names = []
  for folder in ("trainers", "benchmarks"):
    for path in (ROOT / folder).rglob("*.py"):
      parts = path.relative_to(ROOT).with_suffix("").parts
      names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  for name in sorted(names):
    importlib.import_module(name)
