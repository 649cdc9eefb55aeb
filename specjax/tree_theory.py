"""Walltime theory of static token trees: the tree analogue of ``theory``'s chain formulas.

One tree step drafts D = ``topology.max_depth`` levels (one drafter forward per
depth) and runs the target once over the root and the N nodes (T = N + 1 new
tokens), then emits E[tokens per step] = 1 + sum of path probabilities
(``tree_builders.expected_tokens_per_step``). In units of one plain decode step
(a target forward over one token):

  speedup = E[tokens per step] / (verify_cost(N + 1) + draft cost),

  draft cost = D c for a per-depth cost c (the chain's γ c), or the sum of
  per-depth costs when the drafter's cost grows with the width of a level.

``verify_cost`` is ``theory``'s: a callable T -> relative time of a target
forward over T tokens (1 at T = 1), a mapping of measured points (wrapped in a
``theory.VerifyCostCurve``), or None for the paper's assumption that verifying
is as cheap as one step. For a chain of γ nodes with rank-0 rate α this is
exactly ``theory.calibrated_walltime_improvement(α, γ, c, verify_cost)``.

Worked example: the chain γ = 2 at α = 0.8 gives 2.44 tokens; with c = 0.05
and verify_cost(3) = 1.1 the speedup is 2.44 / (1.1 + 0.1) = 2.033.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Union

import numpy as np

from specjax import theory
from specjax.speculative.tree import TreeTopology
from specjax.speculative.tree_builders import (_check_count, _check_rank_accept,
                                               best_static_tree, expected_tokens_per_step)

__all__ = ["draft_cost", "optimal_static_tree", "tree_speedup", "verify_cost_at"]

DraftCost = Union[float, Sequence[float]]


def verify_cost_at(verify_cost: Optional[theory.VerifyCost], num_tokens: int) -> float:
  """Relative cost of a target forward over ``num_tokens`` new tokens (1.0 when None).

  Example::

    >>> verify_cost_at({1: 1.0, 8: 1.7}, 5)
    1.4
  """
  t = _check_count(num_tokens, "num_tokens", 1)
  if verify_cost is None:
    return 1.0
  return float(theory._verify_costs(verify_cost, np.array([t]))[0])


def draft_cost(draft_cost_per_depth: DraftCost, max_depth: int) -> float:
  """Drafter time for one step of depth ``max_depth``, in target decode steps.

  A number c is the cost of each of the D drafter forwards (total D c, the
  chain's γ c); a sequence gives each depth's cost (at least D entries; the
  first D are used).

  Example::

    >>> draft_cost(0.05, 4), draft_cost([0.05, 0.06, 0.08], 2)
    (0.2, 0.11)
  """
  d = _check_count(max_depth, "max_depth", 1)
  if isinstance(draft_cost_per_depth, numbers.Real) and not isinstance(draft_cost_per_depth, bool):
    c = float(draft_cost_per_depth)
    if not (np.isfinite(c) and c >= 0.0):
      raise ValueError(f"draft costs must be finite and >= 0, got {draft_cost_per_depth!r}")
    return d * c  # As theory's gamma * c, bit for bit.
  try:
    costs = np.asarray(draft_cost_per_depth, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"draft_cost_per_depth must be a number or a sequence of per-depth "
                     f"costs, got {draft_cost_per_depth!r}") from None
  if costs.ndim != 1 or costs.shape[0] < d:
    raise ValueError(f"draft_cost_per_depth needs a cost for each of the {d} depths, got "
                     f"shape {costs.shape}")
  costs = costs[:d]
  if not np.all(np.isfinite(costs) & (costs >= 0.0)):
    raise ValueError(f"draft costs must be finite and >= 0, got {draft_cost_per_depth!r}")
  return float(np.sum(costs))


def tree_speedup(topology: TreeTopology, rank_accept,
                 verify_cost: Optional[theory.VerifyCost] = None,
                 draft_cost_per_depth: DraftCost = 0.0) -> float:
  """Expected walltime improvement of one static tree over plain decoding.

  E[tokens per step] / (verify_cost(N + 1) + draft cost), see the module
  docstring. With a chain and a uniform rank-0 rate α it equals
  ``theory.calibrated_walltime_improvement(α, γ, c, verify_cost)`` (and, with
  ``verify_cost=None``, ``theory.walltime_improvement(α, γ, c)``).

  Args:
    topology: the tree (N nodes, depth D).
    rank_accept: [D', K] per-depth, per-rank acceptance (``tree_builders``).
    verify_cost: callable, mapping of measured points, ``theory.VerifyCostCurve``
      or None (verifying N + 1 tokens costs one step).
    draft_cost_per_depth: c, each drafter forward's cost relative to a target
      step, or a sequence of per-depth costs.

  Returns:
    The improvement factor (> 1: faster than plain decoding).

  Raises:
    ValueError: on a bad table, negative or non-finite draft cost, or a
      non-positive verify cost.

  Example::

    >>> round(tree_speedup(TreeTopology.chain(2), [[0.8], [0.8]], {1: 1.0, 3: 1.1}, 0.05), 4)
    2.0333
  """
  tokens = expected_tokens_per_step(topology, rank_accept)
  cost = (verify_cost_at(verify_cost, topology.num_nodes + 1)
          + draft_cost(draft_cost_per_depth, topology.max_depth))
  return tokens / cost


def optimal_static_tree(rank_accept, max_nodes: int,
                        verify_cost: Optional[theory.VerifyCost] = None,
                        draft_cost_per_depth: DraftCost = 0.0,
                        max_depth: Optional[int] = None) -> tuple[TreeTopology, float]:
  """The static tree of at most ``max_nodes`` nodes with the largest ``tree_speedup``.

  Tries ``best_static_tree(rank_accept, n, max_depth=d)`` for every n <= max_nodes
  and depth cap d <= min(max_depth, D, n), D = the table's depth. This is exact
  under the model: any tree of n nodes and depth d has at most the expected
  length of the best tree of n nodes with depth <= d, which costs the same to
  verify and no more to draft (per-depth costs >= 0); nodes deeper than D are
  worth 0 and could sit, for free, as extra children of the root instead.
  Ties go to fewer nodes, then to a smaller depth cap.

  Args:
    rank_accept: [D, K] table.
    max_nodes: the largest N considered, >= 1.
    verify_cost, draft_cost_per_depth: as in ``tree_speedup``.
    max_depth: optional cap on the depth.

  Returns:
    (topology, its speedup).

  Example::

    >>> t, s = optimal_static_tree([[0.6, 0.3], [0.5, 0.2]], 8, {1: 1.0, 4: 1.1, 8: 1.5}, 0.05)
    >>> t.parents, round(s, 4)      # (1 + 0.6 + 0.3 + 0.3) / (1.1 + 2 * 0.05)
    ((-1, -1, 0), 1.8333)
  """
  a = _check_rank_accept(rank_accept)
  n_max = _check_count(max_nodes, "max_nodes", 1)
  cap = a.shape[0]
  if max_depth is not None:
    cap = min(cap, _check_count(max_depth, "max_depth", 1))
  best, best_speedup = None, -np.inf
  for n in range(1, n_max + 1):
    verify = verify_cost_at(verify_cost, n + 1)
    for d in range(1, min(cap, n) + 1):
      topo = best_static_tree(a, n, max_depth=d)
      s = expected_tokens_per_step(topo, a) / (
          verify + draft_cost(draft_cost_per_depth, topo.max_depth))
      if s > best_speedup:
        best, best_speedup = topo, s
  return best, float(best_speedup)
