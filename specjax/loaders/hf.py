"""Offline loading and saving of Hugging Face model directories.

A directory holds ``config.json`` and either ``model.safetensors`` or a sharded
``model.safetensors.index.json``. Nothing is ever downloaded.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig, RopeScaling
from specjax.loaders.hf_layout import params_from_hf, params_to_hf
from specjax.model import Params
from specjax.validation import CheckpointError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def config_from_hf_dict(c: dict[str, Any]) -> ModelConfig:
  """Maps an HF ``config.json`` dict to a ModelConfig."""
  model_type = c.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise CheckpointError(
        f"unsupported architecture model_type={model_type!r}; specjax supports "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  # Llama/Mistral's attention_bias also adds an o_proj bias, and mlp_bias adds
  # biases to the MLP; specjax has neither, so loading would silently drop them.
  if c.get("mlp_bias"):
    raise CheckpointError("mlp_bias=true is not supported (specjax's MLP has no biases)")
  if model_type != "qwen2" and c.get("attention_bias"):
    raise CheckpointError(f"attention_bias=true is not supported for {model_type}: it adds an "
                          "o_proj bias that specjax's attention does not have")
  rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  scaling = None
  if rope_type == "llama3":
    scaling = RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
  elif rope_type not in ("default", None):
    raise CheckpointError(f"unsupported rope scaling type {rope_type!r}")
  theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
  eos = c.get("eos_token_id")
  eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
  return ModelConfig(
      vocab_size=c["vocab_size"], dim=c["hidden_size"], num_layers=c["num_hidden_layers"],
      num_heads=c["num_attention_heads"],
      num_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
      ffn_dim=c["intermediate_size"], head_dim=c.get("head_dim"), rope_theta=float(theta),
      rope_scaling=scaling, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      qkv_bias=model_type == "qwen2",
      max_position_embeddings=int(c.get("max_position_embeddings", 8192)),
      sliding_window=_sliding_window(c),
      bos_token_id=c.get("bos_token_id"), eos_token_ids=eos, name=model_type)


def _sliding_window(c: dict[str, Any]) -> Optional[int]:
  """Mistral always windows when sliding_window is set; Qwen2 only with use_sliding_window."""
  window = c.get("sliding_window")
  if window is None or (c.get("model_type") == "qwen2" and not c.get("use_sliding_window")):
    return None
  return int(window)


def config_to_hf_dict(cfg: ModelConfig) -> dict[str, Any]:
  """Inverse of ``config_from_hf_dict`` (a Llama config that transformers accepts)."""
  d: dict[str, Any] = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_dim,
      "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias,
      "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
      "torch_dtype": "float32", "bos_token_id": cfg.bos_token_id,
      "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else
                      (cfg.eos_token_ids[0] if cfg.eos_token_ids else None),
  }
  if cfg.qkv_bias:
    raise CheckpointError("exporting q/k/v biases as a Llama config is not supported")
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    d["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                         "low_freq_factor": s.low_freq_factor,
                         "high_freq_factor": s.high_freq_factor,
                         "original_max_position_embeddings": s.original_max_position_embeddings}
  return d


def _open_tensors(path: str):
  """Returns (getter name -> numpy array, tensor names) over single or sharded safetensors."""
  from safetensors import safe_open  # local: only this loader needs it

  single = os.path.join(path, "model.safetensors")
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"corrupt safetensors index {index}: {e}") from None
    files = {name: os.path.join(path, shard) for name, shard in weight_map.items()}
  elif os.path.exists(single):
    files = None
  else:
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")

  handles: dict[str, Any] = {}

  def handle(file: str):
    if file not in handles:
      if not os.path.exists(file):
        raise CheckpointError(f"missing safetensors shard {file}")
      try:
        handles[file] = safe_open(file, framework="numpy")
      except Exception as e:  # safetensors raises its own error types
        raise CheckpointError(f"corrupt safetensors file {file}: {e}") from None
    return handles[file]

  def get(name: str) -> np.ndarray:
    file = single if files is None else files.get(name)
    if file is None:
      raise KeyError(name)
    h = handle(file)
    if name not in h.keys():
      raise KeyError(name)
    return h.get_tensor(name)

  return get, list(handle(single).keys()) if files is None else list(files)


def read_json_object(file: str, what: str) -> dict[str, Any]:
  """Reads a JSON object, raising CheckpointError naming ``what`` if it is corrupt."""
  try:
    with open(file) as f:
      obj = json.load(f)
  except json.JSONDecodeError as e:
    raise CheckpointError(f"corrupt {what}: {e}") from None
  if not isinstance(obj, dict):
    raise CheckpointError(f"corrupt {what}: not a JSON object")
  return obj


def read_config_json(path: str, what: str = "model directory") -> dict[str, Any]:
  """The ``config.json`` object of the checkpoint directory ``path`` (``what`` names the
  kind of directory in the error), refusing a missing directory, file or corrupt JSON."""
  if not os.path.isdir(path):
    raise CheckpointError(f"{what} {path!r} does not exist")
  cfg_file = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_file):
    raise CheckpointError(f"{path!r} has no config.json")
  return read_json_object(cfg_file, f"config.json in {path!r}")


def load_hf_config(path: str) -> ModelConfig:
  c = read_config_json(path)
  try:
    return config_from_hf_dict(c)
  except KeyError as e:
    raise CheckpointError(f"config.json in {path!r} lacks the field {e.args[0]!r}") from None


def load_hf(path: str, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
  """Loads (config, params) from a local HF model directory."""
  cfg = load_hf_config(path)
  get, names = _open_tensors(path)
  try:
    params = params_from_hf(cfg, get, dtype, source=path, names=names)
  except KeyError as e:
    raise CheckpointError(f"{path}: {e.args[0]}") from None
  return cfg, params


def save_hf(path: str, cfg: ModelConfig, params: Params, max_shard_bytes: int = 2 << 30) -> None:
  """Writes config.json and safetensors (sharded past ``max_shard_bytes``).

  Safetensors files and the index of an earlier checkpoint in ``path`` are
  removed, so the directory never pairs the new config with stale weights.
  """
  from safetensors.numpy import save_file

  os.makedirs(path, exist_ok=True)
  for old in os.listdir(path):
    if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json", old):
      os.remove(os.path.join(path, old))
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config_to_hf_dict(cfg), f, indent=2)
  tensors = params_to_hf(cfg, params)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, t in tensors.items():
    if size + t.nbytes > max_shard_bytes and shards[-1]:
      shards.append({})
      size = 0
    shards[-1][name] = t
    size += t.nbytes
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    weight_map.update({name: fname for name in shard})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
