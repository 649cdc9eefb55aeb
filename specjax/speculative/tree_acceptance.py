"""Lossless acceptance of a token tree: which path the target keeps, and the next token.

Inputs: a ``Proposal`` of N nodes (tokens, how they were drawn) and the
target's warped distributions ``p`` [B, N + 1, V] at every block entry
(p[:, 0] after the root, p[:, i + 1] after node i). Output: the accepted path
from the root, its length n (draft tokens accepted, 0..D) and one more token
drawn from the target's (residual) distribution, so every step emits n + 1
tokens (the "+1 bonus/correction" convention of ``metrics``).

The rules (all exact: the emitted tokens are distributed as the target's):

  chain, "sampled"     Leviathan/Chen modified rejection sampling
                       (``acceptance.accept``), bit-identical to the chain loop.
  chain, block=True    block verification (``block_verification``, Sun et al.
                       2024): the chain is judged jointly; never fewer tokens
                       per step in expectation. q of a point-mass chain is one-hot.
  tree, block=True     traversal verification (``traversal_verification``, Weng
                       et al. 2025): paths judged jointly, leaves first; on a
                       chain, block verification's law.
  greedy (one-hot p)   the deepest node whose path equals the target's argmax
                       at every step (ties: smallest index), then the argmax.
                       On GPU and TPU the walk over the tree runs in the
                       Pallas kernel pallas_kernels/tree_verify, elsewhere in
                       jnp: the same result (``accept_greedy``, ``impl``).
  recursive rejection  walk from the root; at each node try its children in
                       index order. Child x (drawn from q) is accepted with
                       probability min(1, r(x) / q(x)), where r is the current
                       residual; on acceptance the walk moves to x and r = p
                       there; on rejection r <- norm(max(r - q, 0)) and, for
                       siblings drawn without replacement, q <- norm(q with x
                       removed) (SpecInfer's multi-step speculative sampling;
                       Sequoia's without-replacement fix). Point-mass q makes
                       this the EAGLE/SGLang rule: accept x with probability
                       r(x), else remove x from r. When no child is accepted
                       the next token is drawn from r.

Worked example (point mass, V = 3): the root's children propose tokens 0 then
1 and p_root = (0.5, 0.3, 0.2). Token 0 is kept with probability 0.5; else r =
(0, 0.6, 0.4) and token 1 is kept with probability 0.6; else r = (0, 0, 1) and
token 2 is emitted. P(0) = 0.5, P(1) = 0.5·0.6 = 0.3, P(2) = 0.2 — exactly p.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from specjax import sharding
from specjax.attention import ACCELERATORS, pallas_variant
from specjax.sampling import first_argmax, sample_from
from specjax.speculative import acceptance as chain_rule
from specjax.speculative.acceptance import finite_probs, normalized, support_view
from specjax.speculative.block_verification import accept_block
from specjax.speculative.proposal import Proposal
from specjax.speculative.traversal_verification import traverse
from specjax.speculative.tree import (TreeTopology, block_parents_from_parents, node_arrays,
                                      path_to)


class TreeAcceptance(NamedTuple):
  """Outcome of verifying one tree.

  Attributes:
    path: [B, D + 1] block indices of the accepted path, root (0) first,
      -1 past its end (entries 1..n are accepted draft nodes, node = index - 1).
    num_accepted: [B] n, draft tokens accepted (0..D).
    next_token: [B] the token drawn after the path (correction or bonus).
    beta: [B, D] β = Σ min(p, q) per depth for chains of sampled drafts (the
      paper's α = E[β]); zeros for other trees, where no single q applies.
  """

  path: jax.Array
  num_accepted: jax.Array
  next_token: jax.Array
  beta: jax.Array


class AcceptedPath(NamedTuple):
  """What ``rollback`` learns about a verification.

  Attributes:
    start: [B] position of the root (the committed length − 1 before the step).
    path: [B, D + 1] block indices of the accepted path (root 0 first, -1 past n).
    num_accepted: [B] accepted draft nodes n.
  """

  start: jax.Array
  path: jax.Array
  num_accepted: jax.Array


GREEDY_IMPLS = ("auto", "reference", "pallas", "pallas_tpu", "pallas_gpu",
                "pallas_tpu_interpret", "pallas_gpu_interpret")
# The TPU kernel scalar-prefetches its three [B, N + 1] int32 inputs into SMEM; a batch
# that would take more than this many words (16 KiB) is verified in slices of rows.
TPU_SMEM_WORDS = 4096

_logged: set[tuple[str, str, str]] = set()


def resolve_greedy_impl(impl: str, backend: str | None = None) -> str:
  """Maps a greedy verification implementation to a concrete one (never "auto" or "pallas").

  "reference" is the jnp rule of ``accept_greedy``; "pallas_tpu" and "pallas_gpu" are
  the kernels of ``pallas_kernels.tree_verify`` (``*_interpret``: the same kernels in
  Pallas interpret mode, on CPU: tests, debugging); "pallas" is whichever matches the
  backend; "auto" is "pallas" on TPU and GPU and the reference elsewhere (as
  ``specjax.attention.resolve_impl``); under a multi-device mesh a kernel runs on each
  device's rows (``sharding.per_device``). The choice is logged once per (name, backend).

  Raises:
    ValueError: unknown name, or "pallas" on a backend without a kernel.
  """
  if impl not in GREEDY_IMPLS:
    raise ValueError(f"unknown greedy verification implementation {impl!r}; expected one of "
                     f"{GREEDY_IMPLS}")
  backend = backend or jax.default_backend()
  resolved = impl
  if impl == "auto":
    resolved = "pallas" if backend in ACCELERATORS else "reference"
  if resolved == "pallas":
    resolved = pallas_variant(backend, "tree verification")
  if (impl, resolved, backend) not in _logged:
    _logged.add((impl, resolved, backend))
    logging.info("specjax greedy tree verification: impl=%r -> %r on %s", impl, resolved,
                 backend)
  return resolved


def accept_greedy(proposal: Proposal, p: jax.Array, topology: TreeTopology, *,
                  impl: str = "auto", target: Optional[jax.Array] = None) -> TreeAcceptance:
  """The deepest path agreeing with the target's argmax (``p`` one-hot or not).

  Args:
    proposal: the drafter's N nodes (static or per-row parents).
    p: [B, N + 1, V] the target's distributions at each block entry.
    topology: the static topology (for dynamic trees: N and the maximum depth).
    impl: static, see ``resolve_greedy_impl``: "auto" walks the tree in
      ``pallas_kernels.tree_verify`` on TPU and GPU and in the jnp rule below
      elsewhere. Both take the same argmax of ``p`` and give the same path, n and
      next token (tests/test_tree_verify.py).
    target: [B, N + 1] the argmax of ``p`` (first maximal id), where the caller has it;
      ``p`` is then not read.
  """
  b, n = proposal.tokens.shape
  target = first_argmax(p) if target is None else target.astype(jnp.int32)  # [B, N+1]
  resolved = resolve_greedy_impl(impl)
  if resolved != "reference":
    return _greedy_by_kernel(proposal, target, topology, resolved)
  par, mask, depth = node_arrays(topology, b, proposal.parents)
  match = proposal.tokens == jnp.take_along_axis(target, par, axis=1)  # [B, N]
  match = jnp.concatenate([jnp.ones((b, 1), bool), match], axis=1)
  ok = ~jnp.any(mask & ~match[:, None, :], axis=-1)  # every ancestor-or-self matches
  score = jnp.where(ok, depth * (n + 2) - jnp.arange(n + 1)[None, :], -1)
  best = jnp.argmax(score, axis=1).astype(jnp.int32)
  path = path_to(best, mask, depth, topology.max_depth)
  n_acc = jnp.take_along_axis(depth, best[:, None], axis=1)[:, 0]
  next_token = jnp.take_along_axis(target, best[:, None], axis=1)[:, 0]
  return TreeAcceptance(path=path, num_accepted=n_acc, next_token=next_token,
                        beta=jnp.zeros((b, topology.max_depth), jnp.float32))


def _greedy_by_kernel(proposal: Proposal, target: jax.Array, topology: TreeTopology,
                      impl: str) -> TreeAcceptance:
  """``accept_greedy`` through a ``pallas_kernels.tree_verify`` kernel ("pallas_tpu",
  "pallas_gpu" or their ``*_interpret``), given the argmax ``target`` [B, N + 1].

  The kernel's tree is the verified block itself: node 0 is the root (parent -1, a
  token it never reads) and node i + 1 is draft node i, so its path is already in
  block indices and its rule (deepest accepted node, ties to the smallest index) is
  the jnp rule's. Example: topology (-1, -1, 0) and tokens [[7, 3, 9]] give the
  kernel parents [[-1, 0, 0, 1]] and tokens [[-1, 7, 3, 9]].
  """
  from pallas_kernels.tree_verify import tree_verify_gpu, tree_verify_tpu

  b, n = proposal.tokens.shape
  d = topology.max_depth
  if proposal.parents is None:
    parents = jnp.broadcast_to(jnp.asarray(topology.block_parents), (b, n + 1))
  else:
    parents = block_parents_from_parents(proposal.parents)
  tokens = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32),
                            proposal.tokens.astype(jnp.int32)], axis=1)

  def verify(parents, tokens, target):  # on each device's rows under a mesh
    if impl.startswith("pallas_tpu"):
      from jax.experimental.pallas import tpu as pltpu
      interpret = pltpu.InterpretParams() if impl.endswith("_interpret") else False
      rows = max(1, TPU_SMEM_WORDS // (3 * (n + 1)))
      parts = [tree_verify_tpu(parents[i:i + rows], tokens[i:i + rows], target[i:i + rows],
                               max_depth=d, interpret=interpret)
               for i in range(0, parents.shape[0], rows)]
      return tuple(jnp.concatenate(x) for x in zip(*parts))
    return tuple(tree_verify_gpu(parents, tokens, target, max_depth=d,
                                 interpret=impl.endswith("_interpret")))

  by_row = ("batch", None)
  path, length, next_token = sharding.per_device(
      verify, (parents, tokens, target), (by_row,) * 3, (by_row, ("batch",), ("batch",)),
      {"batch": b})
  return TreeAcceptance(path=path, num_accepted=length, next_token=next_token,
                        beta=jnp.zeros((b, d), jnp.float32))


def _accept_point_mass(key, proposal, p, topology) -> TreeAcceptance:
  """Recursive rejection with point-mass q: O(N^2) scalar work plus one [B, V] draw."""
  b, n = proposal.tokens.shape
  par, mask, depth = node_arrays(topology, b, proposal.parents)
  u_key, s_key = jax.random.split(key)
  u = jax.random.uniform(u_key, (b, n))
  tok = proposal.tokens
  rows = jnp.arange(b)
  # p at each node's parent, of the node's own token: [B, N+1, N] (entry, node) is
  # all the rule ever reads, besides the final draw.
  p_tok = jnp.take_along_axis(p, jnp.broadcast_to(tok[:, None, :], (b, n + 1, n)), axis=2)
  total = jnp.sum(p, axis=-1)  # [B, N+1]

  def body(carry, j):
    cur, mass, rejected = carry
    t = tok[:, j]
    is_child = par[:, j] == cur
    excluded = jnp.any(rejected & (tok == t[:, None]), axis=1)
    pt = jnp.where(excluded, 0.0, p_tok[rows, cur, j])
    ok = u[:, j] * mass < pt
    acc, rej = is_child & ok, is_child & ~ok
    cur = jnp.where(acc, j + 1, cur)
    mass = jnp.where(acc, total[rows, j + 1], jnp.where(rej, mass - pt, mass))
    rejected = jnp.where(acc[:, None], False, rejected.at[:, j].set(rejected[:, j] | rej))
    return (cur, mass, rejected), None

  init = (jnp.zeros((b,), jnp.int32), total[:, 0], jnp.zeros((b, n), bool))
  (cur, _, rejected), _ = jax.lax.scan(body, init, jnp.arange(n))
  residual = jnp.take_along_axis(p, cur[:, None, None], axis=1)[:, 0]
  drop = jnp.where(rejected, tok, p.shape[-1])  # rejected siblings of the final node
  residual = residual.at[rows[:, None], drop].set(0.0, mode="drop")
  path = path_to(cur, mask, depth, topology.max_depth)
  n_acc = jnp.take_along_axis(depth, cur[:, None], axis=1)[:, 0]
  return TreeAcceptance(path=path, num_accepted=n_acc, next_token=sample_from(s_key, residual),
                        beta=jnp.zeros((b, topology.max_depth), jnp.float32))


def _accept_sampled(key, proposal, p, topology) -> TreeAcceptance:
  """Recursive rejection with the drafter's real q (SpecInfer; without replacement: Sequoia).

  The residual r is kept unnormalised on q's support (K entries: the vocabulary, or a
  ``SubsetProbs``' ids) with its total mass z, the mass outside the support being the
  current entry's p there, which subtracting q never changes: r's value at x is r_K(x) / z.
  So a rejection, r <- norm(max(r - q, 0)), is r_K <- max(r_K - q z, 0) with z <- (p's
  mass outside) + Σ r_K, and only the final draw reads a [B, V] row.
  """
  b, n = proposal.tokens.shape
  par, mask, depth = node_arrays(topology, b, proposal.parents)
  u_key, s_key = jax.random.split(key)
  u = jax.random.uniform(u_key, (b, n))
  without = proposal.draw == "without_replacement"
  q_k, p_k, ids = support_view(proposal.q, p)  # [B, N, K], [B, N + 1, K]
  if ids is None:
    slot, found = proposal.tokens, jnp.ones((b, n), bool)
    outside = jnp.zeros(p.shape[:2], p.dtype)
  else:
    slot, found = proposal.q.slots(proposal.tokens)  # q is 0 at a token outside the ids
    outside = chain_rule.mass_outside(p, ids)  # [B, N + 1]
  total = jnp.sum(p, axis=-1)  # [B, N + 1]

  def body(carry, xs):
    cur, r, z, out, q_run, fresh = carry
    j, t, in_q, q_j, p_next, z_next, out_next, u_j, par_j = xs
    if without:  # later siblings are drawn from q minus the earlier siblings' tokens
      q_j = jnp.where(fresh[:, None], q_j, q_run)
    q_t = jnp.where(in_q, jnp.take_along_axis(q_j, t[:, None], axis=1)[:, 0], 0.0)
    # A node with q = 0 was never a draw (e.g. padding past q's support): skip it.
    is_child = (par_j == cur) & (q_t > 0)
    r_t = jnp.take_along_axis(r, t[:, None], axis=1)[:, 0]
    ok = u_j * q_t * z < r_t  # u < r(x) / q(x), r(x) = r_t / z
    acc, rej = is_child & ok, is_child & ~ok
    rest = jnp.maximum(r - q_j * z[:, None], 0.0)
    z_rest = out + jnp.sum(rest, axis=-1)
    shrink = rej & (z_rest > 0)  # no mass left: r = q, where rejection has probability 0
    cur = jnp.where(acc, j + 1, cur)
    r = jnp.where(acc[:, None], p_next, jnp.where(shrink[:, None], rest, r))
    z = jnp.where(acc, z_next, jnp.where(shrink, z_rest, z))
    out = jnp.where(acc, out_next, out)
    if without:
      removed = q_j.at[jnp.arange(b), t].set(0.0)
      q_run = jnp.where(rej[:, None], normalized(removed, jnp.zeros_like(removed)), q_run)
      fresh = jnp.where(acc, True, jnp.where(rej, False, fresh))
    return (cur, r, z, out, q_run, fresh), None

  xs = (jnp.arange(n), slot.T, found.T, jnp.moveaxis(q_k, 1, 0), jnp.moveaxis(p_k[:, 1:], 1, 0),
        total[:, 1:].T, outside[:, 1:].T, u.T, par.T)
  init = (jnp.zeros((b,), jnp.int32), p_k[:, 0], total[:, 0], outside[:, 0],
          jnp.zeros_like(p_k[:, 0]), jnp.ones((b,), bool))
  (cur, r, _, _, _, _), _ = jax.lax.scan(body, init, xs)
  if ids is not None:  # r's entries placed in the final entry's p row
    r = jnp.take_along_axis(p, cur[:, None, None], axis=1)[:, 0].at[:, ids].set(r)
  path = path_to(cur, mask, depth, topology.max_depth)
  n_acc = jnp.take_along_axis(depth, cur[:, None], axis=1)[:, 0]
  return TreeAcceptance(path=path, num_accepted=n_acc, next_token=sample_from(s_key, r),
                        beta=jnp.zeros((b, topology.max_depth), jnp.float32))


def accept_tree(key: jax.Array, proposal: Proposal, p: jax.Array, topology: TreeTopology,
                *, greedy: bool = False, block: bool = False,
                greedy_impl: str = "auto",
                target_argmax: Optional[jax.Array] = None) -> TreeAcceptance:
  """Runs the lossless rule that matches the proposal (see the module docstring).

  Args:
    key: PRNG key (unused by the greedy rule).
    proposal: the drafter's nodes; ``proposal.tokens`` is [B, N] with N =
      ``topology.num_nodes``.
    p: [B, N + 1, V] the target's warped distributions at each block entry.
    topology: the static topology (for dynamic trees: N and the maximum depth).
    greedy: the target decodes greedily (p one-hot): take the argmax rule, which for a
      chain gives what the chain rule gives with one-hot p and q (β included) without
      the chain rule's draw over the vocabulary.
    block: judge the drafts jointly instead of token by token: a chain by
      ``block_verification``, a tree by ``traversal_verification``.
    greedy_impl: static, where the greedy rule walks the tree (``resolve_greedy_impl``).
    target_argmax: with ``greedy``, [B, N + 1] the argmax of ``p`` where the caller has it
      (the greedy rule then reads no distribution).
  """
  b, n = proposal.tokens.shape
  if n != topology.num_nodes or p.shape[:2] != (b, n + 1):
    raise ValueError(f"proposal of {n} nodes and p of shape {p.shape} do not match the topology "
                     f"of {topology.num_nodes} nodes")
  if target_argmax is not None and target_argmax.shape != (b, n + 1):
    raise ValueError(f"target_argmax of shape {target_argmax.shape}, want {(b, n + 1)}")
  p = finite_probs(p)
  chain_of_draws = proposal.parents is None and topology.is_chain and proposal.draw == "sampled"
  if greedy:
    acc = accept_greedy(proposal, p, topology, impl=greedy_impl, target=target_argmax)
    if chain_of_draws:  # the chain rule's β, without its (here deterministic) residual draw
      acc = acc._replace(beta=chain_rule.overlap(p[:, :n], proposal.q))
    return acc
  if block and (proposal.parents is not None or not topology.is_chain):
    walk, next_token = traverse(key, proposal, p, topology)
    return TreeAcceptance(path=walk.path, num_accepted=walk.num_accepted, next_token=next_token,
                          beta=jnp.zeros((b, topology.max_depth), jnp.float32))
  if block:
    q = (jax.nn.one_hot(proposal.tokens, p.shape[-1], dtype=p.dtype)
         if proposal.q is None else proposal.q)
    acc = accept_block(key, proposal.tokens, q, p)
  elif chain_of_draws:
    acc = chain_rule.accept(key, proposal.tokens, proposal.q, p)
  if block or chain_of_draws:
    levels = jnp.arange(n + 1)[None, :]
    path = jnp.where(levels <= acc.num_accepted[:, None], levels, -1).astype(jnp.int32)
    return TreeAcceptance(path=path, num_accepted=acc.num_accepted, next_token=acc.next_token,
                          beta=acc.beta)
  if proposal.draw == "point_mass":
    return _accept_point_mass(key, proposal, p, topology)
  return _accept_sampled(key, proposal, p, topology)


def node_ranks(proposal: Proposal, topology: TreeTopology) -> jax.Array:
  """[B, N] each node's rank among its siblings, the order recursive rejection tries them
  in (static trees: the topology's)."""
  b, n = proposal.tokens.shape
  if proposal.parents is None:
    return jnp.broadcast_to(jnp.asarray(topology.ranks, jnp.int32), (b, n))
  par = proposal.parents
  earlier = jnp.tril(jnp.ones((n, n), bool), -1)[None]  # earlier[i, j]: j < i
  return jnp.sum(earlier & (par[:, :, None] == par[:, None, :]), axis=-1).astype(jnp.int32)


def first_chain_beta(proposal: Proposal, p: jax.Array,
                     topology: TreeTopology) -> tuple[jax.Array, jax.Array]:
  """The first-ranked chain's acceptance probabilities under recursive rejection.

  The first-ranked chain is the root's rank-0 child, its rank-0 child, and so on. Each of
  its nodes is its parent's first child tried, so when the walk reaches its parent it is
  accepted with probability β = min(1, p(x) / q(x)) (point-mass q: p(x)), p the target's
  distribution at the parent and x the node's token: a number fixed before its flip, which
  an adaptive policy counts in place of the flip (``AdaptiveGamma.evidence``).

  Args:
    proposal: the drafter's nodes (point-mass or sampled).
    p: [B, N + 1, V] the target's warped distributions at each block entry.
    topology: the static topology (for dynamic trees: N and the maximum depth).

  Returns:
    (beta [B, D]: the chain's node at depth d + 1's β, 0 past the chain's end;
    length [B]: the chain's depth in each row).
  """
  b, n = proposal.tokens.shape
  d = topology.max_depth
  p = finite_probs(p)
  par, _, depth = node_arrays(topology, b, proposal.parents)
  first = node_ranks(proposal, topology) == 0
  lead = first & (par == 0)
  for _ in range(d - 1):  # down one level per pass (parents come before their children)
    above = jnp.take_along_axis(lead, jnp.maximum(par - 1, 0), axis=1)
    lead = first & ((par == 0) | ((par > 0) & above))
  rows = jnp.arange(b)[:, None]
  p_t = p[rows, par, proposal.tokens]  # [B, N] p at each node's parent, of its token
  if proposal.q is None:  # accepted with probability p(x) over the parent's mass
    mass = jnp.sum(p, axis=-1)[rows, par]
    r = p_t / jnp.where(mass > 0, mass, 1.0)
  else:  # with min(1, p(x) / q(x)); a node with q = 0 was never a draw (skipped)
    q_t = chain_rule.probs_at(proposal.q, proposal.tokens)
    r = jnp.where(q_t > 0, p_t / jnp.where(q_t > 0, q_t, 1.0), 0.0)
  beta = jnp.minimum(r, 1.0)
  at = lead[:, None, :] & (depth[:, None, 1:] == jnp.arange(1, d + 1)[None, :, None])
  return (jnp.sum(jnp.where(at, beta[:, None, :], 0.0), axis=-1),
          jnp.sum(jnp.any(at, axis=-1), axis=-1).astype(jnp.int32))


def accepted_tokens(proposal: Proposal, acc: TreeAcceptance) -> jax.Array:
  """[B, D + 1]: the accepted draft tokens in order, then ``next_token`` at index n.

  Entries past n are undefined (the next token repeated).
  """
  node = jnp.maximum(acc.path[:, 1:] - 1, 0)  # [B, D]
  drafted = jnp.take_along_axis(proposal.tokens, node, axis=1)
  levels = jnp.arange(drafted.shape[1] + 1)[None, :]
  padded = jnp.concatenate([drafted, drafted[:, :1]], axis=1)
  return jnp.where(levels < acc.num_accepted[:, None], padded, acc.next_token[:, None])
