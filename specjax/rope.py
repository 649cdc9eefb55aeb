"""Rotary position embeddings (rotate-half layout, as in Hugging Face Llama)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sharding
from specjax.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """[H/2] inverse frequencies, with Llama-3 scaling when configured."""
  h = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
  s = cfg.rope_scaling
  if s is None:
    return inv.astype(np.float32)
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
      s.high_freq_factor - s.low_freq_factor)
  scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
  mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  scaled = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
  return scaled.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """(cos, sin) [B, T, 1, H/2] of ``positions`` [B, T]: computed once per forward and read by
  every layer's queries and keys (``apply_rope``).

  On CPU they are computed inside a conditional whose two branches are the same (so the
  predicate does not matter), which XLA cannot fuse into its users: otherwise XLA:CPU
  (which drops optimisation barriers before it fuses) evaluates the cos and sin again in
  every layer's rotation, once per head. In the verify of a 16-node tree that took 0.065 ms
  a layer, ~2 ms of SmolLM2's 30-layer forward, on an AMD EPYC. The values are the same
  either way (the same cos and sin of the same angles). Not under a mesh of several devices,
  where the predicate would cost a reduction across them in every forward."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]

  def tables(a):
    return jnp.cos(a)[:, :, None, :], jnp.sin(a)[:, :, None, :]

  if jax.default_backend() != "cpu" or sharding.multi_device():
    return tables(angles)
  return jax.lax.cond(jnp.any(positions > 0), tables, tables, angles)


def apply_rope(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Rotates ``x`` [B, T, heads, H] by the positions of ``tables`` (``rope_tables``)."""
  cos, sin = tables
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
