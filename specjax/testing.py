"""Tiny configs and random models shared by tests, notebooks and benchmarks."""

from __future__ import annotations

import jax

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
