"""One skeleton that grows a static token tree from any model-like draft, one depth per forward.

A drafter supplies two things:
  * the draft's logits at the root (after it has caught up with the
    committed sequence), plus any per-entry carry it needs (EAGLE: the
    predicted feature ĥ; a token draft: nothing);
  * ``expand(tokens, carry, depth, mask)``: one draft forward over the T nodes
    of one depth, whose tokens sit at the end of a window of W = (nodes so
    far) slots after the root; ``mask`` [T, W] says which earlier nodes each
    sees (its ancestors and itself). It returns the nodes' logits and carry.

The skeleton picks each node's children from its logits: the top-c tokens
("point_mass", the EAGLE-2 / Medusa choice: deterministic, so verification
treats each as a point mass), or c draws without replacement from the warped
distribution by the Gumbel-top-k trick ("without_replacement", SpecInfer
style, verified with the real q). Nodes of the deepest level are never fed.

Node i of the topology is written by the draft at slot ``root + 1 + i``, the
same layout as the target's verify block, so ``kv_cache.compact`` with the
accepted path serves both caches.

Dynamic trees (EAGLE-2, ``grow_dynamic``) keep the same ``expand`` but choose
the shape per row: each depth feeds a frontier of the k best nodes so far (by
cumulative draft log-probability) under a per-row mask [B, k, W], and the N
best of all candidates become the proposal with per-row ``parents``. Sampled dynamic
trees (``grow_sampled``) keep static widths per depth and place each depth's draws before
reading them, which keeps recursive rejection with the real q exact.

Example (a two-level tree, point mass)::

    tree = TreeTopology((-1, -1, 0))      # the root's top-2, then node 0's top-1
    proposal, carry = grow(tree, sampler, key, root_logits, None, expand, draft_to_target)
    # proposal.tokens[b] = [top1(root), top2(root), top1(node 0)]
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import Greedy, Sampler, as_subset
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology

TREE_DRAWS = ("point_mass", "without_replacement")


def check_tree_draw(draw: str) -> None:
  """Raises ValueError unless ``draw`` is one of ``TREE_DRAWS`` (a drafter's ``tree_draw``)."""
  if draw not in TREE_DRAWS:
    raise ValueError(f"tree_draw must be one of {TREE_DRAWS}, got {draw!r}")

# expand(tokens [B, T] target ids, carry of the nodes' parents [B, T, ...], depth,
#        mask [T, W]) -> (logits [B, T, Vd], carry [B, T, ...])
Expand = Callable[[jax.Array, Any, int, np.ndarray], tuple[jax.Array, Any]]


def vocab_maps(vocab_map: Optional[jax.Array], vocab_size: int):
  """(draft row ids -> target ids, draft probabilities [..., Vd] -> the proposal's q) for
  ``grow``: ``SubsetProbs`` over ``vocab_map``, or identities without a reduced vocabulary
  (``vocab_map`` None)."""
  if vocab_map is None:
    return (lambda ids: ids), (lambda q: q)
  return (lambda ids: vocab_map[ids]), (lambda q: as_subset(q, vocab_map, vocab_size))


def _take(x: Any, idx: np.ndarray) -> Any:
  """Entries ``idx`` along axis 1 of every leaf of a carry pytree."""
  return jax.tree.map(lambda a: a[:, idx], x)


def grow(tree: TreeTopology, sampler: Sampler, key: jax.Array, root_logits: jax.Array,
         root_carry: Any, expand: Expand, to_target: Callable[[jax.Array], jax.Array],
         wrap_q: Optional[Callable[[jax.Array], Any]] = None,
         draw: str = "point_mass") -> Proposal:
  """Grows ``tree`` from the root's draft logits; returns the proposal.

  Args:
    tree: the static topology.
    sampler: the decoder's sampler (Greedy always gives point-mass children).
    key: PRNG key (used by "without_replacement" only).
    root_logits: [B, Vd] the draft's logits after the root.
    root_carry: pytree of [B, ...] arrays at the root (None if unused).
    expand: one draft forward per depth (see the module docstring).
    to_target: draft row ids -> target ids (identity without a reduced vocabulary).
    wrap_q: warped draft probabilities [..., Vd] -> the proposal's q (``vocab_maps``;
      needed for "without_replacement").
    draw: one of ``TREE_DRAWS``.
  """
  check_tree_draw(draw)
  sampled = draw == "without_replacement" and not isinstance(sampler, Greedy)
  bp = tree.block_parents
  ranks = np.asarray(tree.ranks)
  levels = tree.level_ranges
  logits = root_logits[:, None]  # [B, 1, Vd]: the logits of the previous level's entries
  carry = jax.tree.map(lambda a: a[:, None], root_carry)
  prev_start = -1  # block index of the previous level's first entry, minus one (root: 0)
  tokens, qs = [], []
  keys = jax.random.split(key, len(levels))
  for d, (start, stop) in enumerate(levels, start=1):
    local = bp[1 + start:1 + stop] - (prev_start + 1)  # parent's index within its level
    k = int(ranks[start:stop].max()) + 1
    if sampled:
      logq = jnp.log(sampler.probs(logits))  # [B, T_prev, Vd]; -inf outside the support
      perturbed = logq + jax.random.gumbel(keys[d - 1], logq.shape)
      ids = jax.lax.top_k(perturbed, k)[1]
      qs.append(jnp.exp(logq)[:, local])
    else:
      ids = jax.lax.top_k(logits, k)[1]  # [B, T_prev, k]
    level_tokens = to_target(ids[:, local, ranks[start:stop]]).astype(jnp.int32)  # [B, T]
    tokens.append(level_tokens)
    if d < len(levels):
      mask = tree.block_mask[1 + start:1 + stop, 1:1 + stop]  # [T, W]: earlier nodes + itself
      logits, carry = expand(level_tokens, _take(carry, local), d, mask)
    prev_start = start
  tokens = jnp.concatenate(tokens, axis=1)
  if sampled:
    return Proposal(tokens=tokens, q=wrap_q(jnp.concatenate(qs, axis=1)),
                    draw="without_replacement")
  return Proposal(tokens=tokens, draw="point_mass")


def grow_dynamic(tree: DynamicTree, root_logits: jax.Array, root_carry: Any, expand: Expand,
                 to_target: Callable[[jax.Array], jax.Array]) -> tuple[Proposal, jax.Array]:
  """Grows an EAGLE-2 dynamic tree from the root's draft logits.

  Scores are cumulative log-probabilities of the *raw* draft logits
  (temperature 1, as EAGLE-2): the tree is a deterministic function of the
  context, verified as point masses, so it is lossless under any sampler.
  Candidates ("the pool", P = k + (D - 1) k² entries, depth-major): the root's
  top-k (depth 1), then for each depth d < D the top-k children of each of
  the k frontier nodes of depth d (k² entries, score = parent's + log p). The
  frontier of depth 1 is the root's top-k; that of depth d + 1 the k best of
  depth d + 1's k² candidates. Frontier nodes of depth d < D are fed in one
  ``expand`` over window slots (d - 1) k … d k - 1 (W = d k; frontier node f
  of depth d sits at draft-cache slot root + 1 + (d - 1) k + f), each seeing
  its ancestors and itself. Finally the N best candidates (ties: smaller pool
  index, so a node's parent, which scores at least as high, always comes
  first) are kept in pool order, which is breadth-first.

  Args:
    tree: the static sizes (k, D, N).
    root_logits: [B, Vd] the draft's logits after the root.
    root_carry: pytree of [B, ...] arrays at the root (None if unused).
    expand: one draft forward per depth (module docstring), here with a per-row
      mask [B, k, W].
    to_target: draft row ids -> target ids.

  Returns:
    (the point-mass proposal with per-row ``parents`` [B, N], slots [B, N]:
    each node's draft-cache slot offset from the root, 1 + (d - 1) k + f, or
    -1 for a node that was never fed).
  """
  k, depth, n = tree.top_k, tree.max_depth, tree.num_nodes
  b, vd = root_logits.shape
  if k > vd:
    raise ValueError(f"DynamicTree top_k={k} exceeds the draft's {vd} rows")
  rows = jnp.arange(b)[:, None]
  front_scores, front_ids = jax.lax.top_k(jax.nn.log_softmax(root_logits.astype(jnp.float32)), k)
  scores, ids, pool_parent = [front_scores], [front_ids], [jnp.full((b, k), -1, jnp.int32)]
  slots = jnp.full((b, tree.pool_size), -1, jnp.int32)
  front_pool = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # pool index per node
  carry = jax.tree.map(lambda a: jnp.repeat(a[:, None], k, axis=1), root_carry)
  mask = jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))  # [B, k, W]: ancestors + itself
  for d in range(1, depth):
    base = k + (d - 1) * k * k  # pool index of depth d + 1's first candidate
    logits, out_carry = expand(to_target(front_ids).astype(jnp.int32), carry, d, mask)
    slots = slots.at[rows, front_pool].set(1 + (d - 1) * k + jnp.arange(k, dtype=jnp.int32))
    child_logp, child_ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), k)
    child_scores = (front_scores[:, :, None] + child_logp).reshape(b, k * k)
    child_ids = child_ids.reshape(b, k * k)
    scores.append(child_scores)
    ids.append(child_ids)
    pool_parent.append(jnp.repeat(front_pool, k, axis=1))
    if d + 1 < depth:  # the next frontier (the deepest level is never fed)
      front_scores, best = jax.lax.top_k(child_scores, k)
      front_ids = jnp.take_along_axis(child_ids, best, axis=1)
      front_pool = (base + best).astype(jnp.int32)
      parent = best // k  # index of each new frontier node's parent in the old frontier
      carry = jax.tree.map(lambda a: jnp.take_along_axis(
          a, parent.reshape(parent.shape + (1,) * (a.ndim - 2)), axis=1), out_carry)
      mask = jnp.concatenate([jnp.take_along_axis(mask, parent[:, :, None], axis=1),
                              jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))], axis=2)
  scores, ids = jnp.concatenate(scores, axis=1), jnp.concatenate(ids, axis=1)
  chosen, parents = keep_best(scores, jnp.concatenate(pool_parent, axis=1), n)
  tokens = to_target(jnp.take_along_axis(ids, chosen, axis=1)).astype(jnp.int32)
  proposal = Proposal(tokens=tokens, parents=parents, draw="point_mass")
  return proposal, jnp.take_along_axis(slots, chosen, axis=1)


