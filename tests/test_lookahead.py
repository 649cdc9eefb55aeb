"""Lookahead decoding (drafters/lookahead.py, drafters/ngram_pool.py): the pool's LRU rule,
the tree is the reference's 2D-Jacobi mask, greedy exact and step for step equal to a plain
re-derivation, sampling keeps the target's law (a known-wrong verifier does not), one
compile, bad input refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import LookaheadDrafter
from specjax.drafters.ngram_pool import NgramPool
from specjax.generate import generate
from specjax.sampling import Greedy, Sampling, sample_from
from specjax.speculative import SpeculativeDecoder, TreeTopology
from specjax.speculative.replay import replay_greedy
from specjax.speculative.tree_acceptance import TreeAcceptance
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint,
                             greedy_predictions, new_compiles_across_batches, tiny_model)

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 5, 6], [9, 3]]
SHAPES = [(1, 2, 1), (5, 4, 5), (3, 3, 2), (4, 2, 3), (2, 5, 1)]  # (W, N, G)


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=3)


# --- the pool ----------------------------------------------------------------------


def test_pool_keeps_the_most_recent_g_per_key_and_refreshes_repeats():
  pool = NgramPool.empty(2, 10, 2, 2)
  keys = jnp.array([3, 3])
  for gram in ([1, 1], [2, 2], [1, 1], [4, 4]):  # row 0: [1,1] refreshed, so [2,2] goes
    pool = pool.insert(keys, jnp.array([gram, [7, 7]]), valid=jnp.array([True, False]))
  grams, valid = pool.lookup(keys)
  np.testing.assert_array_equal(grams[0], [[4, 4], [1, 1]])  # most recent first
  np.testing.assert_array_equal(valid, [[True, True], [False, False]])
  np.testing.assert_array_equal(pool.clock, [4, 0])
  _, valid = pool.lookup(jnp.array([5, 5]))
  assert not valid.any()


def test_pool_takes_a_sequences_ngrams_in_order():
  tokens = jnp.array([[1, 2, 3, 1, 2, 4, 0, 0]])
  pool = NgramPool.empty(1, 8, 3, 2).insert_sequence(tokens, jnp.array([0]), jnp.array([6]), 8)
  grams, valid = pool.lookup(jnp.array([1]))
  np.testing.assert_array_equal(grams[0][valid[0]], [[2, 4], [2, 3]])
  grams, valid = pool.lookup(jnp.array([2]))
  np.testing.assert_array_equal(grams[0][valid[0]], [[3, 1]])  # (2, 4, 0) ends past stop
  assert int(pool.clock[0]) == 4  # n-grams ending at positions 2 … 5


# --- the tree ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_is_the_2d_jacobi_mask_with_guess_chains(shape):
  w, n, g = shape
  d = LookaheadDrafter(64, window=w, ngram=n, guesses=g)
  topo, at = d.default_tree(), d.layout.window_block
  mask, depth = topo.block_mask, topo.block_depth
  assert topo.num_nodes == (w - 1) + (n - 2) * w + g * (n - 1)
  cells = {(l, j): int(at[l, j]) for l in range(n - 1) for j in range(w)}
  for (l, j), e in cells.items():
    assert depth[e] == l + j  # row ℓ shifted by ℓ: column j follows a diagonal
    sees = {cells[(0, k)] for k in range(j + 1)} | {cells[(k, j)] for k in range(l + 1)}
    assert set(np.flatnonzero(mask[e])) == sees
  guesses = sorted(set(range(topo.num_nodes + 1)) - set(cells.values()))
  assert len(guesses) == g * (n - 1)
  for e in guesses:  # each guess sees the root and its own chain only
    anc = np.flatnonzero(mask[e])
    assert anc[0] == 0 and all(a in guesses for a in anc[1:]) and len(anc) == depth[e] + 1
  assert d.supports(topo) and not d.supports(TreeTopology.chain(topo.num_nodes + 1))


# --- greedy --------------------------------------------------------------------------


# Two shapes by default (the degenerate W = 1 window and a wide one); the rest are heavy.
@pytest.mark.parametrize("shape", SHAPES[:2] + [pytest.param(s, marks=pytest.mark.heavy)
                                                for s in SHAPES[2:]])
def test_greedy_equals_plain_decoding(target, shape):
  cfg, params = target
  w, n, g = shape
  want = generate(params, cfg, PROMPTS, 30, sampler=Greedy(), eos_ids=())
  for from_context in (True, False):
    d = LookaheadDrafter(cfg.vocab_size, window=w, ngram=n, guesses=g,
                         pool_from_context=from_context)
    got = SpeculativeDecoder(cfg, d, eos_ids=()).generate(params, (), PROMPTS, 30)
    assert [got.generated(r) for r in range(2)] == [want.generated(r) for r in range(2)]
    assert 1.0 <= got.metrics()["tokens_per_call"] <= d.default_tree().max_depth + 1


def _reference_lookahead(cfg, params, d: LookaheadDrafter, prompt, budget, window0):
  """Greedy lookahead written out plainly (a dict of LRU lists, full forwards, no cache):
  returns (generated tokens, target calls)."""
  w, n, g = d.window, d.ngram, d.guesses
  pool: dict[int, list[tuple]] = {}

  def insert(key, gram):
    lst = pool.setdefault(key, [])
    if gram in lst:
      lst.remove(gram)
    elif len(lst) == g:
      lst.pop(0)
    lst.append(gram)

  predictions = greedy_predictions(cfg, params, len(prompt) + budget + 2 * (w + n))
  seq, window, calls, its = list(prompt), [list(r) for r in window0], 0, 0
  for e in range(n - 1, len(seq)):
    insert(seq[e - n + 1], tuple(seq[e - n + 2:e + 1]))
  pooled = len(seq)
  want = generate(params, cfg, [prompt], budget + 64, sampler=Greedy(), eos_ids=()).generated(0)
  while len(seq) - len(prompt) < budget:
    for e in range(max(pooled, n - 1), len(seq)):
      insert(seq[e - n + 1], tuple(seq[e - n + 2:e + 1]))
    pooled, root = len(seq), seq[-1]
    window[0][0] = root
    guesses = list(reversed(pool.get(root, []))) or [(0,) * (n - 1)]  # an empty key: zeros
    paths = [list(x) for x in guesses] + [
        window[0][1:j + 1] + [window[k][j] for k in range(1, l + 1)]
        for l in range(n - 1) for j in range(w) if (l, j) != (0, 0)]
    truth = want[len(seq) - len(prompt):]
    hit = max([next((i for i, (a, b) in enumerate(zip(p, truth)) if a != b), len(p))
               for p in paths] + [0])
    fresh = [predictions(seq + window[0][1:j + 1] + [window[k][j] for k in range(1, n - 1)])[-1]
             for j in range(w)]
    if its >= n - 2:
      for j in range(w):
        insert(window[0][j], tuple([window[k][j] for k in range(1, n - 1)] + [fresh[j]]))
    window = window[1:] + [fresh]
    seq += truth[:hit + 1]
    calls, its = calls + 1, its + 1
  return seq[len(prompt):len(prompt) + budget], calls


@pytest.mark.parametrize("shape", [(3, 3, 2), (2, 4, 2)])
def test_steps_match_a_plain_rederivation(target, shape):
  """Same tokens and the same number of target calls as the algorithm written out by hand:
  a wrong harvest, slide or pool rule changes what is guessed, and so the count."""
  cfg, params = target
  w, n, g = shape
  d = LookaheadDrafter(cfg.vocab_size, window=w, ngram=n, guesses=g)
  prompt, budget = PROMPTS[0], 24
  got = SpeculativeDecoder(cfg, d, eos_ids=()).generate(params, (), [prompt], budget)
  window0 = np.asarray(d.init((), jnp.asarray([prompt]), jnp.asarray([len(prompt)])).window[0])
  want, calls = _reference_lookahead(cfg, params, d, prompt, budget, window0.tolist())
  assert got.generated(0) == want
  assert int(got.per_row["target_calls"][0]) == calls
  assert calls < budget  # the pool and window pay on this repetitive prompt


def test_a_constant_target_is_decoded_in_long_strides():
  """All-zero weights: the target always picks token 0. Once the window has converged and
  the pool holds (0, 0, …), each call accepts a whole guess: N tokens per call."""
  cfg, params = tiny_model(seed=0, scale=0.0)
  d = LookaheadDrafter(cfg.vocab_size, window=3, ngram=4, guesses=2)
  out = SpeculativeDecoder(cfg, d, eos_ids=()).generate(params, (), [[5, 9, 11]], 60)
  assert out.generated(0) == [0] * 60
  assert out.metrics()["tokens_per_call"] > 3.0


# --- sampling ------------------------------------------------------------------------


class _ResampleFromP(SpeculativeDecoder):
  """Known wrong: after the children of the path's end are rejected, draws the next token
  from the target's p there instead of the residual (p with the rejected tokens removed)."""

  def accept(self, key, proposal, scores):
    acc = super().accept(key, proposal, scores)
    b = proposal.tokens.shape[0]
    end = acc.path[jnp.arange(b), acc.num_accepted]
    has_children = jnp.asarray([True] + [c > 0 for c in self.tree.num_children])[end]
    p_end = scores.p[jnp.arange(b), end]
    wrong = sample_from(jax.random.fold_in(key, 1), p_end)
    return TreeAcceptance(acc.path, acc.num_accepted,
                          jnp.where(has_children, wrong, acc.next_token), acc.beta)


