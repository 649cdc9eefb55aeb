"""Block verification (speculative/block_verification.py): exact law, tokens per step, decoder.

Three layers of evidence:
  * exact enumeration: for a toy Markov target P and draft Q (the distribution after
    a token depends on that token only), every draft block of length γ is fed to the
    library's own ``stop_probabilities``; the law of the emitted tokens, extended by the
    target to γ + 1 tokens, must equal the target's law to float precision, and its
    expected tokens per step must never fall below token-wise verification's;
  * sampling: ``accept_block`` itself (η draws, τ selection, residual draw) over ROWS
    independent runs of the first three emitted tokens, by chi-square and total
    variation; two deliberately wrong variants of the rule must fail the same test;
  * the decoder: ``SpeculativeDecoder(verification="block")`` on tiny models is greedy
    exact, matches the target's two-token law, compiles once; trees go to traversal
    verification (``tests/test_traversal_verification.py``).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import ModelDrafter
from specjax.generate import generate
from specjax.sampling import Greedy, Sampling, SubsetProbs, sample_from
from specjax.speculative import DynamicTree, SpeculativeDecoder, TreeTopology
from specjax.speculative import acceptance as chain_rule
from specjax.speculative.acceptance import Acceptance
from specjax.speculative.block_verification import (accept_block, block_weights,
                                                    expected_tokens, stop_probabilities)
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint, make_drafter,
                             new_compiles_across_batches, tiny_model)

X0 = 1


def _markov(seed: int, v: int, alpha: float) -> np.ndarray:
  return np.random.default_rng(seed).dirichlet([alpha] * v, size=v)


def _pair(seed: int, v: int, alpha: float = 0.7):
  """(P, Q): a target and a draft that overlap only partly."""
  p = _markov(seed, v, alpha)
  q = 0.5 * _markov(seed + 100, v, alpha) + 0.5 * np.roll(p, 1, axis=1)
  return p, q


# --- exact enumeration ------------------------------------------------------------


def _all_blocks(v: int, gamma: int):
  """Every draft block [V^γ, γ], its draft probability, q [., γ, V] and p [., γ + 1, V]."""
  return np.array(list(itertools.product(range(v), repeat=gamma)), np.int32)


def _block_inputs(P, Q, blocks):
  ctx = np.concatenate([np.full((len(blocks), 1), X0, np.int32), blocks], axis=1)  # [M, γ + 1]
  q = Q[ctx[:, :-1]]
  p = P[ctx]
  prob = np.prod(np.take_along_axis(q, blocks[..., None], -1)[..., 0], axis=1)
  return ctx, prob, q, p


def _target_law(P, length):
  law = np.zeros((P.shape[0],) * length)
  for s in itertools.product(range(P.shape[0]), repeat=length):
    law[s] = np.prod([P[a, b] for a, b in zip((X0,) + s[:-1], s)])
  return law


def _extend(P, prefix, mass, law):
  """Adds ``mass`` × the target's continuation of ``prefix`` to ``law`` (all its lengths)."""
  if len(prefix) == law.ndim:
    law[prefix] += mass
    return
  row = P[prefix[-1] if prefix else X0]
  for t in range(P.shape[0]):
    _extend(P, prefix + (t,), mass * row[t], law)


def _tau_law(h: np.ndarray) -> np.ndarray:
  """[M, γ + 1] P(τ = i) from h [M, γ]: hᵢ Πⱼ>ᵢ (1 − hⱼ), h₀ = 1."""
  m, gamma = h.shape
  hh = np.concatenate([np.ones((m, 1)), h], axis=1)
  after = np.concatenate([np.cumprod((1 - h)[:, ::-1], axis=1)[:, ::-1], np.ones((m, 1))], 1)
  return hh * after