def slot_scores(value: jax.Array, q_ids: jax.Array) -> jax.Array:
  """[B, P, k] the score of each draw slot of ``grow_sampled``: V(parent) times the q-mass not
  yet drawn before the slot (−1 outside q's support). Reads no draw at or after its slot, and
  never rises along a parent's slots (a running minimum: float rounding of the sums, or a
  negative V, could otherwise let a later draw outscore an earlier one)."""
  before = jnp.maximum(1.0 - (jnp.cumsum(q_ids, axis=-1) - q_ids), 0.0)
  return jax.lax.cummin(jnp.where(q_ids > 0, value[:, :, None] * before, -1.0), axis=2)


def grow_sampled(tree: SampledDynamicTree, sampler: Sampler, key: jax.Array,
                 root_logits: jax.Array, root_carry: Any, expand: Expand,
                 to_target: Callable[[jax.Array], jax.Array],
                 wrap_q: Callable[[jax.Array], Any]) -> Proposal:
  """Grows a sampled dynamic tree (``SampledDynamicTree``) from the root's draft logits.

  Depth by depth: every node of the previous depth (the root first) draws k =
  ``tree.max_children`` children without replacement from the warped draft law q
  (Gumbel-top-k; a greedy sampler takes its top-k, scored by the raw softmax as EAGLE-2),
  the j-th draw under node v is scored π = V(v) · (1 − Σ_{i<j} q(x_i)) (V(root) = 1,
  a draw outside q's support −1; ``slot_scores``), and the ``widths[d - 1]`` best scores of
  the depth are kept (ties: the earlier draw), in (parent, draw) order: each node's kept
  children are its first draws, in the order recursive rejection tries them. A kept node's V
  is its own π.
  Neither the choice nor the order reads a draw before it is kept, so the number of
  siblings kept under a node is a stopping time of its draws: the condition under which
  SpecInfer / Sequoia verification with the real q is exact. Nodes are fed at draft slot
  root + 1 + their index (W = nodes so far), like a static tree's.

  Returns:
    the proposal with per-row ``parents`` [B, N] (breadth-first) and, when sampling, the
    law q [B, N, V] each node was drawn from (its parent's, before removal; ``SubsetProbs``
    [B, N, Vd] over a reduced vocabulary).
  """
  sampled = not isinstance(sampler, Greedy)
  b, vd = root_logits.shape
  k = min(tree.max_children, vd)
  for d, (prev, width) in enumerate(zip((1,) + tree.widths, tree.widths), start=1):
    if width > prev * k:
      raise ValueError(f"{tree} keeps {width} nodes at depth {d}, more than the {prev} × {k} "
                       f"draws of a draft of {vd} rows")
  logits = root_logits[:, None]  # [B, P, Vd]: the previous depth's nodes (the root first)
  value = jnp.ones((b, 1), jnp.float32)
  carry = jax.tree.map(lambda a: a[:, None], root_carry)
  mask = jnp.zeros((b, 1, 0), bool)  # [B, P, W]: each previous node's ancestors + itself
  keys = jax.random.split(key, tree.max_depth)
  tokens, qs, parents, prev_first = [], [], [], 0  # prev_first: the previous depth's first node
  for d, width in enumerate(tree.widths, start=1):
    prev = logits.shape[1]
    if sampled:
      q = sampler.probs(logits)  # [B, P, Vd]
      perturbed = jnp.log(q) + jax.random.gumbel(keys[d - 1], q.shape)
      ids = jax.lax.top_k(perturbed, k)[1]
    else:
      q = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
      ids = jax.lax.top_k(logits, k)[1]
    q_ids = jnp.take_along_axis(q, ids, axis=-1)  # [B, P, k]
    score = slot_scores(value, q_ids).reshape(b, prev * k)
    chosen = jnp.sort(jax.lax.top_k(score, width)[1], axis=1)  # [B, width]
    local = chosen // k  # each kept node's parent among the previous depth's nodes
    level = to_target(jnp.take_along_axis(ids.reshape(b, prev * k), chosen, axis=1))
    level = level.astype(jnp.int32)
    tokens.append(level)
    parents.append((jnp.full_like(local, -1) if d == 1 else prev_first + local).astype(jnp.int32))
    if sampled:
      qs.append(jnp.take_along_axis(q, local[:, :, None], axis=1))
    value = jnp.take_along_axis(score, chosen, axis=1)
    mask = jnp.concatenate([jnp.take_along_axis(mask, local[:, :, None], axis=1),
                            jnp.broadcast_to(jnp.eye(width, dtype=bool), (b, width, width))],
                           axis=2)
    if d < tree.max_depth:
      logits, carry = expand(level, jax.tree.map(lambda a: jnp.take_along_axis(
          a, local.reshape(local.shape + (1,) * (a.ndim - 2)), axis=1), carry), d, mask)
    if d > 1:
      prev_first += prev
  tokens, parents = jnp.concatenate(tokens, axis=1), jnp.concatenate(parents, axis=1)
  if sampled:
    return Proposal(tokens=tokens, q=wrap_q(jnp.concatenate(qs, axis=1)), parents=parents,
                    draw="without_replacement")
  return Proposal(tokens=tokens, parents=parents, draw="point_mass")


