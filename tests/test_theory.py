"""Speedup theory against the numbers printed in Leviathan et al. (2023)."""

import math

import numpy as np
import pytest

from specjax import theory

# Table 1 (c = c_hat = 0): (alpha, gamma) -> (operations, speed).
TABLE_1 = [
    (0.6, 2, 1.53, 1.96),
    (0.7, 3, 1.58, 2.53),
    (0.8, 2, 1.23, 2.44),
    (0.8, 5, 1.63, 3.69),
    (0.9, 2, 1.11, 2.71),
    (0.9, 10, 1.60, 6.86),
]

# Table 4 "expected" speedups, T = 0, with c per draft size and (gamma, alpha)
# taken from the matching Table 2 row.
TABLE_4 = [
    ("ende_small", 0.02, 7, 0.75, 3.2),
    ("ende_base", 0.04, 7, 0.80, 3.3),
    ("ende_large", 0.11, 7, 0.82, 2.5),
    ("cnndm_small", 0.02, 5, 0.65, 2.4),
    ("cnndm_base", 0.04, 5, 0.73, 2.6),
    ("cnndm_large", 0.11, 3, 0.74, 2.0),
]

ALPHAS = np.linspace(0.0, 1.0, 2001)


@pytest.mark.parametrize("alpha,gamma,operations,speed", TABLE_1)
def test_table1(alpha, gamma, operations, speed):
  assert round(theory.operations_factor(alpha, gamma, 0.0), 2) == operations
  assert round(theory.walltime_improvement(alpha, gamma, 0.0), 2) == speed


@pytest.mark.parametrize("name,c,gamma,alpha,expected", TABLE_4)
def test_table4_expected_speedup(name, c, gamma, alpha, expected):
  del name
  assert round(theory.walltime_improvement(alpha, gamma, c), 1) == expected


def test_expected_tokens_edges():
  gammas = np.arange(1, 33)
  np.testing.assert_array_equal(theory.expected_tokens_per_step(1.0, gammas), gammas + 1)
  np.testing.assert_array_equal(theory.expected_tokens_per_step(0.0, gammas), 1.0)
  # No cancellation just below the alpha = 1 limit: E = 6 - 15 eps + O(eps^2).
  eps = 1e-12
  assert theory.expected_tokens_per_step(1.0 - eps, 5) == pytest.approx(6.0 - 15 * eps, rel=1e-14)


def test_expected_tokens_vectorised_matches_geometric_sum():
  alpha, gamma = np.array([0.0, 0.3, 0.9, 1.0]), np.array([[1], [4], [9]])
  got = theory.expected_tokens_per_step(alpha, gamma)
  assert got.shape == (3, 4)
  want = [[sum(a**k for k in range(g + 1)) for a in alpha] for g in gamma[:, 0]]
  np.testing.assert_allclose(got, want, rtol=1e-14)
  assert isinstance(theory.expected_tokens_per_step(0.5, 2), float)


def test_batched_expected_tokens_waits_for_the_slowest_row_of_each_batch():
  e = lambda a: theory.expected_tokens_per_step(a, 2)
  assert theory.batched_expected_tokens([[0.6]], 2) == pytest.approx(e(0.6))
  # one batch: its slowest row sets the pace, not the rows' mean
  assert theory.batched_expected_tokens([np.array([0.3, 0.9])], 2) == pytest.approx(e(0.3))
  # batches run one after another, N tokens a row each: the steps add up (harmonic mean)
  two = theory.batched_expected_tokens([[0.3, 0.9], [0.8]], 2)
  assert two == pytest.approx(2 / (1 / e(0.3) + 1 / e(0.8)))
  assert two < (e(0.3) + e(0.8)) / 2
  # batch 1: the rows' harmonic mean, near E at the mean rate when the rates are alike
  assert theory.batched_expected_tokens([[0.5], [0.52]], 3) == pytest.approx(
      theory.expected_tokens_per_step(0.51, 3), rel=1e-3)
  for bad in ([], [[]], [[1.2]], [[0.5], []]):
    with pytest.raises(ValueError):
      theory.batched_expected_tokens(bad, 2)
  with pytest.raises(ValueError, match="gamma"):
    theory.batched_expected_tokens([[0.5]], 0)
  # measured tokens per step (a tree, no single α): the same rule
  assert theory.slowest_row_tokens([[1.5, 2.5], [2.0]]) == pytest.approx(2 / (1 / 1.5 + 1 / 2))
  for bad in ([], [[]], [[0.5]], [[float("nan")]]):
    with pytest.raises(ValueError):
      theory.slowest_row_tokens(bad)


