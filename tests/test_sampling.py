"""Sampling strategies: each warped distribution against a plain numpy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.sampling import (Greedy, Sampling, first_argmax, make_sampler, sample_from,
                              scale_temperature)

V = 50


def _logits(seed: int = 0, rows: int = 4, scale: float = 3.0) -> np.ndarray:
  """Random float32 logits; normal draws are distinct, so there are no ties."""
  return (scale * np.random.default_rng(seed).standard_normal((rows, V))).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _ref_top_k(logits: np.ndarray, k: int) -> np.ndarray:
  """Keeps the k largest logits per row (others -> -inf)."""
  out = np.full_like(logits, -np.inf, dtype=np.float64)
  for r, row in enumerate(logits):
    keep = np.argsort(-row)[:k]
    out[r, keep] = row[keep]
  return out


def _ref_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
  """Smallest prefix of the descending-sorted probs whose mass reaches top_p, renormalised."""
  out = np.zeros_like(probs)
  for r, row in enumerate(probs):
    order = np.argsort(-row)
    n = int(np.searchsorted(np.cumsum(row[order]), top_p)) + 1  # first cumsum >= top_p
    out[r, order[:n]] = row[order[:n]]
  return out / out.sum(-1, keepdims=True)


def test_greedy_probs_are_one_hot_argmax():
  logits = _logits()
  probs = np.asarray(Greedy().probs(jnp.asarray(logits)))
  np.testing.assert_array_equal(probs, np.eye(V)[logits.argmax(-1)])
  tokens, sample_probs = Greedy().sample(jax.random.PRNGKey(0), jnp.asarray(logits))
  np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
  np.testing.assert_array_equal(np.asarray(sample_probs), probs)


def test_first_argmax_is_jnp_argmax_on_every_kind_of_row():
  rng = np.random.default_rng(0)
  rows = rng.normal(size=(6, 1000)).astype(np.float32)
  rows[1, [3, 700]] = 9.0           # a tie: the first id wins
  rows[2, [5, 8]] = np.inf          # +inf ties
  rows[3] = -np.inf                 # all -inf: id 0
  rows[4, [40, 90]] = np.nan        # NaN: the first NaN (jnp.argmax's rule)
  rows[5, 999] = 50.0               # the last id
  x = jnp.asarray(rows)
  want = np.asarray(jnp.argmax(x, axis=-1))
  np.testing.assert_array_equal(first_argmax(x), want)
  assert want.tolist()[1:] == [3, 5, 0, 40, 999]
  assert first_argmax(x).dtype == jnp.int32
  # any leading shape, under jit; a wrong rule (the last maximal id) differs on the tie
  batch = jnp.asarray(rng.normal(size=(2, 3, 4, 257)).astype(np.float32)).at[1, 2, 0, 9].set(7.0)
  np.testing.assert_array_equal(jax.jit(first_argmax)(batch), jnp.argmax(batch, axis=-1))
  last = rows.shape[1] - 1 - np.argmax(rows[1, ::-1])
  assert last == 700 != int(first_argmax(x)[1])


def test_top1_sampling_matches_greedy():
  logits = jnp.asarray(_logits())
  np.testing.assert_array_equal(np.asarray(Sampling(top_k=1).probs(logits)),
                                np.asarray(Greedy().probs(logits)))
  keys = jax.random.split(jax.random.PRNGKey(1), 64)
  tokens = jax.vmap(lambda k: Sampling(top_k=1, temperature=2.0).sample(k, logits)[0])(keys)
  np.testing.assert_array_equal(np.asarray(tokens),
                                np.broadcast_to(np.asarray(logits).argmax(-1), (64, 4)))


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_keeps_exactly_k_and_renormalises(k):
  logits = _logits(seed=k)
  probs = np.asarray(Sampling(top_k=k).probs(jnp.asarray(logits)))
  assert ((probs > 0).sum(-1) == k).all()
  top = np.argsort(-logits, axis=-1)[:, :k]
  np.testing.assert_array_equal(np.sort(np.nonzero(probs)[1].reshape(-1, k), -1), np.sort(top, -1))
  np.testing.assert_allclose(probs, _softmax(_ref_top_k(logits, k)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_numpy_reference(top_p):
  logits = _logits(seed=int(top_p * 100), rows=8, scale=2.0)
  probs = np.asarray(Sampling(top_p=top_p).probs(jnp.asarray(logits)))
  np.testing.assert_allclose(probs, _ref_top_p(_softmax(logits), top_p), rtol=1e-5, atol=1e-7)


def test_top_p_one_is_plain_softmax():
  logits = _logits()
  np.testing.assert_allclose(np.asarray(Sampling(top_p=1.0).probs(jnp.asarray(logits))),
                             _softmax(logits), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_scaling_matches_softmax_of_scaled_logits(temperature):
  logits = _logits()
  probs = np.asarray(Sampling(temperature=temperature).probs(jnp.asarray(logits)))
  np.testing.assert_allclose(probs, _softmax(logits / temperature), rtol=1e-5, atol=1e-7)


def test_temperature_top_k_top_p_combined_match_numpy_reference():
  # Hugging Face order: temperature, then top-k (renormalised), then top-p.
  logits = _logits(seed=7, rows=8)
  temperature, k, top_p = 1.7, 12, 0.8
  ref = _ref_top_p(_softmax(_ref_top_k(logits / temperature, k)), top_p)
  probs = np.asarray(Sampling(temperature=temperature, top_k=k, top_p=top_p).probs(
      jnp.asarray(logits)))
  np.testing.assert_allclose(probs, ref, rtol=1e-5, atol=1e-7)
  assert ((probs > 0).sum(-1) < k).any()  # top-p actually cut below top-k somewhere


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
  """Chi-square of counts against probs (support only; cells expecting < 5 draws pooled
  into one) below mean + 6 sd of chi2(df)."""
  support = probs > 0
  expected = counts.sum() * probs[support] / probs.sum()
  observed = counts[support].astype(np.float64)
  small = expected < 5
  if small.any():
    expected = np.append(expected[~small], expected[small].sum())
    observed = np.append(observed[~small], observed[small].sum())
  chi2 = float(((observed - expected) ** 2 / expected).sum())
  df = len(expected) - 1
  return chi2 < df + 6 * np.sqrt(2 * df)


def test_sample_from_frequencies_match_probs():
  probs = np.array([0.3, 0.0, 0.2, 0.05, 0.25, 0.0, 0.15, 0.05], np.float32)
  n = 40_000
  keys = jax.random.split(jax.random.PRNGKey(3), n)
  draws = np.asarray(jax.vmap(lambda k: sample_from(k, jnp.asarray(probs)))(keys))
  counts = np.bincount(draws, minlength=len(probs))
  assert counts[probs == 0].sum() == 0  # zero-probability tokens are never drawn
  assert _chi2_ok(counts, probs), counts
  # Finite weights whose sum overflows float32 are still drawn by their shares.
  huge = np.array([0.0, 3e38, 1e38, 0.0, 2e38], np.float32)
  draws = np.asarray(jax.vmap(lambda k: sample_from(k, jnp.asarray(huge)))(keys[:6000]))
  assert _chi2_ok(np.bincount(draws, minlength=5), huge.astype(np.float64))
  assert np.bincount(draws, minlength=5)[huge == 0].sum() == 0


@pytest.mark.parametrize("vocab", [3, 1000])  # one block of 2 + a padded one; 32 blocks of 32
def test_sample_from_matches_probs_across_blocks_and_rejects_a_shifted_distribution(vocab):
  # Unnormalised weights with zero runs (whole empty blocks) and a tail in the
  # padded last block: the two-level inverse CDF must still draw each id with
  # its weight / total, independently per row.
  rng = np.random.default_rng(vocab)
  w = rng.gamma(0.5, size=(2, vocab)).astype(np.float32)
  w[:, vocab // 4:vocab // 2] = 0.0
  w[1, 0] = 0.0
  n = 60_000
  keys = jax.random.split(jax.random.PRNGKey(4), n)
  draws = np.asarray(jax.vmap(lambda k: sample_from(k, jnp.asarray(w)))(keys))  # [n, 2]
  for r in range(2):
    counts = np.bincount(draws[:, r], minlength=vocab)
    assert len(counts) == vocab and counts[w[r] == 0].sum() == 0
    assert _chi2_ok(counts, w[r]), r
    # The same test rejects a distribution with 3% of the mass moved between two
    # likely ids, so it can tell a wrong draw from a right one.
    wrong = w[r].copy()
    a, b = np.argsort(wrong)[-2:]
    wrong[a], wrong[b] = wrong[a] + 0.03 * wrong.sum(), max(wrong[b] - 0.03 * wrong.sum(), 1e-3)
    assert not _chi2_ok(counts, wrong)
  # Rows draw independently: the joint counts of the two rows' draws match the
  # product of their distributions (two rows sharing uniforms would be comonotone).
  pair = draws[:, 0] * vocab + draws[:, 1]
  joint = np.outer(w[0] / w[0].sum(), w[1] / w[1].sum()).ravel()
  assert _chi2_ok(np.bincount(pair, minlength=vocab * vocab), joint)


def test_sampling_sample_returns_its_probs_and_draws_from_support():
  logits = jnp.asarray(_logits())
  sampler = Sampling(temperature=0.8, top_k=3)
  tokens, probs = sampler.sample(jax.random.PRNGKey(0), logits)
  np.testing.assert_array_equal(np.asarray(probs), np.asarray(sampler.probs(logits)))
  assert (np.asarray(probs)[np.arange(4), np.asarray(tokens)] > 0).all()


def test_make_sampler_picks_greedy_at_zero_temperature():
  assert make_sampler(0.0) == Greedy()
  assert make_sampler(0.7, top_k=5, top_p=0.9) == Sampling(temperature=0.7, top_k=5, top_p=0.9)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_k=0), "top_k"),
])
def test_invalid_sampling_params_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_sampler(**kwargs)
  with pytest.raises(ValueError, match=match):
    Sampling(**kwargs)


def test_make_sampler_validates_even_at_zero_temperature():
  with pytest.raises(ValueError, match="top_k"):
    make_sampler(0.0, top_k=0)
  with pytest.raises(ValueError, match="top_p"):
    make_sampler(0.0, top_p=1.5)


def test_sampling_rejects_zero_temperature():
  with pytest.raises(ValueError, match="Greedy"):
    Sampling(temperature=0.0)


@pytest.mark.parametrize("sampler", [Greedy(), Sampling(0.7), Sampling(1.0, top_k=3),
                                     Sampling(1.3, top_p=0.8)])
def test_sampling_a_vocabulary_subset_equals_sampling_its_lifted_logits(sampler):
  """q of the subset sampler = the warp of the logits lifted with -inf outside the subset,
  and the drawn tokens follow it."""
  from specjax.drafters.reduced_vocab import lift_logits
  from specjax.sampling import SubsetProbs, sample_subset

  v, ids = 12, jnp.array([7, 2, 9, 4, 0])
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5)) * 2.0
  toks, q_sub = sample_subset(sampler, jax.random.PRNGKey(1), logits, ids)
  q = SubsetProbs(q_sub, ids, v).dense()
  np.testing.assert_allclose(np.asarray(q), np.asarray(sampler.probs(lift_logits(logits, ids, v))),
                             atol=1e-6)
  keys = jax.random.split(jax.random.PRNGKey(2), 4000)
  draws = np.asarray(jax.vmap(lambda k: sample_subset(sampler, k, logits[:1], ids)[0])(keys))
  freq = np.bincount(draws.ravel(), minlength=v) / draws.size
  np.testing.assert_allclose(freq, np.asarray(q[0]), atol=0.03)
  assert set(np.unique(draws)) <= set(np.asarray(ids).tolist())


def test_subset_probs_places_its_columns_and_finds_tokens():
  from specjax.sampling import SubsetProbs, as_subset, dense_probs

  q = SubsetProbs(jnp.array([[0.25, 0.75]]), jnp.array([4, 1]), 6)
  np.testing.assert_array_equal(np.asarray(q.dense()), [[0, 0.75, 0, 0, 0.25, 0]])
  assert dense_probs(q).shape == (1, 6)
  slot, found = q.slots(jnp.array([1, 4, 3]))
  np.testing.assert_array_equal(np.asarray(found), [True, True, False])
  np.testing.assert_array_equal(np.asarray(slot)[:2], [1, 0])
  dense = jnp.ones((2, 6))
  assert as_subset(dense, None, 6) is dense and dense_probs(dense) is dense
  assert isinstance(as_subset(q.probs, q.ids, 6), SubsetProbs)
  # A pytree: jit and scan carry it; the vocabulary size stays static.
  out = jax.jit(lambda s: s)(q)
  assert isinstance(out, SubsetProbs) and out.vocab_size == 6


def test_scale_temperature_keeps_the_warping_at_a_new_temperature():
  s = Sampling(temperature=1.5, top_k=5, top_p=0.9)
  assert scale_temperature(s, 0.5) == Sampling(temperature=0.75, top_k=5, top_p=0.9)
  assert scale_temperature(s, 1) == s
  assert scale_temperature(s, 0) == Greedy() and scale_temperature(Greedy(), 0.8) == Greedy()
  with pytest.raises(ValueError, match="ratio must be a finite number"):
    scale_temperature(s, -1.0)
  with pytest.raises(ValueError, match="temperature must be a finite number"):
    scale_temperature(s, 1e-6)  # 1.5e-6 is below MIN_TEMPERATURE
