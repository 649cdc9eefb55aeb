"""Exact-distribution and structural tests of tree acceptance (speculative/tree_acceptance.py).

A toy Markov target: the target's distribution after a token depends on that
token only (row x of a random V x V row-stochastic matrix P); the drafter uses
a different matrix Q. Each distribution test draws ROWS = 100k independent runs
(one batch row each, V = 8) of the first two emitted tokens after a fixed
committed token X0 and compares their empirical joint law with the exact one,
P[X0, x1] P[x1, x2], by a chi-square test and by total variation. When a step
accepts no draft token (n = 0) the second token comes from a second,
independent step started at the first one.

Deliberately wrong rules must fail the same harness, which shows it has power:
SpecInfer's raw-q rule on siblings drawn without replacement, and recursive
rejection that does not update the residual after a rejected sibling (a local
re-implementation, ``_reference_accept``, whose correct setting passes and so
cross-checks the library).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import SubsetProbs, sample_from
from specjax.speculative import acceptance as chain_rule
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import TreeTopology
from specjax.speculative.tree_acceptance import (TreeAcceptance, accept_greedy, accept_tree,
                                                 accepted_tokens, first_chain_beta,
                                                 node_ranks)
from specjax.testing import chi_square_pvalue

from matrix import cases, grid

V, ROWS, X0 = 8, 100_000, 3

TOPOLOGIES = {
    "two_branch": TreeTopology((-1, -1, 0, 0, 1)),
    "depth3": TreeTopology((-1, -1, 0, 0, 1, 2, 3)),
    "wide4": TreeTopology((-1, -1, -1, -1)),
    "chain3": TreeTopology.chain(3),
}


def _markov(seed: int, alpha: float) -> np.ndarray:
  return np.random.default_rng(seed).dirichlet([alpha] * V, size=V)


P = _markov(0, 0.6)  # target
Q = 0.5 * _markov(1, 0.6) + 0.5 * np.roll(P, 1, axis=1)  # draft: overlaps P, but not much
EXACT = P[X0][:, None] * P  # [V, V] exact law of the first two tokens
TOP = np.argsort(-Q, axis=1, kind="stable").astype(np.int32)  # [V, V] draft tokens by rank
# A reduced-vocabulary draft: Q kept on 5 of the 8 ids, which leaves the target 0.3-0.5 of
# its mass outside the draft's support.
SUBSET = np.array([0, 2, 3, 5, 6], np.int32)
Q_SUBSET = np.zeros_like(Q)
Q_SUBSET[:, SUBSET] = Q[:, SUBSET] / Q[:, SUBSET].sum(axis=1, keepdims=True)


# --- harness ------------------------------------------------------------------------


def _draft(key, roots, topo, draw, duplicate=None, draft_matrix=Q):
  """A tree drafted from Q below ``roots`` [B], and the target's p at its entries.

  draw: "sampled" (iid from Q[parent]), "without_replacement" (Gumbel-top-k of
  Q[parent] over siblings) or "point_mass" (top-k of Q[parent], deterministic).
  duplicate: (i, j) makes node i repeat the token of its earlier sibling j.
  Returns (tokens [B, N], q [B, N, V] = Q[parent token], p [B, N + 1, V]).
  """
  b, n = roots.shape[0], topo.num_nodes
  qm, pm = jnp.asarray(draft_matrix, jnp.float32), jnp.asarray(P, jnp.float32)
  keys = jax.random.split(key, n + 1)
  gumbel = jax.random.gumbel(keys[n], (b, n + 1, V))  # one vector per parent entry
  block_tok = [roots.astype(jnp.int32)]
  for i, (par, rank) in enumerate(zip(topo.parents, topo.ranks)):
    qrow = qm[block_tok[par + 1]]
    if draw == "sampled":
      t = jax.random.categorical(keys[i], jnp.log(qrow))
    elif draw == "without_replacement":
      t = jnp.argsort(-(jnp.log(qrow) + gumbel[:, par + 1]), axis=-1)[:, rank]
    else:  # a table lookup: a sort of a constant row would be constant-folded for B rows
      t = jnp.asarray(TOP)[block_tok[par + 1], rank]
    if duplicate is not None and duplicate[0] == i:
      t = block_tok[duplicate[1] + 1]
    block_tok.append(t.astype(jnp.int32))
  entries = jnp.stack(block_tok, axis=1)  # [B, N + 1]
  q = qm[entries[:, [par + 1 for par in topo.parents]]]
  return entries[:, 1:], q, pm[entries]


def _library(key, prop, p, topo):
  return accept_tree(key, prop, p, topo)


def _path_table(topo) -> np.ndarray:
  """[N + 1, D + 1]: the root-to-entry path of every block entry, padded with -1."""
  out = np.full((topo.num_nodes + 1, topo.max_depth + 1), -1, np.int32)
  for e in range(topo.num_nodes + 1):
    chain, j = [], e
    while j >= 0:
      chain.append(j)
      j = int(topo.block_parents[j])
    out[e, :len(chain)] = chain[::-1]
  return out


def _reference_accept(key, prop, p, topo, *, update_residual=True):
  """Recursive rejection written out plainly (static trees): an independent re-derivation.

  With ``update_residual=False`` it is wrong: after a rejected child the
  residual stays the parent's p instead of norm(max(r - q, 0)).
  """
  b, n = prop.tokens.shape
  u_key, s_key = jax.random.split(key)
  u = jax.random.uniform(u_key, (b, n))
  rows = jnp.arange(b)
  cur = jnp.zeros((b,), jnp.int32)
  r = p[:, 0]
  removed = jnp.zeros((b, V), bool)  # tokens of rejected children of `cur`
  for j, par in enumerate(topo.parents):
    t = prop.tokens[:, j]
    hot = jax.nn.one_hot(t, V, dtype=bool)
    if prop.draw == "point_mass":
      qj = hot.astype(jnp.float32)
    else:
      qj = prop.q[:, j]
      if prop.draw == "without_replacement":
        qj = jnp.where(removed, 0.0, qj)
        qj = qj / jnp.sum(qj, axis=-1, keepdims=True)
    is_child = cur == par + 1
    ok = u[:, j] * qj[rows, t] < r[rows, t]  # accept with probability min(1, r / q)
    acc, rej = is_child & ok, is_child & ~ok
    res = jnp.maximum(r - qj, 0.0)
    mass = jnp.sum(res, axis=-1, keepdims=True)
    res = jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), r)
    if update_residual:
      r = jnp.where(rej[:, None], res, r)
    r = jnp.where(acc[:, None], p[:, j + 1], r)
    removed = jnp.where(acc[:, None], False, removed | (rej[:, None] & hot))
    cur = jnp.where(acc, j + 1, cur)
  next_token = sample_from(s_key, r)  # the draw primitive, pinned in test_sampling
  path = jnp.asarray(_path_table(topo))[cur]
  depth = jnp.asarray(topo.block_depth)[cur]
  return TreeAcceptance(path=path, num_accepted=depth, next_token=next_token,
                        beta=jnp.zeros((b, topo.max_depth), jnp.float32))


def _subset_q(q):
  """Q_SUBSET's rows [..., V] as ``SubsetProbs`` over SUBSET."""
  return SubsetProbs(q[..., SUBSET], jnp.asarray(SUBSET), V)