@pytest.mark.parametrize("c", [0.0, 1e-6, 0.01, 0.02, 0.11, 0.5, 1.0, 2.0])
def test_optimal_gamma_monotone_in_alpha(c):
  gammas = theory.optimal_gamma(ALPHAS, c, max_gamma=64)
  assert np.all(np.diff(gammas) >= 0)
  assert gammas.min() >= 1 and gammas.max() <= 64


@pytest.mark.parametrize("c", [0.01, 0.02, 0.11, 0.5, 1.0])
def test_optimal_gamma_is_argmax_where_well_conditioned(c):
  gammas = np.arange(1, 41)
  improvement = theory.walltime_improvement(ALPHAS[:, None], gammas, c)
  np.testing.assert_array_equal(theory.optimal_gamma(ALPHAS, c, max_gamma=40),
                                np.argmax(improvement, axis=-1) + 1)


def test_optimal_gamma_limits():
  assert theory.optimal_gamma(0.3, 0.0, max_gamma=50) == 50  # c = 0: more drafts always help.
  assert theory.optimal_gamma(0.0, 0.05) == 1  # Nothing accepted: drafting only costs.
  assert theory.optimal_gamma(0.0, 0.0) == 1  # All gammas tie; smallest wins.
  assert theory.optimal_gamma(1.0, 1.0) == 1  # (gamma + 1) / (gamma + 1): a tie again.
  assert theory.optimal_gamma(0.9, 0.5, max_gamma=1) == 1
  assert isinstance(theory.optimal_gamma(0.8, 0.02), int)


def test_calibrated_flat_curve_is_paper_formula():
  alpha, gamma = ALPHAS[::50, None], np.arange(1, 17)
  want = theory.walltime_improvement(alpha, gamma, 0.05)
  for flat in (lambda t: 1.0, {1: 1.0}, {1: 2.0, 32: 2.0}, theory.VerifyCostCurve({1: 1.0})):
    np.testing.assert_allclose(
        theory.calibrated_walltime_improvement(alpha, gamma, 0.05, flat), want, rtol=1e-15)


@pytest.mark.parametrize("c", [0.0, 1e-3, 0.1, 1.0])
def test_no_parallelism_never_speeds_up(c):
  # E[tokens] < gamma + 1 for alpha < 1, while an iteration costs gamma c + gamma + 1.
  alpha, gamma = ALPHAS[:-1, None], np.arange(1, 33)
  assert np.all(theory.calibrated_walltime_improvement(alpha, gamma, c, lambda t: t) < 1.0)


def test_calibrated_optimal_gamma_prefers_fewer_drafts_when_verify_is_costly():
  curve = theory.VerifyCostCurve({1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6, 16: 2.5})
  assert theory.optimal_gamma(0.8, 0.02, verify_cost=curve) < theory.optimal_gamma(0.8, 0.02)


def test_gamma1_bound():
  # gamma = 1 gives exactly (1 + alpha) / (1 + c), so the optimum gives at least that,
  # and it is a real speedup precisely when alpha > c.
  alpha, c = ALPHAS[::20, None], np.array([0.0, 0.02, 0.1, 0.5, 1.0])
  bound = theory.min_speedup_gamma1(alpha, c)
  np.testing.assert_allclose(theory.walltime_improvement(alpha, 1, c), bound, rtol=1e-15)
  best = theory.walltime_improvement(alpha, theory.optimal_gamma(alpha, c, max_gamma=64), c)
  assert np.all(best >= bound - 1e-12)
  np.testing.assert_array_equal(bound > 1.0, alpha > c)


