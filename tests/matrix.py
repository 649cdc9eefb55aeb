"""The default run's share of a test matrix.

A capability tested over every drafter kind, tree or sampler (continuous batching, bfloat16,
greedy replay, hybrid lookup, ...) runs a few representative cases by default and the whole
matrix under ``-m heavy`` (docs/testing.md, "What the default run keeps"). Each method's own
losslessness tests are not matrices of this kind and stay in the default run.
"""

import itertools
from collections.abc import Sequence

import pytest


def cases(values: Sequence, keep: Sequence, ids: Sequence[str] | None = None) -> list:
  """``values`` as ``pytest.param``s (a tuple is one case of several arguments), every one
  whose id is not in ``keep`` marked ``heavy``. ``ids`` names the cases (default: ``str`` of
  each value, its parts joined by ``-``); ``keep`` lists ids, so a typo fails at collection."""
  values = list(values)
  if ids is None:
    ids = ["-".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in values]
  ids = list(ids)
  if len(ids) != len(values) or len(set(ids)) != len(ids):
    raise ValueError(f"one distinct id per case, got {ids}")
  unknown = sorted(set(keep) - set(ids))
  if unknown or not keep:
    raise ValueError(f"the default run must keep some of {ids}, got unknown {unknown}")
  return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i,
                       marks=() if i in keep else pytest.mark.heavy)
          for v, i in zip(values, ids)]


def grid(*axes: Sequence | dict, keep: Sequence[str]) -> list:
  """``cases`` over the product of ``axes`` (the parametrize names in the same order), each
  case's id its parts' ids joined by ``-``. An axis is a sequence of values named by ``str``
  or a dict from names to values."""
  axes = [dict(a) if isinstance(a, dict) else {str(v): v for v in a} for a in axes]
  combos = list(itertools.product(*(a.items() for a in axes)))
  return cases([tuple(v for _, v in c) for c in combos],
               keep=keep, ids=["-".join(name for name, _ in c) for c in combos])
