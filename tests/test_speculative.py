"""The speculative loop on tiny models: greedy equality, batching, EOS, cache limits, metrics."""

import dataclasses

import numpy as np
import pytest

import specjax
from specjax.drafters import ModelDrafter
from specjax.sampling import Greedy, Sampling, make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.decoder import prefill_models
from specjax.testing import new_compiles_across_batches, tiny_model

from matrix import grid

PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11, 12, 13], [3]]


def _decoder(target_cfg, draft_cfg, gamma, sampler=Greedy(), eos_ids=()):
  drafter = ModelDrafter(draft_cfg)
  return SpeculativeDecoder(target_cfg, drafter, gamma=gamma, sampler=sampler, eos_ids=eos_ids)


@pytest.mark.parametrize("which, gamma", grid(["random_draft", "target_as_draft"], [1, 3, 6],
                                              keep=("random_draft-1", "random_draft-3",
                                                    "target_as_draft-6")))
def test_greedy_equals_plain_greedy_decoding(target, draft, gamma, which):
  cfg, params = target
  dcfg, dparams = draft if which == "random_draft" else target
  ref = specjax.generate(params, cfg, PROMPTS, 24, eos_ids=())
  dec = _decoder(cfg, dcfg, gamma)
  out = dec.generate(params, dec.drafter.make_params(dparams), PROMPTS, 24)
  for row in range(len(PROMPTS)):
    assert out.generated(row) == ref.generated(row)
  if which == "target_as_draft":
    assert out.metrics()["acceptance_rate"] == 1.0


def test_batch_rows_equal_each_row_alone(target, draft):
  cfg, params = target
  dec = _decoder(cfg, draft[0], 3)
  dp = dec.drafter.make_params(draft[1])
  batch = dec.generate(params, dp, PROMPTS, 20, cache_size=64)
  for row, prompt in enumerate(PROMPTS):
    alone = dec.generate(params, dp, [prompt], 20, cache_size=64)
    assert alone.generated(0) == batch.generated(row)


def test_target_as_draft_has_alpha_one_when_sampling(target):
  cfg, params = target
  dec = _decoder(cfg, cfg, 4, Sampling(temperature=1.0))
  out = dec.generate(params, dec.drafter.make_params(params), PROMPTS, 24, seed=3)
  m = out.metrics()
  assert m["alpha"] == pytest.approx(1.0, abs=1e-5)
  assert m["acceptance_rate"] > 0.99


def test_the_drafter_draws_from_the_draft_sampler(target):
  """Target as draft: its own law gives α = 1; a sharper draft law (or point masses) gives
  α = E[Σ min(p, q)] < 1, so the drafter drew from ``draft_sampler``, not the target's."""
  cfg, params = target
  sampler = Sampling(temperature=1.0)
  alphas = {}
  for name, ds in [("own", None), ("same", Sampling(temperature=1.0)),
                   ("sharp", Sampling(temperature=0.5)), ("greedy", Greedy())]:
    dec = SpeculativeDecoder(cfg, ModelDrafter(cfg), gamma=3, sampler=sampler,
                             draft_sampler=ds, eos_ids=())
    assert dec.proposal_sampler == (sampler if ds is None else ds)
    out = dec.generate(params, dec.drafter.make_params(params), PROMPTS, 24, seed=3)
    alphas[name] = out.metrics()["alpha"]
  assert alphas["own"] == pytest.approx(1.0, abs=1e-5)
  assert alphas["same"] == pytest.approx(1.0, abs=1e-5)
  assert alphas["sharp"] < 0.99 and alphas["greedy"] < 0.99


