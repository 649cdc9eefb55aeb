"""Traversal verification (speculative/traversal_verification.py): exact by enumeration.

A toy Markov target over V = 4 tokens (the law after a token depends on that token only:
row x of P) and a draft Q. For a small tree every draft the drafter can make is listed
with its probability (independent draws, draws without replacement, or the deterministic
top-k), and for each the rule's law of what it emits: the chance of stopping at each block
entry (the coins integrated out) times the law of the next token there. Completed by the
target to D + 1 tokens, the mixture must be the target's own law of D + 1 tokens: exactly,
up to float rounding. Deliberately wrong updates fail the same check by orders of magnitude
more, and a plain-Python re-derivation of the rule agrees with the library tree by tree.
The decoder (``verification="block"`` on a tree) is then checked as every method is: the
target's two-token law on tiny models, greedy equality with plain decoding, no recompilation.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import ModelDrafter
from specjax.generate import generate
from specjax.sampling import Greedy, Sampling, SubsetProbs
from specjax.speculative import (DynamicTree, SampledDynamicTree, SpeculativeDecoder,
                                 block_verification)
from specjax.speculative import traversal_verification as tv
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import TreeTopology
from specjax.speculative.tree_acceptance import accept_tree
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint,
                             new_compiles_across_batches, tiny_model)

from matrix import grid

V, X0 = 4, 1
_rng = np.random.default_rng(0)
P = _rng.dirichlet([0.7] * V, size=V)  # target: row x is the law after token x
Q = _rng.dirichlet([0.7] * V, size=V)  # draft
TREES = {
    "chain2": (-1, 0),
    "wide3": (-1, -1, -1),
    "two_branch": (-1, -1, 0, 0, 1),
    "depth3": (-1, -1, 0, 1, 2),
}
DRAWS = ("sampled", "without_replacement", "point_mass")


def _drafts(parents, draw):
  """Every draft tree below X0 with its probability: (weights [M], tokens [M, N])."""
  n = len(parents)
  ranks = TreeTopology(parents).ranks
  weights, rows = [], []
  for toks in itertools.product(range(V), repeat=n):
    entries = (X0,) + toks
    w = 1.0
    for i in range(n):
      q = Q[entries[parents[i] + 1]]
      earlier = [toks[j] for j in range(i) if parents[j] == parents[i]]
      if draw == "sampled":
        w *= q[toks[i]]
      elif draw == "without_replacement":
        w = 0.0 if toks[i] in earlier else w * q[toks[i]] / (1.0 - q[earlier].sum())
      elif toks[i] != np.argsort(-q, kind="stable")[ranks[i]]:
        w = 0.0
      if w == 0.0:
        break
    if w > 0:
      weights.append(w)
      rows.append(toks)
  return np.array(weights), np.array(rows, np.int32)


def _inputs(parents, tokens, draw):
  """(Proposal, p [M, N + 1, V]) of the draft trees ``tokens`` [M, N] (q = Q at the parent)."""
  entries = np.concatenate([np.full((len(tokens), 1), X0), tokens], axis=1)
  q = Q[entries[:, [par + 1 for par in parents]]]
  prop = Proposal(tokens=jnp.asarray(tokens), draw=draw,
                  q=None if draw == "point_mass" else jnp.asarray(q, jnp.float32))
  return prop, jnp.asarray(P[entries], jnp.float32)


def _library_law(prop, p, topo):
  """(stop [M, N + 1], residual laws [M, N + 1, V]) of the library's rule: the walk with
  coins that fail every test but entry e's gives the residual at e."""
  m, n = prop.tokens.shape
  walk = jax.jit(tv._walk, static_argnums=2)
  stop = np.asarray(tv.stop_probabilities(prop, p, topo))
  laws = [np.asarray(walk(prop, p, topo, jnp.ones((m, n))).residual)]
  for e in range(1, n + 1):
    out = walk(prop, p, topo, jnp.ones((m, n)).at[:, e - 1].set(0.0))
    assert np.all((np.asarray(out.entry) == e) | (stop[:, e] == 0))
    laws.append(np.asarray(out.residual))
  laws = np.stack(laws, axis=1)
  return stop, laws / laws.sum(-1, keepdims=True)


