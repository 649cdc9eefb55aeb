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
Σ_c Q(c) min(1, aP(c)/Q(c)) = Σ min(Q, aP), emitting c first with mass min(Q(c), aP(c)),
and fails with probability 1 − a + Z in all. What v still owes is max(0, aP − Q) of total
mass Z, and the updated v (P ← norm(max(0, aP − Q)), its later children drawn from the
updated Q) pays exactly that when fair with weight Z / (1 − a + Z), provided that weight is
the same whichever child failed: by induction v is fair, and the root, with a = 1, always
emits the target's tokens. So the weight after a failure may not depend on the failed
token (a version whose weight reads it is one of the tests' wrong rules).

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
for drawn children [B, D + 1, K] for a draft law over K ids (the vocabulary, or a
``SubsetProbs``' ids), read and written at one depth per step; for deterministic children
(point masses) one remaining mass per depth, P being the entry's p without the failed
children's tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.sampling import sample_from
from specjax.speculative.acceptance import (finite_probs, mass_outside, normalized,
                                            support_view)
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import TreeTopology, node_arrays, path_to


class Traversal(NamedTuple):
  """Where a traversal stopped, and the law of each stop.

  Attributes:
    entry: [B] the accepted block entry (0: the root, node i: i + 1).
    path: [B, D + 1] block entries from the root to ``entry`` (-1 past its depth).
    num_accepted: [B] ``entry``'s depth: draft tokens accepted.
    residual: [B, V] the (unnormalised) law of the next token at ``entry``.
    stop: [B, N + 1] the probability that the traversal stops at each block entry, given
      the drafts (the coins integrated out; sums to 1 per row).
  """

  entry: jax.Array
  path: jax.Array
  num_accepted: jax.Array
  residual: jax.Array
  stop: jax.Array


class _PointMass:
  """The walk's laws for deterministic children (Q a point mass at each child's token).

  A failure only removes its token from the parent's law (max(0, aP − δₜ) = aP without t),
  so a level's law is its entry's p without its failed children's tokens, and the walk
  needs one scalar per level: y, the mass of p left (O(N) work per step, no vector)."""

  def __init__(self, proposal, p, par, rows):
    n = proposal.tokens.shape[1]
    tok = proposal.tokens.astype(jnp.int32)
    self.p, self.rows, self.par, self.tok = p, rows, par, tok
    self.p_tok = p[rows[:, None], par, tok]  # [B, N] p at each node's parent, of its token
    # a sibling repeating an earlier sibling's token finds it removed (its mass gone)
    earlier = jnp.tril(jnp.ones((n, n), bool), -1)[None]
    self.repeat = jnp.any(earlier & (par[:, :, None] == par[:, None, :])
                          & (tok[:, :, None] == tok[:, None, :]), axis=-1)
    self.total = jnp.sum(p, axis=-1)  # [B, N + 1]

  def init(self, b, d):
    return jnp.zeros((b, d + 1), self.p.dtype).at[:, 0].set(self.total[:, 0])

  def ratio(self, state, lvl, j):
    """(num, den): P_v(t_j) = num / den, Q_v(t_j) = 1; and whether node j was a draw."""
    rows = self.rows
    num = jnp.where(self.repeat[rows, j], 0.0, self.p_tok[rows, j])
    return num, state[rows, lvl], jnp.ones_like(num), jnp.ones(num.shape, bool)

  def enter(self, state, lvl, child, where):
    return jnp.where(where[:, None], state.at[self.rows, lvl].set(self.total[self.rows, child]),
                     state)

  def fail(self, state, up, node, a_p, where):
    """(state, Z) after node failed under its parent at level ``up`` of weight a_p."""
    rows = self.rows
    y = state[rows, up]
    y_new = y - jnp.where(self.repeat[rows, node], 0.0, self.p_tok[rows, node])
    big_z = a_p * jnp.maximum(y_new, 0.0) / jnp.where(y > 0, y, 1.0)
    keep = where & (y_new > 0)
    return jnp.where(keep[:, None], state.at[rows, up].set(y_new), state), big_z

  def residual(self, state, cur, depth):
    """[B, V] the law after entry cur: its p without its (failed) children's tokens."""
    out = self.p[self.rows, cur]
    drop = jnp.where(self.par == cur[:, None], self.tok, out.shape[-1])
    return out.at[self.rows[:, None], drop].set(0.0, mode="drop")


class _Drawn:
  """The walk's laws for drawn children (a real q, over the vocabulary or a subset's K ids):
  per level, the residual r [K] (unnormalised; outside the ids its law is ``scale`` × p,
  which subtracting q never changes but the weight a does) and, for siblings drawn without
  replacement, the running q with the failed siblings' tokens removed."""

  def __init__(self, proposal, p, par, rows):
    b, n = proposal.tokens.shape
    tok = proposal.tokens.astype(jnp.int32)
    self.without = proposal.draw == "without_replacement"
    self.q_k, self.p_k, self.ids = support_view(proposal.q, p)  # [B, N, K], [B, N + 1, K]
    if self.ids is None:
      self.slot, self.found = tok, jnp.ones((b, n), bool)
      self.outside = jnp.zeros((b, n + 1), p.dtype)
    else:
      self.slot, self.found = proposal.q.slots(tok)
      self.outside = mass_outside(p, self.ids)
    self.p, self.par, self.rows = p, par, rows

  def init(self, b, d):
    k = self.p_k.shape[-1]
    r = jnp.zeros((b, d + 1, k), self.p.dtype).at[:, 0].set(self.p_k[:, 0])
    run_q = jnp.zeros((b, d + 1, k if self.without else 1), self.p.dtype)
    return (r, jnp.ones((b, d + 1), self.p.dtype), run_q, jnp.ones((b, d + 1), bool))

  def _q(self, state, lvl, j):
    """[B, K] the law node j was drawn from, under its parent at level lvl."""
    _, _, run_q, fresh = state
    q_j = self.q_k[self.rows, j]
    if self.without:  # later siblings: the parent's law with the earlier siblings removed
      q_j = jnp.where(fresh[self.rows, lvl][:, None], q_j, run_q[self.rows, lvl])
    return q_j

  def _z(self, r, scale, entry):
    return scale * self.outside[self.rows, entry] + jnp.sum(r, axis=-1)

  def ratio(self, state, lvl, j):
    rows = self.rows
    r, scale, _, _ = state
    t = self.slot[rows, j]
    q_t = jnp.where(self.found[rows, j], self._q(state, lvl, j)[rows, t], 0.0)
    r_v = r[rows, lvl]
    return r_v[rows, t], self._z(r_v, scale[rows, lvl], self.par[rows, j]), q_t, q_t > 0

  def enter(self, state, lvl, child, where):
    rows = self.rows
    r, scale, run_q, fresh = state
    r = r.at[rows, lvl].set(jnp.where(where[:, None], self.p_k[rows, child], r[rows, lvl]))
    scale = scale.at[rows, lvl].set(jnp.where(where, 1.0, scale[rows, lvl]))
    fresh = fresh.at[rows, lvl].set(where | fresh[rows, lvl])
    return r, scale, run_q, fresh

  def fail(self, state, up, node, a_p, where):
    rows = self.rows
    r, scale, run_q, fresh = state
    q_u = self._q(state, up, node)
    r_p, s_p = r[rows, up], scale[rows, up]
    parent = self.par[rows, node]
    z_p = self._z(r_p, s_p, parent)
    r_new = jnp.maximum(a_p[:, None] * r_p - q_u * z_p[:, None], 0.0)
    s_new = a_p * s_p
    z_new = self._z(r_new, s_new, parent)
    big_z = z_new / jnp.where(z_p > 0, z_p, 1.0)
    keep = where & (z_new > 0)  # no mass left: the weight is 0, the old law never drawn from
    r = r.at[rows, up].set(jnp.where(keep[:, None], r_new, r_p))
    scale = scale.at[rows, up].set(jnp.where(keep, s_new, s_p))
    if self.without:
      removed = normalized(q_u.at[rows, self.slot[rows, node]].set(0.0), 0.0)
      run_q = run_q.at[rows, up].set(jnp.where(where[:, None], removed, run_q[rows, up]))
      fresh = fresh.at[rows, up].set(fresh[rows, up] & ~where)
    return (r, scale, run_q, fresh), big_z

  def residual(self, state, cur, depth):
    r, scale, _, _ = state
    lvl = depth[self.rows, cur]
    r_end, s_end = r[self.rows, lvl], scale[self.rows, lvl]
    if self.ids is None:
      return r_end
    return (s_end[:, None] * self.p[self.rows, cur]).at[:, self.ids].set(r_end)


def _walk(proposal: Proposal, p: jax.Array, topology: TreeTopology,
          coins: jax.Array) -> Traversal:
  """The traversal of every row's tree with the given coins [B, N] (one per node: node i
  is accepted when coins[:, i] < its weight; coins of 1 never accept, which yields the
  law alone). ``p`` is [B, N + 1, V], already ``finite_probs``."""
  b, n = proposal.tokens.shape
  d = topology.max_depth
  rows = jnp.arange(b)
  par, mask, depth = node_arrays(topology, b, proposal.parents)  # par: block parents
  laws = (_PointMass if proposal.draw == "point_mass" else _Drawn)(proposal, p, par, rows)
  # descendants-or-self of each node: below[b, i, j] says node j lies in node i's subtree.
  below = jnp.swapaxes(mask, 1, 2)[:, 1:, 1:]
  node_ids = jnp.arange(n)

  def step(carry, _):
    cur, last, done, skipped, a, reach, stop, state = carry
    lvl = depth[rows, cur]
    cand = (par == cur[:, None]) & (node_ids[None, :] + 1 > last[:, None]) & ~skipped
    has = jnp.any(cand, axis=1)
    j = jnp.argmax(cand, axis=1).astype(jnp.int32)  # the next child to enter (index order)
    leave = ~has & (cur > 0) & ~done
    enter = has & ~done
    # ---- entering child j of cur: a_c = min(1, a P(t) / Q(t)), P(t) = r(t) / z, computed
    # without dividing by a tiny Q(t) (a * inf is NaN where a = 0; float32 q reaches 1e-45)
    r_t, z_v, q_t, drawn = laws.ratio(state, lvl, j)
    never = enter & ~drawn  # never a draw: skip it and its subtree
    enter = enter & drawn
    num, den = a[rows, lvl] * r_t, z_v * q_t
    a_c = jnp.where(num <= 0, 0.0, jnp.where(num >= den, 1.0,
                                             num / jnp.where(den > 0, den, 1.0)))
    below_lvl = jnp.minimum(lvl + 1, d)  # the child's level (a leaf at depth D enters none)
    a = a.at[rows, below_lvl].set(jnp.where(enter, a_c, a[rows, below_lvl]))
    state = laws.enter(state, below_lvl, j + 1, enter)
    skipped = skipped | (never[:, None] & below[rows, j])
    # ---- leaving cur: test it; on failure its parent learns of it
    node = jnp.maximum(cur - 1, 0)
    a_u = a[rows, lvl]
    passed = leave & (coins[rows, node] < a_u)
    failed = leave & ~passed
    stop = stop.at[rows, cur].add(jnp.where(leave, reach * a_u, 0.0))
    reach = jnp.where(leave, reach * (1.0 - a_u), reach)
    up = jnp.maximum(lvl - 1, 0)
    a_p = a[rows, up]
    state, big_z = laws.fail(state, up, node, a_p, failed)
    den = big_z + 1.0 - a_p
    # den = 0 only when a = 1 and P = Q, where failing has probability 0.
    a_new = jnp.where(den > 0, jnp.minimum(1.0, big_z / jnp.where(den > 0, den, 1.0)), 1.0)
    a = a.at[rows, up].set(jnp.where(failed, a_new, a_p))
    done = done | passed
    parent = par[rows, node]
    last = jnp.where(enter, 0, jnp.where(failed, cur, last)).astype(jnp.int32)
    cur = jnp.where(enter, j + 1, jnp.where(failed, parent, cur)).astype(jnp.int32)
    return (cur, last, done, skipped, a, reach, stop, state), None

  zeros_i = jnp.zeros((b,), jnp.int32)
  init = (zeros_i, zeros_i, jnp.zeros((b,), bool), jnp.zeros((b, n), bool),
          jnp.ones((b, d + 1), p.dtype), jnp.ones((b,), p.dtype),
          jnp.zeros((b, n + 1), p.dtype), laws.init(b, d))
  (cur, _, _, _, _, reach, stop, state), _ = jax.lax.scan(step, init, None, length=2 * n)
  stop = stop.at[:, 0].add(reach)  # the root always passes
  residual = laws.residual(state, cur, depth)
  p_end = p[rows, cur]
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  residual = jnp.where(mass > 0, residual, p_end)  # an empty residual is never reached
  return Traversal(entry=cur, path=path_to(cur, mask, depth, d),
                   num_accepted=depth[rows, cur], residual=residual, stop=stop)


def traverse(key: jax.Array, proposal: Proposal, p: jax.Array,
             topology: TreeTopology) -> tuple[Traversal, jax.Array]:
  """Traversal verification of a batch of trees: (where it stopped, [B] the next token
  drawn there).

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
  return walk, sample_from(s_key, walk.residual)


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
