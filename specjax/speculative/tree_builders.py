"""Static token trees from measured per-depth, per-rank acceptance (Sequoia / Medusa style).

The acceptance model. ``rank_accept`` is a [D, K] table: ``rank_accept[d - 1, r]``
is the probability that the node of sibling rank r at depth d is the accepted
child *given that its parent was accepted* (the root always is). Ranks >= K and
depths > D count as probability 0. Under the independence model a node is on
the accepted path with its *path probability*, the product of
``rank_accept[depth - 1, rank]`` over the node and its ancestors, so

  E[accepted draft tokens] = sum over nodes of path probability,
  E[tokens per step]       = that + 1  (the bonus / correction token, as in
                             ``theory.expected_tokens_per_step`` and ``metrics``).

Why this is well defined for a tree: with the recursive rejection rule
(``tree_acceptance``) the children of an accepted node are tried in rank order,
so whether rank r is accepted does not depend on ranks > r existing, nor on
what hangs below any sibling. A table measured on one tree therefore prices
every other tree with the same per-(depth, rank) rates. The rows need not sum
to 1: rates pooled over parents with different numbers of children (see
``estimate_rank_accept``) can exceed 1 in total, and the model takes them as
given.

A chain of γ nodes with ``rank_accept[:, 0] = α`` gives
E[tokens] = 1 + α + ... + α^γ, the paper's (1 - α^(γ+1)) / (1 - α).

Pure numpy, trace-time only: the output is a ``TreeTopology``.
"""

from __future__ import annotations

import heapq
import numbers
from typing import Optional, Sequence

import numpy as np

from specjax.speculative.tree import TreeTopology

__all__ = [
    "best_static_tree",
    "estimate_rank_accept",
    "expected_accepted_length",
    "expected_tokens_per_step",
    "full_tree",
    "full_tree_counts",
    "path_probabilities",
    "rank_accept_counts",
]


# --- validation --------------------------------------------------------------------


