"""Heads of residual SiLU blocks over the target's normalised hidden state and its LM head
rows: Medusa's heads and the trained early exit.

``residual_blocks`` applies L blocks y ← y + SiLU(y W_l + b_l) (FasterDecoding's
``ResBlock``; W in specjax's [in, out] layout) to an already-normalised hidden
state, with f32 accumulation. Zero W and b leave y unchanged (SiLU(0) = 0), so
an untrained head reads exactly what the target's own LM head reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.kernels.accumulate import einsum_f32
from specjax.kernels.packed import unpacked
from specjax.model import Params, rms_norm


def residual_blocks(y: jax.Array, res_w: jax.Array, res_b: jax.Array) -> jax.Array:
  """y [..., K, D] through each of K heads' L blocks: res_w [K, L, D, D], res_b [K, L, D]."""
  y = y.astype(res_w.dtype)
  for j in range(res_w.shape[1]):
    z = einsum_f32("...kd,kde->...ke", y, res_w[:, j]) + res_b[:, j]
    y = y + jax.nn.silu(z).astype(y.dtype)
  return y


def zero_blocks(num_heads: int, num_layers: int, dim: int) -> dict[str, jax.Array]:
  """``res_w`` [K, L, D, D] and ``res_b`` [K, L, D], all zero: heads that change nothing."""
  return {"res_w": jnp.zeros((num_heads, num_layers, dim, dim), jnp.float32),
          "res_b": jnp.zeros((num_heads, num_layers, dim), jnp.float32)}


def head_logits(dp, features: jax.Array, norm_eps: float) -> jax.Array:
  """[..., K, D] raw (pre-final-norm) features, one per head -> [..., K, Vd] f32 logits.

  ``dp``: ``final_norm`` [D], ``res_w``/``res_b`` (``residual_blocks``) and ``head``
  [Vd, D] shared by the heads or [K, Vd, D], each head its own rows.
  """
  y = residual_blocks(rms_norm(features, dp["final_norm"], norm_eps), dp["res_w"], dp["res_b"])
  spec = "...kd,vd->...kv" if dp["head"].ndim == 2 else "...kd,kvd->...kv"
  return einsum_f32(spec, y, dp["head"])


def target_head(target_cfg: ModelConfig, target_params: Params) -> jax.Array:
  """The target's LM head as [V, D] rows (its embedding when tied; unpacked)."""
  if target_cfg.tie_embeddings:
    return target_params["embed"]
  return jnp.transpose(unpacked(target_params["lm_head"]))
