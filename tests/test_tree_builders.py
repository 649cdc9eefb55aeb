"""Static tree construction and tree speedup theory, against chain theory and brute force."""

import doctest
import math

import numpy as np
import pytest

from specjax import theory, tree_theory
from specjax.speculative import tree_builders as tb
from specjax.speculative.tree import TreeTopology

ALPHAS = np.linspace(0.0, 1.0, 21)


def all_trees(num_nodes, max_depth=None):
  """Every valid tree of exactly ``num_nodes`` nodes, as TreeTopology (brute force)."""
  level = {frozenset()}
  for _ in range(num_nodes):
    nxt = set()
    for paths in level:
      for parent in [()] + sorted(paths):
        if max_depth is not None and len(parent) + 1 > max_depth:
          continue
        rank = sum(1 for p in paths if len(p) == len(parent) + 1 and p[:-1] == parent)
        nxt.add(paths | {parent + (rank,)})
    level = nxt
  return [TreeTopology.from_choices(sorted(p)) for p in level]


def test_all_trees_counts_plane_trees():
  # Ordered (plane) trees with n non-root nodes: the Catalan numbers.
  assert [len(all_trees(n)) for n in range(1, 6)] == [1, 2, 5, 14, 42]


def test_doctests():
  for module in (tb, tree_theory):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0, module.__name__


# --- expected length -----------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 8])
def test_chain_expected_length_is_chain_theory(gamma):
  for alpha in ALPHAS:
    # Ranks > 0 never appear in a chain, whatever the table says about them.
    table = np.stack([np.full(gamma, alpha), np.full(gamma, 0.123)], axis=1)
    chain = TreeTopology.chain(gamma)
    want = theory.expected_tokens_per_step(alpha, gamma)
    assert tb.expected_tokens_per_step(chain, table) == pytest.approx(want, rel=1e-13, abs=1e-13)
    assert tb.expected_accepted_length(chain, table) == pytest.approx(want - 1, abs=1e-13)


def test_nodes_outside_the_table_are_worth_zero():
  t = TreeTopology((-1, -1, -1, 0, 3))  # ranks 0, 1, 2 at depth 1; depths up to 3
  probs = tb.path_probabilities(t, [[0.5, 0.25], [0.4, 0.1]])
  np.testing.assert_allclose(probs, [0.5, 0.25, 0.0, 0.2, 0.0])


def test_expected_length_monte_carlo():
  """The model's expectation against simulated recursive acceptance on a full tree."""
  table = np.array([[0.5, 0.2, 0.1], [0.6, 0.15, 0.05], [0.7, 0.1, 0.0]])
  topo = tb.full_tree((3, 2, 2))
  rng = np.random.default_rng(0)
  children = [[] for _ in range(topo.num_nodes + 1)]
  for i, p in enumerate(topo.parents):
    children[p + 1].append(i + 1)
  steps, lengths, paths = 20000, [], []
  for _ in range(steps):
    path, b = [0], 0
    while children[b]:
      d = len(path) - 1
      # P(rank r is the accepted child | parent accepted) = table[d, r]; else none.
      u, acc, nxt = rng.random(), 0.0, None
      for c in children[b]:
        acc += table[d, topo.ranks[c - 1]]
        if u < acc:
          nxt = c
          break
      if nxt is None:
        break
      path.append(nxt)
      b = nxt
    lengths.append(len(path) - 1)
    paths.append(path + [-1] * (topo.max_depth + 1 - len(path)))
  want = tb.expected_accepted_length(topo, table)
  assert np.mean(lengths) == pytest.approx(want, abs=4 * np.std(lengths) / math.sqrt(steps))
  # And the counters recover the table where it was offered (ranks < 2 at depths 2, 3).
  est = tb.estimate_rank_accept(*tb.rank_accept_counts(topo, np.array(paths)))
  assert est.shape == (3, 3)
  np.testing.assert_allclose(est[0], table[0], atol=0.02)
  np.testing.assert_allclose(est[1:, :2], table[1:, :2], atol=0.03)
  np.testing.assert_array_equal(est[1:, 2], 0.0)  # Never offered: `empty`.


def test_counts_for_a_chain():
  chain = TreeTopology.chain(3)
  paths = [[0, 1, 2, 3], [0, 1, -1, -1], [0, -1, -1, -1], [0, 1, 2, -1]]
  acc, off = tb.rank_accept_counts(chain, paths)
  assert acc[:, 0].tolist() == [3, 2, 1] and off[:, 0].tolist() == [4, 3, 2]
  np.testing.assert_allclose(tb.estimate_rank_accept(acc, off[:, 0]), [[0.75], [2 / 3], [0.5]])