def grow_tree(tree: TreeTopology | DynamicTree | SampledDynamicTree, sampler: Sampler,
              key: jax.Array, root_logits: jax.Array, root_carry: Any, expand: Expand,
              to_target: Callable[[jax.Array], jax.Array],
              wrap_q: Callable[[jax.Array], Any],
              draw: str) -> tuple[Proposal, Optional[jax.Array]]:
  """Any tree a model-like draft grows: a static topology (``grow``, its children by
  ``draw``), an EAGLE-2 ``DynamicTree`` (``grow_dynamic``) or a ``SampledDynamicTree``
  (``grow_sampled``). Returns (the proposal, the nodes' draft slots [B, N] for an EAGLE-2
  tree, else None: node i at slot root + 1 + i)."""
  if isinstance(tree, DynamicTree):
    return grow_dynamic(tree, root_logits, root_carry, expand, to_target)
  if isinstance(tree, SampledDynamicTree):
    return grow_sampled(tree, sampler, key, root_logits, root_carry, expand, to_target,
                        wrap_q), None
  return grow(tree, sampler, key, root_logits, root_carry, expand, to_target, wrap_q,
              draw), None


def keep_best(scores: jax.Array, pool_parent: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """The ``n`` best entries of a candidate pool per row, as a tree.

  The pool is breadth-first (a parent before its children) and no child scores above its
  parent; ties go to the smaller index (``jax.lax.top_k`` keeps index order), so every kept
  entry's parent is kept too.

  Args:
    scores: [B, P] each candidate's score.
    pool_parent: [B, P] or [P] each candidate's parent's pool index, −1 at depth 1.
    n: N <= P.

  Returns:
    (chosen [B, N] pool indices in pool order, which is breadth-first; parents [B, N] int32,
    each kept entry's parent as an index into ``chosen``, −1 at depth 1).
  """
  b, p = scores.shape
  chosen = jnp.sort(jax.lax.top_k(scores, n)[1], axis=1)
  node_of = jnp.full((b, p), -1, jnp.int32).at[jnp.arange(b)[:, None], chosen].set(
      jnp.arange(n, dtype=jnp.int32))
  par = jnp.take_along_axis(jnp.broadcast_to(pool_parent, (b, p)), chosen, axis=1)
  parents = jnp.where(par >= 0, jnp.take_along_axis(node_of, jnp.maximum(par, 0), axis=1), -1)
  return chosen, parents.astype(jnp.int32)
