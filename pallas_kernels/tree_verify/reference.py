"""Greedy token-tree verification: semantics, input checks, the jnp reference.

Axes: B batch, N tree nodes (root included), D max depth (static).

Each row holds a token tree in topological order: node 0 is the root (the
last committed token, ``parents[b, 0] = -1``) and ``parents[b, c] < c``.
``target_argmax[b, c]`` is the target's greedy token at node c's position.
Node c > 0 is *accepted* iff

* its parent p = parents[b, c] is a real earlier node (0 <= p < c),
* p is accepted and at depth < D (nodes deeper than D are never accepted),
* ``tokens[b, c] == target_argmax[b, p]``.

The root is always accepted; padding nodes (parent -1, token -1) never are.
The result is the deepest accepted node, ties broken by the smallest node
index (with distinct siblings at most one child per node is accepted, so the
accepted set is a single path and there is no tie), its root-to-node path and
the target's argmax there (the corrected or bonus token).

Example: parents (-1, 0, 0, 1, 2), tokens (r, 7, 5, 9, 4), target_argmax
(5, 8, 9, 1, 6): node 2 (token 5 == argmax at the root) is accepted, node 1
is not; node 4 (token 4 != argmax 9 at node 2) is not. Path (0, 2, -1),
length 1, next_token = target_argmax[2] = 9.

The rule is total: invalid parents (traced inputs escape ``check_parents``)
make a node unaccepted rather than undefined.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Verified(NamedTuple):
  """Outcome of greedy tree verification.

  Attributes:
    path: [B, D+1] int32 node indices root to last accepted node (path[:, 0] = 0),
      -1 after it.
    length: [B] int32 accepted non-root nodes (the depth of the last one).
    next_token: [B] int32 target_argmax at the last accepted node.
  """

  path: jax.Array
  length: jax.Array
  next_token: jax.Array


def check_inputs(parents, tokens, target_argmax, max_depth: int | None) -> int:
  """Raises ValueError on bad shapes, dtypes or max_depth (static), and for concrete
  parents on a bad topology (``check_parents``); returns D.

  Args:
    parents: [B, N] int parent of each node, -1 for the root and padding.
    tokens: [B, N] int token of each node (tokens[:, 0] is not checked).
    target_argmax: [B, N] int the target's greedy token at each node.
    max_depth: D, or None for N - 1 (any tree fits).
  """
  if parents.ndim != 2:
    raise ValueError(f"parents must be [B, N], got shape {tuple(parents.shape)}")
  b, n = parents.shape
  if b == 0 or n == 0:
    raise ValueError(f"parents must have B >= 1 rows and N >= 1 nodes, got {(b, n)}")
  for name, x in (("parents", parents), ("tokens", tokens), ("target_argmax", target_argmax)):
    if tuple(x.shape) != (b, n):
      raise ValueError(f"{name} must be [B, N]=[{b}, {n}] like parents, got {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be integers, got {x.dtype}")
  if max_depth is None:
    max_depth = n - 1
  elif not isinstance(max_depth, (int, np.integer)) or max_depth < 0:
    raise ValueError(f"max_depth must be a non-negative int, got {max_depth!r}")
  if is_concrete(parents):
    check_parents(parents, int(max_depth))
  return int(max_depth)


def node_depths(parents: np.ndarray) -> np.ndarray:
  """[B, N] depth of each node on the host (root 0, padding -1); parents already checked."""
  depth = np.full(parents.shape, -1, np.int64)
  depth[:, 0] = 0
  for c in range(1, parents.shape[1]):
    p = parents[:, c]
    depth[:, c] = np.where(p >= 0, depth[np.arange(len(p)), np.maximum(p, 0)] + 1, -1)
  return depth


def check_parents(parents, max_depth: int) -> None:
  """Raises ValueError unless parents is a valid topological tree of depth <= max_depth.

  Runs only on concrete arrays (the public wrappers skip it for tracers).
  """
  p = np.asarray(parents)
  if np.any(p[:, 0] != -1):
    raise ValueError(f"parents[:, 0] must be -1 (node 0 is the root), got {p[:, 0].tolist()}")
  node = np.arange(p.shape[1])
  bad = (p[:, 1:] < -1) | (p[:, 1:] >= node[1:])
  if np.any(bad):
    row, col = np.argwhere(bad)[0]
    raise ValueError(f"parents[{row}, {col + 1}] = {p[row, col + 1]}: a node's parent must be "
                     "an earlier node (parent < index) or -1 (padding)")
  deepest = int(node_depths(p).max())
  if deepest > max_depth:
    raise ValueError(f"tree depth {deepest} exceeds max_depth={max_depth}")


def is_concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _reference(parents, tokens, target_argmax, *, max_depth: int) -> Verified:
  b, n = parents.shape
  node = jnp.arange(n, dtype=jnp.int32)
  valid = (parents >= 0) & (parents < node)  # [B, N], False at the root
  p = jnp.where(valid, parents, 0)
  match = valid & (tokens == jnp.take_along_axis(target_argmax, p, axis=1))
  # depth[b, c]: depth of accepted node c, -1 if not accepted. Iteration k accepts
  # exactly the nodes at depth k, so D iterations give the depth cap for free.
  depth = jnp.broadcast_to(jnp.where(node == 0, 0, -1), (b, n)).astype(jnp.int32)

  def deepen(k, depth):
    at_parent = jnp.take_along_axis(depth, p, axis=1)
    return jnp.where(match & (at_parent == k - 1), k, depth)

  depth = jax.lax.fori_loop(1, max_depth + 1, deepen, depth)
  best = jnp.argmax(depth, axis=1).astype(jnp.int32)  # first maximum: smallest index wins ties
  length = jnp.max(depth, axis=1)
  next_token = jnp.take_along_axis(target_argmax, best[:, None], axis=1)[:, 0]

  # Walk back from the best node: step j writes path[length - j] (nothing once < 0).
  col = jnp.arange(max_depth + 1, dtype=jnp.int32)

  def back(j, carry):
    path, cur = carry
    path = jnp.where(col == (length - j)[:, None], cur[:, None], path)
    return path, jnp.take_along_axis(p, cur[:, None], axis=1)[:, 0]

  path0 = jnp.full((b, max_depth + 1), -1, jnp.int32)
  path, _ = jax.lax.fori_loop(0, max_depth + 1, back, (path0, best))
  return Verified(path=path, length=length, next_token=next_token)


_reference_jit = jax.jit(_reference, static_argnames=("max_depth",))


def tree_verify_reference(parents, tokens, target_argmax, *,
                          max_depth: int | None = None) -> Verified:
  """Greedy tree verification in ``jnp`` (jitted; semantics in the module docstring).

  Args:
    parents: [B, N] int parent of each node (parents[:, 0] = -1, parents[:, c] < c,
      -1 for padding).
    tokens: [B, N] int token of each node.
    target_argmax: [B, N] int the target's greedy token at each node.
    max_depth: static D, the path budget; None for N - 1.

  Returns:
    ``Verified(path [B, D+1], length [B], next_token [B])``, all int32.

  Raises:
    ValueError: bad shapes or dtypes, or (for concrete parents) a parent that is
      not an earlier node, or a tree deeper than max_depth.
  """
  max_depth = check_inputs(parents, tokens, target_argmax, max_depth)
  parents, tokens, target_argmax = (jnp.asarray(x, jnp.int32)
                                    for x in (parents, tokens, target_argmax))
  return _reference_jit(parents, tokens, target_argmax, max_depth=max_depth)
