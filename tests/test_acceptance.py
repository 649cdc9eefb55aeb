"""Edge cases of the modified rejection sampling rule (specjax.speculative.accept)."""

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import sample_from
from specjax.speculative import accept as _accept

V = 8
accept = jax.jit(_accept)  # as the decoder runs it: one program per shape, not per op


def _dists(key, shape, peak=1.0):
  return jax.nn.softmax(peak * jax.random.normal(key, shape + (V,)), axis=-1)


def _draft(key, q):
  return sample_from(key, q)


def test_q_equal_p_accepts_every_draft():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  gamma, b = 4, 2000
  p = _dists(k1, (b, gamma + 1))
  drafts = _draft(k2, p[:, :gamma])
  acc = accept(k3, drafts, p[:, :gamma], p)
  assert np.all(np.asarray(acc.num_accepted) == gamma)
  np.testing.assert_allclose(np.asarray(acc.beta), 1.0, atol=1e-6)


def test_disjoint_supports_always_reject_and_resample_from_target():
  b, gamma = 5000, 3
  p = jnp.zeros((b, gamma + 1, V)).at[..., :4].set(0.25)
  q = jnp.zeros((b, gamma, V)).at[..., 4:].set(0.25)
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  acc = accept(k2, _draft(k1, q), q, p)
  assert np.all(np.asarray(acc.num_accepted) == 0)
  nxt = np.asarray(acc.next_token)
  assert np.all(nxt < 4)
  freq = np.bincount(nxt, minlength=V)[:4] / b
  np.testing.assert_allclose(freq, 0.25, atol=0.03)
  np.testing.assert_allclose(np.asarray(acc.beta), 0.0)


def test_zeros_in_p_and_q_give_no_nan():
  gamma = 2
  p = jnp.array([[[1.0, 0, 0, 0, 0, 0, 0, 0]] * (gamma + 1)])
  q = jnp.array([[[0.5, 0.5, 0, 0, 0, 0, 0, 0]] * gamma])
  for seed in range(50):
    acc = accept(jax.random.PRNGKey(seed), jnp.array([[1, 0]]), q, p)
    assert int(acc.num_accepted[0]) == 0  # p(1) = 0: always rejected
    assert int(acc.next_token[0]) == 0
    assert np.all(np.isfinite(np.asarray(acc.beta)))


def test_one_hot_distributions_reduce_to_greedy_matching():
  gamma = 4
  target = jnp.array([[3, 1, 4, 1, 5]])
  drafts = jnp.array([[3, 1, 2, 1]])  # third draft differs
  p = jax.nn.one_hot(target, V)
  q = jax.nn.one_hot(drafts, V)
  acc = accept(jax.random.PRNGKey(0), drafts, q, p)
  assert int(acc.num_accepted[0]) == 2
  assert int(acc.next_token[0]) == 4
  all_ok = accept(jax.random.PRNGKey(0), target[:, :gamma], jax.nn.one_hot(target[:, :gamma], V), p)
  assert int(all_ok.num_accepted[0]) == gamma and int(all_ok.next_token[0]) == 5


def test_first_token_is_distributed_as_target_for_arbitrary_q():
  # One draft position: the emitted token is d if accepted else the residual draw.
  n = 200_000
  k = jax.random.split(jax.random.PRNGKey(2), 4)
  p1 = _dists(k[0], (1, 2), peak=2.0)
  q1 = _dists(k[1], (1, 1), peak=2.0)
  p = jnp.broadcast_to(p1, (n, 2, V))
  q = jnp.broadcast_to(q1, (n, 1, V))
  drafts = _draft(k[2], q)
  acc = accept(k[3], drafts, q, p)
  first = np.where(np.asarray(acc.num_accepted) > 0, np.asarray(drafts[:, 0]),
                   np.asarray(acc.next_token))
  freq = np.bincount(first, minlength=V) / n
  assert 0.5 * np.abs(freq - np.asarray(p1[0, 0])).sum() < 0.006


def test_extreme_distributions_are_finite():
  b, gamma = 64, 3
  logits = 1e4 * jax.random.normal(jax.random.PRNGKey(3), (b, gamma + 1, V))
  p = jax.nn.softmax(logits, axis=-1)
  q = jax.nn.softmax(-logits[:, :gamma], axis=-1)
  acc = accept(jax.random.PRNGKey(4), _draft(jax.random.PRNGKey(5), q), q, p)
  assert np.all(np.isfinite(np.asarray(acc.beta)))
  assert np.all((np.asarray(acc.next_token) >= 0) & (np.asarray(acc.next_token) < V))


def test_scoring_chances_are_the_expected_scored_positions_given_the_drafts():
  """The adaptive policy's weighted evidence (``AdaptiveGamma.evidence="expected"``): for fixed
  drafts, wᵢ = Πⱼ<ᵢ min(1, pⱼ(dⱼ)/qⱼ(dⱼ)) is the chance the token-wise rule scores position i
  (reaches it), so Σ wᵢβᵢ and Σ wᵢ are the expected Σβ and count over the positions its flips
  score, here over 200,000 flips of the real rule for each of 4 fixed draft blocks. Weights
  that include position i's own flip (Πⱼ≤ᵢ, the accepted positions') are rejected."""
  from specjax.speculative.acceptance import keep_probabilities, scoring_chances
  gamma, rows, n = 3, 4, 200_000
  k = jax.random.split(jax.random.PRNGKey(7), 4)
  p = _dists(k[0], (rows, gamma + 1), peak=1.5)
  q = _dists(k[1], (rows, gamma), peak=1.5)
  drafts = _draft(k[2], q)
  keep = keep_probabilities(drafts, q, p)
  assert float(jnp.min(keep)) < 0.9  # some flips matter
  w = np.asarray(scoring_chances(keep))
  np.testing.assert_allclose(w[:, 0], 1.0)
  tile = lambda x: jnp.repeat(x, n, axis=0)
  acc = accept(k[3], tile(drafts), tile(q), tile(p))
  beta = np.asarray(acc.beta).reshape(rows, n, gamma)
  scored = np.arange(gamma)[None, None, :] <= np.asarray(acc.num_accepted).reshape(rows, n, 1)
  mean_sum = (beta * scored).sum(axis=2).mean(axis=1)  # [rows]
  mean_count = scored.sum(axis=2).mean(axis=1)
  se = np.maximum((beta * scored).sum(axis=2).std(axis=1), scored.sum(axis=2).std(axis=1))
  tol = 5 * se / np.sqrt(n) + 1e-6
  beta0 = np.asarray(acc.beta)[::n]  # β does not depend on the flips
  np.testing.assert_array_less(np.abs((w * beta0).sum(axis=1) - mean_sum), tol)
  np.testing.assert_array_less(np.abs(w.sum(axis=1) - mean_count), tol)
  wrong = np.cumprod(np.asarray(keep), axis=1)
  assert np.any(np.abs(wrong.sum(axis=1) - mean_count) > 20 * tol)