@pytest.mark.parametrize("v,gamma,seed", [(3, 3, 0), (3, 4, 1), (4, 2, 2), (2, 5, 3)])
def test_exact_law_equals_target_and_never_loses_to_tokenwise(v, gamma, seed):
  P, Q = _pair(seed, v)
  blocks = _all_blocks(v, gamma)
  ctx, prob, q, p = _block_inputs(P, Q, blocks)
  h, residual = map(np.asarray, jax.jit(stop_probabilities)(
      jnp.asarray(blocks), jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32)))
  tau = _tau_law(h.astype(np.float64))
  law = np.zeros((v,) * (gamma + 1))
  for m, block in enumerate(blocks):
    for t in range(gamma + 1):
      for y in range(v):
        _extend(P, tuple(block[:t]) + (y,), prob[m] * tau[m, t] * residual[m, t, y], law)
  np.testing.assert_allclose(law, _target_law(P, gamma + 1), atol=2e-6)

  # Tokens per step: block ≥ token-wise (Sun et al., Theorem 2), strictly here.
  block_tokens = np.sum(prob * (tau @ np.arange(1, gamma + 2)))
  ratio = np.minimum(1.0, np.take_along_axis(p[:, :gamma], blocks[..., None], -1)[..., 0]
                     / np.take_along_axis(q, blocks[..., None], -1)[..., 0])
  tokenwise = np.sum(prob * (1 + np.sum(np.cumprod(ratio, axis=1), axis=1)))
  assert block_tokens > tokenwise + 1e-4, (block_tokens, tokenwise)
  # The library's per-block expectations agree with the enumeration.
  lib_tokenwise, lib_block = map(np.asarray, expected_tokens(
      jnp.asarray(blocks), jnp.asarray(q, jnp.float32), jnp.asarray(p, jnp.float32)))
  np.testing.assert_allclose(np.sum(prob * lib_block), block_tokens, rtol=1e-5)
  np.testing.assert_allclose(np.sum(prob * lib_tokenwise), tokenwise, rtol=1e-5)
  assert np.all(lib_block >= 1) and np.all(lib_block <= gamma + 1 + 1e-5)


def test_gamma_one_is_the_tokenwise_rule():
  P, Q = _pair(4, 5)
  blocks = _all_blocks(5, 1)
  _, _, q, p = _block_inputs(P, Q, blocks)
  h, residual = stop_probabilities(jnp.asarray(blocks), jnp.asarray(q), jnp.asarray(p))
  accept = np.minimum(1, p[np.arange(5), 0, blocks[:, 0]] / q[np.arange(5), 0, blocks[:, 0]])
  np.testing.assert_allclose(np.asarray(h)[:, 0], accept, rtol=1e-6)
  tokenwise = np.maximum(p[:, 0] - q[:, 0], 0)
  np.testing.assert_allclose(np.asarray(residual)[:, 0],
                             tokenwise / tokenwise.sum(-1, keepdims=True), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(residual)[:, 1], p[:, 1], rtol=1e-6)


def test_weights_worked_example():
  """The module docstring's example: q = ½ everywhere, p₁ = (1, 0), p₂ = (½, ½)."""
  q = jnp.full((2, 2, 2), 0.5)
  p = jnp.array([[[1.0, 0.0], [0.5, 0.5], [0.5, 0.5]]] * 2)
  w = block_weights(jnp.array([[0, 0], [1, 0]]), q, p)
  np.testing.assert_allclose(np.asarray(w), [[1, 1, 1], [1, 0, 0]])
  h, residual = stop_probabilities(jnp.array([[1, 0]]), q[:1], p[:1])
  np.testing.assert_allclose(np.asarray(h), [[0, 0]])
  np.testing.assert_allclose(np.asarray(residual)[0, 0], [1, 0])


# --- sampling: accept_block itself, and wrong variants -------------------------------

V, GAMMA, ROWS = 5, 3, 200_000
P_S, Q_S = _pair(7, V, alpha=0.6)


def _no_weight_residual(key, drafts, q, p):
  """Wrong: the extra token from norm(max(0, p − q)), without the weight w_τ."""
  acc = accept_block(key, drafts, q, p)
  q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
  n = acc.num_accepted[:, None, None]
  res = jnp.maximum(jnp.take_along_axis(p, n, 1)[:, 0] - jnp.take_along_axis(q_pad, n, 1)[:, 0],
                    0.0)
  return acc._replace(next_token=sample_from(jax.random.fold_in(key, 3), res))


def _weights_as_stops(key, drafts, q, p):
  """Wrong: stop tests hᵢ = wᵢ at every i (no residual mass term)."""
  b, gamma = drafts.shape
  u_key, s_key = jax.random.split(key)
  w = block_weights(drafts, q, p)
  _, residual = stop_probabilities(drafts, q, p)
  levels = jnp.arange(1, gamma + 1)[None, :]
  tau = jnp.max(jnp.where(jax.random.uniform(u_key, (b, gamma)) < w[:, 1:], levels, 0), axis=1)
  r = jnp.take_along_axis(residual, tau[:, None, None], axis=1)[:, 0]
  return Acceptance(tau, sample_from(s_key, r), levels <= tau[:, None], jnp.zeros((b, gamma)))