def _support_only(key, prop, p, topo):
  """Wrong: recursive rejection on the draft's support alone, the target's mass outside it
  dropped (what reading p only at a ``SubsetProbs``' ids, final draw included, would do)."""
  inside = jnp.zeros((V,), bool).at[SUBSET].set(True)
  return accept_tree(key, prop, jnp.where(inside, p, 0.0), topo)


@functools.lru_cache(maxsize=None)
def _first_two_fn(topo, draw, label, duplicate, rule, q_form="dense"):
  """jit: key -> (x1, x2, num_accepted of the first step) for ROWS independent runs.

  q_form: "dense" (Q, over the vocabulary), "subset_dense" (Q_SUBSET over the vocabulary)
  or "subset" (Q_SUBSET as ``SubsetProbs``)."""
  accept_fn = {"library": _library, "reference": _reference_accept,
               "no_residual": functools.partial(_reference_accept, update_residual=False),
               "support_only": _support_only}[rule]
  draft_matrix = Q if q_form == "dense" else Q_SUBSET

  def step(key, roots):
    d_key, a_key = jax.random.split(key)
    tokens, q, p = _draft(d_key, roots, topo, draw, duplicate, draft_matrix)
    if q_form == "subset":
      q = _subset_q(q)
    prop = Proposal(tokens=tokens, q=None if label == "point_mass" else q, draw=label)
    acc = accept_fn(a_key, prop, p, topo)
    return accepted_tokens(prop, acc), acc.num_accepted

  @jax.jit
  def run(key):
    k1, k2 = jax.random.split(key)
    toks, n = step(k1, jnp.full((ROWS,), X0, jnp.int32))
    toks2, _ = step(k2, toks[:, 0])  # an independent second step from x1
    return toks[:, 0], jnp.where(n >= 1, toks[:, 1], toks2[:, 0]), n

  return run


def _empirical(topo, draw, label=None, duplicate=None, rule="library", seed=0, q_form="dense"):
  x1, x2, n = map(np.asarray, _first_two_fn(topo, draw, label or draw, duplicate, rule,
                                            q_form)(jax.random.PRNGKey(seed)))
  assert x1.min() >= 0 and x1.max() < V and x2.min() >= 0 and x2.max() < V
  counts = np.bincount(x1 * V + x2, minlength=V * V).reshape(V, V)
  return counts, n


def _tv(counts: np.ndarray) -> float:
  return 0.5 * float(np.abs(counts / counts.sum() - EXACT).sum())