def _reference_law(parents, tokens, draw, variant="exact"):
  """The rule written out plainly, one tree: (stop [N + 1], residual laws [N + 1, V]).

  variant "exact" is the module docstring's rule. Wrong ones: "ratio" sets the weight after
  a failed child y to min(1, Z / (1 − Q(y))), which reads the failed token; "keep_weight"
  keeps the parent's weight.
  """
  n = len(parents)
  entries = (X0,) + tuple(int(t) for t in tokens)
  children = [[i + 1 for i in range(n) if parents[i] + 1 == e] for e in range(n + 1)]
  stop, laws, reach = np.zeros(n + 1), np.zeros((n + 1, V)), [1.0]

  def visit(e, a, law):
    q_run = None
    for c in children[e]:
      t = entries[c]
      if draw == "point_mass":
        q = np.eye(V)[t]
      else:
        q = Q[entries[e]] if q_run is None else q_run
      if q[t] == 0:
        continue  # never a draw
      visit(c, min(1.0, a * law[t] / q[t]), P[t])
      rest = np.maximum(a * law - q, 0.0)
      z = rest.sum()
      if variant == "exact":
        a_next = z / (z + 1.0 - a) if z + 1.0 - a > 0 else 1.0
      elif variant == "ratio":
        a_next = min(1.0, z / (1.0 - q[t])) if q[t] < 1 else 0.0
      else:
        a_next = a
      law = rest / z if z > 0 else law
      a = a_next
      if draw == "without_replacement":
        q_run = np.where(np.arange(V) == t, 0.0, q)
        q_run = q_run / q_run.sum() if q_run.sum() > 0 else q_run
    a = 1.0 if e == 0 else a  # the root always passes
    stop[e] += reach[0] * a
    laws[e] = law
    reach[0] *= 1.0 - a

  visit(0, 1.0, P[X0])
  return stop, laws


def _distance_from_target(parents, weights, tokens, stop, laws):
  """Total variation between the target's law of D + 1 tokens and the rule's emissions
  (path, next token) completed by the target."""
  topo = TreeTopology(parents)
  length = topo.max_depth + 1
  out = np.zeros((V,) * length)
  bp = topo.block_parents
  for w, toks, st, law in zip(weights, tokens, stop, laws):
    entries = (X0,) + tuple(int(t) for t in toks)
    for e in np.flatnonzero(st > 0):
      path, j = [], e
      while j > 0:
        path.append(entries[j])
        j = bp[j]
      prefix = np.zeros((V,) * (len(path) + 1))
      prefix[tuple(path[::-1])] = w * st[e] * law[e]
      while prefix.ndim < length:  # the target continues
        prefix = prefix[..., None] * P[np.arange(V)].reshape((1,) * (prefix.ndim - 1) + (V, V))
      out += prefix
  exact = P[X0]
  for _ in range(length - 1):
    exact = exact[..., None] * P.reshape((1,) * (exact.ndim - 1) + (V, V))
  return 0.5 * np.abs(out - exact).sum()


@pytest.mark.parametrize("name, draw", grid(list(TREES), list(DRAWS), keep=(
    "chain2-sampled", "wide3-without_replacement", "two_branch-without_replacement",
    "two_branch-point_mass", "depth3-sampled")))
