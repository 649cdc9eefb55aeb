"""Static token-tree topologies: the shape of a speculative step, chains included.

A topology is a tuple ``parents`` over N draft nodes: ``parents[i]`` is the
node that node i continues, or -1 for a child of the *root* (the last
committed token, which the target feeds first). Nodes are in breadth-first
order: every parent precedes its children and depths never decrease, so the
nodes of one depth are a contiguous range (one draft forward per depth) and
siblings are ranked by index (rank r = the parent's r-th best token in a
top-k tree). Everything else is derived, in numpy, at trace time.

Block indices put the root first: block index 0 is the root and node i is
block index i + 1. The verify block the target runs is ``[root, nodes...]``
at positions ``s - 1 + block_depth``, under ``block_mask`` (each entry sees
its ancestors and itself).

Example (γ = 3 chain, and a two-branch tree of five nodes)::

    >>> TreeTopology.chain(3).parents
    (-1, 0, 1)
    >>> t = TreeTopology((-1, -1, 0, 0, 1))   # root -> {0, 1}; 0 -> {2, 3}; 1 -> {4}
    >>> t.depth, t.max_depth, t.ranks
    ((1, 1, 2, 2, 2), 2, (0, 1, 0, 1, 0))
    >>> t.block_mask.astype(int)[3]           # node 2 (block 3) sees root, node 0, itself
    array([1, 1, 0, 1, 0, 0])

Dynamic trees (EAGLE-2) keep N and the maximum depth static but choose
per-row parents ``[B, N]`` at run time; ``block_mask_from_parents`` and
``depth_from_parents`` derive the same quantities from such arrays.
``DynamicTree`` is their static spec (k, D, N), which the decoder takes in
place of a topology; ``SampledDynamicTree`` (static widths per depth) is the spec of
dynamic trees whose children are drawn, for sampling.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TreeTopology:
  """A static tree of draft nodes (hashable: a valid static jit argument).

  Attributes:
    parents: parents[i] in [-1, i): the parent node of node i (-1: the root).
  """

  parents: tuple[int, ...]

  def __post_init__(self):
    try:
      parents = tuple(int(p) for p in self.parents)
    except (TypeError, ValueError):
      raise ValueError(f"tree parents must be a sequence of ints, got {self.parents!r}") from None
    if any(int(p) != p for p in self.parents):
      raise ValueError(f"tree parents must be ints, got {self.parents!r}")
    object.__setattr__(self, "parents", parents)
    n = len(parents)
    if n < 1:
      raise ValueError("a tree needs at least one draft node (N >= 1)")
    for i, p in enumerate(parents):
      if not -1 <= p < n:
        raise ValueError(f"tree node {i} has parent {p}, outside [-1, {n})")
    for i in range(n):  # follow parents: more than n hops means a cycle
      j, hops = i, 0
      while j != -1:
        j, hops = parents[j], hops + 1
        if hops > n:
          raise ValueError(f"tree parents {parents} contain a cycle through node {i}")
    if any(p >= i for i, p in enumerate(parents)):
      raise ValueError(f"tree parents {parents} are not in order (every parent must precede its "
                       "children); TreeTopology.from_parents reorders any valid tree")
    depth = self.depth
    if any(depth[i] > depth[i + 1] for i in range(n - 1)):
      raise ValueError(f"tree nodes must be in breadth-first order (depths {depth}); "
                       "TreeTopology.from_parents reorders any valid tree")

  # --- construction ------------------------------------------------------------

  @classmethod
  def chain(cls, gamma: int) -> "TreeTopology":
    """γ nodes in a line: today's draft chain."""
    if int(gamma) != gamma or gamma < 1:
      raise ValueError(f"a chain needs gamma >= 1, got {gamma!r}")
    return cls(tuple(range(-1, int(gamma) - 1)))

  @classmethod
  def from_parents(cls, parents: Sequence[int]) -> "TreeTopology":
    """Any valid parent list (any node order) reordered breadth-first, siblings kept in order
    (node k of the result is node ``breadth_first_order(parents)[k]`` of the input)."""
    parents = [int(p) for p in parents]
    order = breadth_first_order(parents)
    new = {old: k for k, old in enumerate(order)}
    return cls(tuple(-1 if parents[o] == -1 else new[parents[o]] for o in order))

  @classmethod
  def from_choices(cls, choices: Sequence[Sequence[int]]) -> "TreeTopology":
    """A Medusa-style choice list: each entry is a path of sibling ranks from the root.

    ``[(0,), (1,), (0, 0), (0, 1)]`` is the root's best two tokens, and the
    best two continuations of the first. Every prefix of a path must be listed.
    """
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    if not paths or any(len(c) == 0 for c in paths):
      raise ValueError("choices must be non-empty paths of sibling ranks, e.g. [(0,), (0, 0)]")
    index = {c: i for i, c in enumerate(paths)}
    parents = []
    for c in paths:
      if any(r < 0 for r in c):
        raise ValueError(f"choice {c} has a negative rank")
      if len(c) > 1 and c[:-1] not in index:
        raise ValueError(f"choice {c} is listed without its prefix {c[:-1]}")
      parents.append(-1 if len(c) == 1 else index[c[:-1]])
    topo = cls(tuple(parents))
    if topo.ranks != tuple(c[-1] for c in paths):
      raise ValueError(f"choices {paths} skip a sibling rank (ranks must be 0, 1, ... per parent)")
    return topo

  # --- derived structure (numpy, trace time) -----------------------------------

  @property
  def num_nodes(self) -> int:
    return len(self.parents)

  @functools.cached_property
  def depth(self) -> tuple[int, ...]:
    """Depth of each node (children of the root have depth 1)."""
    d: list[int] = []
    for p in self.parents:
      d.append(1 if p < 0 else d[p] + 1)
    return tuple(d)

  @property
  def max_depth(self) -> int:
    """D, the most draft tokens one step can accept."""
    return max(self.depth)

  @functools.cached_property
  def ranks(self) -> tuple[int, ...]:
    """Each node's index among its siblings (0 = first child)."""
    seen: dict[int, int] = {}
    out = []
    for p in self.parents:
      out.append(seen.get(p, 0))
      seen[p] = seen.get(p, 0) + 1
    return tuple(out)

  @functools.cached_property
  def num_children(self) -> tuple[int, ...]:
    """Children per block index (root first), [N + 1]."""
    counts = [0] * (self.num_nodes + 1)
    for p in self.parents:
      counts[p + 1] += 1
    return tuple(counts)

  @property
  def max_children(self) -> int:
    """The most children any block entry has (bounds a node's sibling rank)."""
    return max(self.num_children)

  @functools.cached_property
  def first_chain_depth(self) -> int:
    """Depth of the first-ranked chain: the root's rank-0 child, its rank-0 child, …"""
    on: list[bool] = []  # node i is on that chain (breadth-first: parents come first)
    for p, r in zip(self.parents, self.ranks):
      on.append(r == 0 and (p < 0 or on[p]))
    return max(d for d, o in zip(self.depth, on) if o)

  @property
  def cache_headroom(self) -> int:
    """Slots past the committed prefix a step writes (the N nodes)."""
    return self.num_nodes

  @property
  def is_chain(self) -> bool:
    return self.parents == tuple(range(-1, self.num_nodes - 1))

  @property
  def level_ranges(self) -> tuple[tuple[int, int], ...]:
    """[start, stop) node ranges of depths 1..D (contiguous in breadth-first order)."""
    out = []
    for d in range(1, self.max_depth + 1):
      idx = [i for i, x in enumerate(self.depth) if x == d]
      out.append((idx[0], idx[-1] + 1))
    return tuple(out)

  @property
  def block_parents(self) -> np.ndarray:
    """[N + 1] parent block index per block entry (the root's is -1)."""
    return np.array([-1] + [p + 1 for p in self.parents], np.int32)

  @property
  def block_depth(self) -> np.ndarray:
    """[N + 1] position offset of each block entry from the root (0 for the root)."""
    return np.array((0,) + self.depth, np.int32)

  @property
  def block_mask(self) -> np.ndarray:
    """[N + 1, N + 1] bool: entry i sees entry j iff j is i or one of its ancestors."""
    bp = self.block_parents
    m = np.eye(self.num_nodes + 1, dtype=bool)
    for i in range(1, self.num_nodes + 1):
      m[i] |= m[bp[i]]
    return m

  @property
  def paths(self) -> np.ndarray:
    """[num_leaves, D + 1] root-to-leaf block indices, padded with -1."""
    leaves = [i + 1 for i in range(self.num_nodes) if self.num_children[i + 1] == 0]
    out = np.full((len(leaves), self.max_depth + 1), -1, np.int32)
    for r, leaf in enumerate(leaves):
      chain, j = [], leaf
      while j >= 0:
        chain.append(j)
        j = int(self.block_parents[j])
      out[r, :len(chain)] = chain[::-1]
    return out

  def __repr__(self) -> str:
    if self.is_chain:
      return f"TreeTopology.chain({self.num_nodes})"
    return f"TreeTopology(N={self.num_nodes}, D={self.max_depth}, parents={self.parents})"