def _assert_exact(counts, n, topo):
  pvalue, tv = chi_square_pvalue(counts, EXACT), _tv(counts)
  assert pvalue > 1e-3, (pvalue, tv)
  assert tv < 0.01, (pvalue, tv)
  # The harness exercised the tree: rejections at the root and accepted drafts,
  # down to the deepest level.
  assert 0.05 < np.mean(n == 0) < 0.95
  assert np.any(n == topo.max_depth)


def _assert_wrong(counts):
  pvalue, tv = chi_square_pvalue(counts, EXACT), _tv(counts)
  assert pvalue < 1e-6, (pvalue, tv)
  assert tv > 0.01, (pvalue, tv)  # outside the tolerance _assert_exact allows


def test_harness_matrices_are_far_apart():
  """Draft and target disagree enough that rejections (and residuals) matter."""
  overlap = np.minimum(P, Q).sum(axis=1)
  assert np.all(overlap < 0.85) and np.all(overlap > 0.2)
  assert np.allclose(P.sum(1), 1) and np.allclose(Q.sum(1), 1)


# --- the lossless rules match the exact law ------------------------------------------------


@pytest.mark.parametrize("name, draw", grid(
    list(TOPOLOGIES), ["point_mass", "sampled", "without_replacement"], keep=(
    "two_branch-point_mass", "wide4-point_mass", "two_branch-sampled", "depth3-sampled",
    "depth3-without_replacement", "wide4-without_replacement")))  # each rule on two trees
def test_tree_rules_match_target(name, draw):
  topo = TOPOLOGIES[name]
  counts, n = _empirical(topo, draw)
  _assert_exact(counts, n, topo)


@pytest.mark.parametrize("name,duplicate", [("wide4", (1, 0)), ("two_branch", (3, 2))])
def test_point_mass_with_a_duplicate_sibling_matches_target(name, duplicate):
  """A sibling repeating an earlier (rejected) token must never be accepted as fresh mass."""
  topo = TOPOLOGIES[name]
  counts, n = _empirical(topo, "point_mass", duplicate=duplicate)
  _assert_exact(counts, n, topo)


@pytest.mark.parametrize("draw", ["point_mass", "sampled", "without_replacement"])
def test_reference_rule_matches_target_and_library(draw):
  """The local re-derivation passes the harness and agrees with the library row by row."""
  topo = TOPOLOGIES["two_branch"]
  counts, n = _empirical(topo, draw, rule="reference")
  _assert_exact(counts, n, topo)
  # Same key, same uniforms and the same final draw: the two agree on
  # (almost) every row; float rounding may flip a rare comparison.
  key = jax.random.PRNGKey(5)
  tokens, q, p = _draft(jax.random.PRNGKey(6), jnp.full((20_000,), X0, jnp.int32), topo, draw)
  prop = Proposal(tokens=tokens, q=None if draw == "point_mass" else q, draw=draw)
  lib, ref = accept_tree(key, prop, p, topo), _reference_accept(key, prop, p, topo)
  same = (np.asarray(lib.num_accepted) == np.asarray(ref.num_accepted)) & (
      np.asarray(lib.next_token) == np.asarray(ref.next_token))
  assert same.mean() > 0.999
  np.testing.assert_array_equal(np.asarray(lib.path)[same], np.asarray(ref.path)[same])


@pytest.mark.parametrize("name, draw, q_form", grid(
    ["two_branch", "chain3"], ["sampled", "without_replacement"], ["subset", "subset_dense"],
    keep=("two_branch-without_replacement-subset", "chain3-sampled-subset_dense")))
def test_reduced_vocabulary_drafts_match_target(name, draw, q_form):
  """A draft on 5 of the 8 ids, its q as ``SubsetProbs`` or over the vocabulary: the target's
  law either way (the chain through the chain rule, the trees through recursive rejection)."""
  topo = TOPOLOGIES[name]
  counts, n = _empirical(topo, draw, q_form=q_form)
  _assert_exact(counts, n, topo)


@pytest.mark.parametrize("name, draw", grid(["two_branch", "chain3"],
                                             ["sampled", "without_replacement"],
                                             keep=("chain3-without_replacement",)))
def test_subset_q_agrees_with_the_same_q_over_the_vocabulary(name, draw):
  """Same key: the same outcome row by row (float rounding may flip a rare comparison), and
  the same β on a chain."""
  topo = TOPOLOGIES[name]
  tokens, q, p = _draft(jax.random.PRNGKey(6), jnp.full((20_000,), X0, jnp.int32), topo, draw,
                        draft_matrix=Q_SUBSET)
  key = jax.random.PRNGKey(5)
  dense = accept_tree(key, Proposal(tokens=tokens, q=q, draw=draw), p, topo)
  sub = accept_tree(key, Proposal(tokens=tokens, q=_subset_q(q), draw=draw), p, topo)
  same = (np.asarray(dense.num_accepted) == np.asarray(sub.num_accepted)) & (
      np.asarray(dense.next_token) == np.asarray(sub.next_token))
  assert same.mean() > 0.999
  assert 0 < np.asarray(dense.num_accepted).mean() < topo.max_depth
  assert np.isin(np.asarray(sub.next_token), SUBSET, invert=True).mean() > 0.1  # outside mass
  np.testing.assert_allclose(np.asarray(sub.beta), np.asarray(dense.beta), atol=1e-6)
  np.testing.assert_array_equal(np.asarray(first_chain_beta(
      Proposal(tokens=tokens, q=_subset_q(q), draw=draw), p, topo)[0]), np.asarray(
          first_chain_beta(Proposal(tokens=tokens, q=q, draw=draw), p, topo)[0]))


