"""specjax.files: a file is replaced whole or not at all."""

import os

import numpy as np
import pytest

from specjax import files


def test_a_finished_block_replaces_the_file_and_leaves_no_temporary(tmp_path):
  path = str(tmp_path / "new" / "dir" / "out.json")  # parents created
  files.write_text(path, "first")
  files.write_text(path, "second")
  assert open(path).read() == "second"
  assert os.listdir(os.path.dirname(path)) == ["out.json"]


def test_a_block_that_raises_keeps_the_old_file_and_removes_its_temporary(tmp_path):
  path = str(tmp_path / "out.txt")
  files.write_text(path, "old")
  with pytest.raises(RuntimeError, match="cut off"):
    with files.atomic_path(path) as tmp:
      with open(tmp, "w") as f:
        f.write("half of the ne")
      raise RuntimeError("cut off")
  assert open(path).read() == "old"
  assert os.listdir(tmp_path) == ["out.txt"]


def test_the_suffix_a_writer_appends_is_renamed_with_the_file(tmp_path):
  path = str(tmp_path / "table.npz")
  with files.atomic_path(path, ".npz") as tmp:
    assert tmp.endswith(".npz") and tmp != path
    np.savez(tmp, x=np.arange(3))  # savez would append .npz to a name without it
  with np.load(path) as z:
    np.testing.assert_array_equal(z["x"], np.arange(3))
  assert os.listdir(tmp_path) == ["table.npz"]