def test_the_rule_emits_the_targets_law(name, draw):
  parents = TREES[name]
  topo = TreeTopology(parents)
  weights, tokens = _drafts(parents, draw)
  prop, p = _inputs(parents, tokens, draw)
  stop, laws = _library_law(prop, p, topo)
  np.testing.assert_allclose(stop.sum(axis=1), 1.0, atol=1e-5)
  assert _distance_from_target(parents, weights, tokens, stop, laws) < 1e-5
  # Not trivially so: drafts are rejected and kept, down to the deepest level.
  mean_depth = np.sum(weights[:, None] * stop * topo.block_depth)
  assert 0.02 < mean_depth < topo.max_depth - 0.05


@pytest.mark.parametrize("variant", ["ratio", "keep_weight"])
def test_wrong_updates_are_caught(variant):
  parents = TREES["two_branch"]
  weights, tokens = _drafts(parents, "without_replacement")
  exact = [_reference_law(parents, t, "without_replacement") for t in tokens]
  wrong = [_reference_law(parents, t, "without_replacement", variant) for t in tokens]
  assert _distance_from_target(parents, weights, tokens, *map(np.stack, zip(*exact))) < 1e-9
  assert _distance_from_target(parents, weights, tokens, *map(np.stack, zip(*wrong))) > 1e-3


@pytest.mark.parametrize("draw", DRAWS)
def test_library_agrees_with_the_plain_rule_tree_by_tree(draw):
  parents = TREES["depth3"]
  topo = TreeTopology(parents)
  rng = np.random.default_rng(1)
  if draw == "point_mass":  # any deterministic drafter's tokens, repeated siblings included
    tokens = rng.integers(0, V, size=(64, len(parents))).astype(np.int32)
  else:
    _, tokens = _drafts(parents, draw)
    tokens = tokens[rng.permutation(len(tokens))[:64]]
  prop, p = _inputs(parents, tokens, draw)
  stop, laws = _library_law(prop, p, topo)
  for i, toks in enumerate(tokens):
    ref_stop, ref_laws = _reference_law(parents, toks, draw)
    np.testing.assert_allclose(stop[i], ref_stop, atol=2e-6)
    on = ref_stop > 1e-6  # (a stop of float rounding size is not reached by the coins)
    np.testing.assert_allclose(laws[i][on], ref_laws[on], atol=2e-5)


def test_per_row_parents_and_a_subset_q_give_the_static_trees_law():
  """Rows of different (dynamic) shapes, q as ``SubsetProbs`` over all V ids in a shuffled
  order: each row's law is its static tree's over the vocabulary."""
  shapes = [TREES["two_branch"], (-1, -1, 0, 1, 3)]
  _, tok_a = _drafts(shapes[0], "without_replacement")
  _, tok_b = _drafts(shapes[1], "without_replacement")
  tokens = np.stack([tok_a[7], tok_b[11]])
  props = [_inputs(s, t[None], "without_replacement") for s, t in zip(shapes, tokens)]
  ids = jnp.asarray([2, 0, 3, 1], jnp.int32)
  q = jnp.concatenate([pr.q for pr, _ in props])[..., ids]
  dynamic = Proposal(tokens=jnp.asarray(tokens), q=SubsetProbs(q, ids, V),
                     parents=jnp.asarray(shapes, jnp.int32), draw="without_replacement")
  p = jnp.concatenate([pp for _, pp in props])
  got = np.asarray(tv.stop_probabilities(dynamic, p, TreeTopology(shapes[1])))
  for i, shape in enumerate(shapes):
    want = np.asarray(tv.stop_probabilities(props[i][0], props[i][1], TreeTopology(shape)))[0]
    np.testing.assert_allclose(got[i], want, atol=1e-6)


