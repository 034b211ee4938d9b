"""The notebooks run top to bottom within a CI time budget, and are committed with real outputs.

Each notebook is executed from a copy with nbclient in a fresh kernel (the test interpreter's own
ipykernel, so the venv's packages), with ``notebooks/`` as the working directory, as a user
would run it. A cell that raises fails the test; outputs are never written back to the
committed file.
"""

from __future__ import annotations

import copy
import pathlib
import sys
import time

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

pytestmark = pytest.mark.integration  # starts servers, subprocesses or another venv: make test, not make test-fast

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT_S = 300
KERNEL_NAME = "python3"

# Wall-clock budget per notebook (kernel start included), about 4x its time on 2 CPU cores.
NOTEBOOKS = [
  pytest.param("01_rollout_correction_tour.ipynb", 180, id="01_rollout_correction_tour"),
  pytest.param(
    "02_compose_with_flax.ipynb", 240, id="02_compose_with_flax", marks=pytest.mark.slow
  ),  # ~65 s on 2 cores
  # The experiment's analysis, from the committed full run's results.json (the run itself:
  # `python -m trainers.experiments.mismatch`; its --quick mode is tests/trainers/experiments/test_experiment.py).
  pytest.param("03_mismatch_experiment.ipynb", 120, id="03_mismatch_experiment"),
]
ENV: dict[str, dict[str, str]] = {}  # per-notebook environment variables
NAMES = [p.values[0] for p in NOTEBOOKS]


def _read(name: str) -> nbformat.NotebookNode:
  return nbformat.read(NOTEBOOKS_DIR / name, as_version=4)


def _code_cells(nb):
  return [c for c in nb.cells if c.cell_type == "code"]


def test_kernel_is_this_interpreter():
  """The ``python3`` kernel resolves to the interpreter running the tests (no global Jupyter)."""
  spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
  # jupyter_client replaces a bare "python"/"python3" argv[0] with sys.executable at launch.
  assert spec.argv[0] in {"python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}", sys.executable}, (
    spec.argv
  )


@pytest.mark.parametrize("name", NAMES)
def test_committed_with_outputs(name):
  """Committed from one real top-to-bottom run: every code cell ran, in order, without error."""
  path = NOTEBOOKS_DIR / name
  assert path.stat().st_size < 1_000_000, f"{name} is {path.stat().st_size} bytes"
  nb = _read(name)
  nbformat.validate(nb)
  cells = _code_cells(nb)
  assert cells
  assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1)), (
    f"{name}: execution counts {[c.execution_count for c in cells]}: re-run top to bottom and save"
  )
  for i, cell in enumerate(cells):
    assert cell.outputs, f"{name}: code cell {i} has no output"
    for out in cell.outputs:
      assert out.output_type != "error", f"{name}: code cell {i} has an error output: {out.get('ename')}"
      assert not (out.output_type == "stream" and out.name == "stderr"), (
        f"{name}: code cell {i} wrote to stderr: {out.text[:200]}"
      )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name, budget_s", NOTEBOOKS)
def test_notebook_executes(name, budget_s, monkeypatch):
  for key, value in ENV.get(name, {}).items():
    monkeypatch.setenv(key, value)  # the kernel inherits the environment
  nb = copy.deepcopy(_read(name))
  for cell in _code_cells(nb):
    cell.outputs, cell.execution_count = [], None
  client = NotebookClient(
    nb,
    timeout=CELL_TIMEOUT_S,
    kernel_name=KERNEL_NAME,
    allow_errors=False,
    resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
  )
  start = time.perf_counter()
  client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
  elapsed = time.perf_counter() - start
  print(f"{name}: {elapsed:.1f} s")
  assert elapsed < budget_s, f"{name} took {elapsed:.0f} s, over its {budget_s} s budget"
  for i, cell in enumerate(_code_cells(nb)):
    assert not any(o.output_type == "error" for o in cell.outputs), f"{name}: code cell {i} errored"