# A reduced-vocabulary draft: Q_S kept on 3 of the 5 ids (q = 0 elsewhere), handed over as
# ``SubsetProbs``; the target keeps mass outside it.
SUB = np.array([0, 2, 4], np.int32)
Q_SUB = np.zeros_like(Q_S)
Q_SUB[:, SUB] = Q_S[:, SUB] / Q_S[:, SUB].sum(axis=1, keepdims=True)


def _on_subset(rule):
  def run(key, drafts, q, p):
    return rule(key, drafts, SubsetProbs(q[..., SUB], jnp.asarray(SUB), V), p)

  return run


def _support_only(key, drafts, q, p):
  """Wrong: the rule on the draft's support alone, the target's mass outside it dropped."""
  inside = jnp.zeros((V,), bool).at[SUB].set(True)
  return _on_subset(accept_block)(key, drafts, q, jnp.where(inside, p, 0.0))


RULES = {"block": accept_block, "tokenwise": chain_rule.accept,
         "no_weight_residual": _no_weight_residual, "weights_as_stops": _weights_as_stops,
         "block_subset": _on_subset(accept_block),
         "tokenwise_subset": _on_subset(chain_rule.accept), "support_only": _support_only}


@functools.lru_cache(maxsize=None)
def _first_three_fn(rule):
  accept_fn = RULES[rule]
  reduced = rule.endswith("subset") or rule == "support_only"
  pm, qm = jnp.asarray(P_S, jnp.float32), jnp.asarray(Q_SUB if reduced else Q_S, jnp.float32)

  def step(key, last):
    d_key, a_key = jax.random.split(key)
    toks, ctx = [], last
    keys = jax.random.split(d_key, GAMMA)
    for i in range(GAMMA):
      ctx = jax.random.categorical(keys[i], jnp.log(qm[ctx])).astype(jnp.int32)
      toks.append(ctx)
    drafts = jnp.stack(toks, axis=1)
    entries = jnp.concatenate([last[:, None], drafts], axis=1)
    acc = accept_fn(a_key, drafts, qm[entries[:, :-1]], pm[entries])
    emitted = jnp.concatenate([drafts, drafts[:, :1]], axis=1)
    levels = jnp.arange(GAMMA + 1)[None, :]
    emitted = jnp.where(levels < acc.num_accepted[:, None], emitted, acc.next_token[:, None])
    return emitted, acc.num_accepted + 1

  @jax.jit
  def run(key):
    out = jnp.zeros((ROWS, 3), jnp.int32)
    have = jnp.zeros((ROWS,), jnp.int32)
    last = jnp.full((ROWS,), X0, jnp.int32)
    first_n = None
    for k in jax.random.split(key, 3):  # three steps always emit >= 3 tokens
      emitted, n = step(k, last)
      for j in range(3):
        slot = have + j
        take = (j < n) & (slot < 3)
        out = out.at[jnp.arange(ROWS), jnp.minimum(slot, 2)].set(
            jnp.where(take, emitted[:, j], out[jnp.arange(ROWS), jnp.minimum(slot, 2)]))
      last = jnp.take_along_axis(emitted, (n - 1)[:, None], axis=1)[:, 0]
      have = have + n
      first_n = n if first_n is None else first_n
    return out, first_n

  return run


def _counts(rule, seed=0):
  out, n = map(np.asarray, _first_three_fn(rule)(jax.random.PRNGKey(seed)))
  return np.bincount(out[:, 0] * V * V + out[:, 1] * V + out[:, 2],
                     minlength=V ** 3).reshape(V, V, V), n


EXACT3 = _target_law(P_S, 3)


def _tv(counts):
  return 0.5 * float(np.abs(counts / counts.sum() - EXACT3).sum())


def test_sampled_block_rule_matches_target_and_beats_tokenwise():
  counts, n = _counts("block")
  assert chi_square_pvalue(counts, EXACT3) > 1e-3, _tv(counts)
  assert _tv(counts) < 0.01
  assert 0.05 < np.mean(n == 1) < 0.95 and np.any(n == GAMMA + 1)  # the rule was exercised
  _, n_tok = _counts("tokenwise")
  assert np.mean(n) > np.mean(n_tok) + 0.01, (np.mean(n), np.mean(n_tok))


@pytest.mark.parametrize("rule", ["block_subset", "tokenwise_subset"])
def test_reduced_vocabulary_draft_as_subset_probs_matches_target(rule):
  counts, n = _counts(rule)
  assert chi_square_pvalue(counts, EXACT3) > 1e-3, _tv(counts)
  assert _tv(counts) < 0.01
  assert 0.05 < np.mean(n == 1) < 0.95 and np.any(n == GAMMA + 1)


