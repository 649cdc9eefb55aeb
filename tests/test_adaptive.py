"""Adaptive γ and tree budgets (``speculative.adaptive``): the policy's arithmetic (chains in
closed form, trees priced from a scaled acceptance table), lossless switching inside the loop
among chains, static and dynamic trees and plain steps (greedy equality, the exact law, a
peeking policy rejected), drafters catching up after skipped steps, no recompilation, the
measured costs and bad input."""

import dataclasses
import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache as kvc
from specjax import theory
from specjax.attention import resolve_impl
from specjax.drafters import JacobiDrafter, ModelDrafter
from specjax.generate import prefill
from specjax.sampling import Greedy, Sampling, dense_probs
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import EVIDENCE, MIN_GAIN, AdaptiveGamma, PolicyState
from specjax.speculative.calibration import (calibrate, chain_alphas, chain_decoder,
                                             measure_chain_alpha, measure_chain_alphas,
                                             measure_rank_accept, measure_step_costs,
                                             measure_tree_prices)
from specjax.speculative.replay import replay_greedy
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.speculative.tree_builders import best_static_tree, expected_tokens_per_step
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint, make_drafter,
                             new_compiles_across_batches, tiny_model)

from matrix import cases

PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11, 12, 13], [3]]
CORPUS = [[1, 2, 5, 3, 3, 7, 1, 2, 5, 0], [4, 4, 1, 2, 6]]
# Cheap drafts and a quickly forgetting estimate: on the tiny random models this policy
# moves between plain steps and several draft lengths within a few dozen tokens.
SWITCHING = AdaptiveGamma(gammas=(0, 1, 2, 4), step_costs=(1.0, 1.2, 1.3, 1.5),
                          prior_alpha=0.6, decay=0.7)
# A measured-looking table (depths 1-3, ranks 0-2) and a policy over plain steps, a γ = 1
# chain, a static tree of depth 2 and a dynamic tree of depth 3: each choice has a depth of
# its own, so ``depth_hist`` tells which ran.
TABLE = ((0.55, 0.1, 0.04), (0.5, 0.1, 0.0), (0.6, 0.1, 0.0))
FORK = TreeTopology.from_choices([(0,), (1,), (0, 0), (0, 1)])
WITH_TREES = AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1.1),
                           trees=(FORK, DynamicTree(top_k=2, depth=3, num_nodes=4)),
                           tree_costs=(1.15, 1.25), rank_accept=TABLE, prior_alpha=0.6,
                           decay=0.7)


def _state(policy, successes, failures, tree_successes=None, tree_failures=None):
  """The counts of chain steps and of tree steps (none by default)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  none = [0.0] * len(successes)
  return PolicyState(successes=f32(successes), failures=f32(failures),
                     tree_successes=f32(none if tree_successes is None else tree_successes),
                     tree_failures=f32(none if tree_failures is None else tree_failures))


# --- 1. the policy's arithmetic -------------------------------------------------------------


def test_docstring_example_choices():
  policy = AdaptiveGamma(gammas=(0, 1, 2, 4), step_costs=(1.0, 1.15, 1.27, 1.52),
                         prior_weight=1.0)
  on = jnp.ones((1,), bool)
  # α̂ = (s + 0.5) / (s + f + 1): s = 6.5, f = 2.5 gives 0.7; s = 0.1, f = 1.9 gives 0.2.
  assert policy.gammas[int(policy.choose(_state(policy, [6.5], [2.5]), on))] == 4
  assert float(policy.alpha(_state(policy, [6.5], [2.5]))[0]) == pytest.approx(0.7)
  np.testing.assert_allclose(policy.scores(_state(policy, [6.5], [2.5]), on),
                             [1.0, 1.7 / 1.15, 2.19 / 1.27, 2.7731 / 1.52], rtol=1e-5)
  # α̂ = 0.3 (s = 0.1, f = 0.9): γ = 1 at 1.13; α̂ = 0.2: γ = 1 promises 4%, within the
  # default margin, so plain decoding (the formula's argmax, γ = 1, with min_gain = 0).
  assert policy.gammas[int(policy.choose(_state(policy, [0.1], [0.9]), on))] == 1
  assert policy.gammas[int(policy.choose(_state(policy, [0.1], [1.9]), on))] == 0
  eager = dataclasses.replace(policy, min_gain=0.0)
  assert eager.gammas[int(eager.choose(_state(policy, [0.1], [1.9]), on))] == 1


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.35, 0.5, 0.62, 0.8, 0.95, 0.999])
def test_choice_is_the_calibrated_theory_argmax(alpha):
  curve = theory.VerifyCostCurve({1: 1.0, 2: 1.08, 3: 1.2, 5: 1.6})
  c = 0.07
  policy = AdaptiveGamma.from_theory((0, 1, 2, 3, 4), c, curve, prior_weight=1e-6,
                                     min_gain=0.0)
  # Evidence giving α̂ = alpha (the prior's weight is negligible).
  state = _state(policy, [alpha * 1e3], [(1 - alpha) * 1e3])
  expected = [1.0] + [theory.calibrated_walltime_improvement(alpha, g, c, curve)
                      for g in (1, 2, 3, 4)]
  np.testing.assert_allclose(policy.scores(state, jnp.ones((1,), bool)), expected, rtol=1e-4)
  assert int(policy.choose(state, jnp.ones((1,), bool))) == int(np.argmax(expected))


def test_scores_average_expected_tokens_over_active_rows_only():
  policy = AdaptiveGamma(gammas=(1, 3), step_costs=(1.0, 1.0), prior_weight=1e-6)
  state = _state(policy, [900.0, 0.0, 500.0], [100.0, 1000.0, 500.0])  # α̂ = 0.9, 0, 0.5
  a = np.array([0.9, 0.5])
  np.testing.assert_allclose(policy.scores(state, jnp.array([True, False, True])),
                             [np.mean(1 + a), np.mean(1 + a + a ** 2 + a ** 3)], rtol=1e-4)


def test_batch_factors_are_the_expected_least_rows_share_of_the_mean():
  """η_k(b) = E[min of b rows' E_k] / mean E_k, rows drawn from the prompts' ease: checked
  against enumerating every batch of b prompts; 1 at one row; scores use the active rows'."""
  import itertools
  ease = (0.4, 1.0, 1.3)
  policy = AdaptiveGamma(gammas=(0, 1, 3), step_costs=(1.0, 1.2, 1.6), prior_alpha=0.6,
                         prompt_ease=ease, prior_weight=1e-6)
  rates = [min(0.6 * e, 1.0) for e in ease]
  tokens = np.array([[1.0, 1 + a, 1 + a + a ** 2 + a ** 3] for a in rates])  # [prompts, K]
  for b in (1, 2, 3):
    least = np.mean([tokens[list(rows)].min(axis=0)
                     for rows in itertools.product(range(3), repeat=b)], axis=0)
    np.testing.assert_allclose(policy.batch_factors[b - 1], least / tokens.mean(axis=0),
                               rtol=1e-5)
  np.testing.assert_allclose(policy.batch_factors[0], 1.0, rtol=1e-6)
  assert np.all(np.diff(policy.batch_factors[:, 1:], axis=0) <= 1e-9)  # falls with b
  np.testing.assert_allclose(policy.batch_factors[-1], tokens.min(axis=0) / tokens.mean(axis=0),
                             rtol=1e-4)
  state = _state(policy, [600.0] * 4, [400.0] * 4)  # every row at α̂ = 0.6
  e = np.array([1.0, 1.6, 1 + 0.6 + 0.36 + 0.216])
  active = jnp.array([True, False, True, False])
  np.testing.assert_allclose(policy.scores(state, active),
                             e * policy.batch_factors[1] / np.array([1.0, 1.2, 1.6]), rtol=1e-4)
  assert AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1.2)).batch_factors is None


