"""Plain generation: batching, EOS, budgets, input validation and the no-recompile guard."""

import dataclasses

import numpy as np
import pytest

from specjax.generate import _decode, _prefill, generate
from specjax.testing import tiny_model

CACHE = 64


@pytest.fixture(scope="module")
def model():
  return tiny_model(seed=0)


def _prompt(cfg, length, seed):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, length).tolist()


def test_batched_greedy_equals_each_row_alone(model):
  cfg, params = model
  prompts = [_prompt(cfg, n, seed) for seed, n in enumerate((3, 11, 1))]
  batch = generate(params, cfg, prompts, 12, cache_size=CACHE, eos_ids=())
  for i, p in enumerate(prompts):
    alone = generate(params, cfg, [p], 12, cache_size=CACHE, eos_ids=())
    assert batch.generated(i) == alone.generated(0)
    assert batch.tokens[i, :len(p)].tolist() == p
  np.testing.assert_array_equal(batch.num_generated, [12, 12, 12])


def test_wall_time_splits_into_prefill_and_decode_loop(model):
  cfg, params = model
  out = generate(params, cfg, [_prompt(cfg, 30, 5)], 6, cache_size=CACHE, eos_ids=())
  assert 0 < out.prefill_seconds < out.seconds and out.steps == 6


def test_eos_stops_its_row_right_after_it_while_others_continue(model):
  cfg, params = model
  prompts = [_prompt(cfg, 4, 10), _prompt(cfg, 7, 11)]
  free = generate(params, cfg, prompts, 16, cache_size=CACHE, eos_ids=())
  row0, row1 = free.generated(0), free.generated(1)
  # The first step k >= 2 whose token is new in row 0 and absent from row 1.
  k = next(k for k in range(2, 16) if row0[k] not in row0[:k] and row0[k] not in row1)
  out = generate(params, cfg, prompts, 16, cache_size=CACHE, eos_ids=(row0[k],))
  assert out.generated(0) == row0[:k + 1]  # the EOS token itself is kept
  assert out.generated(1) == row1
  np.testing.assert_array_equal(out.seq_lens, [4 + k + 1, 7 + 16])


def test_default_eos_comes_from_the_config(model):
  cfg, params = model
  prompt = _prompt(cfg, 5, 12)
  first = generate(params, cfg, [prompt], 1, cache_size=CACHE, eos_ids=()).generated(0)[0]
  out = generate(params, dataclasses.replace(cfg, eos_token_ids=(first,)), [prompt], 8,
                 cache_size=CACHE)
  assert out.generated(0) == [first]


def test_zero_new_tokens_returns_the_prompt_unchanged(model):
  cfg, params = model
  prompts = [_prompt(cfg, 6, 13), _prompt(cfg, 2, 14)]
  out = generate(params, cfg, prompts, 0, cache_size=CACHE)
  np.testing.assert_array_equal(out.seq_lens, out.prompt_lens)
  assert out.steps == 0
  for i, p in enumerate(prompts):
    assert out.tokens[i, :len(p)].tolist() == p
    assert out.generated(i) == []


def _compiled() -> int:
  return _prefill._cache_size() + _decode._cache_size()


def test_no_recompilation_across_prompt_lengths_and_budgets(model):
  cfg, params = model
  generate(params, cfg, [_prompt(cfg, 3, 0), _prompt(cfg, 2, 1)], 4, cache_size=CACHE)  # warm-up
  compiled = _compiled()
  for i, (n0, n1, budget) in enumerate([(1, 5, 4), (17, 40, 8), (40, 1, 2), (5, 17, 0)]):
    generate(params, cfg, [_prompt(cfg, n0, 2 * i), _prompt(cfg, n1, 2 * i + 1)], budget,
             cache_size=CACHE)
  assert _compiled() == compiled


@pytest.mark.parametrize("prompts, max_new, match", [
    ([[1, 2], []], 4, "prompt 1 is empty"),
    ([[1] * 60, [2]], 5, "prompt 0 has 60 tokens.*needs 65 cache slots but the cache has 64"),
    ([[1, 2]], -1, "max_new_tokens must be >= 0"),
    ([[1, 64]], 4, r"prompt 0 has token ids outside \[0, 64\)"),
    ([[3], [-1, 2]], 4, r"prompt 1 has token ids outside \[0, 64\)"),
    ([], 4, "no prompts"),
    ([1, 2, 3], 4, "must be a batch"),
])
def test_bad_input_raises_before_compiling(model, prompts, max_new, match):
  cfg, params = model
  compiled = _compiled()
  with pytest.raises(ValueError, match=match):
    generate(params, cfg, prompts, max_new, cache_size=CACHE)
  assert _compiled() == compiled


def test_cache_beyond_a_sliding_window_is_refused():
  cfg, params = tiny_model(sliding_window=32)
  with pytest.raises(ValueError, match="sliding-window"):
    generate(params, cfg, [[1, 2]], 8, cache_size=64)


def test_non_integer_token_ids_are_refused():
  cfg, params = tiny_model()
  with pytest.raises(ValueError, match="integer"):
    generate(params, cfg, [[1.5, 2.0]], 4)