def test_subset_probs_give_the_dense_rules_outcome():
  """Same key, q over the vocabulary or as ``SubsetProbs``: the same τ, β and (up to a rare
  float-rounding flip of the residual draw) the same extra token."""
  rng = np.random.default_rng(3)
  b = 20_000
  drafts = np.stack([rng.choice(SUB, size=b) for _ in range(GAMMA)], axis=1).astype(np.int32)
  ctx = np.concatenate([np.full((b, 1), X0), drafts], axis=1)
  q, p = jnp.asarray(Q_SUB[ctx[:, :-1]], jnp.float32), jnp.asarray(P_S[ctx], jnp.float32)
  key = jax.random.PRNGKey(4)
  for rule in (accept_block, chain_rule.accept):
    dense, sub = rule(key, jnp.asarray(drafts), q, p), _on_subset(rule)(key, jnp.asarray(drafts),
                                                                        q, p)
    np.testing.assert_array_equal(np.asarray(dense.num_accepted), np.asarray(sub.num_accepted))
    np.testing.assert_allclose(np.asarray(dense.beta), np.asarray(sub.beta), atol=1e-6)
    assert np.mean(np.asarray(dense.next_token) == np.asarray(sub.next_token)) > 0.999
    assert 0 < np.asarray(sub.num_accepted).mean() < GAMMA


@pytest.mark.parametrize("rule", ["no_weight_residual", "weights_as_stops", "support_only"])
def test_wrong_variants_are_rejected(rule):
  counts, _ = _counts(rule)
  assert chi_square_pvalue(counts, EXACT3) < 1e-6, _tv(counts)


# --- the decoder ------------------------------------------------------------------------

TV = 8


@pytest.fixture(scope="module")
def models():
  return tiny_model(seed=0, vocab_size=TV, scale=1.0), tiny_model(seed=1, vocab_size=TV,
                                                                   scale=1.0, num_layers=1)


def test_decoder_block_verification_matches_target(models):
  target, draft = models
  sampler = Sampling(temperature=1.0)
  dec = SpeculativeDecoder(target[0], ModelDrafter(draft[0]), gamma=3, sampler=sampler,
                           eos_ids=(), verification="block")
  counts = empirical_joint(dec, target, dec.drafter.make_params(draft[1]), [1, 2, 5], 100_000)
  exact = exact_joint(*target, sampler, [1, 2, 5])
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / counts.sum() - exact).sum() < 0.02


def test_point_mass_chain_matches_target(models):
  """A deterministic drafter (prompt lookup): q is one-hot at its token."""
  target, _ = models
  sampler = Sampling(temperature=0.9, top_k=6)
  drafter, dp = make_drafter("prompt_lookup", *target, [])
  dec = SpeculativeDecoder(target[0], drafter, gamma=2, sampler=sampler, eos_ids=(),
                           verification="block")
  prompt = [1, 2, 5, 3, 1, 2]  # the suffix (1, 2) has a match: drafts are proposed
  counts = empirical_joint(dec, target, dp, prompt, 100_000)
  exact = exact_joint(*target, sampler, prompt)
  assert chi_square_pvalue(counts, exact) > 1e-3


def test_greedy_equals_plain_decoding_and_no_recompilation():
  cfg, params = tiny_model(seed=3)
  dcfg, dparams = tiny_model(seed=4, num_layers=1)
  prompts = [[5, 6, 7, 8], [9, 3]]
  want = generate(params, cfg, prompts, 24, sampler=Greedy(), eos_ids=())
  for sampler in (Greedy(), Sampling(temperature=0.8)):
    dec = SpeculativeDecoder(cfg, ModelDrafter(dcfg), gamma=4, sampler=sampler, eos_ids=(),
                             verification="block")
    dp = dec.drafter.make_params(dparams)
    if isinstance(sampler, Greedy):
      got = dec.generate(params, dp, prompts, 24)
      np.testing.assert_array_equal(got.tokens, want.tokens)
    assert new_compiles_across_batches(dec, params, dp) == 0


def test_bad_settings_are_refused_before_compiling(models):
  (cfg, _), (dcfg, _) = models
  with pytest.raises(ValueError, match="unknown verification"):
    SpeculativeDecoder(cfg, ModelDrafter(dcfg), gamma=2, verification="joint")
  for tree in (TreeTopology((-1, -1, 0)), DynamicTree(top_k=2, depth=2, num_nodes=4)):
    # trees are verified by traversal verification (tests/test_traversal_verification.py)
    assert SpeculativeDecoder(cfg, ModelDrafter(dcfg), tree=tree,
                              verification="block").verification == "block"