def test_a_node_outside_the_subset_is_never_accepted():
  """A node whose token lies outside a ``SubsetProbs``' ids has q = 0 there: never a draw,
  skipped as over the vocabulary (node 0 here, so the walk tries node 1 first)."""
  topo = TOPOLOGIES["two_branch"]
  tokens, q, p = _draft(jax.random.PRNGKey(6), jnp.full((5_000,), X0, jnp.int32), topo,
                        "sampled", draft_matrix=Q_SUBSET)
  tokens = tokens.at[:, 0].set(1)  # id 1 is not in SUBSET
  key = jax.random.PRNGKey(5)
  dense = accept_tree(key, Proposal(tokens=tokens, q=q, draw="sampled"), p, topo)
  sub = accept_tree(key, Proposal(tokens=tokens, q=_subset_q(q), draw="sampled"), p, topo)
  assert not np.any(np.asarray(sub.path)[:, 1] == 1)  # block entry 1 is node 0
  assert np.any(np.asarray(sub.path)[:, 1] == 2)
  assert np.mean(np.asarray(dense.path[:, 1]) == np.asarray(sub.path[:, 1])) > 0.999


# --- deliberately wrong rules must fail the same harness ------------------------------------


@pytest.mark.parametrize("name, draw", grid(
    ["two_branch", "chain3"], ["sampled", "without_replacement"],
    keep=("two_branch-without_replacement", "chain3-sampled")))
def test_residual_on_the_drafts_support_alone_is_rejected(name, draw):
  counts, _ = _empirical(TOPOLOGIES[name], draw, rule="support_only", q_form="subset")
  _assert_wrong(counts)



@pytest.mark.parametrize("name", ["wide4", "two_branch"])
def test_specinfer_raw_q_on_without_replacement_siblings_is_rejected(name):
  """Siblings drawn without replacement but verified as iid draws ("sampled")."""
  counts, _ = _empirical(TOPOLOGIES[name], "without_replacement", label="sampled")
  _assert_wrong(counts)


@pytest.mark.parametrize("draw", ["point_mass", "sampled", "without_replacement"])
def test_residual_not_updated_after_rejection_is_rejected(draw):
  counts, _ = _empirical(TOPOLOGIES["wide4"], draw, rule="no_residual")
  _assert_wrong(counts)


# --- greedy ---------------------------------------------------------------------------------


def _greedy_continuation(length):
  out, x = [], X0
  for _ in range(length):
    x = int(np.argmax(P[x]))
    out.append(x)
  return out


@pytest.mark.parametrize("draw, name", grid(["point_mass", "sampled"], list(TOPOLOGIES), keep=(
    "point_mass-depth3", "point_mass-chain3", "sampled-two_branch")))
def test_greedy_emits_the_exact_greedy_continuation(name, draw):
  topo = TOPOLOGIES[name]
  b = 4000
  tokens, q, p = _draft(jax.random.PRNGKey(1), jnp.full((b,), X0, jnp.int32), topo, draw)
  onehot = jax.nn.one_hot(jnp.argmax(p, -1), V)
  prop = Proposal(tokens=tokens, q=None if draw == "point_mass" else q, draw=draw)
  acc = jax.jit(accept_tree, static_argnums=3, static_argnames="greedy")(
      jax.random.PRNGKey(2), prop, onehot, topo, greedy=True)
  toks, n = np.asarray(accepted_tokens(prop, acc)), np.asarray(acc.num_accepted)
  greedy = _greedy_continuation(topo.max_depth + 1)
  tokens = np.asarray(tokens)
  for row in range(b):
    assert list(toks[row, :n[row] + 1]) == greedy[:n[row] + 1]
    # n is the depth of the deepest node whose whole path matches the continuation.
    deepest = 0
    for i in range(topo.num_nodes):
      path = [e for e in _path_table(topo)[i + 1] if e > 0]
      if all(tokens[row, e - 1] == greedy[k] for k, e in enumerate(path)):
        deepest = max(deepest, len(path))
    assert n[row] == deepest
  if draw == "sampled":  # top-k drafts below a fixed root are the same on every row
    assert 0 < n.mean() < topo.max_depth  # both full and partial matches occurred