# --- shapes ---------------------------------------------------------------------------------


def test_full_tree():
  assert tb.full_tree((1, 1, 1)) == TreeTopology.chain(3)
  t = tb.full_tree((4, 2, 1))
  assert t.num_nodes == 20 and t.max_depth == 3
  assert t.num_children[0] == 4 and set(t.num_children[1:5]) == {2}
  assert t.num_children[5:13] == (1,) * 8 and t.num_children[13:] == (0,) * 8
  assert tb.full_tree([3]).parents == (-1, -1, -1)


# --- best static tree -----------------------------------------------------------------------


@pytest.mark.parametrize("num_nodes", [1, 2, 4, 6])
def test_best_tree_is_the_chain_when_only_rank0_is_accepted(num_nodes):
  table = np.zeros((6, 3))
  table[:, 0] = 0.7
  assert tb.best_static_tree(table, num_nodes) == TreeTopology.chain(num_nodes)


def test_best_tree_is_wide_when_ranks_are_flat():
  table = np.full((3, 3), 0.3)
  assert tb.best_static_tree(table, 3).parents == (-1, -1, -1)
  t = tb.best_static_tree(table, 12)  # 3 at 0.3, then the 9 grandchildren at 0.09.
  assert t.num_children[0] == 3 and t.num_nodes == 12 and t.max_depth == 2
  assert t == tb.full_tree((3, 3))


def test_best_tree_fills_the_budget_beyond_the_table():
  # Only 1 rank and depth 1 in the table: every other node is worth 0 and the
  # tie-break widens the root.
  t = tb.best_static_tree([[0.9]], 4)
  assert t.parents == (-1, -1, -1, -1)
  assert tb.best_static_tree([[0.9, 0.0]], 3, max_depth=1).parents == (-1, -1, -1)
  assert tb.best_static_tree(np.zeros((2, 2)), 2).parents == (-1, -1)


def test_max_depth_caps_the_tree():
  table = np.full((5, 1), 0.9)
  assert tb.best_static_tree(table, 5) == TreeTopology.chain(5)
  t = tb.best_static_tree(table, 5, max_depth=2)
  assert t.max_depth == 2 and t.num_nodes == 5


def random_table(rng, depth, k, monotone):
  table = rng.random((depth, k))
  # Round a few entries to exact ties and zeros.
  table = np.where(rng.random(table.shape) < 0.2, np.round(table, 1), table)
  if monotone:
    table = -np.sort(-table, axis=1)
  return table


@pytest.mark.parametrize("monotone", [True, False])
@pytest.mark.parametrize("max_depth", [None, 1, 2])
def test_best_tree_is_optimal_by_brute_force(monotone, max_depth):
  rng = np.random.default_rng(17 + 2 * (max_depth or 0) + monotone)
  trees = {n: all_trees(n, max_depth) for n in range(1, 6)}
  for trial in range(40):
    depth, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    table = random_table(rng, depth, k, monotone)
    for n in range(1, 6):
      got = tb.best_static_tree(table, n, max_depth=max_depth)
      assert got.num_nodes == n
      assert max_depth is None or got.max_depth <= max_depth
      best = max(tb.expected_accepted_length(t, table) for t in trees[n])
      assert tb.expected_accepted_length(got, table) == pytest.approx(best, abs=1e-12), (
          trial, table, n, got)


def test_greedy_trees_are_nested_and_deterministic():
  rng = np.random.default_rng(3)
  for _ in range(20):
    table = random_table(rng, 4, 3, monotone=True)
    prev = None
    for n in range(1, 16):
      t = tb.best_static_tree(table, n)
      assert t == tb.best_static_tree(table.copy(), n)
      if prev is not None:
        # The tree for n - 1 is the tree for n with one leaf removed: same choice paths.
        assert _choices(prev) < _choices(t)
      prev = t


def _choices(topology):
  paths = []
  for p, r in zip(topology.parents, topology.ranks):
    paths.append((paths[p] if p >= 0 else ()) + (r,))
  return set(paths)