def test_observe_discounts_counts_rejections_and_spares_inactive_rows():
  policy = AdaptiveGamma(gammas=(0, 2, 4), step_costs=(1.0, 1.1, 1.3), decay=0.5)
  state = _state(policy, [2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
  active = jnp.array([True, True, False])
  new = policy.observe(state, jnp.int32(2), jnp.array([4, 1, 0]), active)  # γ = 4
  np.testing.assert_allclose(new.successes, [1.0 + 4, 1.0 + 1, 2.0])
  np.testing.assert_allclose(new.failures, [0.5, 0.5 + 1, 1.0])
  plain = policy.observe(state, jnp.int32(0), jnp.zeros(3, jnp.int32), active)  # γ = 0
  np.testing.assert_allclose(plain.successes, [1.0, 1.0, 2.0])
  np.testing.assert_allclose(plain.failures, [0.5, 0.5, 1.0])


def test_a_weighed_chain_step_counts_its_betas_in_place_of_its_outcomes():
  """``evidence="expected"``: Σβ successes and count − Σβ failures where the step weighed
  its drafts (count > 0); outcomes where it did not; ``"accepted"`` ignores the βs."""
  expected = AdaptiveGamma(gammas=(0, 2, 4), step_costs=(1.0, 1.1, 1.3), decay=0.5)
  accepted = dataclasses.replace(expected, evidence="accepted")
  state = _state(expected, [2.0, 2.0, 2.0], [1.0, 1.0, 1.0])
  active = jnp.array([True, True, True])
  # γ = 4: row 0 accepted 2 of its drafts (3 positions scored), row 1 all 4 (4 scored), row 2
  # weighed nothing (count 0, as a greedy or tree step's: its outcome counts).
  step = (jnp.int32(2), jnp.array([2, 4, 1]), active)
  betas = dict(beta_sum=jnp.array([1.9, 3.2, 0.0]), beta_count=jnp.array([3, 4, 0]))
  new = expected.observe(state, *step, **betas)
  np.testing.assert_allclose(new.successes, [1.0 + 1.9, 1.0 + 3.2, 1.0 + 1])
  np.testing.assert_allclose(new.failures, [0.5 + 1.1, 0.5 + 0.8, 0.5 + 1], rtol=1e-6)
  old = accepted.observe(state, *step, **betas)
  np.testing.assert_allclose(old.successes, [1.0 + 2, 1.0 + 4, 1.0 + 1])
  np.testing.assert_allclose(old.failures, [0.5 + 1, 0.5, 0.5 + 1])
  for policy in (expected, accepted):  # without βs both count outcomes
    np.testing.assert_allclose(policy.observe(state, *step).successes, old.successes)
  with pytest.raises(ValueError, match="together"):
    expected.observe(state, *step, beta_sum=betas["beta_sum"])


def test_plain_steps_return_the_estimate_to_the_prior_so_drafting_is_tried_again():
  policy = AdaptiveGamma(gammas=(0, 2), step_costs=(1.0, 1.3), prior_alpha=0.6, decay=0.9,
                         min_gain=0.0)
  state, on = policy.init(1), jnp.ones((1,), bool)
  assert policy.gammas[int(policy.choose(state, on))] == 2  # E(0.6, 2) / 1.3 = 1.51
  for _ in range(3):  # three rejections: f = 2.71, α̂ = 0.16, E / 1.3 = 0.91
    state = policy.observe(state, jnp.int32(1), jnp.zeros(1, jnp.int32), on)
  assert int(policy.choose(state, on)) == 0
  low = float(policy.alpha(state)[0])
  plain_steps = 0
  while int(policy.choose(state, on)) == 0:
    state = policy.observe(state, jnp.int32(0), jnp.zeros(1, jnp.int32), on)
    plain_steps += 1
  # E > 1.3 needs α̂ > 0.24, i.e. 2.71 · 0.9^k < 1.5: k = 6 plain steps.
  assert plain_steps == 6
  assert float(policy.alpha(state)[0]) > max(low, 0.24)


def test_a_draft_must_promise_more_than_min_gain_over_plain_decoding():
  """Plain decoding's score is raised by ``min_gain`` (5% by default) in the choice, not in
  the scores: a draft promising 3% stays plain, one promising 8% is taken; with no plain
  choice the margin changes nothing; the prior's choice decides ``never_drafts``."""
  on = jnp.ones((1,), bool)
  # α̂ = 0.5 at the prior: E(γ = 1) = 1.5, so a cost of 1.5 / 1.03 promises 3%.
  close = AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1.5 / 1.03), prior_alpha=0.5)
  assert close.min_gain == MIN_GAIN == 0.05
  np.testing.assert_allclose(close.scores(close.init(1), on), [1.0, 1.03], rtol=1e-5)
  assert int(close.choose(close.init(1), on)) == 0 and close.never_drafts()
  eager = dataclasses.replace(close, min_gain=0.0)  # the calibrated formula's argmax
  assert int(eager.choose(eager.init(1), on)) == 1 and not eager.never_drafts()
  clear = dataclasses.replace(close, step_costs=(1.0, 1.5 / 1.08))
  assert int(clear.choose(clear.init(1), on)) == 1 and not clear.never_drafts()
  strict = dataclasses.replace(clear, min_gain=0.1)
  assert int(strict.choose(strict.init(1), on)) == 0
  # Without plain decoding the choice is the argmax, whatever the margin.
  drafts = AdaptiveGamma(gammas=(1, 2), step_costs=(1.0, 1.4), prior_alpha=0.5, min_gain=0.5)
  np.testing.assert_allclose(drafts.scores(drafts.init(1), on), [1.5, 1.75 / 1.4], rtol=1e-5)
  assert drafts.gammas[int(drafts.choose(drafts.init(1), on))] == 1
  for bad in (-0.01, float("nan"), float("inf"), True, "0.05"):
    with pytest.raises(ValueError, match="min_gain must be a finite number >= 0"):
      AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1.2), min_gain=bad)


def test_policy_sorts_its_set_and_builds_costs_from_theory():
  policy = AdaptiveGamma(gammas=(4, 0, 2), step_costs=(1.5, 1.0, 1.2))
  assert policy.gammas == (0, 2, 4) and policy.step_costs == (1.0, 1.2, 1.5)
  assert policy.max_depth == 4 and policy.plain
  th = AdaptiveGamma.from_theory((0, 1, 3), 0.1, {1: 1.0, 2: 1.1, 4: 1.5})
  assert th.step_costs == pytest.approx((1.0, 0.1 + 1.1, 0.3 + 1.5))
  curve = theory.VerifyCostCurve({1: 1.0, 2: 1.1, 6: 1.5})
  tr = AdaptiveGamma.from_theory((0, 1), 0.1, curve, trees=(FORK,), rank_accept=TABLE)
  assert tr.tree_costs == pytest.approx((2 * 0.1 + float(curve(5)),))  # D c + T(N + 1)


def test_a_table_of_constant_rank0_rate_prices_a_chain_shaped_tree_by_the_closed_form():
  table = ((0.7, 0.2),) * 4
  policy = AdaptiveGamma(gammas=(0, 3), step_costs=(1.0, 1.3),
                         trees=(TreeTopology.chain(3),), tree_costs=(1.3,), rank_accept=table)
  assert policy.table_alpha == pytest.approx(0.7)  # α_A of a constant column is that α
  alphas = jnp.array([0.05, 0.33, 0.5, 0.7, 0.91])
  tokens = policy.expected_tokens(alphas, alphas)  # [B, plain / γ = 3 / the tree]
  np.testing.assert_allclose(tokens[:, 2], tokens[:, 1], atol=2e-3)  # interpolated on a grid
  np.testing.assert_allclose(tokens[:, 1], 1 + alphas + alphas ** 2 + alphas ** 3, rtol=1e-6)


