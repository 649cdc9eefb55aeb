"""Adaptive γ (``speculative.adaptive``): the policy's arithmetic, lossless switching inside the
loop (greedy equality, the exact law, a peeking policy rejected), drafters catching up after
skipped steps, no recompilation, the measured costs and bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache as kvc
from specjax import theory
from specjax.drafters import JacobiDrafter, ModelDrafter
from specjax.generate import prefill
from specjax.sampling import Greedy, Sampling
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma, PolicyState
from specjax.speculative.calibration import calibrate, measure_step_costs
from specjax.speculative.replay import replay_greedy
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint, make_drafter,
                             new_compiles_across_batches, tiny_model)

PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11, 12, 13], [3]]
CORPUS = [[1, 2, 5, 3, 3, 7, 1, 2, 5, 0], [4, 4, 1, 2, 6]]
# Cheap drafts and a quickly forgetting estimate: on the tiny random models this policy
# moves between plain steps and several draft lengths within a few dozen tokens.
SWITCHING = AdaptiveGamma(gammas=(0, 1, 2, 4), step_costs=(1.0, 1.2, 1.3, 1.5),
                          prior_alpha=0.6, decay=0.7)


def _state(policy, successes, failures):
  return PolicyState(successes=jnp.asarray(successes, jnp.float32),
                     failures=jnp.asarray(failures, jnp.float32))


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
  assert policy.gammas[int(policy.choose(_state(policy, [0.1], [1.9]), on))] == 1


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.35, 0.5, 0.62, 0.8, 0.95, 0.999])
def test_choice_is_the_calibrated_theory_argmax(alpha):
  curve = theory.VerifyCostCurve({1: 1.0, 2: 1.08, 3: 1.2, 5: 1.6})
  c = 0.07
  policy = AdaptiveGamma.from_theory((0, 1, 2, 3, 4), c, curve, prior_weight=1e-6)
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


def test_plain_steps_return_the_estimate_to_the_prior_so_drafting_is_tried_again():
  policy = AdaptiveGamma(gammas=(0, 2), step_costs=(1.0, 1.3), prior_alpha=0.6, decay=0.9)
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


def test_policy_sorts_its_set_and_builds_costs_from_theory():
  policy = AdaptiveGamma(gammas=(4, 0, 2), step_costs=(1.5, 1.0, 1.2))
  assert policy.gammas == (0, 2, 4) and policy.step_costs == (1.0, 1.2, 1.5)
  assert policy.max_gamma == 4 and policy.plain
  th = AdaptiveGamma.from_theory((0, 1, 3), 0.1, {1: 1.0, 2: 1.1, 4: 1.5})
  assert th.step_costs == pytest.approx((1.0, 0.1 + 1.1, 0.3 + 1.5))


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


@pytest.mark.parametrize("kind", ["model", "eagle", "prompt_lookup", "bigram", "early_exit"])
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


def test_fixed_topologies_count_every_step_at_their_depth(models):
  target, draft = models
  cfg, params = target
  drafter, dp = _drafter("model", target, draft)
  out = SpeculativeDecoder(cfg, drafter, gamma=3, eos_ids=()).generate(params, dp, PROMPTS, 12)
  hist = out.per_row["depth_hist"]
  np.testing.assert_array_equal(hist[:, 3], out.per_row["target_calls"])
  assert hist[:, :3].sum() == 0


def test_one_compiled_loop_serves_every_batch(models):
  target, draft = models
  drafter, dp = _drafter("eagle", target, draft)
  dec = SpeculativeDecoder(target[0], drafter, policy=SWITCHING, sampler=Sampling(1.0))
  assert new_compiles_across_batches(dec, target[1], dp) == 0


# Two policies whose first step drafts γ = 3 (prior α = 0.9) and whose second, for rows that
# rejected the first draft (α̂ = 0.18), is a plain step or a γ = 1 chain.
THEN_PLAIN = AdaptiveGamma(gammas=(0, 1, 3), step_costs=(1.0, 1.3, 1.6), prior_alpha=0.9,
                           prior_weight=0.25)
THEN_ONE = dataclasses.replace(THEN_PLAIN, step_costs=(1.0, 1.05, 1.6))
V, ROWS, PROMPT = 8, 100_000, [1, 2, 5]


@pytest.fixture(scope="module")
def small_models():
  return (tiny_model(seed=0, vocab_size=V, scale=1.0),
          tiny_model(seed=1, vocab_size=V, scale=1.0, num_layers=1))


@pytest.mark.parametrize("policy,second,sampler", [
    (THEN_PLAIN, 0, Sampling(temperature=1.0)),
    (THEN_ONE, 1, Sampling(temperature=0.8, top_k=5)),
], ids=["3-then-plain-t1", "3-then-1-topk5"])
def test_a_switching_policy_samples_the_exact_joint(small_models, policy, second, sampler):
  target, (dcfg, dparams) = small_models
  dec = SpeculativeDecoder(target[0], ModelDrafter(dcfg), policy=policy, sampler=sampler,
                           eos_ids=())
  counts, steps_at = _joint_and_steps(dec, target, {"model": dparams})
  assert steps_at[3] == ROWS and steps_at[second] > 0.1 * ROWS, steps_at  # both were taken
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
  out = dec.generate(params, dp, [PROMPT] * ROWS, 2, cache_size=len(PROMPT) + 2 + dec.gamma)
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
  np.testing.assert_allclose(qa, qb, atol=1e-5)


# --- 4. measured costs and bad input ------------------------------------------------------------


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
  """``run`` gives each choice its own inner loop, and XLA keeps the KV caches in place; the
  same loop around ``step`` (a ``lax.switch`` over the choices) copies them every step."""
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
