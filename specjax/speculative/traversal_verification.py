"""Traversal verification (Weng et al. 2025): a token tree judged path by path, leaves first.

Recursive rejection (``tree_acceptance``) walks a tree from the root and decides each node
on its own. Traversal verification decides whole paths, as block verification
(``block_verification``, Sun et al. 2024) does for a chain, and on a chain it *is* block
verification. Each block entry v (the root or a node) carries a weight aᵥ, the target's
law Pᵥ of the token after it and the law Qᵥ its remaining children were drawn from. A child
c of v, on being reached, gets

    a_c = min(1, aᵥ · Pᵥ(c) / Qᵥ(c)),      a_root = 1,

with P_c the target's distribution after c and Q_c the draft's there. The tree is walked
depth first, children in index order (the order their draws were made). A node whose
subtree is used up is tested: with probability a it is accepted, its whole path from the
root is kept and the next token is drawn from its P. Otherwise it is deleted and its
parent v learns of it:

    Z   = Σₓ max(0, aᵥ Pᵥ(x) − Qᵥ(x)),
    Pᵥ ← norm(max(0, aᵥ Pᵥ − Qᵥ)),   aᵥ ← Z / (Z + 1 − aᵥ),
    Qᵥ ← Qᵥ without the deleted token, renormalised (siblings drawn without replacement;
         unchanged for independent draws, and a point mass at the next sibling's token
         for deterministic children),

then the walk goes on with v's next child, or tests v itself when it has none left. The
root always passes (its weight stays 1), so every step emits at least one token.

Why it is exact (the argument, written out; ``tests/test_traversal_verification.py``
checks it by enumerating every draft of small trees): call a subtree at v with weight a
*fair* if it ends accepted with probability exactly a, averaged over the draws below v,
and the tokens it then emits after v are the target's (a stopped run of it). A leaf is
fair. If v's children are fair, the first child c ~ Q is accepted with probability
Σ_c Q(c) min(1, aP(c)/Q(c)) = Σ min(Q, aP), emitting c first with mass min(Q(c), aP(c));
it fails with probability 1 − a + Z whatever c was, so what remains to be emitted,
max(0, aP − Q) of total Z, is what the updated v (P ← norm(max(0, aP − Q)), a ← Z / (1 −
a + Z), its later children drawn from the updated Q) emits when fair: by induction v is
fair, and the root, with a = 1, always emits the target's tokens. The update reads only
laws, never a rejected draw's token beyond removing it from Q, which is why the weight
after a failure may not depend on the failed token.

On a chain the tests come in the order γ, γ − 1, …, with the weights h of block
verification, so the emitted law is block verification's (tested). The paper reports 2–6%
longer acceptances than recursive rejection on sampled trees; ``expected_tokens`` here and
in ``benchmarks/traversal_verification.py`` compare the two on real drafts.

Worked example (one node, V = 2): the root's child is token 0, drawn from Q = (½, ½), and
P = (¾, ¼). a₀ = min(1, ¾ / ½) = 1: token 0 is always kept. With token 1 drawn instead,
a₁ = ½: kept half the time; else the root's Z = Σ max(0, P − Q) = ¼, its residual is
(1, 0) and its weight ¼ / (¼ + 1 − 1) = 1, so token 0 is emitted. Token 0 comes out with
probability ½ + ½ · ½ = ¾ and token 1 with ¼: exactly P.

Static shapes: the walk is a ``lax.scan`` of 2N steps (each node is entered once and
left once; a node with Q = 0 at its token was never a draw and is skipped, with its
subtree, in one step). The state keeps one (a, P, Q) per depth along the current path:
[B, D + 1, K] for a draft law over K ids (the vocabulary, or a ``SubsetProbs``' ids).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.sampling import SubsetProbs, sample_from
from specjax.speculative.acceptance import finite_probs, mass_outside, support_view
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import TreeTopology, node_arrays


class Traversal(NamedTuple):
  """Where a traversal stopped, and the law of each stop.

  Attributes:
    entry: [B] the accepted block entry (0: the root, node i: i + 1).
    residual: [B, V] the (unnormalised) law of the next token at ``entry``.
    stop: [B, N + 1] the probability that the traversal stops at each block entry, given
      the drafts (the coins integrated out; sums to 1 per row).
  """

  entry: jax.Array
  residual: jax.Array
  stop: jax.Array


def _walk(proposal: Proposal, p: jax.Array, topology: TreeTopology,
          coins: jax.Array) -> Traversal:
  """The traversal of every row's tree with the given coins [B, N] (one per node: node i
  is accepted when coins[:, i] < its weight; coins of 1 never accept, which yields the
  law alone). ``p`` is [B, N + 1, V], already ``finite_probs``."""
  b, n = proposal.tokens.shape
  d = topology.max_depth
  rows = jnp.arange(b)
  par, mask, depth = node_arrays(topology, b, proposal.parents)  # par: block parents
  tokens = proposal.tokens.astype(jnp.int32)
  point_mass = proposal.draw == "point_mass"
  without = proposal.draw == "without_replacement"
  if point_mass:
    q_k, p_k, ids = None, p, None
    slot, found = tokens, jnp.ones((b, n), bool)
  else:
    q_k, p_k, ids = support_view(proposal.q, p)  # [B, N, K], [B, N + 1, K]
    if ids is None:
      slot, found = tokens, jnp.ones((b, n), bool)
    else:
      slot, found = proposal.q.slots(tokens)
  k = p_k.shape[-1]
  outside = (jnp.zeros((b, n + 1), p.dtype) if ids is None else mass_outside(p, ids))
  total = jnp.sum(p, axis=-1)  # [B, N + 1]
  # descendants-or-self of each node: below[b, i, j] says node j lies in node i's subtree.
  below = jnp.swapaxes(mask, 1, 2)[:, 1:, 1:]
  node_ids = jnp.arange(n)
  levels = jnp.arange(d + 1)

  def at_level(x, lvl):  # x [B, D + 1, ...] at per-row level lvl [B]
    return jnp.take_along_axis(x, lvl.reshape((b, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]

  def set_level(x, lvl, value, where):  # x with x[b, lvl[b]] = value[b] where where[b]
    hit = (levels[None, :] == lvl[:, None]) & where[:, None]
    return jnp.where(hit.reshape(hit.shape + (1,) * (x.ndim - 2)), value[:, None], x)

  def drawn_from(j, lvl, run_q, fresh):
    """[B, K] the law node j (per row) was drawn from, under its parent at level lvl."""
    if point_mass:
      return jax.nn.one_hot(slot[rows, j], k, dtype=p.dtype)
    q_j = q_k[rows, j]
    if without:  # later siblings: the parent's law with the earlier siblings removed
      q_j = jnp.where(at_level(fresh, lvl)[:, None], q_j, at_level(run_q, lvl))
    return q_j

  def step(carry, _):
    cur, last, done, skipped, a, r, scale, run_q, fresh, reach, stop = carry
    lvl = depth[rows, cur]
    cand = (par == cur[:, None]) & (node_ids[None, :] + 1 > last[:, None]) & ~skipped
    has = jnp.any(cand, axis=1)
    j = jnp.argmax(cand, axis=1).astype(jnp.int32)  # the next child to enter (first in index order)
    leave = ~has & (cur > 0) & ~done
    enter = has & ~done
    # ---- entering child j of cur
    q_j = drawn_from(j, lvl, run_q, fresh)
    t = slot[rows, j]
    q_t = jnp.where(found[rows, j], q_j[rows, t], 0.0)
    never = enter & ~(q_t > 0)  # never a draw: skip it and its subtree
    enter = enter & (q_t > 0)
    a_v, r_v, s_v = at_level(a, lvl), at_level(r, lvl), at_level(scale, lvl)
    z_v = s_v * outside[rows, cur] + jnp.sum(r_v, axis=-1)
    # a_c = min(1, a P(t) / Q(t)) with P(t) = r(t) / z, without dividing by a tiny Q(t)
    # (a * inf is NaN where a = 0, and float32 holds q down to 1e-45).
    num, den = a_v * r_v[rows, t], z_v * q_t
    a_c = jnp.where(num <= 0, 0.0, jnp.where(num >= den, 1.0, num / jnp.where(den > 0, den, 1.0)))
    child = j + 1
    a = set_level(a, lvl + 1, a_c, enter)
    r = set_level(r, lvl + 1, p_k[rows, child], enter)
    scale = set_level(scale, lvl + 1, jnp.ones((b,), p.dtype), enter)
    fresh = set_level(fresh, lvl + 1, jnp.ones((b,), bool), enter)
    skipped = skipped | (never[:, None] & below[rows, j])
    # ---- leaving cur: test it; on failure its parent learns of it
    node = jnp.maximum(cur - 1, 0)
    a_u = a_v  # cur's own weight (cur sits at level lvl)
    passed = leave & (coins[rows, node] < a_u)
    failed = leave & ~passed
    stop = stop.at[rows, cur].add(jnp.where(leave, reach * a_u, 0.0))
    reach = jnp.where(leave, reach * (1.0 - a_u), reach)
    up = jnp.maximum(lvl - 1, 0)
    q_u = drawn_from(node, up, run_q, fresh)
    a_p, r_p, s_p = at_level(a, up), at_level(r, up), at_level(scale, up)
    parent = par[rows, node]
    z_p = s_p * outside[rows, parent] + jnp.sum(r_p, axis=-1)
    r_new = jnp.maximum(a_p[:, None] * r_p - q_u * z_p[:, None], 0.0)
    s_new = a_p * s_p
    z_new = s_new * outside[rows, parent] + jnp.sum(r_new, axis=-1)
    big_z = z_new / jnp.where(z_p > 0, z_p, 1.0)
    den = big_z + 1.0 - a_p
    # den = 0 only when a = 1 and P = Q, where failing has probability 0.
    a_new = jnp.where(den > 0, jnp.minimum(1.0, big_z / jnp.where(den > 0, den, 1.0)), 1.0)
    keep = failed & (z_new > 0)  # no mass left: a_new = 0, the old law is never drawn from
    a = set_level(a, up, a_new, failed)
    r = set_level(r, up, r_new, keep)
    scale = set_level(scale, up, s_new, keep)
    if without:
      removed = q_u.at[rows, slot[rows, node]].set(0.0)
      mass = jnp.sum(removed, axis=-1, keepdims=True)
      removed = jnp.where(mass > 0, removed / jnp.where(mass > 0, mass, 1.0), 0.0)
      run_q = set_level(run_q, up, removed, failed)
      fresh = set_level(fresh, up, jnp.zeros((b,), bool), failed)
    done = done | passed
    last = jnp.where(enter, 0, jnp.where(failed, cur, last)).astype(jnp.int32)
    cur = jnp.where(enter, child, jnp.where(failed, parent, cur)).astype(jnp.int32)
    return (cur, last, done, skipped, a, r, scale, run_q, fresh, reach, stop), None

  zeros_i = jnp.zeros((b,), jnp.int32)
  init = (zeros_i, zeros_i, jnp.zeros((b,), bool), jnp.zeros((b, n), bool),
          jnp.ones((b, d + 1), p.dtype),
          jnp.zeros((b, d + 1, k), p.dtype).at[:, 0].set(p_k[:, 0]),
          jnp.ones((b, d + 1), p.dtype),
          jnp.zeros((b, d + 1, k) if without else (b, d + 1, 1), p.dtype),
          jnp.ones((b, d + 1), bool), jnp.ones((b,), p.dtype),
          jnp.zeros((b, n + 1), p.dtype))
  (cur, _, _, _, _, r, scale, _, _, reach, stop), _ = jax.lax.scan(step, init, None,
                                                                   length=2 * n)
  stop = stop.at[:, 0].add(reach)  # the root always passes
  lvl = depth[rows, cur]
  r_end, s_end = (jnp.take_along_axis(r, lvl[:, None, None], axis=1)[:, 0],
                  jnp.take_along_axis(scale, lvl[:, None], axis=1)[:, 0])
  p_end = p[rows, cur]
  residual = r_end if ids is None else (s_end[:, None] * p_end).at[:, ids].set(r_end)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  residual = jnp.where(mass > 0, residual, p_end)  # an empty residual is never reached
  return Traversal(entry=cur, residual=residual, stop=stop)


def traverse(key: jax.Array, proposal: Proposal, p: jax.Array,
             topology: TreeTopology) -> tuple[jax.Array, jax.Array]:
  """Traversal verification of a batch of trees: ([B] the accepted block entry, [B] the
  next token drawn after it).

  Args:
    key: PRNG key.
    proposal: the drafter's N nodes (any ``draw``; static or per-row parents; q over the
      vocabulary or ``SubsetProbs``).
    p: [B, N + 1, V] the target's warped distributions at each block entry.
    topology: the static topology (for dynamic trees: N and the maximum depth).
  """
  u_key, s_key = jax.random.split(key)
  coins = jax.random.uniform(u_key, proposal.tokens.shape)
  walk = _walk(proposal, finite_probs(p), topology, coins)
  return walk.entry, sample_from(s_key, walk.residual)


def stop_probabilities(proposal: Proposal, p: jax.Array, topology: TreeTopology) -> jax.Array:
  """[B, N + 1] the chance that traversal verification keeps the path to each block entry
  (the root: no draft token), given the drafts. Inputs as in ``traverse``."""
  coins = jnp.ones(proposal.tokens.shape, jnp.float32)  # never below a weight: the law alone
  return _walk(proposal, finite_probs(p), topology, coins).stop


def expected_tokens(proposal: Proposal, p: jax.Array, topology: TreeTopology) -> jax.Array:
  """[B] the tokens one step of traversal verification emits in expectation for these drafts
  (accepted draft tokens plus the next token)."""
  b = proposal.tokens.shape[0]
  _, _, depth = node_arrays(topology, b, proposal.parents)
  stop = stop_probabilities(proposal, p, topology)
  return jnp.sum(stop * (depth + 1).astype(stop.dtype), axis=-1)
