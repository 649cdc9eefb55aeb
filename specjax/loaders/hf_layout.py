"""Conversion between specjax's fused parameter pytree and Hugging Face tensor names.

Every loader (GGUF, HF safetensors) first produces tensors under HF names in
HF orientation ([out, in] for linear layers); ``params_from_hf`` is the single
place that fuses and transposes them, and ``params_to_hf`` is its inverse.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.kernels.packed import unpack_params
from specjax.model import Params
from specjax.param_layout import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from specjax.validation import CheckpointError, all_finite, float_dtype

# Tensors a checkpoint may hold that specjax recomputes from the config.
_RECOMPUTED_SUFFIXES = ("rotary_emb.inv_freq", "rope_freqs.weight")

_ATTN = "model.layers.{}.self_attn.{}"
_MLP = "model.layers.{}.mlp.{}"


class MissingTensorError(KeyError):
  pass


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """The HF name and [out, in] shape of every tensor a checkpoint of ``cfg`` holds."""
  n, kh, h, d, f = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.dim, cfg.ffn_dim
  shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
  if not cfg.tie_embeddings:
    shapes["lm_head.weight"] = (cfg.vocab_size, d)
  for i in range(cfg.num_layers):
    shapes.update({
        f"model.layers.{i}.input_layernorm.weight": (d,),
        f"model.layers.{i}.post_attention_layernorm.weight": (d,),
        _ATTN.format(i, "q_proj.weight"): (n * h, d), _ATTN.format(i, "k_proj.weight"): (kh * h, d),
        _ATTN.format(i, "v_proj.weight"): (kh * h, d), _ATTN.format(i, "o_proj.weight"): (d, n * h),
        _MLP.format(i, "gate_proj.weight"): (f, d), _MLP.format(i, "up_proj.weight"): (f, d),
        _MLP.format(i, "down_proj.weight"): (d, f),
    })
    if cfg.qkv_bias:
      shapes.update({_ATTN.format(i, "q_proj.bias"): (n * h,),
                     _ATTN.format(i, "k_proj.bias"): (kh * h,),
                     _ATTN.format(i, "v_proj.bias"): (kh * h,)})
  return shapes


def params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray],
                   dtype=jnp.float32, *, source: str = "checkpoint",
                   names: Optional[Iterable[str]] = None) -> Params:
  """Builds params from a getter of HF-named numpy tensors, checking each one.

  Every tensor must have the shape the config implies (so the embedding's
  vocabulary is the config's), a float dtype and only finite values; with
  ``names`` (all tensor names the checkpoint holds) none may be left unused.

  Raises:
    MissingTensorError (a KeyError): a tensor is missing.
    CheckpointError: naming ``source`` and the tensor that breaks a rule.
  """
  float_dtype(dtype)
  shapes = hf_shapes(cfg)
  if names is not None:
    _check_unused(cfg, get, set(names) - set(shapes), source)

  def fetch(name: str) -> np.ndarray:
    try:
      raw = get(name)
    except KeyError:
      raise MissingTensorError(f"checkpoint has no tensor {name!r}") from None
    if not np.issubdtype(raw.dtype, np.floating) and raw.dtype.name != "bfloat16":
      raise CheckpointError(f"{source}: tensor {name!r} has dtype {raw.dtype}, not a float")
    if tuple(raw.shape) != shapes[name]:
      raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(raw.shape)}, but the "
                            f"config needs {shapes[name]}")
    w = np.asarray(raw, np.float32)
    if not all_finite(w):
      raise CheckpointError(f"{source}: tensor {name!r} holds {np.size(w) - np.isfinite(w).sum()} "
                            "non-finite values (NaN or inf): the file is corrupt")
    return w

  def linear(name: str) -> np.ndarray:  # HF [out, in] -> ours [in, out]
    return fetch(name).T

  cast = lambda a: jnp.asarray(a, dtype)
  layers = []
  for i in range(cfg.num_layers):
    qkv = fuse_qkv(*[linear(_ATTN.format(i, f"{x}_proj.weight")) for x in "qkv"],
                   cfg.num_kv_heads)
    layer = {
        "attn_norm": cast(fetch(f"model.layers.{i}.input_layernorm.weight")),
        "wqkv": cast(qkv),
        "wo": cast(linear(_ATTN.format(i, "o_proj.weight"))),
        "mlp_norm": cast(fetch(f"model.layers.{i}.post_attention_layernorm.weight")),
        "w_gate_up": cast(fuse_gate_up(linear(_MLP.format(i, "gate_proj.weight")),
                                       linear(_MLP.format(i, "up_proj.weight")))),
        "w_down": cast(linear(_MLP.format(i, "down_proj.weight"))),
    }
    if cfg.qkv_bias:
      layer["bqkv"] = cast(fuse_qkv(*[fetch(_ATTN.format(i, f"{x}_proj.bias")) for x in "qkv"],
                                    cfg.num_kv_heads))
    layers.append(layer)
  params = {"embed": cast(fetch("model.embed_tokens.weight")), "layers": layers,
            "final_norm": cast(fetch("model.norm.weight"))}
  if not cfg.tie_embeddings:
    params["lm_head"] = cast(linear("lm_head.weight"))
  return params


def _check_unused(cfg: ModelConfig, get, extra: set[str], source: str) -> None:
  """Refuses tensors the config does not use (a wrong config would silently drop them)."""
  extra = {x for x in extra if not x.endswith(_RECOMPUTED_SUFFIXES)}
  if cfg.tie_embeddings and "lm_head.weight" in extra:
    # Some tied checkpoints store the head anyway; it must then be the embedding.
    if not np.array_equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
      raise CheckpointError(f"{source}: the config ties the embeddings, but tensor "
                            "'lm_head.weight' differs from 'model.embed_tokens.weight'")
    extra.discard("lm_head.weight")
  if extra:
    raise CheckpointError(f"{source}: {len(extra)} tensor(s) unused by the config, e.g. "
                          f"{sorted(extra)[0]!r}: the config does not describe this checkpoint")


def params_to_hf(cfg: ModelConfig, params: Params) -> dict[str, np.ndarray]:
  """Inverse of ``params_from_hf``: HF-named float32 numpy tensors."""
  n, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  params = unpack_params(params, cfg.tie_embeddings)
  out = {"model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
         "model.norm.weight": np.asarray(params["final_norm"], np.float32)}
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = np.asarray(params["lm_head"], np.float32).T
  for i, p in enumerate(params["layers"]):
    q, k, v = split_qkv(np.asarray(p["wqkv"], np.float32), n, kh, h)
    gate, up = split_gate_up(np.asarray(p["w_gate_up"], np.float32))
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
      bq, bk, bv = split_qkv(np.asarray(p["bqkv"], np.float32), n, kh, h)
      out.update({_ATTN.format(i, "q_proj.bias"): bq, _ATTN.format(i, "k_proj.bias"): bk,
                  _ATTN.format(i, "v_proj.bias"): bv})
  return {k: np.ascontiguousarray(v) for k, v in out.items()}