def test_trees_are_priced_by_tree_theory_on_the_scaled_table():
  dynamic = DynamicTree(top_k=2, depth=3, num_nodes=5)
  policy = AdaptiveGamma(gammas=(0, 2), step_costs=(1.0, 1.2), trees=(FORK, dynamic),
                         tree_costs=(1.3, 1.5), rank_accept=TABLE, prior_weight=1e-6,
                         prior_alpha=0.99 / 1.825, min_gain=0.0)
  # The chains' calibrated rate is the table's, so chain evidence at α prices both at α.
  ref = policy.table_alpha  # P = 0.55, 0.275, 0.165: 0.99 / (0.99 + 0.835)
  assert ref == pytest.approx(0.99 / 1.825)
  for alpha in (0.3, 0.5, 0.8):  # grid points: the interpolation is exact there
    scaled = np.minimum(np.asarray(TABLE) * alpha / ref, 1.0)
    expected = [1.0, 1 + alpha + alpha ** 2,  # chains: the closed form at their own α̂
                expected_tokens_per_step(FORK, scaled),
                expected_tokens_per_step(best_static_tree(scaled[:, :2], 5, max_depth=3),
                                         scaled)]
    state = _state(policy, [alpha * 1e3], [(1 - alpha) * 1e3])
    scores = policy.scores(state, jnp.ones((1,), bool))
    np.testing.assert_allclose(scores, np.array(expected) / policy.costs, rtol=1e-4)
    assert int(policy.choose(state, jnp.ones((1,), bool))) == int(np.argmax(scores))
  assert policy.costs == (1.0, 1.2, 1.3, 1.5)
  assert (policy.max_depth, policy.max_children, policy.cache_headroom) == (3, 2, 5)
  # Low α: plain decoding; high α: the dynamic tree, the widest bet.
  assert int(policy.choose(_state(policy, [50.0], [950.0]), jnp.ones((1,), bool))) == 0
  assert int(policy.choose(_state(policy, [950.0], [50.0]), jnp.ones((1,), bool))) == 3


def test_a_tree_step_counts_its_first_ranked_chain_in_the_trees_estimate():
  short = TreeTopology((-1, -1, 1))  # the rank-0 child is a leaf; rank 1 has a child
  policy = AdaptiveGamma(gammas=(0, 3), step_costs=(1.0, 1.3),
                         trees=(FORK, short, DynamicTree(top_k=2, depth=3, num_nodes=4)),
                         tree_costs=(1.2, 1.2, 1.3), rank_accept=TABLE, decay=0.5)
  assert policy.first_chain_depths == (0, 3, 2, 1, 3)
  state, on = _state(policy, *[[2.0, 2.0]] * 4), jnp.ones((2,), bool)
  # Rank-0 drafts accepted from the root: 2 (FORK's whole first chain), 1 (stopped short).
  fork = policy.observe(state, jnp.int32(2), jnp.array([2, 1]), on)
  np.testing.assert_allclose(fork.tree_successes, [1.0 + 2, 1.0 + 1])
  np.testing.assert_allclose(fork.tree_failures, [1.0, 1.0 + 1])
  np.testing.assert_allclose(fork.successes, [1.0, 1.0])  # the chains' counts only decay
  np.testing.assert_allclose(fork.failures, [1.0, 1.0])
  # ``short``'s first chain ends after one draft: accepting it is censored, not a failure.
  np.testing.assert_allclose(policy.observe(state, jnp.int32(3), jnp.array([1, 0]), on)
                             .tree_failures, [1.0, 1.0 + 1])
  chain = policy.observe(state, jnp.int32(1), jnp.array([3, 0]), on)  # γ = 3
  np.testing.assert_allclose(chain.successes, [1.0 + 3, 1.0])
  np.testing.assert_allclose(chain.tree_successes, [1.0, 1.0])
  # Priors: the chains' is prior_alpha, the trees' the table's own α_A.
  fresh = policy.init(1)
  assert float(policy.alpha(fresh)[0]) == pytest.approx(policy.prior_alpha)
  assert float(policy.tree_alpha(fresh)[0]) == pytest.approx(policy.table_alpha)
  # The estimate a choice is priced on (and recorded with): its kind's.
  skewed = _state(policy, [3.0], [1.0], tree_successes=[1.0], tree_failures=[3.0])
  for index, which in ((0, policy.alpha), (1, policy.alpha), (2, policy.tree_alpha),
                       (4, policy.tree_alpha)):
    assert float(policy.estimate(skewed, jnp.int32(index))[0]) == pytest.approx(
        float(which(skewed)[0])), index


def test_chains_and_trees_share_one_running_ease():
  policy = WITH_TREES  # α_c = 0.6, α_A = 0.99 / 1.825, prior weight 1
  a_c, a_t = policy.prior_alpha, policy.table_alpha
  assert policy.table_alpha == pytest.approx(0.99 / 1.825)
  # A dip seen by the chains alone prices the trees down as well, in proportion.
  dip = _state(policy, [0.5], [3.0], tree_successes=[0.0], tree_failures=[0.0])
  ease = (0.5 + a_c) / (a_c * 3.5 + a_c)
  assert float(policy.ease(dip)[0]) == pytest.approx(ease, rel=1e-6)
  assert float(policy.alpha(dip)[0]) == pytest.approx(a_c * ease, rel=1e-6)
  assert float(policy.tree_alpha(dip)[0]) == pytest.approx(a_t * ease, rel=1e-6)
  # Tree evidence moves the chains' estimate; both kinds' drafts count, each against the
  # rate calibrated for it.
  both = _state(policy, [2.0], [1.0], tree_successes=[1.0], tree_failures=[2.0])
  ease = (2.0 + 1.0 + a_c) / (a_c * 3.0 + a_t * 3.0 + a_c)
  assert float(policy.ease(both)[0]) == pytest.approx(ease, rel=1e-6)
  trees_good = _state(policy, [0.0], [0.0], tree_successes=[4.0], tree_failures=[0.0])
  assert float(policy.alpha(trees_good)[0]) > a_c
  # Estimates are rates: a run of accepted tree drafts cannot price a chain above 1.
  sure = _state(policy, [0.0], [0.0], tree_successes=[1000.0], tree_failures=[0.0])
  assert float(policy.alpha(sure)[0]) == 1.0 and float(policy.tree_alpha(sure)[0]) < 1.0
  # With no trees the estimate is the chains' own: (s + w·α_c) / (s + f + w).
  chains = AdaptiveGamma(gammas=(1, 2), step_costs=(1.1, 1.2), prior_alpha=0.3,
                         prior_weight=2.0)
  state = _state(chains, [3.0], [1.0])
  assert float(chains.alpha(state)[0]) == pytest.approx((3.0 + 0.6) / 6.0, rel=1e-6)
  # Fresh, the trees are priced at the table's own rate.
  assert float(policy.tree_alpha(policy.init(1))[0]) == pytest.approx(a_t)