def test_on_a_chain_it_is_block_verification():
  """A chain's stops are block verification's: P(τ = i) = hᵢ Πⱼ>ᵢ (1 − hⱼ)."""
  rng = np.random.default_rng(2)
  b, gamma, v = 16, 4, 12
  q = rng.dirichlet([0.5] * v, size=(b, gamma)).astype(np.float32)
  p = rng.dirichlet([0.5] * v, size=(b, gamma + 1)).astype(np.float32)
  drafts = np.array([[rng.choice(v, p=q[i, j] / q[i, j].sum()) for j in range(gamma)]
                     for i in range(b)], np.int32)
  h, residual = block_verification.stop_probabilities(jnp.asarray(drafts), jnp.asarray(q),
                                                      jnp.asarray(p))
  h = np.asarray(h)
  fail_after = np.concatenate([np.cumprod((1 - h)[:, ::-1], axis=1)[:, ::-1][:, 1:],
                               np.ones((b, 1))], axis=1)
  want = np.concatenate([fail_after[:, :1] * (1 - h[:, :1]), h * fail_after], axis=1)
  prop = Proposal.chain(jnp.asarray(drafts), jnp.asarray(q))
  stop = np.asarray(tv.stop_probabilities(prop, jnp.asarray(p), TreeTopology.chain(gamma)))
  np.testing.assert_allclose(stop, want, atol=1e-5)
  assert np.mean(want[:, 1:-1].sum(1)) > 0.1  # the chains stop part-way, not only at the ends


def test_a_node_that_was_never_a_draw_changes_nothing():
  """q = 0 at node 0's token: node 0 and its subtree are skipped, and the rest of the tree
  is judged as if they were not there."""
  parents, draw = TREES["two_branch"], "sampled"
  _, tokens = _drafts(parents, draw)
  prop, p = _inputs(parents, tokens[:32], draw)
  q = prop.q.at[:, 0].set(prop.q[:, 0].at[jnp.arange(32), prop.tokens[:, 0]].set(0.0))
  stop = np.asarray(tv.stop_probabilities(prop.replace(q=q), p, TreeTopology(parents)))
  assert np.all(stop[:, [1, 3, 4]] == 0)
  pruned = Proposal(tokens=prop.tokens[:, [1, 4]], q=prop.q[:, [1, 4]], draw=draw)
  want = np.asarray(tv.stop_probabilities(pruned, p[:, [0, 2, 5]], TreeTopology((-1, 0))))
  np.testing.assert_allclose(stop[:, [0, 2, 5]], want, atol=1e-6)


@pytest.mark.parametrize("draw", ["sampled", "without_replacement"])
def test_extreme_laws_give_a_law(draw):
  """Laws as peaked as a sharp softmax in float32 (entries down to 1e-45, whole rows of
  zeros after a failure): every row's stops are finite, non-negative and sum to 1 (a
  weight of 0 times the ratio of a tiny q once made NaN)."""
  rng = np.random.default_rng(0)
  parents = (-1, -1, -1, 0, 0, 1, 3, 3, 5)
  b, v, n = 512, 6, len(parents)
  q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, n, v)) * 40, jnp.float32), -1)
  p = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, n + 1, v)) * 40, jnp.float32), -1)
  tokens = jnp.asarray(rng.integers(0, v, size=(b, n)), jnp.int32)
  stop = np.asarray(tv.stop_probabilities(Proposal(tokens=tokens, q=q, draw=draw), p,
                                          TreeTopology(parents)))
  assert np.all(np.isfinite(stop)) and np.all(stop >= 0)
  np.testing.assert_allclose(stop.sum(axis=1), 1.0, atol=1e-5)