# --- per-row (dynamic) trees: the same quantities from [B, N] parent arrays ----------


def breadth_first_order(parents: Sequence[int]) -> list[int]:
  """The nodes of a valid parent list (any order; -1: the root) in breadth-first order,
  siblings in their given order. Raises ValueError for parents out of range or a cycle."""
  parents = [int(p) for p in parents]
  n = len(parents)
  if n < 1:
    raise ValueError("a tree needs at least one draft node (N >= 1)")
  for i, p in enumerate(parents):
    if not -1 <= p < n or p == i:
      raise ValueError(f"tree node {i} has parent {p}, outside [-1, {n}) or itself")
  order, frontier, seen = [], [-1], set()
  while frontier:
    nxt = []
    for f in frontier:
      for i, p in enumerate(parents):
        if p == f and i not in seen:
          seen.add(i)
          order.append(i)
          nxt.append(i)
    frontier = nxt
  if len(order) != n:
    raise ValueError(f"tree parents {tuple(parents)} contain a cycle (nodes "
                     f"{sorted(set(range(n)) - seen)} never reach the root)")
  return order


def block_parents_from_parents(parents: jax.Array) -> jax.Array:
  """[B, N] node parents (-1 = root) -> [B, N + 1] block parents (root first, its own -1)."""
  b = parents.shape[0]
  return jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents.astype(jnp.int32) + 1], 1)