def test_accept_greedy_picks_the_deepest_matching_path():
  """Argmax of soft p; among equally deep matches the smallest node index wins."""
  topo = TreeTopology((-1, -1, -1, 0, 1, 2, 4))  # nodes 0,1,2 at depth 1; 6 under 4 under 1
  # target argmax: after root 5, after token 5 -> 6, after token 6 -> 7, after 7 -> 0.
  nxt = {5: 6, 6: 7, 7: 0}
  def p_for(entry_tokens):
    rows = []
    for t in entry_tokens:
      pr = np.full(V, 0.1 / (V - 1))
      pr[nxt.get(t, 1)] = 0.9
      rows.append(pr)
    return np.array(rows, np.float32)

  cases = [
      # tokens of nodes 0..6           expected (n, path, next)
      ([6, 6, 6, 7, 7, 7, 0], (3, [0, 2, 5, 7], 1)),  # deeper match under node 1 wins
      ([6, 6, 6, 7, 2, 7, 0], (2, [0, 1, 4, -1], 0)),  # node 3 (under 0) beats node 5 (under 2)
      ([6, 6, 6, 2, 2, 7, 0], (2, [0, 3, 6, -1], 0)),  # only node 5 at depth 2
      ([6, 6, 2, 2, 2, 2, 2], (1, [0, 1, -1, -1], 7)),  # ties at depth 1: smallest index
      ([1, 2, 3, 7, 7, 7, 0], (0, [0, -1, -1, -1], 6)),  # no child matches
  ]
  for tokens, (n, path, nxt_tok) in cases:
    entries = [5] + tokens
    p = jnp.asarray(p_for(entries))[None]
    prop = Proposal(tokens=jnp.asarray([tokens], jnp.int32), q=None, draw="point_mass")
    acc = accept_greedy(prop, p, topo)
    assert int(acc.num_accepted[0]) == n, tokens
    np.testing.assert_array_equal(acc.path[0], path)
    assert int(acc.next_token[0]) == nxt_tok
    # accept_tree(greedy=True) is the same rule.
    acc2 = accept_tree(jax.random.PRNGKey(0), prop, p, topo, greedy=True)
    np.testing.assert_array_equal(acc2.path, acc.path)
    # ... and given the argmax instead of searching p (a greedy verify's TargetScores.argmax)
    argmax = jnp.argmax(p, axis=-1).astype(jnp.int32)
    acc3 = accept_tree(jax.random.PRNGKey(0), prop, p, topo, greedy=True, target_argmax=argmax)
    np.testing.assert_array_equal(acc3.path, acc.path)
    assert int(acc3.next_token[0]) == nxt_tok
  with pytest.raises(ValueError, match="target_argmax of shape"):
    accept_tree(jax.random.PRNGKey(0), prop, p, topo, greedy=True, target_argmax=argmax[:, 1:])


# --- the chain fast path --------------------------------------------------------------------


def _random_chain_inputs(seed, b, gamma):
  rng = np.random.default_rng(seed)
  q = rng.dirichlet([0.5] * V, size=(b, gamma)).astype(np.float32)
  p = rng.dirichlet([0.5] * V, size=(b, gamma + 1)).astype(np.float32)
  drafts = np.array([[rng.choice(V, p=q[i, j] / q[i, j].sum()) for j in range(gamma)]
                     for i in range(b)], np.int32)
  return jnp.asarray(drafts), jnp.asarray(q), jnp.asarray(p)


@pytest.mark.parametrize("gamma", [1, 4])
def test_chain_fast_path_is_bit_identical_to_accept(gamma):
  drafts, q, p = _random_chain_inputs(gamma, 3000, gamma)
  key = jax.random.PRNGKey(11)
  ref = chain_rule.accept(key, drafts, q, p)
  acc = accept_tree(key, Proposal.chain(drafts, q), p, TreeTopology.chain(gamma))
  np.testing.assert_array_equal(acc.num_accepted, ref.num_accepted)
  np.testing.assert_array_equal(acc.next_token, ref.next_token)
  np.testing.assert_array_equal(acc.beta, ref.beta)
  levels = np.arange(gamma + 1)[None]
  n = np.asarray(ref.num_accepted)[:, None]
  np.testing.assert_array_equal(acc.path, np.where(levels <= n, levels, -1))
  assert 0 < np.asarray(ref.num_accepted).mean() < gamma
  # accepted_tokens: the accepted drafts, then the next token.
  toks = np.asarray(accepted_tokens(Proposal.chain(drafts, q), acc))
  for row in range(200):
    k = int(ref.num_accepted[row])
    np.testing.assert_array_equal(toks[row, :k], np.asarray(drafts)[row, :k])
    assert toks[row, k] == int(ref.next_token[row])


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_chain_equals_the_chain_rule_on_one_hot_distributions(gamma):
  """Under a greedy target (one-hot p, and one-hot q from the same sampler) a chain takes
  the argmax rule, skipping the chain rule's draw over V: same path, next token and β."""
  rng = np.random.default_rng(gamma)
  b = 400
  target = rng.integers(0, V, (b, gamma + 1))
  # Drafts agree with the target's argmax often enough to reach every depth.
  drafts = np.where(rng.random((b, gamma)) < 0.7, target[:, :gamma],
                    rng.integers(0, V, (b, gamma))).astype(np.int32)
  p = jax.nn.one_hot(target, V, dtype=jnp.float32)
  q = jax.nn.one_hot(drafts, V, dtype=jnp.float32)
  key = jax.random.PRNGKey(3)
  ref = chain_rule.accept(key, jnp.asarray(drafts), q, p)
  acc = accept_tree(key, Proposal.chain(jnp.asarray(drafts), q), p, TreeTopology.chain(gamma),
                    greedy=True)
  np.testing.assert_array_equal(acc.num_accepted, ref.num_accepted)
  np.testing.assert_array_equal(acc.next_token, ref.next_token)
  np.testing.assert_array_equal(acc.beta, ref.beta)
  assert set(np.asarray(ref.num_accepted)) == set(range(gamma + 1))