@pytest.mark.parametrize("monotone", [True, False])
def test_best_length_is_monotone_in_budget_and_depth(monotone):
  rng = np.random.default_rng(5)
  for _ in range(10):
    table = random_table(rng, 4, 4, monotone)
    for cap in (1, 2, 3, None):
      lengths = [tb.expected_accepted_length(tb.best_static_tree(table, n, max_depth=cap), table)
                 for n in range(1, 25)]
      assert np.all(np.diff(lengths) >= -1e-12)
    for n in (3, 8):
      by_cap = [tb.expected_accepted_length(tb.best_static_tree(table, n, max_depth=c), table)
                for c in (1, 2, 3, 4, None)]
      assert np.all(np.diff(by_cap) >= -1e-12)


# --- tree speedup ------------------------------------------------------------------------------


CURVES = [None, lambda t: 1.0, {1: 1.0, 4: 1.1, 8: 1.3},
          theory.VerifyCostCurve({1: 1.0, 2: 1.02, 16: 2.0}), lambda t: float(t)]


@pytest.mark.parametrize("curve", CURVES)
@pytest.mark.parametrize("c", [0.0, 0.02, 0.3])
def test_chain_speedup_is_calibrated_chain_theory(curve, c):
  for gamma in (1, 3, 7):
    for alpha in ALPHAS:
      table = np.full((gamma, 2), alpha)
      got = tree_theory.tree_speedup(TreeTopology.chain(gamma), table, curve, c)
      if curve is None:
        want = theory.walltime_improvement(alpha, gamma, c)
      else:
        want = theory.calibrated_walltime_improvement(alpha, gamma, c, curve)
      assert got == pytest.approx(want, rel=1e-13)


def test_speedup_sanity():
  rng = np.random.default_rng(11)
  topo = tb.full_tree((3, 2))
  for _ in range(20):
    table = random_table(rng, 2, 3, monotone=False)
    tokens = tb.expected_tokens_per_step(topo, table)
    # Free verification and drafting: the speedup is the tokens per step.
    assert tree_theory.tree_speedup(topo, table) == pytest.approx(tokens)
    # No parallelism in the target: a step costs N + 1 target steps for at most N + 1 tokens.
    assert tree_theory.tree_speedup(topo, table, lambda t: t) <= 1.0 + 1e-12
    # Drafting costs what the depth says; per-depth lists are summed.
    s1 = tree_theory.tree_speedup(topo, table, {1: 1.0, 8: 1.5}, 0.1)
    s2 = tree_theory.tree_speedup(topo, table, {1: 1.0, 8: 1.5}, [0.05, 0.15, 99.0])
    assert s1 == pytest.approx(s2)
    # N + 1 = 10 tokens, past the last point: 1 + (0.5 / 7) * 9.
    assert s1 == pytest.approx(tokens / (1.0 + 0.5 * 9 / 7 + 0.2))
  # Nothing accepted: drafting and wider verification only cost.
  assert tree_theory.tree_speedup(topo, np.zeros((2, 2)), {1: 1.0, 7: 1.2}, 0.01) < 1.0


def test_optimal_static_tree_by_brute_force():
  rng = np.random.default_rng(23)
  curve = {1: 1.0, 2: 1.02, 3: 1.1, 5: 1.4}
  trees = [t for n in range(1, 5) for t in all_trees(n)]
  for _ in range(15):
    table = random_table(rng, 3, 3, monotone=bool(rng.integers(2)))
    for c in (0.0, 0.05, 0.4):
      got, s = tree_theory.optimal_static_tree(table, 4, curve, c)
      assert got.num_nodes <= 4
      assert s == pytest.approx(tree_theory.tree_speedup(got, table, curve, c))
      best = max(tree_theory.tree_speedup(t, table, curve, c) for t in trees)
      assert s == pytest.approx(best, abs=1e-12)


def test_optimal_static_tree_without_drafting_cost_or_verify_growth_uses_the_budget():
  table = np.full((2, 2), 0.4)
  t, s = tree_theory.optimal_static_tree(table, 6)
  assert t == tb.full_tree((2, 2))  # Every in-table node: 2 + 4.
  assert s == pytest.approx(1 + 2 * 0.4 + 4 * 0.16)
  t, _ = tree_theory.optimal_static_tree(table, 6, max_depth=1)
  assert t.max_depth == 1


# --- bad inputs ----------------------------------------------------------------------------------


CHAIN = TreeTopology.chain(2)


