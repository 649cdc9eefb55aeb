"""Greedy speculative decoding on the embedded SmolLM2-135M equals plain greedy decoding."""

import pytest

import specjax
from specjax.drafters import JacobiDrafter, LookaheadDrafter, ModelDrafter
from specjax.drafts import (default_drafter, default_eagle_drafter, default_exit_drafter,
                            default_medusa_drafter)
from specjax.loaders import chat_prompt, load_model, load_model_tokenizer
from specjax.speculative import DynamicTree, SpeculativeDecoder
from specjax.testing import tiny_model

from matrix import cases

pytestmark = pytest.mark.real_model

TEXTS = ["Write a Python function that checks whether a number is prime.",
         "Summarise in one sentence: the cat sat on the mat because it was warm.",
         "What is 17 times 23?", "Give me three tips for learning to play the guitar."]


@pytest.fixture(scope="module")
def target():
  cfg, params = load_model()
  tok = load_model_tokenizer()
  return cfg, params, [chat_prompt(tok, t) for t in TEXTS]


def _check(target, drafter, draft_params, prompts, gamma, new=32, tree=None):
  """``gamma`` and ``tree`` None: the drafter's own tree (lookahead)."""
  cfg, params, _ = target
  dec = SpeculativeDecoder(cfg, drafter, gamma=gamma, tree=tree)
  out = dec.generate(params, draft_params, prompts, new)
  ref = specjax.generate(params, cfg, prompts, new)
  for row in range(len(prompts)):
    assert out.generated(row) == ref.generated(row)
  return out


@pytest.mark.heavy  # 28 s; the shipped drafts below pin losslessness on the real model
def test_target_as_draft_batch1(target):
  cfg, params, prompts = target
  drafter = ModelDrafter(cfg)
  out = _check(target, drafter, drafter.make_params(params), prompts[:1], gamma=4)
  assert out.metrics()["acceptance_rate"] > 0.97


def test_random_tiny_draft_batch1(target):
  cfg, params, prompts = target
  dcfg, dparams = tiny_model(vocab_size=cfg.vocab_size, dim=32, num_layers=1)
  drafter = ModelDrafter(dcfg)
  _check(target, drafter, drafter.make_params(dparams), prompts[2:3], gamma=3)


def _drafter(target, which):
  cfg, params, _ = target
  if which == "default":
    return default_drafter()
  if which == "eagle":
    return default_eagle_drafter(cfg, params)
  if which == "adapter_exit":
    return default_exit_drafter(cfg, params, adapter=True)
  if which == "medusa":
    return default_medusa_drafter(cfg, params)
  dcfg, dparams = (cfg, params) if which == "target_as_draft" else tiny_model(
      vocab_size=cfg.vocab_size, dim=32, num_layers=1)
  drafter = ModelDrafter(dcfg)
  return drafter, drafter.make_params(dparams)


@pytest.mark.heavy
@pytest.mark.parametrize("which", ["target_as_draft", "random_tiny", "default", "eagle"])
def test_batch4(target, which):
  """Rows accept different lengths; each must still equal its own plain greedy output."""
  _check(target, *_drafter(target, which), target[2], gamma=5, new=48)


@pytest.mark.parametrize("which", cases(["default", "eagle", "adapter_exit"],  # the adapter exit's
                                        keep=("default", "eagle")))  # tree test follows
def test_shipped_drafts_are_lossless_and_get_accepted(target, which):
  """The shipped distilled token draft, EAGLE drafter and adapter exit, as users load them."""
  out = _check(target, *_drafter(target, which), target[2][:2], gamma=3)
  assert out.metrics()["alpha"] > 0.2  # E[β] up to the first rejection; random drafts get ~0


def test_shipped_adapter_exit_drafts_a_lossless_dynamic_tree(target):
  """The adapter exit's EAGLE-2 tree in the target's own cache, on the real model."""
  out = _check(target, *_drafter(target, "adapter_exit"), target[2][:2], gamma=None,
               tree=DynamicTree(top_k=4, depth=3, num_nodes=8))
  assert out.metrics()["tokens_per_call"] > 1.5


def test_shipped_medusa_heads_are_lossless_on_their_own_tree(target):
  """The shipped Medusa-1 heads as users load them, on their default 16-node tree."""
  out = _check(target, *_drafter(target, "medusa"), target[2][:2], gamma=None)
  assert out.metrics()["tokens_per_call"] > 1.6  # 2.10 here, 1.77 on the tree benchmark's 8


@pytest.mark.parametrize("which", ["jacobi", "lookahead"])
def test_draft_free_methods_are_lossless(target, which):
  """Jacobi and lookahead decoding (no draft model) on the real model, two rows of different
  lengths: every row equals plain greedy, and each call emits at least one token."""
  cfg = target[0]
  drafter = (JacobiDrafter(cfg.vocab_size) if which == "jacobi"
             else LookaheadDrafter(cfg.vocab_size, window=4, ngram=3, guesses=3))
  out = _check(target, drafter, (), target[2][:2], gamma=4 if which == "jacobi" else None)
  assert out.metrics()["tokens_per_call"] >= 1.0