def test_eos_inside_accepted_block_stops_the_row(target):
  cfg, params = target
  ref = specjax.generate(params, cfg, PROMPTS[:2], 24, eos_ids=())
  eos = ref.generated(0)[5]  # the 6th greedy token of row 0 becomes EOS
  expected = specjax.generate(params, cfg, PROMPTS[:2], 24, eos_ids=(eos,))
  dec = _decoder(cfg, cfg, 4, eos_ids=(eos,))  # target-as-draft: EOS lands mid-block
  out = dec.generate(params, dec.drafter.make_params(params), PROMPTS[:2], 24)
  for row in range(2):
    assert out.generated(row) == expected.generated(row)
  assert out.generated(0)[-1] == eos and len(out.generated(0)) <= 6


def test_cache_that_fills_exactly(target, draft):
  cfg, params = target
  gamma, new = 3, 10
  dec = _decoder(cfg, draft[0], gamma)
  dp = dec.drafter.make_params(draft[1])
  size = len(PROMPTS[2]) + new + gamma
  out = dec.generate(params, dp, [PROMPTS[2]], new, cache_size=size)
  ref = specjax.generate(params, cfg, [PROMPTS[2]], new, eos_ids=())
  assert out.generated(0) == ref.generated(0)
  with pytest.raises(ValueError, match="cache"):
    dec.generate(params, dp, [PROMPTS[2]], new, cache_size=size - 1)


def test_no_recompilation_across_prompts_and_acceptance_patterns(target, draft):
  cfg, params = target
  dec = _decoder(cfg, draft[0], 2, Sampling(temperature=1.0))
  assert new_compiles_across_batches(dec, params, dec.drafter.make_params(draft[1])) == 0
  sharp = dataclasses.replace(dec, draft_sampler=Sampling(temperature=0.5))
  assert new_compiles_across_batches(sharp, params, dec.drafter.make_params(draft[1])) == 0


def test_one_prefill_program_serves_every_gamma_and_sampler(target, draft):
  """The prefill is keyed by the target and drafter only: a γ sweep compiles it once."""
  cfg, params = target
  prompts = [[3, 1, 4, 1, 5], [9, 2]]
  dp = ModelDrafter(draft[0]).make_params(draft[1])
  _decoder(cfg, draft[0], 1).generate(params, dp, prompts, 4, cache_size=40)
  before = prefill_models._cache_size()
  for gamma, sampler in [(2, Greedy()), (5, Sampling(temperature=0.7)), (3, make_sampler(1.0))]:
    out = _decoder(cfg, draft[0], gamma, sampler).generate(params, dp, prompts, 4,
                                                           cache_size=40)
    assert out.num_generated.tolist() == [4, 4]
  assert prefill_models._cache_size() == before
  _decoder(cfg, draft[0], 2).generate(params, dp, prompts, 4, cache_size=48)  # a new shape
  assert prefill_models._cache_size() == before + 1


def test_stream_twin_matches_fused_loop(target, draft):
  cfg, params = target
  dec = _decoder(cfg, draft[0], 3, Sampling(temperature=0.8, top_k=5))
  dp = dec.drafter.make_params(draft[1])
  fused = dec.generate(params, dp, PROMPTS, 16, seed=7)
  for state, timing in dec.stream(params, dp, PROMPTS, 16, seed=7):
    assert set(timing) == {"draft", "verify", "other"}
  np.testing.assert_array_equal(np.asarray(state.tokens), fused.tokens)
  np.testing.assert_array_equal(np.asarray(state.counters.emitted), fused.per_row["emitted"])
  profiled = dec.generate(params, dp, PROMPTS, 16, seed=7, profile=True)
  np.testing.assert_array_equal(profiled.tokens, fused.tokens)
  m = profiled.metrics()
  assert 0 < m["draft_seconds"] + m["verify_seconds"] + m["other_seconds"] <= m["seconds"]
  assert profiled.prefill_seconds is None  # the fused loop's split only
  assert 0 < fused.metrics()["prefill_seconds"] < fused.seconds