# Traversal verification (verification="block" on its tree) is heavy: the rule is pinned by
# enumeration in tests/test_traversal_verification.py.
@pytest.mark.parametrize("verification", ["tokenwise", pytest.param("block",
                                                                    marks=pytest.mark.heavy)])
def test_sampling_matches_target(verification):
  target = tiny_model(seed=0, vocab_size=8, scale=1.0)
  sampler = Sampling(temperature=0.9, top_k=6)
  d = LookaheadDrafter(8, window=3, ngram=3, guesses=2)
  prompt = [1, 2, 5, 3, 1, 2, 5, 1, 2]
  exact = exact_joint(*target, sampler, prompt)
  dec = SpeculativeDecoder(target[0], d, sampler=sampler, eos_ids=(), verification=verification)
  counts = empirical_joint(dec, target, (), prompt, 100_000)
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / counts.sum() - exact).sum() < 0.02
  if verification == "block":
    return
  wrong = _ResampleFromP(target[0], d, sampler=sampler, eos_ids=())
  counts = empirical_joint(wrong, target, (), prompt, 100_000)
  assert chi_square_pvalue(counts, exact) < 1e-6


# --- compilation and input -----------------------------------------------------------


def test_no_recompilation(target):
  cfg, params = target
  dec = SpeculativeDecoder(cfg, LookaheadDrafter(cfg.vocab_size, window=4, ngram=3, guesses=3),
                           sampler=Sampling(temperature=1.0))
  assert new_compiles_across_batches(dec, params, ()) == 0


def test_bad_input_is_refused_before_compiling(target):
  cfg, params = target
  for kw, msg in [(dict(window=0), "window"), (dict(ngram=1), "ngram"),
                  (dict(guesses=0), "guesses"), (dict(window=2.5), "window")]:
    with pytest.raises((ValueError, TypeError), match=msg):
      LookaheadDrafter(cfg.vocab_size, **kw)
  d = LookaheadDrafter(cfg.vocab_size)
  with pytest.raises(ValueError, match="its own tree only"):
    SpeculativeDecoder(cfg, d, gamma=4)
  # its own tree, verified by traversal verification under "block" (test_sampling_matches_target)
  assert SpeculativeDecoder(cfg, d, verification="block").verification == "block"
  dec = SpeculativeDecoder(cfg, d)
  with pytest.raises(ValueError, match="cache"):
    dec.generate(params, (), [[1, 2, 3]], 8, cache_size=12)
  with pytest.raises(ValueError, match="run it for real"):
    replay_greedy(dec, params, (), [[1, 2]], [[3] * 40], 8)
