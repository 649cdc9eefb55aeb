"""Conversion between specjax's fused parameter pytree and Hugging Face tensor names.

Every loader (GGUF, HF safetensors) first produces tensors under HF names in
HF orientation ([out, in] for linear layers); ``params_from_hf`` is the single
place that fuses and transposes them, and ``params_to_hf`` is its inverse.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.kernels.packed import unpack_params
from specjax.model import Params

_ATTN = "model.layers.{}.self_attn.{}"
_MLP = "model.layers.{}.mlp.{}"


class MissingTensorError(KeyError):
  pass


def params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray],
                   dtype=jnp.float32) -> Params:
  """Builds params from a getter of HF-named numpy tensors."""

  def fetch(name: str) -> np.ndarray:
    try:
      return np.asarray(get(name), np.float32)
    except KeyError:
      raise MissingTensorError(f"checkpoint has no tensor {name!r}") from None

  def linear(name: str) -> np.ndarray:  # HF [out, in] -> ours [in, out]
    return fetch(name).T

  cast = lambda a: jnp.asarray(a, dtype)
  layers = []
  for i in range(cfg.num_layers):
    qkv = np.concatenate([linear(_ATTN.format(i, f"{x}_proj.weight")) for x in "qkv"], axis=1)
    layer = {
        "attn_norm": cast(fetch(f"model.layers.{i}.input_layernorm.weight")),
        "wqkv": cast(qkv),
        "wo": cast(linear(_ATTN.format(i, "o_proj.weight"))),
        "mlp_norm": cast(fetch(f"model.layers.{i}.post_attention_layernorm.weight")),
        "w_gate_up": cast(np.concatenate([linear(_MLP.format(i, "gate_proj.weight")),
                                          linear(_MLP.format(i, "up_proj.weight"))], axis=1)),
        "w_down": cast(linear(_MLP.format(i, "down_proj.weight"))),
    }
    if cfg.qkv_bias:
      layer["bqkv"] = cast(np.concatenate(
          [fetch(_ATTN.format(i, f"{x}_proj.bias")) for x in "qkv"]))
    layers.append(layer)
  params = {"embed": cast(fetch("model.embed_tokens.weight")), "layers": layers,
            "final_norm": cast(fetch("model.norm.weight"))}
  if not cfg.tie_embeddings:
    params["lm_head"] = cast(linear("lm_head.weight"))
  return params


def params_to_hf(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """Inverse of ``params_from_hf``: HF-named float32 numpy tensors."""
  n, kh, h, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
  params = unpack_params(params, cfg.tie_embeddings)
  out = {"model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
         "model.norm.weight": np.asarray(params["final_norm"], np.float32)}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = np.asarray(params["lm_head"], np.float32).T
  for i, p in enumerate(params["layers"]):
    q, k, v = np.split(np.asarray(p["wqkv"], np.float32), [n * h, (n + kh) * h], axis=1)
    gate, up = np.split(np.asarray(p["w_gate_up"], np.float32), [f], axis=1)
    out.update({
        f"model.layers.{i}.input_layernorm.weight": np.asarray(p["attn_norm"], np.float32),
        f"model.layers.{i}.post_attention_layernorm.weight": np.asarray(p["mlp_norm"], np.float32),
        _ATTN.format(i, "q_proj.weight"): q.T, _ATTN.format(i, "k_proj.weight"): k.T,
        _ATTN.format(i, "v_proj.weight"): v.T,
        _ATTN.format(i, "o_proj.weight"): np.asarray(p["wo"], np.float32).T,
        _MLP.format(i, "gate_proj.weight"): gate.T, _MLP.format(i, "up_proj.weight"): up.T,
        _MLP.format(i, "down_proj.weight"): np.asarray(p["w_down"], np.float32).T,
    })
    if "bqkv" in p:
      bq, bk, bv = np.split(np.asarray(p["bqkv"], np.float32), [n * h, (n + kh) * h])
      out.update({_ATTN.format(i, "q_proj.bias"): bq, _ATTN.format(i, "k_proj.bias"): bk,
                  _ATTN.format(i, "v_proj.bias"): bv})
  return {k: np.ascontiguousarray(v) for k, v in out.items()}
