"""The test matrices' helper (tests/matrix.py): which cases the default run keeps."""

import pytest

from matrix import cases, grid


def _heavy(param) -> bool:
  return any(m.name == "heavy" for m in param.marks)


def test_cases_not_kept_are_heavy_and_tuples_are_several_arguments():
  ps = cases([("a", 1), ("b", 2), ("c", 3)], keep=("a-1", "c-3"))
  assert [p.id for p in ps] == ["a-1", "b-2", "c-3"]
  assert [p.values for p in ps] == [("a", 1), ("b", 2), ("c", 3)]
  assert [_heavy(p) for p in ps] == [False, True, False]


def test_grid_names_the_product_and_reads_dict_axes():
  ps = grid({"x": [1], "y": [2]}, ["chain", "tree"], keep=("y-tree",))
  assert [p.id for p in ps] == ["x-chain", "x-tree", "y-chain", "y-tree"]
  assert ps[3].values == ([2], "tree") and not _heavy(ps[3]) and _heavy(ps[0])


@pytest.mark.parametrize("keep", [("nope",), ()])
def test_a_kept_id_that_is_no_case_or_keeping_none_is_refused(keep):
  with pytest.raises(ValueError, match="must keep some"):
    cases(["a", "b"], keep=keep)
  with pytest.raises(ValueError, match="distinct id"):
    cases(["a", "a"], keep=("a",))