def test_chain_through_the_general_rule_is_still_exact():
  """A chain drafted without replacement skips the fast path; it is the same law."""
  topo = TOPOLOGIES["chain3"]
  counts, n = _empirical(topo, "without_replacement")
  _assert_exact(counts, n, topo)


# --- structure of the outcome ----------------------------------------------------------------


def _random_tree_inputs(seed, b, topo, draw, *, per_row=None):
  """Random (not Markov) tokens, q and p; per_row: a list of topologies cycled over rows."""
  rng = np.random.default_rng(seed)
  n = topo.num_nodes
  tokens = rng.integers(0, V, (b, n)).astype(np.int32)
  if draw == "point_mass":  # mostly high-probability tokens, so paths get deep
    q = None
  else:
    q = rng.dirichlet([0.5] * V, size=(b, n)).astype(np.float32)
  p = rng.dirichlet([0.3] * V, size=(b, n + 1)).astype(np.float32)
  if per_row is not None:
    parents = np.array([per_row[i % len(per_row)].parents for i in range(b)], np.int32)
  else:
    parents = np.broadcast_to(np.array(topo.parents, np.int32), (b, n))
  boost = rng.random(b) < 0.7  # most rows: drafted tokens likely, so paths get deep
  for i in np.flatnonzero(boost):
    for j in range(n):
      p[i, parents[i, j] + 1, tokens[i, j]] += 1.0
  p /= p.sum(-1, keepdims=True)
  if q is not None:
    q[np.arange(b)[:, None], np.arange(n)[None], tokens] += 1.0
    q /= q.sum(-1, keepdims=True)
  prop = Proposal(tokens=jnp.asarray(tokens), q=None if q is None else jnp.asarray(q), draw=draw,
                  parents=None if per_row is None else jnp.asarray(parents))
  return prop, jnp.asarray(p), parents


def _check_outcome(prop, acc, parents, max_depth):
  path, n = np.asarray(acc.path), np.asarray(acc.num_accepted)
  nxt, tokens = np.asarray(acc.next_token), np.asarray(prop.tokens)
  b = path.shape[0]
  assert path.shape == (b, max_depth + 1)
  assert np.all((n >= 0) & (n <= max_depth))
  assert np.all((nxt >= 0) & (nxt < V))
  assert np.all(np.isfinite(np.asarray(acc.beta)))
  toks = np.asarray(accepted_tokens(prop, acc))
  assert toks.shape == (b, max_depth + 1)
  for row in range(b):
    k = n[row]
    assert path[row, 0] == 0
    assert np.all(path[row, k + 1:] == -1)
    for j in range(1, k + 1):  # each entry a child of the previous one
      assert parents[row, path[row, j] - 1] + 1 == path[row, j - 1]
    # n is the depth of the last path entry: the path has exactly k + 1 entries.
    np.testing.assert_array_equal(toks[row, :k], tokens[row, path[row, 1:k + 1] - 1])
    assert np.all(toks[row, k:] == nxt[row])


RULES = [("point_mass", False), ("sampled", False), ("without_replacement", False),
         ("point_mass", True)]


@pytest.mark.parametrize("name, draw, greedy", cases(
    [(name, d, g) for name in ("depth3", "chain3") for d, g in RULES],
    keep=tuple(f"depth3-{d}-{g}" for d, g in RULES)))
def test_outcome_is_a_valid_path(name, draw, greedy):
  topo = TOPOLOGIES[name]
  prop, p, parents = _random_tree_inputs(3, 2000, topo, draw)
  acc = accept_tree(jax.random.PRNGKey(4), prop, p, topo, greedy=greedy)
  _check_outcome(prop, acc, parents, topo.max_depth)
  assert np.any(np.asarray(acc.num_accepted) == topo.max_depth)
  assert np.any(np.asarray(acc.num_accepted) == 0)