def test_verify_cost_curve_interpolates_normalises_extrapolates():
  curve = theory.VerifyCostCurve({8: 2.6, 1: 2.0, 4: 2.2})
  assert curve.points == ((1, 1.0), (4, 1.1), (8, 1.3))
  assert curve(6) == pytest.approx(1.2)
  assert curve(16) == pytest.approx(1.7)  # Last segment's slope 0.05 per token.
  np.testing.assert_allclose(curve(np.array([1, 2, 4])), [1.0, 1.1 / 3 + 2 / 3, 1.1])
  dipping = theory.VerifyCostCurve(((1, 1.0), (2, 0.9), (4, 1.5)))  # Not monotone: allowed.
  assert dipping(2) == pytest.approx(0.9)
  assert hash(curve) == hash(theory.VerifyCostCurve({1: 1.0, 4: 1.1, 8: 1.3}))


def test_beta_and_alpha():
  p = np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
  q = np.array([[0.25, 0.25, 0.5], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
  betas = theory.beta(p, q)
  np.testing.assert_allclose(betas, [0.5, 0.0, 1.0])
  assert theory.alpha_from_beta(betas) == pytest.approx(0.5)
  assert theory.beta(p[0], q[0]) == pytest.approx(0.5)


@pytest.mark.parametrize("call", [
    lambda: theory.expected_tokens_per_step(-0.1, 2),
    lambda: theory.expected_tokens_per_step(1.1, 2),
    lambda: theory.expected_tokens_per_step(math.nan, 2),
    lambda: theory.expected_tokens_per_step(0.5, 0),
    lambda: theory.expected_tokens_per_step(0.5, 2.5),
    lambda: theory.expected_tokens_per_step(0.5, True),
    lambda: theory.expected_tokens_per_step(0.5, np.array([1.0, 2.0])),
    lambda: theory.walltime_improvement(0.5, 2, -0.1),
    lambda: theory.walltime_improvement(0.5, 2, math.inf),
    lambda: theory.operations_factor(0.5, 2, -1.0),
    lambda: theory.min_speedup_gamma1(0.5, -1.0),
    lambda: theory.optimal_gamma(0.5, 0.1, max_gamma=0),
    lambda: theory.optimal_gamma(np.array([0.5, 2.0]), 0.1),
    lambda: theory.calibrated_walltime_improvement(0.5, 2, 0.1, lambda t: 0.0),
    lambda: theory.VerifyCostCurve({2: 1.0, 4: 1.2}),  # No T = 1 measurement.
    lambda: theory.VerifyCostCurve({1: 1.0, 4: -1.0}),
    lambda: theory.VerifyCostCurve({1: 1.0, 2.5: 1.2}),
    lambda: theory.VerifyCostCurve({1: 1.0})(0),
    lambda: theory.alpha_from_beta([0.5, 1.5]),
    lambda: theory.alpha_from_beta([]),
])
def test_invalid_inputs_raise(call):
  with pytest.raises(ValueError):
    call()


def test_whole_call_improvement_adds_the_prefill_as_time():
  # plain: prefill 2 s + decode 8 s; speculative: prefill 2.5 s (its draft's too) + 8 / 1.6
  plain, spec = 2.0 + 8.0, 2.5 + 8.0 / 1.6
  got = theory.whole_call_improvement(1.6, 2.0 / plain, 2.0 / 2.5)
  assert got == pytest.approx(plain / spec)
  assert theory.whole_call_improvement(1.6, 0.0, 0.5) == pytest.approx(1.6)  # no prefill
  # between the prefill ratio and the decode loop's, nearer the first the larger its share
  shares = np.array([0.1, 0.5, 0.9])
  out = theory.whole_call_improvement(1.6, shares, 0.9)
  assert np.all((out > 0.9) & (out < 1.6)) and np.all(np.diff(out) < 0)
  for bad in (dict(decode_improvement=0.0), dict(prefill_share=1.0),
              dict(prefill_share=-0.1), dict(prefill_ratio=np.nan)):
    args = dict(decode_improvement=1.5, prefill_share=0.2, prefill_ratio=0.9) | bad
    with pytest.raises(ValueError):
      theory.whole_call_improvement(**args)