@pytest.mark.parametrize("kwargs,match", [
    (dict(gammas=(), step_costs=()), "non-empty"),
    (dict(gammas=(0,), step_costs=(1.0,)), ">= 1"),
    (dict(gammas=(1, 1), step_costs=(1.0, 1.0)), "distinct"),
    (dict(gammas=(-1, 2), step_costs=(1.0, 1.0)), ">= 0"),
    (dict(gammas=(1.5, 2), step_costs=(1.0, 1.0)), "integers"),
    (dict(gammas=(True, 2), step_costs=(1.0, 1.0)), "integers"),
    (dict(gammas=(1, 2), step_costs=(1.0,)), "1 step_costs for 2"),
    (dict(gammas=(1, 2), step_costs=(1.0, float("nan"))), "finite"),
    (dict(gammas=(1, 2), step_costs=(1.0, 0.0)), "> 0"),
    (dict(gammas=(0, 2), step_costs=(1.1, 1.2)), "costs 1"),
    (dict(gammas=(1, 2), step_costs=(1.0, 1.1), prior_alpha=1.0), "prior_alpha"),
    (dict(gammas=(1, 2), step_costs=(1.0, 1.1), prior_weight=0.0), "prior_weight"),
    (dict(gammas=(1, 2), step_costs=(1.0, 1.1), decay=0.0), "decay"),
    (dict(gammas=(1, 2), step_costs=(1.0, 1.1), prompt_ease=(1.0, -0.5)), "prompt_ease"),
    (dict(gammas=(1, 2), step_costs=(1.0, 1.1), evidence="beta"), "evidence"),
    (dict(gammas=(1, 2), step_costs=(1.0, 1.1), prompt_ease=(1.0, float("nan"))),
     "prompt_ease"),
    (dict(gammas=(0,), step_costs=(1.0,), trees=(FORK,), tree_costs=(1.2,)), "rank_accept"),
    (dict(gammas=(0, 4), step_costs=(1.0, 1.3), rank_accept=TABLE), "has none"),
    (dict(gammas=(0,), step_costs=(1.0,), trees=(DynamicTree(2, 4, 4),), tree_costs=(1.2,),
          rank_accept=TABLE), "deepest tree drafts 4"),
    (dict(gammas=(0,), step_costs=(1.0,), trees=(FORK,), tree_costs=(1.2,),
          rank_accept=((0.0, 0.5), (0.5, 0.1))), "rank-0 acceptance at depth 1"),
    (dict(gammas=(0,), step_costs=(1.0,), trees=((-1, 0),), tree_costs=(1.2,),
          rank_accept=TABLE), "TreeTopology or DynamicTree"),
    (dict(gammas=(0,), step_costs=(1.0,), trees=(FORK, FORK), tree_costs=(1.2, 1.2),
          rank_accept=TABLE), "distinct"),
    (dict(gammas=(0,), step_costs=(1.0,), trees=(FORK,), tree_costs=(),
          rank_accept=TABLE), "0 tree_costs for 1 trees"),
    (dict(gammas=(0,), step_costs=(1.0,), trees=(FORK,), tree_costs=(1.2,),
          rank_accept=((0.5, 1.5), (0.5, 0.1))), "probabilities"),
])
def test_bad_policies_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    AdaptiveGamma(**kwargs)


# --- 2. switching inside the loop is lossless -------------------------------------------------


@pytest.fixture(scope="module")
def models():
  target = tiny_model(seed=0)
  draft = tiny_model(seed=1, num_layers=1, dim=16, num_heads=2, num_kv_heads=1, ffn_dim=32)
  return target, draft


def _drafter(kind, target, draft):
  if kind == "model":
    drafter = ModelDrafter(draft[0])
    return drafter, drafter.make_params(draft[1])
  return make_drafter(kind, *target, CORPUS)


@pytest.mark.parametrize("kind", cases(["model", "eagle", "prompt_lookup", "bigram", "early_exit"],
                                       keep=("model", "eagle", "early_exit")))
def test_greedy_with_a_switching_policy_equals_plain_greedy(models, kind):
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter(kind, target, draft)
  ref = specjax.generate(params, cfg, PROMPTS, 40, eos_ids=())
  dec = SpeculativeDecoder(cfg, drafter, policy=SWITCHING, eos_ids=())
  out = dec.generate(params, dp, PROMPTS, 40)
  for row in range(len(PROMPTS)):
    assert out.generated(row) == ref.generated(row), row
  steps_at = out.per_row["depth_hist"].sum(axis=0)
  assert steps_at[0] > 0 and np.count_nonzero(steps_at[1:]) >= 1, steps_at  # it switched
  np.testing.assert_array_equal(out.per_row["depth_hist"].sum(axis=1),
                                out.per_row["target_calls"])
  assert out.per_row["accept_len_hist"].sum() == steps_at[1:].sum()  # plain steps excluded


@pytest.mark.parametrize("kind", cases(["model", "eagle"], keep=("eagle",)))
def test_greedy_with_a_policy_switching_among_chains_and_trees_equals_plain_greedy(models,
                                                                                   kind):
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter(kind, target, draft)
  ref = specjax.generate(params, cfg, PROMPTS, 40, eos_ids=())
  dec = SpeculativeDecoder(cfg, drafter, policy=WITH_TREES, eos_ids=())
  assert dec.cache_headroom == 4 and dec.max_children == 2 and dec.gamma == 3
  out = dec.generate(params, dp, PROMPTS, 40)
  for row in range(len(PROMPTS)):
    assert out.generated(row) == ref.generated(row), row
  steps_at = out.per_row["depth_hist"].sum(axis=0)  # plain, γ = 1, FORK, the dynamic tree
  assert np.count_nonzero(steps_at[2:]) >= 1 and np.count_nonzero(steps_at) >= 2, steps_at
  np.testing.assert_array_equal(out.per_row["depth_hist"].sum(axis=1),
                                out.per_row["target_calls"])
  # Each choice has a depth of its own, so the per-choice counts are the depth histogram.
  np.testing.assert_array_equal(out.per_row["choice_steps"], out.per_row["depth_hist"])
  chosen = out.per_row["choice_steps"] > 0
  mean = out.per_row["choice_estimate"][chosen] / out.per_row["choice_steps"][chosen]
  assert np.all((mean > 0) & (mean < 1)), mean
  assert np.all(out.per_row["choice_estimate"][~chosen] == 0)
  profiled = dec.generate(params, dp, PROMPTS, 40, profile=True)  # the host-side choice
  np.testing.assert_array_equal(profiled.tokens, out.tokens)
  for name in ("depth_hist", "choice_steps"):
    np.testing.assert_array_equal(profiled.per_row[name], out.per_row[name], err_msg=name)
  np.testing.assert_allclose(profiled.per_row["choice_estimate"],
                             out.per_row["choice_estimate"], rtol=1e-6)


@pytest.mark.heavy  # 40 s
def test_profiled_twin_and_single_steps_take_the_same_path(models):
  """``stream`` (the policy's choice on the host) and ``step`` (``lax.switch``) make the
  same choices as the fused loop's inner while loops."""
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("model", target, draft)
  dec = SpeculativeDecoder(cfg, drafter, policy=SWITCHING, eos_ids=())
  fused = dec.generate(params, dp, PROMPTS, 30)
  profiled = dec.generate(params, dp, PROMPTS, 30, profile=True)
  state, _ = dec.prepare(params, dp, PROMPTS, 30)
  step = jax.jit(dec.step)
  while not bool(jnp.all(state.done)):
    state = step(params, dp, state)
  for other in (profiled.tokens, np.asarray(state.tokens)):
    np.testing.assert_array_equal(other, fused.tokens)
  for name, counts in fused.per_row.items():
    np.testing.assert_array_equal(profiled.per_row[name], counts, err_msg=name)
    np.testing.assert_array_equal(np.asarray(getattr(state.counters, name)), counts,
                                  err_msg=name)
  assert profiled.timing["verify"] > 0


def _policy_after(dec, params, dp, new_tokens):
  state, _ = dec.prepare(params, dp, PROMPTS, new_tokens)
  step = jax.jit(dec.step)
  while not bool(jnp.all(state.done)):
    state = step(params, dp, state)
  return state