@pytest.mark.parametrize("draw,greedy", RULES)
def test_per_row_parents_match_the_static_rule_row_by_row(draw, greedy):
  """Dynamic trees: each row verified under its own parents, as its static tree would be."""
  shallow, deep = TreeTopology((-1, -1, 0, 0, 1)), TreeTopology((-1, 0, 0, 1, 2))
  b = 1000
  prop, p, parents = _random_tree_inputs(8, b, deep, draw, per_row=[shallow, deep])
  key = jax.random.PRNGKey(9)
  acc = accept_tree(key, prop, p, deep, greedy=greedy)
  _check_outcome(prop, acc, parents, deep.max_depth)
  for start, topo in ((0, shallow), (1, deep)):
    static = accept_tree(key, prop.replace(parents=None), p, topo, greedy=greedy)
    rows = slice(start, None, 2)
    np.testing.assert_array_equal(acc.num_accepted[rows], static.num_accepted[rows])
    np.testing.assert_array_equal(acc.next_token[rows], static.next_token[rows])
    d = topo.max_depth + 1
    np.testing.assert_array_equal(acc.path[rows, :d], static.path[rows])
    assert np.all(np.asarray(acc.path[rows, d:]) == -1)


def _leading(prop, acc, topo) -> np.ndarray:
  """[B] the first-ranked chain's nodes accepted from the root (rank-0 nodes along the path)."""
  rank = np.asarray(node_ranks(prop, topo))
  path = np.asarray(acc.path)[:, 1:]
  on = (path > 0) & (np.take_along_axis(rank, np.maximum(path - 1, 0), axis=1) == 0)
  return np.cumprod(on, axis=1).sum(axis=1)


@pytest.mark.parametrize("draw", ["point_mass", "sampled", "without_replacement"])
def test_first_chain_betas_are_its_nodes_chances_of_acceptance(draw):
  """``first_chain_beta``: the root's rank-0 child, its rank-0 child, ... (nodes 0, 2, 5 of
  "depth3") each carry β = min(1, p(x) / q(x)) at their parent's entry (point mass: p(x));
  over 100k rows the Σβ of the nodes a step scores (up to the chain's first rejected node or
  its end) has the mean of the rank-0 nodes accepted from the root, and the rest of those
  nodes the mean of the rejections, with a smaller spread: what an adaptive policy counts in
  place of the flips. β read at the node's own entry instead of its parent's misses both (the
  test has power)."""
  topo = TOPOLOGIES["depth3"]
  prop, p, _ = _random_tree_inputs(11, ROWS, topo, draw)
  beta, length = first_chain_beta(prop, p, topo)
  beta, p_np, tok = np.asarray(beta), np.asarray(p), np.asarray(prop.tokens)
  rows = np.arange(ROWS)
  chain, parent_entry = [0, 2, 5], [0, 1, 3]
  own = np.stack([p_np[rows, e, tok[:, j]] for j, e in zip(chain, parent_entry)], axis=1)
  wrong = np.stack([p_np[rows, j + 1, tok[:, j]] for j in chain], axis=1)
  if draw != "point_mass":
    q_t = np.stack([np.asarray(prop.q)[rows, j, tok[:, j]] for j in chain], axis=1)
    own, wrong = np.minimum(own / q_t, 1.0), np.minimum(wrong / q_t, 1.0)
  np.testing.assert_allclose(beta, own, rtol=1e-5, atol=1e-7)
  assert np.all(np.asarray(length) == 3)
  acc = accept_tree(jax.random.PRNGKey(12), prop, p, topo)
  leading = _leading(prop, acc, topo)
  scored = np.arange(3)[None, :] < np.minimum(leading + 1, 3)[:, None]
  rejected = (leading < 3).astype(np.float64)
  for b, ok in ((beta, True), (wrong, False)):
    successes, failures = (np.where(scored, b, 0).sum(1),
                           scored.sum(1) - np.where(scored, b, 0).sum(1))
    for est, outcome in ((successes, leading), (failures, rejected)):
      gap, sigma = abs(est.mean() - outcome.mean()), np.std(est - outcome) / np.sqrt(ROWS)
      assert (gap < 4.5 * sigma) == ok, (draw, ok, gap, sigma)
  # ... and with less noise than the flips (per row: 0.46 against 0.88 for point masses, 0.97
  # against 1.32 sampled, at seed 11): the reason a policy counts them.
  assert np.where(scored, beta, 0).sum(1).std() < 0.8 * leading.std()


def test_first_chain_betas_of_per_row_parents_follow_each_rows_tree():
  """Dynamic trees: each row's first-ranked chain is its own tree's, β and length as the
  static tree's row by row; rows whose tree is shallower read 0 past their chain's end."""
  shallow, deep = TreeTopology((-1, -1, 0, 0, 1)), TreeTopology((-1, 0, 0, 1, 2))
  prop, p, _ = _random_tree_inputs(8, 64, deep, "point_mass", per_row=[shallow, deep])
  beta, length = first_chain_beta(prop, p, deep)
  for start, topo in ((0, shallow), (1, deep)):
    static, static_len = first_chain_beta(prop.replace(parents=None), p, topo)
    rows = slice(start, None, 2)
    d = topo.max_depth
    np.testing.assert_allclose(beta[rows, :d], static[rows], rtol=1e-6)
    assert np.all(np.asarray(beta[rows, d:]) == 0)
    np.testing.assert_array_equal(length[rows], static_len[rows])
  assert np.asarray(length).tolist() == [2, 3] * 32  # nodes 0 → 2, and 0 → 1 → 3