def test_draws_follow_the_law():
  """``traverse``'s coins and draw: the frequency of (entry, next token) over 200k keys on
  one tree matches stop × residual law."""
  parents, draw = TREES["depth3"], "without_replacement"
  topo = TreeTopology(parents)
  _, tokens = _drafts(parents, draw)
  prop, p = _inputs(parents, tokens, draw)
  stop, laws = _library_law(prop, p, topo)
  outcomes = stop[:, :, None] * laws  # [M, N + 1, V]
  pick = int(np.argmax(np.sum(outcomes > 0.02, axis=(1, 2))))  # a tree of many outcomes
  prop, p = _inputs(parents, tokens[pick:pick + 1], draw)
  want = outcomes[pick].ravel()
  keys = jax.random.split(jax.random.PRNGKey(3), 200_000)
  def draw(k):
    walk, nxt = tv.traverse(k, prop, p, topo)
    return walk.entry, nxt

  entry, nxt = jax.jit(jax.vmap(draw))(keys)
  counts = np.bincount((np.asarray(entry)[:, 0] * V + np.asarray(nxt)[:, 0]),
                       minlength=want.size) / len(keys)
  assert np.abs(counts - want).max() < 4e-3
  assert np.sum(want > 0.02) >= 5  # several outcomes, so the check has something to compare


def test_accept_tree_uses_it_for_block_verification_of_a_tree():
  """``accept_tree(block=True)``: a chain keeps ``accept_block``, a tree is traversed (its
  path, n and next token those of ``traverse`` with the same key)."""
  parents, draw = TREES["two_branch"], "without_replacement"
  topo = TreeTopology(parents)
  _, tokens = _drafts(parents, draw)
  prop, p = _inputs(parents, tokens[:64], draw)
  key = jax.random.PRNGKey(4)
  acc = accept_tree(key, prop, p, topo, block=True)
  walk, nxt = tv.traverse(key, prop, p, topo)
  entry = walk.entry
  np.testing.assert_array_equal(np.asarray(acc.next_token), np.asarray(nxt))
  np.testing.assert_array_equal(np.asarray(acc.num_accepted),
                                np.asarray(topo.block_depth)[np.asarray(entry)])
  np.testing.assert_array_equal(np.asarray(acc.path)[np.arange(64), acc.num_accepted],
                                np.asarray(entry))


# --- the decoder: verification="block" on trees ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_models():
  return (tiny_model(seed=0, vocab_size=8, scale=1.0),
          tiny_model(seed=1, vocab_size=8, scale=1.0, num_layers=1))


@pytest.mark.parametrize("tree, tree_draw", [
    pytest.param(SampledDynamicTree((2, 2)), "point_mass",  # children drawn: sampler's law
                 id="sampled_dynamic"),
    pytest.param(TreeTopology((-1, -1, 0)), "without_replacement", id="static_drawn",
                 marks=pytest.mark.heavy),  # the same rule on a static shape
])
def test_decoder_traverses_trees_in_the_targets_law(tiny_models, tree, tree_draw):
  target, draft = tiny_models
  sampler = Sampling(temperature=1.0)
  dec = SpeculativeDecoder(target[0], ModelDrafter(draft[0], tree_draw=tree_draw), tree=tree,
                           sampler=sampler, eos_ids=(), verification="block")
  counts = empirical_joint(dec, target, dec.drafter.make_params(draft[1]), [1, 2, 5], 100_000)
  exact = exact_joint(*target, sampler, [1, 2, 5])
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / counts.sum() - exact).sum() < 0.02


def test_decoder_greedy_equality_and_no_recompilation_on_trees():
  cfg, params = tiny_model(seed=3)
  dcfg, dparams = tiny_model(seed=4, num_layers=1)
  prompts = [[5, 6, 7, 8], [9, 3]]
  want = generate(params, cfg, prompts, 24, sampler=Greedy(), eos_ids=())
  for tree, sampler in ((DynamicTree(top_k=2, depth=3, num_nodes=5), Greedy()),
                        (SampledDynamicTree((2, 2)), Sampling(temperature=0.8))):
    dec = SpeculativeDecoder(cfg, ModelDrafter(dcfg), tree=tree, sampler=sampler, eos_ids=(),
                             verification="block")
    dp = dec.drafter.make_params(dparams)
    if isinstance(sampler, Greedy):
      np.testing.assert_array_equal(dec.generate(params, dp, prompts, 24).tokens, want.tokens)
    assert new_compiles_across_batches(dec, params, dp) == 0