def block_mask_from_parents(parents: jax.Array, max_depth: int) -> jax.Array:
  """[B, N + 1, N + 1] ancestor-or-self mask of per-row trees of depth <= ``max_depth``."""
  bp = block_parents_from_parents(parents)
  t = bp.shape[1]
  eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (bp.shape[0], t, t))
  mask, anc = eye, bp
  for _ in range(max_depth):  # add the ancestor `k` hops up, for k = 1..D
    mask = mask | (jax.nn.one_hot(anc, t, dtype=jnp.int32) > 0)
    anc = jnp.where(anc >= 0, jnp.take_along_axis(bp, jnp.maximum(anc, 0), axis=1), -1)
  return mask


def depth_from_parents(parents: jax.Array, max_depth: int) -> jax.Array:
  """[B, N + 1] depth of each block entry (root 0) of per-row trees."""
  return jnp.sum(block_mask_from_parents(parents, max_depth), axis=-1).astype(jnp.int32) - 1


def node_arrays(topology: "TreeTopology", batch: int, parents: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(block parents of the nodes [B, N], ancestor-or-self mask [B, N + 1, N + 1], block
  depth [B, N + 1]) of ``batch`` rows: the static topology's, or those of per-row
  ``parents`` [B, N] (dynamic trees; ``topology`` then gives the maximum depth)."""
  if parents is None:
    n = topology.num_nodes
    par = jnp.broadcast_to(jnp.asarray(topology.block_parents[1:]), (batch, n))
    mask = jnp.broadcast_to(jnp.asarray(topology.block_mask), (batch, n + 1, n + 1))
    depth = jnp.broadcast_to(jnp.asarray(topology.block_depth), (batch, n + 1))
    return par, mask, depth
  d = topology.max_depth
  return (parents.astype(jnp.int32) + 1, block_mask_from_parents(parents, d),
          depth_from_parents(parents, d))


def path_to(entry: jax.Array, mask: jax.Array, depth: jax.Array, max_depth: int) -> jax.Array:
  """[B, D + 1] the ancestors of block entry ``entry`` [B] by depth, root first (-1 past
  its depth), from ``node_arrays``' mask and depth."""
  anc = jnp.take_along_axis(mask, entry[:, None, None], axis=1)[:, 0]  # [B, N+1]
  levels = jnp.arange(max_depth + 1)
  hit = anc[:, None, :] & (depth[:, None, :] == levels[None, :, None])  # [B, D+1, N+1]
  return jnp.where(jnp.any(hit, -1), jnp.argmax(hit, -1), -1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """An EAGLE-2 dynamic tree: static sizes, per-row shape chosen at run time by the draft.

  Each step the drafter expands a frontier of the ``top_k`` best nodes per
  depth (by cumulative draft log-probability) for ``depth`` levels and keeps
  the ``num_nodes`` best of all candidates (``tree_draft.grow_dynamic``); the
  proposal carries per-row ``parents`` [B, N]. Medusa heads, whose children do not
  depend on the parent, score every path of their top-k instead of a frontier
  (``drafters.medusa.best_product_paths``). Hashable: a valid static jit
  argument, like ``TreeTopology``, whose interface the decoder reads
  (``num_nodes``, ``max_depth``, ``is_chain``, ``max_children``).

  Attributes:
    top_k: k, the frontier width and the children tried per frontier node.
    depth: D, the number of levels (D - 1 draft forwards after the root).
    num_nodes: N, nodes verified per step; depth <= N <= k + (D - 1) k².
  """

  top_k: int
  depth: int
  num_nodes: int

  def __post_init__(self):
    for name in ("top_k", "depth", "num_nodes"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"DynamicTree {name} must be an int >= 1, got {v!r}")
      object.__setattr__(self, name, int(v))
    if self.num_nodes < self.depth:
      raise ValueError(f"DynamicTree num_nodes={self.num_nodes} < depth={self.depth}: a path "
                       "of D levels needs D nodes")
    if self.num_nodes > self.pool_size:
      raise ValueError(f"DynamicTree num_nodes={self.num_nodes} exceeds the {self.pool_size} "
                       f"candidates of top_k={self.top_k}, depth={self.depth} (k + (D - 1) k²)")

  @staticmethod
  def candidates(top_k: int, depth: int) -> int:
    """Candidates drafted per step by a frontier of ``top_k`` over ``depth`` levels: k at
    depth 1, k² at each later depth; the most ``num_nodes`` such a tree admits."""
    return top_k + (depth - 1) * top_k ** 2

  @property
  def pool_size(self) -> int:
    """Candidates drafted per step (``candidates(top_k, depth)``)."""
    return DynamicTree.candidates(self.top_k, self.depth)

  @property
  def max_depth(self) -> int:
    return self.depth

  @property
  def max_children(self) -> int:
    return self.top_k  # every node's children are among its top-k

  @property
  def first_chain_depth(self) -> int:
    """D, taken as the depth of the draft's top-1 path. That path loses its deeper nodes
    only when shallower candidates outscore them; a step that accepted all it kept then
    counts as stopping short (a small downward bias of the adaptive policy's estimate)."""
    return self.depth

  @property
  def cache_headroom(self) -> int:
    """Slots past the committed prefix a step writes: N verified, (D - 1) k drafted."""
    return max(self.num_nodes, (self.depth - 1) * self.top_k)

  @property
  def is_chain(self) -> bool:
    return False

  def __repr__(self) -> str:
    return f"DynamicTree(top_k={self.top_k}, depth={self.depth}, num_nodes={self.num_nodes})"


@dataclasses.dataclass(frozen=True)
class SampledDynamicTree:
  """A dynamic tree for sampling: static widths per depth, per-row placement by the draft.

  Depth d holds ``widths[d - 1]`` nodes in every row. Each node's children are successive
  draws without replacement from the draft's warped law q (Gumbel-top-k; under a greedy
  sampler its top-k, point masses), and each row places a depth's nodes under its most
  promising parents (``tree_draft.grow_sampled``): the j-th draw under node v scores
  V(v) · (1 − the q-mass of v's first j − 1 draws), V(v) being the score v was placed with,
  and the ``widths[d - 1]`` best scores of the depth are kept. A draw's score is fixed
  before the draw is read, so the siblings kept under a node are always its *first* draws,
  and how many there are depends on earlier draws only: a stopping time of the draw
  sequence. SpecInfer's recursive rejection with the real q (Sequoia's renormalisation
  without replacement) is then exact, the sampled analogue of EAGLE-2's dynamic tree,
  whose selection by the drawn tokens' own probabilities would bias sampled children.
  Every node but the deepest level is fed, at draft slot root + 1 + its index (a static
  tree's layout).

  Attributes:
    widths: nodes per depth, ``widths[0]`` at depth 1, each >= 1; every node draws
      ``max_children`` = max(widths) children, so any widths can be filled.
  """

  widths: tuple[int, ...]

  def __post_init__(self):
    widths = tuple(self.widths) if isinstance(self.widths, (tuple, list)) else None
    if not widths or any(isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1
                         for w in widths):
      raise ValueError(f"SampledDynamicTree widths must be a non-empty sequence of ints >= 1, "
                       f"got {self.widths!r}")
    object.__setattr__(self, "widths", tuple(int(w) for w in widths))

  @property
  def num_nodes(self) -> int:
    return sum(self.widths)

  @property
  def max_depth(self) -> int:
    return len(self.widths)

  @property
  def max_children(self) -> int:
    return max(self.widths)  # draws per node: no depth keeps more

  @property
  def cache_headroom(self) -> int:
    return self.num_nodes

  @property
  def is_chain(self) -> bool:
    return False
