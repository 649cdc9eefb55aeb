"""Offline GGUF loading (llama.cpp format), dequantized to float32.

llama.cpp's converter permutes the rows of attn_q / attn_k so that RoPE acts
on interleaved pairs (GPT-J layout); specjax, like Hugging Face, rotates
halves, so those rows are permuted back here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.loaders.hf import CheckpointError
from specjax.loaders.hf_layout import params_from_hf
from specjax.model import Params

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_HF_TO_GGUF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_HF_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}


def _reader(path: str):
  import gguf

  if not os.path.exists(path):
    raise CheckpointError(f"GGUF file {path!r} does not exist")
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # gguf raises ValueError/IndexError/struct errors on bad files
    raise CheckpointError(f"corrupt or unreadable GGUF file {path!r}: {e}") from None


def gguf_metadata(reader) -> dict[str, Any]:
  """All scalar / string / array metadata fields as Python values."""
  out = {}
  for key, field in reader.fields.items():
    try:
      out[key] = field.contents()
    except Exception:  # pylint: disable=broad-except
      continue
  return out


def config_from_gguf_metadata(md: dict[str, Any]) -> ModelConfig:
  arch = md.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(f"unsupported GGUF architecture {arch!r}; specjax supports "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
  g = lambda k, default=None: md.get(f"{arch}.{k}", default)
  for k in ("attention.head_count", "embedding_length", "block_count", "feed_forward_length"):
    if g(k) is None:
      raise CheckpointError(f"GGUF metadata lacks {arch}.{k}")
  heads = int(g("attention.head_count"))
  dim = int(g("embedding_length"))
  vocab = g("vocab_size") or len(md.get("tokenizer.ggml.tokens") or ())
  if not vocab:
    raise CheckpointError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
  eos = md.get("tokenizer.ggml.eos_token_id")
  return ModelConfig(
      vocab_size=int(vocab), dim=dim, num_layers=int(g("block_count")), num_heads=heads,
      num_kv_heads=int(g("attention.head_count_kv", heads)),
      ffn_dim=int(g("feed_forward_length")),
      head_dim=int(g("attention.key_length", dim // heads)),
      rope_theta=float(g("rope.freq_base", 10000.0)),
      norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
      max_position_embeddings=int(g("context_length", 8192)),
      qkv_bias=arch == "qwen2",
      bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=() if eos is None else (int(eos),), name=arch)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undoes llama.cpp's q/k row permutation: interleaved pairs -> rotate-half."""
  rows = w.shape[0]
  return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _config(reader, md: dict[str, Any]) -> ModelConfig:
  has_output = any(t.name == "output.weight" for t in reader.tensors)
  return dataclasses.replace(config_from_gguf_metadata(md), tie_embeddings=not has_output)


def gguf_config(path: str) -> ModelConfig:
  """The config of a GGUF file, from its metadata alone (no tensor is dequantized)."""
  reader = _reader(path)
  return _config(reader, gguf_metadata(reader))


def load_gguf(path: str, dtype=jnp.float32) -> tuple[ModelConfig, Params, dict[str, Any]]:
  """Loads (config, params, metadata) from a GGUF file."""
  import gguf

  reader = _reader(path)
  md = gguf_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  cfg = _config(reader, md)

  def get(hf_name: str) -> np.ndarray:
    name = _gguf_name(hf_name)
    if name not in tensors:
      raise KeyError(hf_name)
    t = tensors[name]
    try:
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f"cannot dequantize {name} ({t.tensor_type.name}): {e}") from None
    w = np.asarray(w, np.float32).reshape(tuple(int(x) for x in reversed(t.shape)))
    if name.endswith("attn_q.weight") or name.endswith("attn_q.bias"):
      w = _unpermute(w, cfg.num_heads) if cfg.name == "llama" else w
    elif name.endswith("attn_k.weight") or name.endswith("attn_k.bias"):
      w = _unpermute(w, cfg.num_kv_heads) if cfg.name == "llama" else w
    return w

  try:
    params = params_from_hf(cfg, get, dtype, source=path,
                            names=[_hf_name(name) for name in tensors])
  except KeyError as e:
    raise CheckpointError(f"{path}: {e.args[0]}") from None
  return cfg, params, md


def _hf_name(gguf_name: str) -> str:
  """'blk.3.ffn_up.weight' -> 'model.layers.3.mlp.up_proj.weight' (unknown names unchanged)."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split(".", 2)
  if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
  return gguf_name


def _gguf_name(hf_name: str) -> str:
  """'model.layers.3.mlp.up_proj.weight' -> 'blk.3.ffn_up.weight'."""
  if hf_name in _HF_TO_GGUF_GLOBAL:
    return _HF_TO_GGUF_GLOBAL[hf_name]
  _, _, layer, rest = hf_name.split(".", 3)
  return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"
