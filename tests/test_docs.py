"""The documentation stays true: every `contract §N` the code cites is a section of
docs/contract.md, the site builds in MkDocs' strict mode (a broken link, anchor or docstring
fails), the README's and the quick start's example runs, and the commands and configs the
README and the guides show exist and validate."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

ROOT = pathlib.Path(__file__).resolve().parents[1]
CITED_IN = ("mis_jax", "trainers", "benchmarks", "examples", "tests", "notebooks", "configs", "docs")
SUFFIXES = (".py", ".ipynb", ".yaml", ".md")
EXTERNAL_FILES = {"examples/data_preprocess/gsm8k.py"}  # verl's script, run in a verl checkout
SECTION = re.compile(r"§(\d+(?:\.\d+)?)(?:\s*[–-]\s*(\d+(?:\.\d+)?))?")


def _files():
  for folder in CITED_IN:
    yield from (p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file())
  yield ROOT / "README.md"


def contract_sections() -> set[str]:
  text = (ROOT / "docs" / "contract.md").read_text()
  return set(re.findall(r"^#{2,3} §(\d+(?:\.\d+)?) .*\{#s\1\}$", text, re.M))


def test_every_contract_citation_names_a_section():
  sections = contract_sections()
  assert {"1", "4.1", "6", "6.1", "8.1", "8.2", "8.3", "11", "12.10"} <= sections
  cited, missing, stale = 0, [], []
  for path in _files():
    text = path.read_text(errors="replace")
    if path != pathlib.Path(__file__) and ("SPEC" + " §" in text or "SPEC" + ".md" in text):
      stale.append(str(path.relative_to(ROOT)))
    for m in SECTION.finditer(text):
      for number in filter(None, m.groups()):
        cited += 1
        if number not in sections:
          missing.append(f"{path.relative_to(ROOT)}: §{number}")
  assert stale == [], "the contract is docs/contract.md, cited as `contract §N`"
  assert missing == []
  assert cited > 100  # the code's citations were found, not skipped


def _fenced(text: str, lang: str) -> list[str]:
  return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def test_readme_example_is_the_library_quick_start_and_runs(monkeypatch, capsys):
  readme = _fenced((ROOT / "README.md").read_text(), "python")
  quick = _fenced((ROOT / "docs" / "index.md").read_text(), "python")
  guide = _fenced((ROOT / "docs" / "guides" / "library.md").read_text(), "python")
  assert readme[0] == quick[0] == guide[0]
  assert len(readme[0].splitlines()) <= 30
  monkeypatch.chdir(ROOT)
  import jax

  with jax.numpy_dtype_promotion("standard"):  # a user's default (Optax mixes floats and int32 counts)
    exec(compile(readme[0], "README.md", "exec"), {})
  out = capsys.readouterr().out
  assert re.match(r"loss -?\d+\.\d+  mis_k3_kl \d\.\d+e-\d+  kept 1\.00", out), out


def _commands():
  paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
  for path in paths:
    for block in _fenced(path.read_text(), "bash"):
      for line in block.replace("\\\n", " ").splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
          yield path.relative_to(ROOT), line


def test_the_make_targets_files_and_modules_the_docs_name_exist():
  targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
  seen = 0
  for path, line in _commands():
    try:
      words = shlex.split(line, comments=True)
    except ValueError:  # a line inside a multi-line quoted argument (curl's JSON body)
      assert not re.match(r"(make|python|\.venv|mis-jax)\b", line), f"{path}: {line}"
      continue
    if not words:
      continue
    if words[0] == "make":
      seen += 1
      assert set(words[1:]) <= targets, f"{path}: {line}"
    for word in words:
      if word in EXTERNAL_FILES:
        continue
      if re.fullmatch(r"(configs|examples|benchmarks|notebooks|data)/[\w./-]+\.(yaml|py|ipynb)", word):
        assert (ROOT / word).exists(), f"{path}: {line} names {word}"
    if "-m" in words and words[0].endswith("python"):
      import importlib.util

      module = words[words.index("-m") + 1]
      if module.startswith("sglang."):  # SGLang's own launcher, on a GPU machine (tests run sglang-jax)
        continue
      assert importlib.util.find_spec(module) is not None, f"{path}: {line}"
  assert seen >= 5


PLACEHOLDERS = ("my.yaml", "/models/", "runs/rec")  # your config, your checkpoint, an earlier command's output


def test_the_trainer_commands_and_the_readme_config_validate(tmp_path):
  """Each `mis-jax train` line of the README and the guides resolves (YAML < --set < flags, and
  every check the trainer runs before starting), except those naming a file of yours."""
  from trainers.app import load
  from trainers.commands import train as train_command
  from trainers import config as config_lib

  lines = [(path, line) for path, line in _commands() if "mis-jax train" in line]
  checked = 0
  for path, line in lines:
    if any(p in line for p in PLACEHOLDERS):
      continue
    argv = shlex.split(line.split("mis-jax train", 1)[1])
    if "--run-dir" not in argv and "--resume" not in argv:
      argv += ["--run-dir", str(tmp_path / f"run{checked}")]
    args = train_command.train_parser().parse_args(argv)
    try:
      load.resolve_train_config(args)
    except Exception as e:  # noqa: BLE001 - the message names the page and the line
      # A command for several processes: every check but the mesh's (the last) holds in this one
      # process, whose devices are a share of the run's.
      if not ((args.num_processes or 1) > 1 and "does not divide the" in str(e)):
        raise AssertionError(f"{path}: {line}: {e}") from e
    checked += 1
  assert checked >= 10
  readme = (ROOT / "README.md").read_text()
  config = yaml.safe_load(_fenced(readme, "yaml")[0])
  config_lib.TrainConfig.from_dict(config, source="README.md")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
  """The docs site, built once for this module in MkDocs' strict mode."""
  site_dir = tmp_path_factory.mktemp("docs") / "site"
  out = subprocess.run(
    [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return site_dir


def test_the_site_builds_strict(site):
  api = (site / "reference" / "api" / "index.html").read_text()
  for name in ("policy_loss", "compute_mis_weights", "MISConfig", "MISGRPOLearner", "sharded_policy_loss"):
    assert f'id="mis_jax.{name}"' in api or f'id="mis_jax.integrations.tunix.{name}"' in api, name
  contract = (site / "contract" / "index.html").read_text()
  assert 'id="s4.1"' in contract and 'id="s12.10"' in contract


# Pages whose formulas are written as math, and the fewest formulas each must show typeset.
MATH_PAGES = {"contract/": 250, "reference/loss/": 30, "guides/choosing/": 3, "guides/agents/": 10, "performance/": 5}


def _browser() -> str:
  """Debian's Chromium (`make browser` installs it); under CI=true its absence fails the test."""
  import shutil

  path = os.environ.get("MIS_JAX_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
  try:
    import playwright.sync_api  # noqa: F401 - the `docs` extra
  except ImportError:
    path = None
  if path is None:
    if os.environ.get("CI") == "true":
      pytest.fail("the docs' math check needs Chromium (make browser) and playwright (the docs extra)")
    pytest.skip("no Chromium or playwright here: `make browser`, pip install -e '.[docs]'")
  return path


@pytest.mark.browser
def test_the_formulas_are_typeset_in_a_browser_from_the_site_alone(site):
  """Each math page, served from 127.0.0.1 and opened in headless Chromium: MathJax (copied from
  the installed package by docs/mathjax_assets.py) typesets every formula arithmatex marked, with
  no TeX error and no delimiter left as text, and the browser requests nothing outside the site
  (a request elsewhere is refused and fails the test: the page must render offline)."""
  from docs_browser import serve_folder, typeset_report

  executable = _browser()
  with serve_folder(site) as base:
    reports, foreign = typeset_report(executable, base, list(MATH_PAGES))
  assert foreign == [], f"requests outside the site: {foreign[:5]}"
  for page, least in MATH_PAGES.items():
    r = reports[page]
    assert r["marked"] >= least and r["typeset"] == r["marked"], (page, r)
    assert r["invisible"] == [], (page, r["invisible"][:5])
    assert r["errors"] == [], (page, r["errors"][:5])
    assert r["leftover"] == [], (page, r["leftover"][:5])
    assert r["fonts"] > 0, (page, r)  # MathJax's TeX fonts loaded, from the site