@pytest.mark.parametrize("draw,greedy", RULES)
def test_batch_rows_are_independent(draw, greedy):
  """A row's outcome depends on its own inputs only (same key, other rows changed)."""
  topo = TOPOLOGIES["depth3"]
  prop, p, _ = _random_tree_inputs(12, 512, topo, draw)
  other, p_other, _ = _random_tree_inputs(13, 512, topo, draw)
  keep = np.arange(512) % 3 == 0
  mix = lambda a, b: None if a is None else jnp.where(
      jnp.asarray(keep).reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
  mixed = prop.replace(tokens=mix(prop.tokens, other.tokens), q=mix(prop.q, other.q))
  key = jax.random.PRNGKey(14)
  a = accept_tree(key, prop, p, topo, greedy=greedy)
  b = accept_tree(key, mixed, mix(p, p_other), topo, greedy=greedy)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(np.asarray(x)[keep], np.asarray(y)[keep])
  assert not np.array_equal(np.asarray(a.next_token)[~keep], np.asarray(b.next_token)[~keep])


@pytest.mark.parametrize("name,draw,greedy", [("two_branch", d, g) for d, g in RULES] +
                         [("chain3", "sampled", False)])  # the chain fast path
def test_nan_and_negative_p_give_valid_ids(name, draw, greedy):
  topo = TOPOLOGIES[name]
  prop, p, parents = _random_tree_inputs(21, 600, topo, draw)
  p = np.array(p)
  rng = np.random.default_rng(22)
  p[rng.random(p.shape) < 0.2] = np.nan
  p[rng.random(p.shape) < 0.2] = -0.5
  p[rng.random(p.shape) < 0.05] = np.inf
  p[:50] = np.nan  # whole rows of garbage
  p[50:100] = -1.0
  if prop.q is not None:
    q = np.array(prop.q)
    q[rng.random(q.shape) < 0.1] = np.nan
    q[100:120] = -1.0
    prop = prop.replace(q=jnp.asarray(q))
  acc = accept_tree(jax.random.PRNGKey(23), prop, jnp.asarray(p), topo, greedy=greedy)
  _check_outcome(prop, acc, parents, topo.max_depth)


def test_shape_mismatch_raises():
  topo = TOPOLOGIES["two_branch"]
  prop = Proposal(tokens=jnp.zeros((2, 4), jnp.int32), q=None, draw="point_mass")
  with pytest.raises(ValueError, match="do not match"):
    accept_tree(jax.random.PRNGKey(0), prop, jnp.ones((2, 5, V)) / V, topo)
  prop = Proposal(tokens=jnp.zeros((2, 5), jnp.int32), q=None, draw="point_mass")
  with pytest.raises(ValueError, match="do not match"):
    accept_tree(jax.random.PRNGKey(0), prop, jnp.ones((2, 5, V)) / V, topo)


# --- Proposal ----------------------------------------------------------------------------------


def test_proposal_validates_draw_and_q():
  tokens = jnp.zeros((1, 2), jnp.int32)
  q = jnp.ones((1, 2, V)) / V
  with pytest.raises(ValueError, match="unknown draw"):
    Proposal(tokens=tokens, q=q, draw="beam")
  with pytest.raises(ValueError, match="needs q"):
    Proposal(tokens=tokens, draw="sampled")
  with pytest.raises(ValueError, match="takes no q"):
    Proposal(tokens=tokens, q=q, draw="point_mass")
  assert Proposal(tokens=tokens, q=None, draw="point_mass").q is None


def test_proposal_is_a_pytree_with_static_draw():
  drafts = jnp.asarray([[1, 2, 3]], jnp.float32)  # cast to int32 by Proposal.chain
  q = jnp.ones((1, 3, V)) / V
  prop = Proposal.chain(drafts, q)
  assert prop.tokens.dtype == jnp.int32 and prop.draw == "sampled" and prop.parents is None
  leaves, treedef = jax.tree.flatten(prop)
  assert len(leaves) == 2  # tokens and q; draw is static, parents None
  back = jax.tree.unflatten(treedef, leaves)
  assert back.draw == "sampled"
  pm = Proposal(tokens=prop.tokens, q=None, draw="point_mass")
  assert jax.tree.structure(pm) != jax.tree.structure(
      Proposal(tokens=prop.tokens, q=q, draw="without_replacement"))
  # Under jit the draw survives as a static field.
  f = jax.jit(lambda pr: pr.tokens + (1 if pr.draw == "point_mass" else 2))
  np.testing.assert_array_equal(f(pm), [[2, 3, 4]])
  np.testing.assert_array_equal(f(prop), [[3, 4, 5]])