def _check_rank_accept(rank_accept) -> np.ndarray:
  """A [D, K] float64 table with every entry in [0, 1] (NaN rejected)."""
  try:
    a = np.asarray(rank_accept, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError(f"rank_accept must be a [D, K] array of probabilities, got {rank_accept!r}"
                     ) from None
  if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
    raise ValueError(f"rank_accept must be a non-empty [D, K] array (depth, sibling rank), "
                     f"got shape {a.shape}")
  if not np.all((a >= 0.0) & (a <= 1.0)):  # Also rejects NaN.
    bad = np.argwhere(~((a >= 0.0) & (a <= 1.0)))[0]
    raise ValueError(f"rank_accept must be probabilities in [0, 1]; entry [depth {bad[0] + 1} - 1, "
                     f"rank {bad[1]}] is {a[tuple(bad)]!r}")
  return a


def _check_count(value, name: str, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{name} must be an integer, got {value!r}")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  return int(value)


def _check_topology(topology) -> TreeTopology:
  if not isinstance(topology, TreeTopology):
    raise ValueError(f"expected a TreeTopology, got {type(topology).__name__}")
  return topology


def _node_accept(a: np.ndarray, depth: int, rank: int) -> float:
  """rank_accept[depth - 1, rank], or 0 outside the table."""
  if depth > a.shape[0] or rank >= a.shape[1]:
    return 0.0
  return float(a[depth - 1, rank])


# --- expected length -----------------------------------------------------------------


def path_probabilities(topology: TreeTopology, rank_accept) -> np.ndarray:
  """[N] probability that each node is on the accepted path (independence model).

  Example::

    >>> t = TreeTopology((-1, -1, 0))   # root -> {0, 1}; node 0 -> {2}
    >>> path_probabilities(t, [[0.6, 0.2], [0.5, 0.1]]).round(6).tolist()
    [0.6, 0.2, 0.3]

  Node 2 (depth 2, rank 0) needs node 0 (0.6) and then itself (0.5).
  """
  topology, a = _check_topology(topology), _check_rank_accept(rank_accept)
  out = np.zeros(topology.num_nodes, np.float64)
  for i, (p, d, r) in enumerate(zip(topology.parents, topology.depth, topology.ranks)):
    out[i] = (1.0 if p < 0 else out[p]) * _node_accept(a, d, r)
  return out


def expected_accepted_length(topology: TreeTopology, rank_accept) -> float:
  """E[draft tokens accepted per step] = sum of the nodes' path probabilities.

  Args:
    topology: the tree.
    rank_accept: [D, K] table, ``rank_accept[d - 1, r]`` = P(the rank-r child at
      depth d is accepted | its parent was accepted). Nodes at depths > D or
      ranks >= K contribute 0.

  Returns:
    The expectation, a float in [0, N].

  Example::

    >>> t = TreeTopology((-1, -1, 0))
    >>> round(expected_accepted_length(t, [[0.6, 0.2], [0.5, 0.1]]), 6)   # 0.6 + 0.2 + 0.3
    1.1
    >>> round(expected_accepted_length(TreeTopology.chain(2), [[0.8], [0.8]]), 6)  # 0.8 + 0.64
    1.44
  """
  return float(np.sum(path_probabilities(topology, rank_accept)))


def expected_tokens_per_step(topology: TreeTopology, rank_accept) -> float:
  """E[tokens emitted per step] = ``expected_accepted_length`` + 1 (the bonus/correction token).

  For a chain with a uniform rank-0 rate α this is
  ``theory.expected_tokens_per_step(α, γ)``.

  Example::

    >>> round(expected_tokens_per_step(TreeTopology.chain(2), [[0.8], [0.8]]), 6)  # Table 1: 2.44
    2.44
  """
  return expected_accepted_length(topology, rank_accept) + 1.0


# --- shapes ----------------------------------------------------------------------------


def full_tree(branching: Sequence[int]) -> TreeTopology:
  """A full tree: ``branching[d - 1]`` children under every node of depth d - 1.

  ``full_tree((1,) * γ)`` is ``TreeTopology.chain(γ)``. Sizes multiply, so keep
  them small: N = b1 + b1 b2 + b1 b2 b3 + ...

  Example::

    >>> t = full_tree((2, 1))      # two root children, one child each
    >>> t.parents, t.ranks
    ((-1, -1, 0, 1), (0, 1, 0, 0))
    >>> full_tree((4, 2, 1)).num_nodes   # 4 + 8 + 8
    20
  """
  try:
    branching = tuple(branching)
  except TypeError:
    raise ValueError(f"branching must be a sequence of ints >= 1, got {branching!r}") from None
  if not branching:
    raise ValueError("branching must be non-empty, e.g. (4, 2, 1)")
  for b in branching:
    _check_count(b, "every branching factor", 1)
  paths: list[tuple[int, ...]] = []
  level = [()]
  for b in branching:
    level = [path + (r,) for path in level for r in range(int(b))]
    paths.extend(level)
  return TreeTopology.from_choices(paths)


# --- the best tree for a budget ----------------------------------------------------------


def best_static_tree(rank_accept, num_nodes: int, max_depth: Optional[int] = None) -> TreeTopology:
  """The tree of ``num_nodes`` nodes maximising ``expected_accepted_length`` (and tokens/step).

  Greedy construction: start from the root and repeatedly add, among the
  candidates (for the root and every node already in the tree, its child of
  the next unused rank, no deeper than ``max_depth``), the one of largest path
  probability, until there are ``num_nodes`` nodes.

  Why greedy is optimal. A valid tree is a set of nodes closed under each
  node's *predecessor*: its lower-rank sibling when its rank is > 0, else its
  parent (a tree cannot hold rank r without ranks 0..r-1 of the same parent,
  nor a node without its parent). The objective is the sum of the chosen
  nodes' path probabilities, all >= 0. Going from a node to its child
  multiplies the path probability by a factor <= 1, so a child never beats its
  parent; going from rank r - 1 to rank r swaps the last factor for one no
  larger *when each row of the table is non-increasing in rank* (the usual
  case: the drafter's r-th best token is accepted less often). Then every
  node's value is <= its predecessor's, and ordering all possible nodes by
  (path probability desc, depth asc, rank path asc) puts every predecessor
  before its successors; the first ``num_nodes`` of that order are thus a
  valid tree holding the ``num_nodes`` largest values, which no tree can beat.
  The greedy picks exactly that prefix (it only ever takes the best remaining
  node, whose predecessor is already in), so ties are broken deterministically:
  shallower first, then by the lexicographically smallest path of ranks. Note
  that greedy trees are nested: the tree for N + 1 extends the tree for N.

  When some row *increases* with rank (noisy measurements), a cheap node can
  be worth adding to reach a valuable sibling, and greedy is no longer
  optimal; this function then solves the budgeted problem exactly with a
  dynamic program over (depth, rank, budget) and fills any leftover budget
  greedily (leftover nodes only add value >= 0).

  Nodes outside the table (depth > D or rank >= K) have path probability 0;
  they are used only when the budget exceeds what the table can fill (the
  order above then widens the root with zero-value nodes).

  Args:
    rank_accept: [D, K] table (see the module docstring).
    num_nodes: N >= 1, the number of draft nodes.
    max_depth: optional cap on the depth (>= 1), e.g. the number of draft
      forwards one step may spend.

  Returns:
    A breadth-first ``TreeTopology`` of exactly ``num_nodes`` nodes.

  Raises:
    ValueError: num_nodes < 1, max_depth < 1, a table that is not [D, K] or
      holds values outside [0, 1] or NaN.

  Example::

    >>> t = best_static_tree([[0.8, 0.15], [0.7, 0.1]], num_nodes=3)
    >>> t.parents                          # (0,), then (0, 0) at 0.56, then (1,) at 0.15
    (-1, -1, 0)
    >>> round(expected_accepted_length(t, [[0.8, 0.15], [0.7, 0.1]]), 6)
    1.51
    >>> best_static_tree([[0.8, 0.0], [0.8, 0.0]], num_nodes=2).is_chain
    True
  """
  a = _check_rank_accept(rank_accept)
  n = _check_count(num_nodes, "num_nodes", 1)
  if max_depth is not None:
    max_depth = _check_count(max_depth, "max_depth", 1)
  if np.all(np.diff(a, axis=1) <= 0.0):
    chosen = _greedy(a, n, max_depth, ())
  else:
    chosen = _greedy(a, n, max_depth, _exact_choices(a, n, max_depth))
  return TreeTopology.from_choices(chosen)


def _greedy(a: np.ndarray, num_nodes: int, max_depth: Optional[int],
            seed: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
  """Extends a valid set of rank paths ``seed`` greedily to ``num_nodes`` paths.

  The heap holds one candidate per tree entry (the root and every chosen
  node): that entry's child of the next unused rank. Keys are (-path
  probability, depth, path), the total order of ``best_static_tree``.
  """
  chosen = list(seed)
  prob = {(): 1.0}
  next_rank = {(): 0}
  for path in chosen:  # Seeds are in (depth, path) order: parents first.
    prob[path] = prob[path[:-1]] * _node_accept(a, len(path), path[-1])
    next_rank[path[:-1]] = max(next_rank.get(path[:-1], 0), path[-1] + 1)
    next_rank.setdefault(path, 0)

  heap: list = []

  def push(parent: tuple[int, ...]):
    if max_depth is not None and len(parent) + 1 > max_depth:
      return
    child = parent + (next_rank[parent],)
    p = prob[parent] * _node_accept(a, len(child), child[-1])
    heapq.heappush(heap, (-p, len(child), child, p))

  for entry in [()] + chosen:
    push(entry)
  while len(chosen) < num_nodes:
    _, _, child, p = heapq.heappop(heap)  # Never empty: the root always has a candidate.
    chosen.append(child)
    prob[child] = p
    next_rank[child[:-1]] += 1
    next_rank[child] = 0
    push(child[:-1])
    push(child)
  return chosen


def _exact_choices(a: np.ndarray, num_nodes: int,
                   max_depth: Optional[int]) -> list[tuple[int, ...]]:
  """The best set of at most ``num_nodes`` in-table nodes, by dynamic programming.

  g[d][r][n] (d = 1..Dm, r = 0..K, n = 0..N) is the best value, relative to the
  parent's path probability, of at most n nodes taken from the rank-r node at
  depth d, its descendants and its higher-rank siblings with theirs (a valid
  choice takes the rank-r node first). With A = rank_accept[d - 1, r]:

    g[d][r][n] = max over m in [0, n - 1] of A (1 + g[d + 1][0][m]) + g[d][r + 1][n - 1 - m]

  for n >= 1, with g = 0 at n = 0, at r = K and at d = Dm + 1. Taking the
  node is never worse (values are >= 0), so "at most" is monotone in n.
  Returns the rank paths in (depth, path) order.
  """
  d_max, k = a.shape
  if max_depth is not None:
    d_max = min(d_max, max_depth)
  n_max = num_nodes
  g = np.zeros((d_max + 2, k + 1, n_max + 1))
  split = np.zeros((d_max + 2, k + 1, n_max + 1), np.int64)
  for d in range(d_max, 0, -1):
    below = g[d + 1, 0]
    for r in range(k - 1, -1, -1):
      acc = a[d - 1, r]
      side = g[d, r + 1]
      for n in range(1, n_max + 1):
        m = np.arange(n)
        vals = acc * (1.0 + below[m]) + side[n - 1 - m]
        best = int(np.argmax(vals))  # First maximum: fewest nodes below, deterministic.
        g[d, r, n], split[d, r, n] = vals[best], best

  out: list[tuple[int, ...]] = []

  def take(d: int, r: int, n: int, parent: tuple[int, ...]):
    while n >= 1 and d <= d_max and r < k:
      m = int(split[d, r, n])
      node = parent + (r,)
      out.append(node)
      take(d + 1, 0, m, node)
      r, n = r + 1, n - 1 - m

  take(1, 0, n_max, ())
  return sorted(out, key=lambda c: (len(c), c))


# --- measuring the table --------------------------------------------------------------------


def rank_accept_counts(topology: TreeTopology, paths) -> tuple[np.ndarray, np.ndarray]:
  """Counters for ``estimate_rank_accept`` from accepted paths of one topology.

  Args:
    topology: the tree the steps verified.
    paths: [S, D + 1] (or [D + 1]) accepted paths as ``TreeAcceptance.path``
      gives them: block indices, root (0) first, -1 past the end.

  Returns:
    (accepted, offered), int64 [D, K] with K = the tree's widest rank + 1:
    accepted[d - 1, r] counts steps whose accepted path went through the
    depth-d, rank-r node; offered[d - 1, r] counts steps in which some node
    of depth d and rank r was a child of an accepted entry (the root always
    is), i.e. had a chance to be accepted.

  Example::

    >>> t = TreeTopology((-1, -1, 0))               # blocks: root 0, nodes 1, 2, 3
    >>> acc, off = rank_accept_counts(t, [[0, 1, 3], [0, 2, -1], [0, -1, -1]])
    >>> acc.tolist(), off.tolist()
    ([[1, 1], [1, 0]], [[3, 3], [1, 0]])
  """
  topology = _check_topology(topology)
  p = np.asarray(paths)
  if p.ndim == 1:
    p = p[None]
  d, n = topology.max_depth, topology.num_nodes
  if p.ndim != 2 or p.shape[1] != d + 1 or not np.issubdtype(p.dtype, np.integer):
    raise ValueError(f"paths must be integer block indices of shape [S, {d + 1}], got "
                     f"{p.dtype} {p.shape}")
  k = max(topology.ranks) + 1
  accepted = np.zeros((d, k), np.int64)
  offered = np.zeros((d, k), np.int64)
  bp = topology.block_parents
  children = [[] for _ in range(n + 1)]
  for i in range(n):
    children[bp[i + 1]].append(i)
  for row in p:
    prev = -1
    for j, b in enumerate(row.tolist()):
      if b < 0:
        if any(x >= 0 for x in row[j:]):
          raise ValueError(f"path {row.tolist()} continues after a -1")
        break
      if not b <= n or (j == 0) != (b == 0) or (j > 0 and bp[b] != prev):
        raise ValueError(f"path {row.tolist()} is not a root-first path of {topology}")
      if j > 0:
        accepted[topology.depth[b - 1] - 1, topology.ranks[b - 1]] += 1
      for c in children[b]:
        offered[topology.depth[c] - 1, topology.ranks[c]] += 1
      prev = b
  return accepted, offered


def full_tree_counts(branching: Sequence[int], accepted_rank,
                     accept_len_hist) -> tuple[np.ndarray, np.ndarray]:
  """(accepted, offered) [D, K] of a ``full_tree(branching)`` from the decoder's counters.

  In a full tree every node of depth d - 1 has ``branching[d - 1]`` children,
  so a node of depth d and rank r < branching[d - 1] is offered exactly when
  its parent is on the accepted path: in every step that accepted >= d - 1
  nodes. ``accepted_rank`` [D, R >= K] and ``accept_len_hist`` [D + 1] are
  ``SpecCounters`` fields summed over rows.

  Example::

    >>> acc, off = full_tree_counts((2, 1), [[3, 1], [2, 0]], [1, 2, 2])
    >>> acc.tolist(), off.tolist()
    ([[3, 1], [2, 0]], [[5, 5], [4, 0]])
  """
  branching = tuple(int(b) for b in branching)
  k = max(branching)
  accepted = np.asarray(accepted_rank, np.int64)[:, :k]
  hist = np.asarray(accept_len_hist, np.int64)
  if accepted.shape != (len(branching), k) or hist.shape != (len(branching) + 1,):
    raise ValueError(f"counters of shapes {np.shape(accepted_rank)}, {hist.shape} do not "
                     f"belong to full_tree({branching})")
  reached = np.cumsum(hist[::-1])[::-1]  # reached[m] = steps that accepted >= m nodes
  offered = np.zeros_like(accepted)
  for d, b in enumerate(branching):
    offered[d, :b] = reached[d]
  return accepted, offered


def estimate_rank_accept(accepted, offered, empty: float = 0.0) -> np.ndarray:
  """The [D, K] table ``accepted / offered`` (maximum likelihood), ``empty`` where never offered.

  Convention: ``accepted[d - 1, r]`` counts steps whose accepted path went
  through a node of depth d and sibling rank r; ``offered[d - 1, r]`` counts
  steps in which such a node was a child of an accepted entry, i.e. its parent
  was on the accepted path (the root always is), so it had a chance. For a
  chain, ``offered[d - 1, 0]`` is the number of steps that accepted at least
  d - 1 drafts. ``rank_accept_counts`` computes both from ``TreeAcceptance``
  paths; counts from several runs or topologies simply add.

  Args:
    accepted: [D, K] non-negative counts.
    offered: [D, K] counts (or [D], the same for every rank), >= accepted.
    empty: the value for cells never offered (0 keeps them out of every tree).

  Returns:
    float64 [D, K] in [0, 1].

  Example::

    >>> estimate_rank_accept([[60, 20], [30, 0]], [[100, 100], [60, 0]]).tolist()
    [[0.6, 0.2], [0.5, 0.0]]
  """
  try:
    acc = np.asarray(accepted, dtype=np.float64)
    off = np.asarray(offered, dtype=np.float64)
  except (TypeError, ValueError):
    raise ValueError("accepted and offered must be arrays of counts") from None
  if acc.ndim != 2 or acc.size == 0:
    raise ValueError(f"accepted must be a non-empty [D, K] array, got shape {acc.shape}")
  if off.ndim == 1:
    off = off[:, None]
  if off.ndim != 2 or off.shape[0] != acc.shape[0] or off.shape[1] not in (1, acc.shape[1]):
    raise ValueError(f"offered must have shape {acc.shape} or ({acc.shape[0]},), got "
                     f"{np.shape(offered)}")
  off = np.broadcast_to(off, acc.shape)
  for name, x in (("accepted", acc), ("offered", off)):
    if not np.all(np.isfinite(x) & (x >= 0)):
      raise ValueError(f"{name} counts must be finite and >= 0")
  if np.any(acc > off):
    raise ValueError("accepted counts cannot exceed offered counts (a node is only accepted "
                     "when it was offered)")
  if not 0.0 <= empty <= 1.0:  # Also rejects NaN.
    raise ValueError(f"empty must be a probability in [0, 1], got {empty!r}")
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(off > 0, acc / np.where(off > 0, off, 1.0), float(empty))