def test_metrics_are_consistent(target, draft):
  cfg, params = target
  gamma = 4
  dec = _decoder(cfg, draft[0], gamma, Sampling(temperature=1.0))
  out = dec.generate(params, dec.drafter.make_params(draft[1]), PROMPTS, 20, seed=1)
  r = out.per_row
  np.testing.assert_array_equal(r["emitted"], out.num_generated)
  np.testing.assert_array_equal(r["accept_len_hist"].sum(axis=1), r["target_calls"])
  np.testing.assert_array_equal(r["drafted"], gamma * r["target_calls"])
  np.testing.assert_array_equal(r["accept_len_hist"] @ np.arange(gamma + 1), r["accepted"])
  np.testing.assert_array_equal(r["accepted_at"].sum(axis=1), r["accepted"])
  # Without EOS, only the last step of a row can be trimmed by the budget.
  assert np.all(r["emitted"] <= r["accepted"] + r["target_calls"])
  assert np.all(r["emitted"] > r["accepted"] + r["target_calls"] - gamma - 1)
  assert out.steps == r["target_calls"].max()


def test_extreme_logits_produce_no_nan(draft):
  cfg, params = tiny_model(seed=4, scale=30.0)
  dec = _decoder(cfg, draft[0], 3, Sampling(temperature=0.5, top_p=0.9))
  out = dec.generate(params, dec.drafter.make_params(draft[1]), PROMPTS, 12)
  m = out.metrics()
  assert np.isfinite(m["alpha"])
  assert np.all((out.tokens >= 0) & (out.tokens < cfg.vocab_size))
  assert np.all(out.num_generated == 12)


def test_top_k_one_sampling_equals_greedy(target, draft):
  cfg, params = target
  dec = _decoder(cfg, draft[0], 3, Sampling(temperature=1.3, top_k=1))
  out = dec.generate(params, dec.drafter.make_params(draft[1]), PROMPTS, 16, seed=5)
  ref = specjax.generate(params, cfg, PROMPTS, 16, eos_ids=())
  for row in range(len(PROMPTS)):
    assert out.generated(row) == ref.generated(row)


def test_bad_input_raises_before_compilation(target, draft):
  cfg, params = target
  with pytest.raises(ValueError, match="gamma"):
    _decoder(cfg, draft[0], 0)
  other_vocab = tiny_model(seed=2, vocab_size=cfg.vocab_size + 1)[0]
  with pytest.raises(ValueError, match="vocabulary"):
    _decoder(cfg, other_vocab, 2)
  with pytest.raises(ValueError, match="temperature"):
    make_sampler(temperature=-0.1)
  with pytest.raises(ValueError, match="top_p"):
    make_sampler(temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match="top_k"):
    make_sampler(temperature=1.0, top_k=0)
  dec = _decoder(cfg, draft[0], 4)
  dp = dec.drafter.make_params(draft[1])
  with pytest.raises(ValueError, match="empty"):
    dec.generate(params, dp, [[1], []], 4)
  with pytest.raises(ValueError, match="max_new_tokens"):
    dec.generate(params, dp, [[1]], -1)
  with pytest.raises(ValueError, match="headroom"):
    dec.generate(params, dp, [[1] * 10], 50, cache_size=62)


def test_a_drafters_default_tree_is_used_without_gamma_or_tree(target):
  """``Drafter.default_tree``: taken when neither gamma nor tree is given; gamma still wins."""
  import dataclasses
  from specjax.drafters import PromptLookupDrafter
  from specjax.speculative import TreeTopology

  @dataclasses.dataclass(frozen=True)
  class TwoBranches(PromptLookupDrafter):
    def default_tree(self):
      return TreeTopology((-1, -1, 0))

  cfg, _ = target
  d = TwoBranches(cfg.vocab_size)
  assert SpeculativeDecoder(cfg, d).tree == TreeTopology((-1, -1, 0))
  assert SpeculativeDecoder(cfg, d, gamma=3).tree == TreeTopology.chain(3)
  assert SpeculativeDecoder(cfg, PromptLookupDrafter(cfg.vocab_size)).tree == TreeTopology.chain(4)
