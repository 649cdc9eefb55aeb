"""Static token-tree topologies (speculative/tree.py) and their per-row (dynamic) twins.

Block indices put the root first: block 0 is the root, node i is block i + 1.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.speculative.tree import (TreeTopology, block_mask_from_parents,
                                      block_parents_from_parents, breadth_first_order,
                                      depth_from_parents)

TWO_BRANCH = (-1, -1, 0, 0, 1)  # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}


def _ancestors_or_self(block_parents, i):
  out = {i}
  while block_parents[i] >= 0:
    i = int(block_parents[i])
    out.add(i)
  return out


def _random_bfs_tree(rng, n):
  """A random valid topology: random parents, then breadth-first reordering."""
  return TreeTopology.from_parents([int(rng.integers(-1, i)) if i else -1 for i in range(n)])


# --- derived structure ---------------------------------------------------------------


def test_two_branch_tree_derivations():
  t = TreeTopology(TWO_BRANCH)
  assert t.num_nodes == 5
  assert t.depth == (1, 1, 2, 2, 2)
  assert t.max_depth == 2
  assert t.ranks == (0, 1, 0, 1, 0)
  assert t.num_children == (2, 2, 1, 0, 0, 0)
  assert t.level_ranges == ((0, 2), (2, 5))
  assert not t.is_chain
  np.testing.assert_array_equal(t.block_parents, [-1, 0, 0, 1, 1, 2])
  np.testing.assert_array_equal(t.block_depth, [0, 1, 1, 2, 2, 2])
  assert t.block_parents.dtype == np.int32 and t.block_depth.dtype == np.int32
  expected_mask = np.array([
      [1, 0, 0, 0, 0, 0],  # root
      [1, 1, 0, 0, 0, 0],  # node 0
      [1, 0, 1, 0, 0, 0],  # node 1
      [1, 1, 0, 1, 0, 0],  # node 2 (child of 0)
      [1, 1, 0, 0, 1, 0],  # node 3 (child of 0)
      [1, 0, 1, 0, 0, 1],  # node 4 (child of 1)
  ], bool)
  np.testing.assert_array_equal(t.block_mask, expected_mask)
  assert t.block_mask.dtype == bool
  np.testing.assert_array_equal(t.paths, [[0, 1, 3], [0, 1, 4], [0, 2, 5]])
  assert "N=5" in repr(t) and "D=2" in repr(t)


@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_chain(gamma):
  t = TreeTopology.chain(gamma)
  assert t.parents == tuple(range(-1, gamma - 1))
  assert t.is_chain
  assert t.depth == tuple(range(1, gamma + 1))
  assert t.max_depth == gamma
  assert t.ranks == (0,) * gamma
  assert t.level_ranges == tuple((i, i + 1) for i in range(gamma))
  np.testing.assert_array_equal(t.block_mask, np.tril(np.ones((gamma + 1, gamma + 1), bool)))
  np.testing.assert_array_equal(t.paths, [list(range(gamma + 1))])
  np.testing.assert_array_equal(t.block_depth, np.arange(gamma + 1))
  assert repr(t) == f"TreeTopology.chain({gamma})"
  assert TreeTopology(tuple(range(-1, gamma - 1))) == t  # same tuple, same topology


def test_wide_tree_is_not_a_chain():
  t = TreeTopology((-1, -1, -1, -1))
  assert not t.is_chain and t.max_depth == 1
  assert t.ranks == (0, 1, 2, 3)
  assert t.num_children == (4, 0, 0, 0, 0)
  np.testing.assert_array_equal(t.paths, [[0, 1], [0, 2], [0, 3], [0, 4]])
  assert t.level_ranges == ((0, 4),)
  np.testing.assert_array_equal(t.block_mask, np.eye(5, dtype=bool) | (np.arange(5) == 0)[None])
  # A chain with a branch at the end is not a chain either.
  assert not TreeTopology((-1, 0, 1, 1)).is_chain


@pytest.mark.parametrize("seed", range(6))
def test_derivations_on_random_trees(seed):
  """Every derived array agrees with a brute-force walk up the parents."""
  rng = np.random.default_rng(seed)
  t = _random_bfs_tree(rng, int(rng.integers(1, 12)))
  n, bp = t.num_nodes, t.block_parents
  for i in range(n + 1):
    anc = _ancestors_or_self(bp, i)
    np.testing.assert_array_equal(np.flatnonzero(t.block_mask[i]), sorted(anc))
    assert t.block_depth[i] == len(anc) - 1
  # Children of one parent get ranks 0, 1, ... in index order.
  for parent in range(-1, n):
    kids = [i for i, p in enumerate(t.parents) if p == parent]
    assert [t.ranks[i] for i in kids] == list(range(len(kids)))
    assert t.num_children[parent + 1] == len(kids)
  # Levels are contiguous and cover all nodes in order.
  flat = [i for a, b in t.level_ranges for i in range(a, b)]
  assert flat == list(range(n))
  for d, (a, b) in enumerate(t.level_ranges, start=1):
    assert all(t.depth[i] == d for i in range(a, b))
  # One path per leaf, root first, each entry the parent of the next, padded with -1.
  leaves = [i + 1 for i in range(n) if t.num_children[i + 1] == 0]
  assert t.paths.shape == (len(leaves), t.max_depth + 1)
  for row, leaf in zip(t.paths, leaves):
    k = int(np.sum(row >= 0))
    assert row[0] == 0 and row[k - 1] == leaf and np.all(row[k:] == -1)
    assert all(bp[row[j + 1]] == row[j] for j in range(k - 1))
  # Reordering an already breadth-first tree is the identity; topologies hash.
  assert TreeTopology.from_parents(t.parents) == t
  assert hash(TreeTopology(t.parents)) == hash(t)


def test_topology_is_a_static_jit_argument():
  f = jax.jit(lambda x, topo: x + topo.max_depth, static_argnums=1)
  assert int(f(jnp.int32(1), TreeTopology(TWO_BRANCH))) == 3
  assert int(f(jnp.int32(1), TreeTopology.chain(4))) == 5


def test_parents_are_normalised_to_python_ints():
  t = TreeTopology(np.array([-1, -1, 0], np.int64))
  assert t.parents == (-1, -1, 0) and all(type(p) is int for p in t.parents)
  assert t == TreeTopology([-1, -1, 0])


# --- construction from other descriptions --------------------------------------------


def test_from_parents_reorders_a_depth_first_tree():
  # The two-branch tree listed depth-first: a(0), c(1), d(2), b(3), e(4) with
  # root -> {a, b}, a -> {c, d}, b -> {e}.
  dfs = (-1, 0, 0, -1, 3)
  with pytest.raises(ValueError, match="breadth-first"):
    TreeTopology(dfs)
  t = TreeTopology.from_parents(dfs)
  assert t.parents == TWO_BRANCH
  # A child listed before its parent.
  assert TreeTopology.from_parents((1, -1)).parents == (-1, 0)
  assert TreeTopology.from_parents((2, 2, -1)).parents == (-1, 0, 0)
  assert TreeTopology.from_parents([-1, 0, 1]).is_chain
  assert breadth_first_order(dfs) == [0, 3, 1, 2, 4]  # node k of the result is this node


@pytest.mark.parametrize("seed", range(4))
def test_from_parents_of_a_shuffled_tree_keeps_its_shape(seed):
  rng = np.random.default_rng(100 + seed)
  t = _random_bfs_tree(rng, 9)
  perm = rng.permutation(t.num_nodes)  # new label k holds old node perm[k]
  inv = np.argsort(perm)
  shuffled = [-1 if t.parents[o] < 0 else int(inv[t.parents[o]]) for o in perm]
  u = TreeTopology.from_parents(shuffled)
  assert sorted(u.depth) == sorted(t.depth)
  assert sorted(u.num_children) == sorted(t.num_children)
  assert u.max_depth == t.max_depth and len(u.paths) == len(t.paths)


def test_from_choices_medusa_style():
  choices = [(0,), (1,), (0, 0), (0, 1), (1, 0)]
  t = TreeTopology.from_choices(choices)
  assert t.parents == TWO_BRANCH
  assert t.ranks == (0, 1, 0, 1, 0)
  # Order and duplicates do not matter; lists work as well as tuples.
  shuffled = [[1, 0], [0], [0, 1], [1], [0, 0], [0]]
  assert TreeTopology.from_choices(shuffled) == t
  # A Medusa-like choice list: three heads, rank-0-heavy.
  medusa = [[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0],
            [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0]]
  t = TreeTopology.from_choices(medusa)
  assert t.num_nodes == len(medusa) and t.max_depth == 4
  assert t.num_children[0] == 3
  # Each node's path of ranks from the root reproduces its choice.
  bp = t.block_parents
  got = set()
  for i in range(t.num_nodes):
    path, j = [], i + 1
    while j > 0:
      path.append(t.ranks[j - 1])
      j = int(bp[j])
    got.add(tuple(path[::-1]))
  assert got == {tuple(c) for c in medusa}
  assert TreeTopology.from_choices([(0,), (0, 0), (0, 0, 0)]) == TreeTopology.chain(3)


# --- clear errors ---------------------------------------------------------------------


@pytest.mark.parametrize("parents,match", [
    ((), "at least one"),
    ((1, 0), "cycle"),
    ((0,), "cycle"),
    ((-1, 5), "outside"),
    ((-2,), "outside"),
    ((-1, 2, 0), "not in order"),
    ((-1, 0, -1), "breadth-first"),
    ((0.5,), "ints"),
    ((-1, 0.5), "ints"),
    (("a",), "ints"),
    ((None,), "ints"),
    (None, "ints"),
])
def test_bad_parents_raise(parents, match):
  with pytest.raises(ValueError, match=match):
    TreeTopology(parents)


@pytest.mark.parametrize("parents,match", [
    ((), "at least one"),
    ((1, 0), "cycle"),
    ((-1, 2, 1), "cycle"),
    ((0,), "itself"),
    ((-1, 7), "outside"),
])
def test_from_parents_bad_input_raises(parents, match):
  with pytest.raises(ValueError, match=match):
    TreeTopology.from_parents(parents)


@pytest.mark.parametrize("gamma", [0, -1, 1.5])
def test_bad_chain_raises(gamma):
  with pytest.raises(ValueError, match="gamma"):
    TreeTopology.chain(gamma)


@pytest.mark.parametrize("choices,match", [
    ([], "non-empty"),
    ([()], "non-empty"),
    ([(0,), (0, 1)], "skip"),
    ([(0,), (2,)], "skip"),
    ([(1,)], "skip"),
    ([(0,), (0, 0, 0)], "prefix"),
    ([(0,), (-1,)], "negative"),
])
def test_bad_choices_raise(choices, match):
  with pytest.raises(ValueError, match=match):
    TreeTopology.from_choices(choices)


# --- per-row (dynamic) trees -----------------------------------------------------------

SAME_N = [TreeTopology.chain(5), TreeTopology(TWO_BRANCH), TreeTopology((-1,) * 5),
          TreeTopology((-1, 0, 0, 1, 2)), TreeTopology((-1, -1, 1, 2, 2))]


@pytest.mark.parametrize("topo", SAME_N + [TreeTopology.chain(1), TreeTopology.from_choices(
    [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]])],
                         ids=repr)
def test_per_row_arrays_match_static_topology(topo):
  b, n = 3, topo.num_nodes
  parents = jnp.broadcast_to(jnp.asarray(topo.parents, jnp.int32), (b, n))
  mask = block_mask_from_parents(parents, topo.max_depth)
  depth = depth_from_parents(parents, topo.max_depth)
  assert mask.shape == (b, n + 1, n + 1) and mask.dtype == bool
  assert depth.shape == (b, n + 1) and depth.dtype == jnp.int32
  for row in range(b):
    np.testing.assert_array_equal(mask[row], topo.block_mask)
    np.testing.assert_array_equal(depth[row], topo.block_depth)
  np.testing.assert_array_equal(block_parents_from_parents(parents)[0], topo.block_parents)
  # A looser depth bound changes nothing.
  np.testing.assert_array_equal(block_mask_from_parents(parents, topo.max_depth + 3)[0],
                                topo.block_mask)


def test_per_row_arrays_differ_per_row_and_jit():
  parents = jnp.asarray([t.parents for t in SAME_N], jnp.int32)  # [5, 5], one tree a row
  d = max(t.max_depth for t in SAME_N)
  mask, depth = jax.jit(lambda x: (block_mask_from_parents(x, d), depth_from_parents(x, d)))(
      parents)
  for row, t in enumerate(SAME_N):
    np.testing.assert_array_equal(mask[row], t.block_mask)
    np.testing.assert_array_equal(depth[row], t.block_depth)
  for a, b in itertools.combinations(range(len(SAME_N)), 2):
    assert not np.array_equal(mask[a], mask[b])


def test_per_row_arrays_on_random_trees():
  rng = np.random.default_rng(7)
  trees = [_random_bfs_tree(rng, 8) for _ in range(16)]
  d = max(t.max_depth for t in trees)
  parents = jnp.asarray([t.parents for t in trees], jnp.int32)
  mask, depth = block_mask_from_parents(parents, d), depth_from_parents(parents, d)
  for row, t in enumerate(trees):
    np.testing.assert_array_equal(mask[row], t.block_mask)
    np.testing.assert_array_equal(depth[row], t.block_depth)
