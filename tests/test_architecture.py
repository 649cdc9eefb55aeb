"""The layers of docs/architecture.md, as the import contracts in .importlinter hold them.

``test_import_contracts_are_kept`` runs import-linter on the repository, so an
import that runs up a floor, into training from the runtime, or round a circle
fails the suite. The other tests copy the packages' Python files to a
temporary tree, plant one forbidden import in the copy and check that the same
contracts catch it: a contract file that could never fail would prove nothing.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("specjax", "pallas_kernels", "experiments", "benchmarks")
# The `lint-imports` console script, run by this interpreter (so it sees the same packages).
LINT_IMPORTS = [sys.executable, "-c",
                "from importlinter.cli import lint_imports_command; lint_imports_command()"]


def lint_imports(root: str) -> subprocess.CompletedProcess:
  """``lint-imports --config .importlinter`` in ``root`` (no cache: nothing written there)."""
  try:
    import importlinter  # pylint: disable=unused-import,import-outside-toplevel
  except ImportError:
    pytest.fail("import-linter is missing (pip install -r requirements.txt): the layers "
                "would go unchecked")
  return subprocess.run(LINT_IMPORTS + ["--config", os.path.join(ROOT, ".importlinter"),
                                        "--no-cache", "--no-logo"],
                        cwd=root, capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept():
  proc = lint_imports(ROOT)
  assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("module, planted, message", [
    # the model reaching for the drafts zoo, floors above it
    ("specjax/model.py", "import specjax.drafts",
     "specjax.model is not allowed to import specjax.drafts"),
    # a drafter reaching into training
    ("specjax/drafters/ngram.py", "from specjax.distill import vocab",
     "specjax.drafters is not allowed to import specjax.distill"),
    # a kernel reaching up into the library
    ("pallas_kernels/tree_attention/reference.py", "import specjax.attention",
     "pallas_kernels is not allowed to import specjax"),
    # the library reaching for a script
    ("specjax/generate.py", "import experiments.models",
     "specjax is not allowed to import experiments"),
    # a circle: a drafters' helper importing a drafter that imports it
    ("specjax/drafters/tree_draft.py", "import specjax.drafters.eagle",
     "No cycles are allowed in specjax.drafters."),
])
def test_a_planted_upward_import_breaks_the_contracts(tmp_path, module, planted, message):
  def not_python(directory, names):
    return [n for n in names if n == "__pycache__" or
            (not n.endswith(".py") and not os.path.isdir(os.path.join(directory, n)))]

  for package in PACKAGES:
    shutil.copytree(os.path.join(ROOT, package), tmp_path / package, ignore=not_python)
  path = tmp_path / module
  path.write_text(path.read_text() + f"\n{planted}\n")
  proc = lint_imports(str(tmp_path))
  assert proc.returncode != 0, proc.stdout + proc.stderr
  assert message in " ".join(proc.stdout.split()), proc.stdout