def test_sampled_chain_steps_feed_the_policy_their_betas_and_greedy_ones_their_outcomes(models):
  """With nothing forgotten (decay 1) and chains only, the policy's counts are the loop's
  own: under ``"expected"`` at T = 1 its successes are the counters' weighted Σwβ and its
  trials Σw, under token-wise and block verification alike (not the βs of the positions
  scored, nor the outcomes); under ``"accepted"`` its successes are the accepted drafts
  (which differ: the test would fail if the βs went unused). Greedy βs are the outcomes, so
  at T = 0 both evidences make the same choices and counts."""
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("model", target, draft)
  policy = AdaptiveGamma(gammas=(1, 3), step_costs=(1.1, 1.3), prior_alpha=0.5, decay=1.0)
  old = dataclasses.replace(policy, evidence="accepted")
  t1 = dict(sampler=Sampling(temperature=1.0), eos_ids=())
  for verification in ("tokenwise", "block"):
    dec = SpeculativeDecoder(cfg, drafter, policy=policy, verification=verification, **t1)
    st = _policy_after(dec, params, dp, 24)
    c = st.counters
    np.testing.assert_allclose(st.policy.successes, c.weighted_beta_sum, rtol=1e-5)
    np.testing.assert_allclose(st.policy.successes + st.policy.failures, c.weighted_count,
                               rtol=1e-5)
    assert not np.allclose(st.policy.successes, c.beta_sum, atol=1e-3), verification
    assert not np.allclose(st.policy.successes, c.accepted, atol=1e-3), verification
  st = _policy_after(SpeculativeDecoder(cfg, drafter, policy=old, **t1), params, dp, 24)
  np.testing.assert_array_equal(st.policy.successes, st.counters.accepted)
  switching = dataclasses.replace(SWITCHING, evidence="accepted")
  runs = [SpeculativeDecoder(cfg, drafter, policy=p, eos_ids=()).generate(params, dp, PROMPTS, 30)
          for p in (SWITCHING, switching)]
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)
  for name in ("choice_steps", "choice_estimate"):
    np.testing.assert_array_equal(runs[0].per_row[name], runs[1].per_row[name], err_msg=name)


def test_recursive_rejection_steps_feed_the_policy_their_first_chains_betas(models):
  """Trees (and chains of point-mass drafts), verified by recursive rejection, weigh their
  first-ranked chain's βs (``tree_acceptance.first_chain_beta``): with nothing forgotten, a
  policy that always takes a tree has under ``"expected"`` at T = 1 the trees' successes the
  loop's Σβ of those chains and their trials its count of their scored nodes; under
  ``"accepted"`` its successes are outcomes, which differ; at T = 0 nothing is weighed. A
  point-mass chain's calibrated rate is the same Σβ over the same count."""
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("model", target, draft)
  trees = AdaptiveGamma(gammas=(1,), step_costs=(5.0,), trees=WITH_TREES.trees,
                        tree_costs=(1.0, 1.0), rank_accept=TABLE, prior_alpha=0.6, decay=1.0,
                        min_gain=0.0)
  t1 = dict(sampler=Sampling(temperature=1.0), eos_ids=())
  st = _policy_after(SpeculativeDecoder(cfg, drafter, policy=trees, **t1), params, dp, 24)
  c = st.counters
  assert np.all(np.asarray(c.choice_steps)[:, 0] == 0)  # never the chain
  assert float(jnp.sum(c.lead_beta_count)) > 0 and float(jnp.sum(c.beta_count)) == 0
  np.testing.assert_allclose(st.policy.tree_successes, c.lead_beta_sum, rtol=1e-5)
  np.testing.assert_allclose(st.policy.tree_successes + st.policy.tree_failures,
                             c.lead_beta_count, rtol=1e-5)
  counted = dataclasses.replace(trees, evidence="accepted")
  st = _policy_after(SpeculativeDecoder(cfg, drafter, policy=counted, **t1), params, dp, 24)
  assert not np.allclose(st.policy.tree_successes, st.counters.lead_beta_sum, atol=1e-3)
  st = _policy_after(SpeculativeDecoder(cfg, drafter, policy=trees, eos_ids=()), params, dp, 24)
  assert float(jnp.sum(st.counters.lead_beta_count)) == 0  # greedy: the outcomes
  # A chain of point-mass drafts (Medusa's) is priced by the same count: two prompts' counters
  # as ``decode_each`` gives them, one weighed by lead βs, one by none (greedy: outcomes).
  counts = dict(accept_len_hist=np.array([[2, 1, 3], [1, 1, 1]]),
                weighted_beta_sum=np.zeros(2), weighted_count=np.zeros(2),
                lead_beta_sum=np.array([3.5, 0.0]), lead_beta_count=np.array([10, 0]))
  alpha, ease = chain_alphas(counts)
  assert alpha == pytest.approx((3.5 + 3) / (10 + 5))  # outcomes: 3 accepted, 2 short steps
  assert ease == pytest.approx((0.35 / alpha, 0.6 / alpha))
  assert chain_alphas(counts, "accepted")[0] == pytest.approx((7 + 3) / (10 + 5))


def test_a_policy_that_never_drafts_decodes_plainly_with_the_loops_tokens_and_counters(
    models, monkeypatch):
  """Plain decoding that scores best at the prior is absorbing (a plain step adds no
  evidence), so ``generate`` runs plain decoding's own loop and never touches the drafter:
  the same tokens (greedy and sampled: the same keys in the same order) and counters as the
  speculative loop, which the profiled twin still runs."""
  from specjax.speculative import decoder as decoder_module
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("eagle", target, draft)
  costly = AdaptiveGamma(gammas=(0, 1, 2), step_costs=(1.0, 1.8, 2.5), prior_alpha=0.5)
  assert costly.never_drafts()  # E(0.5, 1) / 1.8 = 0.83 and E(0.5, 2) / 2.5 = 0.70, below 1
  assert not SWITCHING.never_drafts() and not WITH_TREES.never_drafts()
  assert not AdaptiveGamma(gammas=(1, 2), step_costs=(1.8, 2.5)).never_drafts()  # no plain
  for sampler in (Greedy(), Sampling(temperature=1.0)):
    dec = SpeculativeDecoder(cfg, drafter, policy=costly, sampler=sampler, eos_ids=())
    assert dec.plain_only(len(PROMPTS))
    fused = dec.generate(params, dp, PROMPTS, 20, seed=3)
    loop = dec.generate(params, dp, PROMPTS, 20, seed=3, profile=True)  # the policy's loop
    np.testing.assert_array_equal(fused.tokens, loop.tokens)
    np.testing.assert_array_equal(fused.seq_lens, loop.seq_lens)
    assert fused.steps == loop.steps and 0 < fused.prefill_seconds < fused.seconds
    assert set(fused.per_row) == set(loop.per_row)
    for name, counts in loop.per_row.items():
      assert fused.per_row[name].dtype == counts.dtype, name
      np.testing.assert_allclose(fused.per_row[name], counts, rtol=1e-6, err_msg=name)
    assert loop.per_row["choice_steps"][:, 1:].sum() == 0  # the loop never drafted either
  greedy = SpeculativeDecoder(cfg, drafter, policy=costly, eos_ids=())
  np.testing.assert_array_equal(greedy.generate(params, dp, PROMPTS, 20).tokens,
                                specjax.generate(params, cfg, PROMPTS, 20, eos_ids=()).tokens)

  def no_drafter(*args, **kwargs):
    raise AssertionError("the drafter was prefilled")
  monkeypatch.setattr(decoder_module, "prefill_models", no_drafter)
  greedy.generate(params, dp, PROMPTS, 20)
  with pytest.raises(AssertionError, match="prefilled"):  # the loop does prefill it
    greedy.generate(params, dp, PROMPTS, 20, profile=True)
  # An attention other than plain decoding's keeps the speculative loop.
  other = "reference" if resolve_impl("auto") != "reference" else "cpu"
  assert not SpeculativeDecoder(cfg, drafter, policy=costly, attention_impl=other).plain_only()


