"""Greedy replay reproduces greedy speculative runs exactly, for every drafter and tree kind."""

import jax
import numpy as np
import pytest

import specjax
from specjax.drafters import ModelDrafter
from specjax.sampling import Sampling
from specjax.speculative import DynamicTree, SpeculativeDecoder, TreeTopology
from specjax.speculative.replay import replay_greedy
from specjax.testing import DRAFTER_KINDS, make_drafter, tiny_model

from matrix import cases

PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [7, 8, 9, 10, 7, 8, 9, 10, 7]]
BUDGET = 14
CHAIN, TREE = TreeTopology.chain(3), TreeTopology((-1, -1, 0, 0, 1, 2))
ROOT_BRANCHES = TreeTopology((-1, -1, 0, 1))  # two chains: what prompt lookup builds
DYNAMIC = DynamicTree(top_k=2, depth=3, num_nodes=5)


@pytest.fixture(scope="module")
def target():
  cfg, params = tiny_model(seed=0)
  corpus = specjax.generate(params, cfg, PROMPTS, 16, eos_ids=(), sampler=Sampling())
  return cfg, params, [corpus.generated(i) for i in range(len(PROMPTS))]


def _noisy_self_draft(cfg, params):
  """The target with noisy weights: accepts some drafts, rejects others."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(3), len(leaves))
  noisy = [l + 0.1 * jax.random.normal(k, l.shape, l.dtype) * np.std(l) if l.ndim > 1 else l
           for l, k in zip(leaves, keys)]
  drafter = ModelDrafter(cfg)
  return drafter, drafter.make_params(jax.tree.unflatten(tree, noisy))


def _drafter(kind, cfg, params, corpus):
  if kind == "noisy_self":
    return _noisy_self_draft(cfg, params)
  return make_drafter(kind, cfg, params, corpus)


def _continuations(cfg, params, extra):
  plain = specjax.generate(params, cfg, PROMPTS, BUDGET + extra, eos_ids=(), cache_size=CACHE)
  return [plain.generated(i) for i in range(len(PROMPTS))]


# Every kind replays a chain; a tree kind each that exercises another path (a static tree
# drafted by depth, EAGLE's per-row dynamic parents with features, root branches, the
# exits' trees in the target's own cache).
SHAPES = {"noisy_self": (CHAIN, TREE), "eagle": (CHAIN, DYNAMIC),
          "prompt_lookup": (CHAIN, ROOT_BRANCHES), "trained_exit": (CHAIN, TREE),
          "adapter_exit": (CHAIN, DYNAMIC)}
CACHE = 64  # one cache size for every call, so the programs are shared across budgets


@pytest.mark.parametrize("kind", cases(("noisy_self",) + DRAFTER_KINDS,
                                       keep=("noisy_self", "early_exit", "eagle", "medusa")))
def test_replay_equals_the_greedy_run_token_for_token_and_counter_for_counter(target, kind):
  cfg, params, corpus = target
  drafter, dp = _drafter(kind, cfg, params, corpus)
  for shape in SHAPES.get(kind, (CHAIN,)):
    dec = SpeculativeDecoder(cfg, drafter, tree=shape, eos_ids=())
    real = dec.generate(params, dp, PROMPTS, BUDGET, cache_size=CACHE)
    replay = replay_greedy(dec, params, dp, PROMPTS,
                           _continuations(cfg, params, shape.max_depth), BUDGET,
                           cache_size=CACHE)
    for row in range(len(PROMPTS)):
      assert replay.generated(row) == real.generated(row), (shape, row)
    assert replay.steps == real.steps, shape
    for name, value in real.per_row.items():
      np.testing.assert_array_equal(replay.per_row[name], value, err_msg=f"{shape} {name}")


def test_replay_detects_a_continuation_that_is_not_the_targets(target):
  """The replay trusts its continuation: a wrong one gives other counters (it is no
  re-implementation of the acceptance that would agree whatever it is fed)."""
  cfg, params, corpus = target
  drafter, dp = _noisy_self_draft(cfg, params)
  dec = SpeculativeDecoder(cfg, drafter, gamma=3, eos_ids=())
  real = dec.generate(params, dp, PROMPTS, BUDGET)
  wrong = [[(t + 1) % cfg.vocab_size for t in c] for c in _continuations(cfg, params, 3)]
  replay = replay_greedy(dec, params, dp, PROMPTS, wrong, BUDGET)
  assert replay.generated(0) != real.generated(0)
  assert not np.array_equal(replay.per_row["accepted"], real.per_row["accepted"])


def test_replay_refuses_sampling_and_short_or_foreign_continuations(target):
  cfg, params, corpus = target
  drafter, dp = make_drafter("bigram", cfg, params, corpus)
  conts = _continuations(cfg, params, 3)
  sampled = SpeculativeDecoder(cfg, drafter, gamma=3, eos_ids=(), sampler=Sampling())
  with pytest.raises(ValueError, match="greedy"):
    replay_greedy(sampled, params, dp, PROMPTS, conts, BUDGET)
  dec = SpeculativeDecoder(cfg, drafter, gamma=3, eos_ids=())
  with pytest.raises(ValueError, match="needs max_new_tokens \\+ depth = 17"):
    replay_greedy(dec, params, dp, PROMPTS, [c[:16] for c in conts], BUDGET)
  with pytest.raises(ValueError, match="3 prompts"):
    replay_greedy(dec, params, dp, PROMPTS, conts[:2], BUDGET)
  with pytest.raises(ValueError, match="outside"):
    replay_greedy(dec, params, dp, PROMPTS, [c[:-1] + [cfg.vocab_size] for c in conts], BUDGET)


def test_replay_compiles_once_across_prompts_and_budgets(target):
  from specjax.speculative.replay import _replay
  cfg, params, _ = target
  drafter, dp = _noisy_self_draft(cfg, params)
  dec = SpeculativeDecoder(cfg, drafter, tree=DYNAMIC, eos_ids=())
  runs = [(PROMPTS, BUDGET), (PROMPTS[::-1], BUDGET - 5), ([[9, 8, 7], [1], [2, 2, 2, 2]], 6)]
  for i, (prompts, budget) in enumerate(runs):
    plain = specjax.generate(params, cfg, prompts, budget + 3, eos_ids=(), cache_size=CACHE)
    replay_greedy(dec, params, dp, prompts, [plain.generated(r) for r in range(3)], budget,
                  cache_size=CACHE)
    if i == 0:
      before = _replay._cache_size()
  assert _replay._cache_size() == before