@pytest.mark.parametrize("call", [
    lambda: tb.best_static_tree([[0.5]], 0),
    lambda: tb.best_static_tree([[0.5]], -3),
    lambda: tb.best_static_tree([[0.5]], 2.0),
    lambda: tb.best_static_tree([[0.5]], True),
    lambda: tb.best_static_tree([[0.5]], 2, max_depth=0),
    lambda: tb.best_static_tree([0.5, 0.4], 2),  # 1-D table.
    lambda: tb.best_static_tree(np.zeros((0, 2)), 2),
    lambda: tb.best_static_tree(np.zeros((2, 2, 2)), 2),
    lambda: tb.best_static_tree([[0.5, 1.5]], 2),
    lambda: tb.best_static_tree([[0.5, -0.1]], 2),
    lambda: tb.best_static_tree([[0.5, math.nan]], 2),
    lambda: tb.best_static_tree([["a"]], 2),
    lambda: tb.expected_accepted_length(CHAIN, [[math.nan]]),
    lambda: tb.expected_accepted_length((-1, 0), [[0.5]]),  # Not a TreeTopology.
    lambda: tb.full_tree(()),
    lambda: tb.full_tree((2, 0)),
    lambda: tb.full_tree((2, 1.5)),
    lambda: tb.full_tree(3),
    lambda: tb.estimate_rank_accept([[2]], [[1]]),  # More accepted than offered.
    lambda: tb.estimate_rank_accept([[-1]], [[1]]),
    lambda: tb.estimate_rank_accept([[1, 1]], [[2, 2, 2]]),
    lambda: tb.estimate_rank_accept([1, 1], [2, 2]),
    lambda: tb.estimate_rank_accept([[1]], [[2]], empty=math.nan),
    lambda: tb.rank_accept_counts(CHAIN, [[0, 2, 1]]),  # Not a path.
    lambda: tb.rank_accept_counts(CHAIN, [[1, 2, -1]]),  # Does not start at the root.
    lambda: tb.rank_accept_counts(CHAIN, [[0, -1, 2]]),
    lambda: tb.rank_accept_counts(CHAIN, [[0, 1]]),  # Wrong length.
    lambda: tree_theory.tree_speedup(CHAIN, [[0.5]], None, -0.1),
    lambda: tree_theory.tree_speedup(CHAIN, [[0.5]], None, math.inf),
    lambda: tree_theory.tree_speedup(CHAIN, [[0.5]], None, [0.1]),  # Too few depths.
    lambda: tree_theory.tree_speedup(CHAIN, [[0.5]], None, [0.1, -0.1]),
    lambda: tree_theory.tree_speedup(CHAIN, [[0.5]], lambda t: 0.0, 0.1),
    lambda: tree_theory.tree_speedup(CHAIN, [[0.5]], {2: 1.0}, 0.1),  # No T = 1 point.
    lambda: tree_theory.optimal_static_tree([[0.5]], 0),
    lambda: tree_theory.optimal_static_tree([[0.5]], 3, max_depth=0),
])
def test_invalid_inputs_raise(call):
  with pytest.raises(ValueError):
    call()


def test_full_tree_counts_equal_the_counts_from_paths():
  """The decoder's counters of a full tree give the same table as its accepted paths."""
  from specjax.speculative.tree_builders import full_tree_counts, rank_accept_counts
  tree = tb.full_tree((3, 2, 1))
  rng = np.random.default_rng(0)
  paths = []
  for _ in range(200):
    path, node = [0], 0
    for _ in range(tree.max_depth):
      kids = [i + 1 for i, p in enumerate(tree.block_parents[1:]) if p == node]
      if not kids or rng.random() < 0.3:
        break
      node = int(rng.choice(kids))
      path.append(node)
    paths.append(path + [-1] * (tree.max_depth + 1 - len(path)))
  acc, off = rank_accept_counts(tree, np.asarray(paths))
  rank_hits = np.zeros((tree.max_depth, 3), np.int64)
  hist = np.zeros(tree.max_depth + 1, np.int64)
  for path in paths:
    n = sum(b > 0 for b in path)
    hist[n] += 1
    for b in path[1:n + 1]:
      rank_hits[tree.depth[b - 1] - 1, tree.ranks[b - 1]] += 1
  got_acc, got_off = full_tree_counts((3, 2, 1), rank_hits, hist)
  np.testing.assert_array_equal(got_acc, acc)
  np.testing.assert_array_equal(got_off, off)
  with pytest.raises(ValueError, match="full_tree"):
    full_tree_counts((3, 2), rank_hits, hist)
