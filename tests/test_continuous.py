"""Continuous batching (``speculative.continuous``): every request's greedy tokens are plain
decoding's, sampled requests follow the target's law (a slot keeping its old cache is
rejected), slots refill so a queue takes fewer steps than fixed batches, one program serves
different queues, and bad input is refused before compiling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import LookaheadDrafter, ModelDrafter
from specjax.generate import generate
from specjax.sampling import Sampling
from specjax.speculative import SpeculativeDecoder
from specjax.speculative import continuous
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.speculative.drafter import Drafter
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.testing import (chi_square_pvalue, exact_joint, make_drafter, tiny_model)

from matrix import cases

CORPUS = [[1, 2, 5, 3, 3, 7, 1, 2, 5, 0], [4, 4, 1, 2, 6]]


@pytest.fixture(scope="module")
def models():
  return tiny_model(0), tiny_model(1, num_layers=1)


def _requests(seed=0, n=7, vocab=64):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, vocab, int(rng.integers(1, 20))).tolist() for _ in range(n)]
  return prompts, [int(b) for b in rng.integers(1, 30, n)]


def _decoder(kind, models, eos_ids=()):
  (cfg, params), (dcfg, dparams) = models
  if kind == "model_chain":
    d = ModelDrafter(dcfg)
    return SpeculativeDecoder(cfg, d, gamma=3, eos_ids=eos_ids), d.make_params(dparams)
  if kind == "model_adaptive":  # plain steps (γ = 0) and chains, switching
    d = ModelDrafter(dcfg)
    policy = AdaptiveGamma(gammas=(0, 1, 2, 4), step_costs=(1.0, 1.2, 1.3, 1.5),
                           prior_alpha=0.6, decay=0.7)
    return SpeculativeDecoder(cfg, d, policy=policy, eos_ids=eos_ids), d.make_params(dparams)
  if kind == "model_adaptive_trees":  # plain steps, a chain, a static tree (depth 2) and a
    # dynamic tree (depth 3), switching: at these costs it takes all four on these requests
    d = ModelDrafter(dcfg)
    policy = AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1.2),
                           trees=(TreeTopology.from_choices([(0,), (1,), (0, 0), (0, 1)]),
                                  DynamicTree(top_k=2, depth=3, num_nodes=4)),
                           tree_costs=(1.28, 1.32), prior_alpha=0.7, decay=0.7,
                           rank_accept=((0.55, 0.1, 0.04), (0.5, 0.1, 0.0), (0.6, 0.1, 0.0)))
    return SpeculativeDecoder(cfg, d, policy=policy, eos_ids=eos_ids), d.make_params(dparams)
  if kind == "adapter_exit_adaptive":  # plain steps the adapter catches up on, and chains
    drafter, dp = make_drafter("adapter_exit", cfg, params, CORPUS)
    policy = AdaptiveGamma(gammas=(0, 1, 2, 4), step_costs=(1.0, 1.4, 1.6, 1.9),
                           prior_alpha=0.5, decay=0.7)  # costs at which it mixes all four
    return SpeculativeDecoder(cfg, drafter, policy=policy, eos_ids=eos_ids), dp
  if kind == "lookahead":
    return SpeculativeDecoder(cfg, LookaheadDrafter(cfg.vocab_size, window=3, ngram=3,
                                                    guesses=2), eos_ids=eos_ids), ()
  drafter, dp = make_drafter(kind.removesuffix("_tree"), cfg, params, CORPUS)
  tree = (DynamicTree(top_k=3, depth=3, num_nodes=6) if kind in ("eagle", "adapter_exit_tree")
          else None)
  gamma = 2 if kind in ("early_exit", "bigram") else None
  return SpeculativeDecoder(cfg, drafter, gamma=gamma, tree=tree, eos_ids=eos_ids), dp


KINDS = ["model_chain", "model_adaptive", "model_adaptive_trees", "eagle", "medusa", "early_exit",
         "adapter_exit", "adapter_exit_tree", "adapter_exit_adaptive", "lookahead", "bigram"]


@pytest.mark.parametrize("kind", cases(KINDS, keep=("model_chain", "model_adaptive_trees", "eagle",
                                                   "adapter_exit_tree", "lookahead")))
def test_every_request_gets_plain_greedy_tokens(models, kind):
  """Prompts (1 to 19 tokens, prefilled 4 at a time between the other slots' steps) and
  budgets of different lengths over 3 slots: each request's tokens are plain greedy
  decoding's of that prompt alone (EAGLE's dynamic tree, Medusa's tree, early exit sharing
  the target cache with a chain or a dynamic tree, lookahead reading the target's
  predictions and an adaptive policy's plain steps, chains and trees included), and its
  drafter starts where a batch-1 run's does: the same drafts are accepted in the same
  number of target calls (EAGLE and Medusa read the features of every chunk). Not under the adaptive policy, whose one γ per step follows all
  decoding slots' acceptance, so a request's steps depend on its neighbours."""
  (cfg, params), _ = models
  dec, dp = _decoder(kind, models)
  prompts, budgets = _requests()
  res = continuous.serve(dec, params, dp, prompts, budgets, slots=3, prefill_chunk=4)
  for i, p in enumerate(prompts):
    ref = generate(params, cfg, [p], budgets[i], eos_ids=())
    assert res.generated(i) == ref.generated(0), (kind, i)
    if dec.policy is not None:  # (its plain steps and drafts are checked below)
      continue
    alone = dec.generate(params, dp, [p], budgets[i]).per_row
    assert [res.per_row[k][i] for k in ("target_calls", "accepted")] == \
        [alone[k][0] for k in ("target_calls", "accepted")], (kind, i)
  if dec.policy is not None:  # the policy did switch, and took plain steps where claimed
    taken = np.asarray(res.per_row["depth_hist"]).sum(0)  # steps by depth, 0 = plain
    assert taken[0] > 0 and np.count_nonzero(taken) > 2, (kind, taken)
    if kind == "model_adaptive_trees":  # the dynamic tree is the only depth-3 choice
      assert np.all(taken > 0), taken
  assert res.per_row["emitted"].tolist() == budgets
  assert np.all(res.finished_at > res.prefilled_at) and np.all(res.prefilled_at >= res.admitted_at)


def test_slots_price_a_policys_steps_for_the_rows_mean(models):
  """Continuous batching drops the policy's slowest-row pricing (no row waits for another);
  everything else about the decoder stays."""
  dec, _ = _decoder("model_adaptive", models)
  spread = dec.with_policy(dataclasses.replace(dec.policy, prompt_ease=(0.5, 1.5)))
  slots = continuous.slot_decoder(spread)
  assert slots.policy == dataclasses.replace(spread.policy, prompt_ease=())
  assert slots.with_policy(spread.policy) == spread
  assert continuous.slot_decoder(dec) is dec


def test_a_long_prompt_prefills_between_the_other_slots_steps(models):
  """A 2-token request decodes for 60 tokens while a 30-token prompt is admitted beside it:
  the other slot takes one step after each of its 8 chunks of 4 tokens but the last; with
  interleaving off it takes none (the whole prompt is prefilled before the next step). A
  one-token prompt admitted next has nothing to prefill and decodes at once."""
  (cfg, params), _ = models
  dec, dp = _decoder("model_chain", models)
  prompts = [[3, 4], list(range(1, 31)), [7]]
  res = continuous.serve(dec, params, dp, prompts, [60, 5, 6], slots=2, prefill_chunk=4)
  assert (res.prefilled_at - res.admitted_at).tolist() == [0, 7, 0]
  for i in (1, 2):
    assert res.generated(i) == generate(params, cfg, [prompts[i]], [5, 6][i - 1],
                                        eos_ids=()).generated(0)
  whole = continuous.serve(dec, params, dp, prompts, [60, 5, 6], slots=2, prefill_chunk=4,
                           interleave_prefill=False)
  assert (whole.prefilled_at - whole.admitted_at).tolist() == [0, 0, 0]
  assert [whole.generated(i) for i in (1, 2)] == [res.generated(i) for i in (1, 2)]


def test_requests_stop_at_eos_and_free_their_slot(models):
  (cfg, params), _ = models
  prompts, budgets = _requests(seed=1)
  free = [generate(params, cfg, [p], b, eos_ids=()).generated(0)
          for p, b in zip(prompts, budgets)]
  eos = max(set(sum(free, [])), key=lambda t: sum(t in f[:-1] for f in free))  # stops several
  dec, dp = _decoder("model_chain", models, eos_ids=(eos,))
  res = continuous.serve(dec, params, dp, prompts, budgets, slots=2, interleave_prefill=False)
  stopped = 0
  for i, p in enumerate(prompts):
    ref = generate(params, cfg, [p], budgets[i], eos_ids=(eos,)).generated(0)
    assert res.generated(i) == ref
    stopped += len(ref) < budgets[i]
  assert stopped >= 2


@pytest.mark.parametrize("interleave", cases([True, False], keep=("True",)))
def test_slots_refill_so_a_queue_takes_fewer_steps_than_fixed_batches(models, interleave):
  """Short and long requests alternating: a fixed batch of 2 waits for its long row, a
  freed slot takes the next request at once (prefilled between steps or before them)."""
  (_, params), _ = models
  dec, dp = _decoder("model_chain", models)
  prompts = [[i + 1, 2 * i + 3] for i in range(8)]
  budgets = [40 if i % 2 else 3 for i in range(8)]
  res = continuous.serve(dec, params, dp, prompts, budgets, slots=2,
                         interleave_prefill=interleave)
  fixed = 0
  for i in range(0, 8, 2):
    ids = slice(i, i + 2)
    fixed += max(dec.generate(params, dp, prompts[ids], b).steps for b in budgets[ids])
  assert res.steps < 0.8 * fixed, (res.steps, fixed)
  assert res.per_row["emitted"].tolist() == budgets


def test_one_program_serves_different_queues(models):
  (_, params), _ = models
  dec, dp = _decoder("eagle", models)
  count = continuous.serve_loop._cache_size
  continuous.serve(dec, params, dp, *_requests(0, 5), slots=2, cache_size=64)
  before = count()
  continuous.serve(dec, params, dp, *_requests(1, 9), slots=2, cache_size=64, seed=3)
  continuous.serve(dec, params, dp, [[5]], [1], slots=2, cache_size=64)
  assert count() == before


V, N, PROMPT = 8, 20_000, [1, 2, 5]


def _sampled_joint(slots=64):
  target = tiny_model(seed=0, vocab_size=V, scale=1.0)
  dcfg, dparams = tiny_model(seed=1, vocab_size=V, scale=1.0, num_layers=1)
  sampler = Sampling(temperature=0.9, top_k=6)
  dec = SpeculativeDecoder(target[0], ModelDrafter(dcfg), gamma=2, sampler=sampler, eos_ids=())
  res = continuous.serve(dec, target[1], dec.drafter.make_params(dparams), [PROMPT] * N, 2,
                         slots=slots, cache_size=16)
  gen = res.tokens[:, len(PROMPT):len(PROMPT) + 2]
  counts = np.bincount(gen[:, 0] * V + gen[:, 1], minlength=V * V).reshape(V, V)
  return counts, exact_joint(*target, sampler, PROMPT)


def test_sampled_requests_follow_the_target_law():
  counts, exact = _sampled_joint()
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / N - exact).sum() < 0.03


def test_a_slot_that_keeps_its_old_cache_is_rejected(monkeypatch):
  """The known-wrong variant: admission leaves the slot's target cache as it was (the last
  request's keys and length, or the empty dummy's), and the same test fails."""
  put = continuous._put_row
  monkeypatch.setattr(continuous, "_put_row",
                      lambda tree, row, b, what: tree if what == "target_cache"
                      else put(tree, row, b, what))
  continuous.serve_loop.clear_cache()  # the right program, compiled for these shapes
  try:
    counts, exact = _sampled_joint()
  finally:
    continuous.serve_loop.clear_cache()  # the wrong one
  assert 0.5 * np.abs(counts / N - exact).sum() > 0.1  # 0.98 when measured; right: < 0.03


@dataclasses.dataclass(frozen=True)
class _SharedTableDrafter(Drafter):
  """A drafter whose state has a leaf that is not per row."""
  vocab_size: int

  def init(self, draft_params, tokens, prompt_lens, features=None):
    return {"table": jnp.zeros((5,), jnp.int32)}

  def propose_chain(self, draft_params, state, tokens, seq_lens, key, sampler, gamma):
    last = jnp.take_along_axis(tokens, (seq_lens - 1)[:, None], axis=1)
    drafts = jnp.repeat(last, gamma, axis=1)
    return drafts, jax.nn.one_hot(drafts, self.vocab_size), state


def test_bad_input_is_refused_before_compiling(models):
  (cfg, params), _ = models
  dec, dp = _decoder("model_chain", models)
  prompts, budgets = _requests(n=3)
  before = continuous.serve_loop._cache_size()
  with pytest.raises(ValueError, match="slots must be >= 1"):
    continuous.serve(dec, params, dp, prompts, budgets, slots=0)
  with pytest.raises(ValueError, match="2 budgets for 3 prompts"):
    continuous.serve(dec, params, dp, prompts, budgets[:2], slots=2)
  with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be >= 0"):
    continuous.serve(dec, params, dp, prompts, [3, -1, 2], slots=2)
  with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
    continuous.serve(dec, params, dp, prompts, budgets, slots=2, prefill_chunk=0)
  with pytest.raises(ValueError, match="no prompts"):
    continuous.serve(dec, params, dp, [], 4, slots=2)
  with pytest.raises(ValueError, match="token ids outside"):
    continuous.serve(dec, params, dp, [[1, 999]], 4, slots=2)
  with pytest.raises(ValueError, match="cache slots"):
    continuous.serve(dec, params, dp, prompts, 200, slots=2, cache_size=64)
  assert continuous.serve_loop._cache_size() == before
  shared = SpeculativeDecoder(cfg, _SharedTableDrafter(cfg.vocab_size), gamma=2)
  with pytest.raises(ValueError, match=r"\['table'\] has shape \(5,\).*per row"):
    continuous.serve(shared, params, (), prompts, budgets, slots=2)