def test_a_batch_that_waits_for_its_hardest_row_decodes_plainly_only_without_eos(models):
  """Priced for the row a batch of 4 waits on, γ = 1 no longer pays at the prior, so that
  batch never drafts; one row still does. With EOS a row may end early, leaving fewer rows
  to wait on, so the decoder keeps the speculative loop there (and it decodes greedily)."""
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("eagle", target, draft)
  # α_c·ρ = 0.15 or 0.85: E(γ = 1) = 1.15 or 1.85, mean 1.5; 4 rows: min is 1.15 w.p. 15/16
  spread = AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1.3), prior_alpha=0.5,
                         prompt_ease=(0.3, 1.7))
  assert not spread.never_drafts(1) and spread.never_drafts(4)
  assert not dataclasses.replace(spread, prompt_ease=()).never_drafts(4)
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
      spread.never_drafts(bad)
  # The answers stay with the policy: asking again gives the same, and nothing else keeps
  # the policy alive (an lru_cache on the method kept up to 64 of them).
  assert spread.never_drafts(4) and not spread.never_drafts(1)
  gone = dataclasses.replace(spread, decay=0.8)
  assert gone.never_drafts(4) and gone == gone and hash(gone) == hash(dataclasses.replace(gone))
  gone = weakref.ref(gone)
  gc.collect()
  assert gone() is None
  with pytest.raises(ValueError, match="no prompts given"):  # pack's own error, not the policy's
    SpeculativeDecoder(cfg, drafter, policy=spread, eos_ids=()).generate(params, dp, [], 4)
  assert SpeculativeDecoder(cfg, drafter, policy=spread, eos_ids=()).plain_only(4)
  with_eos = SpeculativeDecoder(cfg, drafter, policy=spread, eos_ids=(5,))
  assert not with_eos.plain_only(4)
  out = with_eos.generate(params, dp, PROMPTS, 12)
  ref = specjax.generate(params, cfg, PROMPTS, 12, eos_ids=(5,))
  for row in range(len(PROMPTS)):
    assert out.generated(row) == ref.generated(row), row


def test_fixed_topologies_count_every_step_at_their_depth(models):
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("model", target, draft)
  out = SpeculativeDecoder(cfg, drafter, gamma=3, eos_ids=()).generate(params, dp, PROMPTS, 12)
  hist = out.per_row["depth_hist"]
  np.testing.assert_array_equal(hist[:, 3], out.per_row["target_calls"])
  assert hist[:, :3].sum() == 0
  assert out.per_row["choice_steps"].shape == (len(PROMPTS), 0)  # no policy, no choices
  assert out.metrics()["choice_steps"] == []


def test_one_compiled_loop_serves_every_batch(models):
  target, draft = models
  drafter, dp = _drafter("eagle", target, draft)
  dec = SpeculativeDecoder(target[0], drafter, policy=SWITCHING, sampler=Sampling(1.0))
  assert new_compiles_across_batches(dec, target[1], dp) == 0
  assert new_compiles_across_batches(dec.with_policy(WITH_TREES), target[1], dp) == 0


# Two policies whose first step drafts γ = 3 (prior α = 0.9) and whose second, for rows that
# rejected the first draft (α̂ = 0.18), is a plain step or a γ = 1 chain.
THEN_PLAIN = AdaptiveGamma(gammas=(0, 1, 3), step_costs=(1.0, 1.3, 1.6), prior_alpha=0.9,
                           prior_weight=0.25)
THEN_ONE = dataclasses.replace(THEN_PLAIN, step_costs=(1.0, 1.05, 1.6))
# Trees: the first step is a three-node tree (scores at the table's own α_A = 0.9: tree
# 3.01 / 1.6; γ = 1 at the chains' rate 0.2: 1.2 / 1.3; plain 1). A row whose root rank-0
# draft was rejected has ρ̂ = 0.2 / 1.1 (α̂_tree = 0.16: 1.24 / 1.6; α̂ = 0.036) and next takes
# a plain step, or with a cheap γ = 1 a chain (1.036 / 1.01, inside the default margin, so
# min_gain = 0).
TREE3 = TreeTopology.from_choices([(0,), (1,), (0, 0)])
TREE_THEN_PLAIN = AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1.3), trees=(TREE3,),
                                tree_costs=(1.6,), rank_accept=((0.9, 0.3), (0.9, 0.3)),
                                prior_alpha=0.2, prior_weight=1.0, min_gain=0.0)
TREE_THEN_ONE = dataclasses.replace(TREE_THEN_PLAIN, step_costs=(1.0, 1.01))
V, ROWS, PROMPT = 8, 100_000, [1, 2, 5]


@pytest.fixture(scope="module")
def small_models():
  return (tiny_model(seed=0, vocab_size=V, scale=1.0),
          tiny_model(seed=1, vocab_size=V, scale=1.0, num_layers=1))


@pytest.mark.parametrize("policy,first,second,sampler", cases([
    (THEN_PLAIN, 3, 0, Sampling(temperature=1.0)),
    (THEN_ONE, 3, 1, Sampling(temperature=0.8, top_k=5)),
    (TREE_THEN_PLAIN, 2, 0, Sampling(temperature=1.0)),
    (TREE_THEN_ONE, 2, 1, Sampling(temperature=0.8, top_p=0.9)),
], ids=["3-then-plain-t1", "3-then-1-topk5", "tree-then-plain-t1", "tree-then-1-topp"],
    keep=("3-then-plain-t1", "tree-then-1-topp")))
def test_a_switching_policy_samples_the_exact_joint(small_models, policy, first, second,
                                                    sampler):
  target, (dcfg, dparams) = small_models
  dec = SpeculativeDecoder(target[0], ModelDrafter(dcfg), policy=policy, sampler=sampler,
                           eos_ids=())
  counts, steps_at = _joint_and_steps(dec, target, {"model": dparams})
  # Every row's first step drafts at depth ``first``; many take a second at ``second``.
  assert steps_at[first] >= ROWS and steps_at[second] > 0.1 * ROWS, steps_at
  exact = exact_joint(*target, sampler, PROMPT)
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / ROWS - exact).sum() < 0.02


@dataclasses.dataclass(frozen=True)
class _PeekingDecoder(SpeculativeDecoder):
  """Wrong: sizes each row's step after seeing the verification. It runs every choice from
  the same state and keeps, per row, the outcome that emitted the most tokens."""

  @functools.partial(jax.jit, static_argnames=("self",), donate_argnames=("state",))
  def run(self, target_params, draft_params, state):
    def body(st):
      outs = [f(target_params, draft_params, st) for f in self.branch_steps()]
      best = jnp.argmax(jnp.stack([o.counters.emitted for o in outs]), axis=0)  # [B]
      rows = jnp.arange(best.shape[0])
      pick = lambda field: jnp.stack([field(o) for o in outs])[best, rows]
      counters = outs[0].counters.replace(
          emitted=pick(lambda o: o.counters.emitted),
          depth_hist=pick(lambda o: o.counters.depth_hist))
      return outs[0].replace(tokens=pick(lambda o: o.tokens), done=pick(lambda o: o.done),
                             seq_lens=pick(lambda o: o.seq_lens), counters=counters)

    return jax.lax.while_loop(lambda st: ~jnp.all(st.done), body, state)


