"""The three notebooks run headless (nbclient), on tiny models and a smoke run's results.

No wall-clock bound on the whole run: the default suite runs in parallel workers on a
shared 2-core machine, where the same notebooks take 25 s alone and 125 s under load.
The per-cell timeout below only catches a hung kernel.
"""

import os
import time

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = ("theory_explorer.ipynb", "speculative_step.ipynb", "results.ipynb")


def _run(name: str) -> float:
  path = os.path.join(ROOT, "notebooks", name)
  nb = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": os.path.dirname(path)}}).execute()
  return time.perf_counter() - start


@pytest.fixture
def notebook_env(smoke, monkeypatch):
  monkeypatch.setenv("SPECJAX_NOTEBOOK_TINY", "1")
  monkeypatch.setenv("SPECJAX_RESULTS", smoke[1])
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def test_notebooks_execute(notebook_env):
  seconds = {name: _run(name) for name in NOTEBOOKS}
  print("notebook seconds:", seconds)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_outputs_are_cleared_in_git(name):
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, f"{name} has outputs"
