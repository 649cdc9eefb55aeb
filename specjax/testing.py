"""Tiny configs and random models shared by tests, notebooks and benchmarks."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from specjax.config import ModelConfig
from specjax.model import Params, init_params


def tiny_config(vocab_size: int = 64, num_layers: int = 2, dim: int = 32, num_heads: int = 4,
                num_kv_heads: int = 2, ffn_dim: int = 64, **kw) -> ModelConfig:
  return ModelConfig(vocab_size=vocab_size, dim=dim, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, ffn_dim=ffn_dim, **kw)


def tiny_model(seed: int = 0, scale: float = 0.5, **kw) -> tuple[ModelConfig, Params]:
  """A random tiny model with peaked (non-uniform) next-token distributions."""
  cfg = tiny_config(**kw)
  return cfg, init_params(cfg, jax.random.PRNGKey(seed), scale=scale)


DRAFTER_KINDS = ("prompt_lookup", "unigram", "bigram", "early_exit", "eagle")


def make_drafter(kind: str, cfg: ModelConfig, params: Params, corpus: Sequence[Sequence[int]]):
  """(drafter, draft_params) for each non-model drafter kind, for tests over all drafters."""
  from specjax import drafters  # local: drafters import this package's models

  if kind == "prompt_lookup":
    return drafters.PromptLookupDrafter(cfg.vocab_size, max_ngram=3), ()
  if kind in ("unigram", "bigram"):
    order = 1 if kind == "unigram" else 2
    return drafters.NgramDrafter(cfg.vocab_size, order=order), drafters.fit_ngram(
        corpus, cfg.vocab_size, top_k=4)
  if kind == "early_exit":
    return drafters.early_exit_drafter(cfg, params, 1)
  if kind == "eagle":  # random weights, half the target vocabulary (q = 0 elsewhere)
    from specjax.drafters.eagle import random_eagle_weights
    weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(7))
    vocab_map = np.arange(0, cfg.vocab_size, 2)
    return drafters.eagle_drafter(cfg, params, weights, vocab_map)
  raise ValueError(f"unknown drafter kind {kind!r}")