def test_a_policy_that_peeks_at_the_verification_is_rejected(small_models):
  target, (dcfg, dparams) = small_models
  sampler = Sampling(temperature=1.0)
  policy = AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1.1))
  dec = _PeekingDecoder(target[0], ModelDrafter(dcfg), policy=policy, sampler=sampler,
                        eos_ids=())
  counts, _ = _joint_and_steps(dec, target, {"model": dparams})
  exact = exact_joint(*target, sampler, PROMPT)
  assert chi_square_pvalue(counts, exact) < 1e-6


def _joint_and_steps(dec, target, dp):
  """The first two tokens' counts over ROWS rows and the steps taken at each γ."""
  cfg, params = target
  out = dec.generate(params, dp, [PROMPT] * ROWS, 2, cache_size=len(PROMPT) + 2 + dec.cache_headroom)
  gen = out.tokens[:, len(PROMPT):len(PROMPT) + 2]
  assert np.all(out.num_generated == 2)
  counts = np.bincount(gen[:, 0] * V + gen[:, 1], minlength=V * V).reshape(V, V)
  return counts, out.per_row["depth_hist"].sum(axis=0)


# --- 3. drafters catch up after skipped steps ----------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "eagle"])
def test_a_drafter_that_missed_steps_proposes_as_if_it_had_seen_them(models, kind):
  """After plain steps the drafter's state stops at the prompt; its next proposal must equal
  one from a state built on the whole committed sequence. Rows lag by 1, 4 and 9 tokens."""
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter(kind, target, draft)
  rng = np.random.default_rng(0)
  prompt_lens = np.array([5, 3, 6], np.int32)
  seq_lens = prompt_lens + np.array([0, 3, 8], np.int32) + 1  # + the token a step appends
  tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, (3, 24)), jnp.int32)
  features = None
  if drafter.reads_target_features():  # what prefill and the plain steps' observe deliver
    _, features = prefill(params, cfg, tokens, jnp.asarray(seq_lens - 1),
                          kvc.init_cache(cfg, 3, 24), return_hidden=True,
                          feature_layers=drafter.target_feature_layers())
  lagging = drafter.init(dp, tokens, jnp.asarray(prompt_lens), features=features)
  fresh = drafter.init(dp, tokens, jnp.asarray(seq_lens), features=features)
  key, sampler = jax.random.PRNGKey(3), Sampling(temperature=1.0)
  da, qa, _ = drafter.propose_chain(dp, lagging, tokens, jnp.asarray(seq_lens), key, sampler, 3)
  db, qb, _ = drafter.propose_chain(dp, fresh, tokens, jnp.asarray(seq_lens), key, sampler, 3)
  np.testing.assert_array_equal(da, db)
  np.testing.assert_allclose(dense_probs(qa), dense_probs(qb), atol=1e-5)


# --- 4. measured costs and bad input ------------------------------------------------------------


def test_the_alpha_evidence_benchmark_refuses_bad_flags_before_loading_a_model(tmp_path,
                                                                               refused):
  """benchmarks.alpha_evidence: a temperature at which βs are the outcomes, or an empty
  count, is refused (its flags are checked before the embedded model loads; nothing is
  written)."""
  out = f"--out={tmp_path / 'a.md'}"
  refused("benchmarks.alpha_evidence",
          (["--temperature=0", out], "--temperature must be > 0"),
          (["--seeds=0", out], "--seeds must be >= 1"),
          (["--prompts=0", out], "--prompts must be >= 1"))
  assert not (tmp_path / "a.md").exists()


def test_measured_costs_make_a_policy(models):
  target, draft = models
  drafter, dp = _drafter("model", target, draft)
  template = SpeculativeDecoder(target[0], drafter, eos_ids=())
  costs = measure_step_costs(template, target[1], dp, PROMPTS[:2], (2, 0, 1), max_new_tokens=8,
                             rounds=1)
  assert costs[1] == 1.0 and all(np.isfinite(costs)) and min(costs) > 0
  policy = calibrate(template, target[1], dp, PROMPTS[:2], (0, 1), max_new_tokens=8, rounds=1,
                     decay=0.8)
  assert policy.gammas == (0, 1) and policy.decay == 0.8
  assert len(policy.prompt_ease) == 2  # two prompts: the chains' spread over them, measured,
  assert (policy.prior_alpha, policy.prompt_ease) == measure_chain_alphas(  # around their rate
      template, target[1], dp, PROMPTS[:2], 1, max_new_tokens=8)
  assert calibrate(template, target[1], dp, PROMPTS[:1], (0, 1), max_new_tokens=8,
                   rounds=1).prompt_ease == ()  # one prompt: no spread
  costs = measure_step_costs(template, target[1], dp, PROMPTS[:2], (0, 1), max_new_tokens=8,
                             rounds=1, trees=(FORK,))
  assert len(costs) == 3 and costs[0] == 1.0 and min(costs) >= 1.0
  # The target drafting for itself: every rank-0 draft is accepted, so the table prices trees.
  itself = SpeculativeDecoder(target[0], ModelDrafter(target[0]), eos_ids=())
  self_dp = itself.drafter.make_params(target[1])
  with_trees = calibrate(itself, target[1], self_dp, PROMPTS[:2], (0, 1), max_new_tokens=8,
                         rounds=1, trees=(FORK,))  # the table measured with a full tree
  table = measure_rank_accept(itself, target[1], self_dp, PROMPTS[:2], (6, 3),
                              max_new_tokens=8)
  assert table["table"][:, 0].tolist() == [1.0, 1.0]
  block = dataclasses.replace(itself, verification="block")  # its trees: traversal
  assert len(measure_step_costs(block, target[1], self_dp, PROMPTS[:1], (1,), max_new_tokens=4,
                                rounds=1, trees=(FORK,))) == 2
  assert with_trees.rank_accept == tuple(map(tuple, table["table"].tolist()))
  assert with_trees.prior_alpha == 0.99  # its chains' rate, 1, measured and clipped
  # The chains' rate as the policy counts it (sampled, where the random draft is accepted
  # some of the time): by default Σwβ over Σw (each position's β weighted by its chance of
  # being scored); counting outcomes, drafts accepted over those plus short steps.
  sampled = dataclasses.replace(template, sampler=Sampling(temperature=1.0))
  chain3 = dataclasses.replace(sampled, gamma=None, tree=TreeTopology.chain(3))  # one program
  outs = [chain3.generate(target[1], dp, [p], 8, seed=i)
          for i, p in enumerate(PROMPTS[:2])]
  row = lambda o, k: float(o.per_row[k][0])
  accepted = sum(row(o, "accepted") for o in outs)
  short = sum(float(o.per_row["accept_len_hist"][0][:3].sum()) for o in outs)
  assert 0 < accepted and 0 < short
  assert sum(row(o, "beta_count") for o in outs) == accepted + short  # each scored once
  beta = sum(row(o, "weighted_beta_sum") for o in outs)
  scored = sum(row(o, "weighted_count") for o in outs)
  assert beta / scored != pytest.approx(accepted / (accepted + short), abs=1e-3)  # they differ
  assert measure_chain_alpha(sampled, target[1], dp, PROMPTS[:2], 3, 8) == pytest.approx(
      beta / scored)
  counted = measure_chain_alpha(sampled, target[1], dp, PROMPTS[:2], 3, 8, evidence="accepted")
  assert counted == pytest.approx(accepted / (accepted + short))
  # Block-verified chains are measured block-wise, as a policy verifies them:
  # their weighted βs, or their own outcomes (not token-wise verification's, which differ
  # over 24 tokens), and so do a policy's tree prices (its trees verified by traversal).
  block = dataclasses.replace(sampled, verification="block")
  assert chain_decoder(block, 3).verification == "block"
  block_outs = [chain_decoder(block, 3).generate(target[1], dp, [p], 24, seed=i)
                for i, p in enumerate(PROMPTS[:2])]
  block_accepted = sum(row(o, "accepted") for o in block_outs)
  block_short = sum(float(o.per_row["accept_len_hist"][0][:3].sum()) for o in block_outs)
  assert measure_chain_alpha(block, target[1], dp, PROMPTS[:2], 3, 24) == pytest.approx(
      sum(row(o, "weighted_beta_sum") for o in block_outs)
      / sum(row(o, "weighted_count") for o in block_outs))
  block_counted = measure_chain_alpha(block, target[1], dp, PROMPTS[:2], 3, 24,
                                      evidence="accepted")
  assert block_counted == pytest.approx(block_accepted / (block_accepted + block_short))
  assert block_counted != pytest.approx(measure_chain_alpha(
      sampled, target[1], dp, PROMPTS[:2], 3, 24, evidence="accepted"), abs=1e-3)
  block_prices = measure_tree_prices(block, target[1], dp, PROMPTS[:2], (2, 1, 1), 24,
                                     evidence="accepted")
  assert block_prices["chain_alpha"] == pytest.approx(block_counted)
  np.testing.assert_array_equal(block_prices["table"], measure_rank_accept(
      sampled, target[1], dp, PROMPTS[:2], (2, 1, 1), 24)["table"])  # recursive rejection's
  with pytest.raises(ValueError, match="evidence must be one of"):
    measure_chain_alphas(sampled, target[1], dp, PROMPTS[:2], 3, 8, evidence="flips")
  # Each prompt's own rate, over the pooled one.
  alpha, ease = measure_chain_alphas(sampled, target[1], dp, PROMPTS[:2], 3, 8)
  own = [row(o, "weighted_beta_sum") / row(o, "weighted_count") for o in outs]
  assert alpha == pytest.approx(beta / scored)
  np.testing.assert_allclose(np.asarray(ease) * alpha, own, rtol=1e-6)
  # Both prices at once: the same table, and the rate of a chain as deep as the full tree.
  prices = measure_tree_prices(sampled, target[1], dp, PROMPTS[:2], (2, 1, 1), 8)
  np.testing.assert_array_equal(prices["table"], measure_rank_accept(
      sampled, target[1], dp, PROMPTS[:2], (2, 1, 1), 8)["table"])
  assert prices["chain_alpha"] == pytest.approx(beta / scored)
  np.testing.assert_allclose(prices["prompt_ease"], ease, rtol=1e-6)
  assert measure_tree_prices(sampled, target[1], dp, PROMPTS[:2], (2, 1, 1), 8,
                             evidence="accepted")["chain_alpha"] == pytest.approx(counted)
  # calibrate prices its policy's prior as that policy counts (a chain as deep as FORK).
  priors = []
  for evidence in EVIDENCE:
    policy = calibrate(sampled, target[1], dp, PROMPTS[:2], (0, 1), max_new_tokens=8,
                       rounds=1, trees=(FORK,), rank_accept=((0.5, 0.5), (0.5, 0.5)),
                       evidence=evidence)
    assert policy.evidence == evidence
    assert policy.prior_alpha == measure_chain_alpha(sampled, target[1], dp, PROMPTS[:2], 2, 8,
                                                     evidence=evidence)
    priors.append(policy.prior_alpha)
  assert priors[0] != pytest.approx(priors[1], abs=1e-3)
  assert table["offered"][0, 0] == table["offered"][0, 5] > 0  # every root rank offered
  np.testing.assert_array_less(table["accepted"] - 1, table["offered"])
  with pytest.raises(ValueError, match="gammas"):
    measure_step_costs(template, target[1], dp, PROMPTS[:2], (1, -1))
  with pytest.raises(ValueError, match="rounds"):
    measure_step_costs(template, target[1], dp, PROMPTS[:2], (1,), rounds=0)


def test_bad_policy_use_is_refused_before_anything_compiles(models):
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("model", target, draft)
  with pytest.raises(TypeError, match="AdaptiveGamma"):
    SpeculativeDecoder(cfg, drafter, policy=(0, 1, 2))
  with pytest.raises(ValueError, match="not gamma=2"):
    SpeculativeDecoder(cfg, drafter, gamma=2, policy=SWITCHING)
  with pytest.raises(ValueError, match="cannot skip steps"):
    SpeculativeDecoder(cfg, JacobiDrafter(cfg.vocab_size), policy=SWITCHING)
  # Without plain steps, a drafter that cannot skip them may still adapt its γ.
  SpeculativeDecoder(cfg, JacobiDrafter(cfg.vocab_size),
                     policy=AdaptiveGamma(gammas=(1, 3), step_costs=(1.1, 1.3)))
  dec = SpeculativeDecoder(cfg, drafter, policy=SWITCHING, eos_ids=())
  with pytest.raises(ValueError, match="adaptive policy"):
    replay_greedy(dec, params, dp, PROMPTS[:1], [[1] * 20], 8)
  assert dec.with_policy(None).gamma == 4  # back to a fixed chain
  assert SpeculativeDecoder(cfg, drafter, policy=WITH_TREES,  # trees: traversal verification
                            verification="block").verification == "block"
  with pytest.raises(ValueError, match="cannot build"):  # Jacobi drafts chains only
    SpeculativeDecoder(cfg, JacobiDrafter(cfg.vocab_size),
                       policy=dataclasses.replace(WITH_TREES, gammas=(1,), step_costs=(1.1,)))


def test_measured_dips_are_pooled_into_non_decreasing_costs():
  from specjax.speculative.calibration import monotone_costs
  assert monotone_costs((0, 1, 2, 3), (1.0, 1.05, 0.99, 1.08)) == pytest.approx(
      (1.0, 1.025, 1.025, 1.08))
  assert monotone_costs((3, 0, 1, 2), (1.2, 1.0, 0.97, 1.3)) == pytest.approx(
      (1.25, 1.0, 1.0, 1.25))  # in the caller's order; below 1 is noise too
  assert monotone_costs((1, 2, 4), (1.1, 1.2, 1.5)) == (1.1, 1.2, 1.5)


def _cache_copies(compiled_text: str, cache) -> int:
  """Copy instructions in an optimized HLO module whose result is a target-cache layer."""
  import re
  layer = "f32[" + ",".join(map(str, cache.k[0].shape)) + "]"
  return sum(1 for m in re.finditer(r"= (\S+?)\{[^}]*\} copy\(", compiled_text)
             if m.group(1) == layer)


def test_the_policy_loop_updates_the_caches_in_place(models):
  """``run`` gives each choice its own inner loop, and XLA keeps the KV caches in place (with
  trees among the choices too); the same loop around ``step`` (a ``lax.switch`` over the
  choices) copies them every step."""
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("model", target, draft)
  dec = SpeculativeDecoder(cfg, drafter, policy=SWITCHING, eos_ids=())
  state, _ = dec.prepare(params, dp, PROMPTS, 16)
  looped = dec.run.lower(dec, params, dp, state).compile().as_text()
  switched = jax.jit(lambda tp, dpp, st: jax.lax.while_loop(
      lambda s: ~jnp.all(s.done), functools.partial(dec.step, tp, dpp), st)).lower(
          params, dp, state).compile().as_text()
  assert _cache_copies(looped, state.target_cache) == 0
  assert _cache_copies(switched, state.target_cache) > 0
  trees = dec.with_policy(WITH_TREES)  # tree steps compact the cache, in place too
  state, _ = trees.prepare(params, dp, PROMPTS, 16)
  assert _cache_copies(trees.run.lower(trees, params, dp, state).compile().as_text(),
                       state.target_cache) == 0
