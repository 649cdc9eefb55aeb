"""Offline model and tokenizer loaders."""

from __future__ import annotations

import logging
import os
from typing import Optional

import jax
import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.kernels import streaming_matmul
from specjax.kernels.packed import pack_params, should_pack
from specjax.loaders.embedded import load_smollm2, smollm2_gguf_path
from specjax.loaders.gguf_loader import load_gguf
from specjax.loaders.hf import CheckpointError, load_hf, save_hf
from specjax.loaders.tokenizer import chat_prompt, load_tokenizer
from specjax.model import Params

EMBEDDED = "smollm2"


def load_model(source: str = EMBEDDED, dtype=jnp.float32, packed: Optional[bool] = None
               ) -> tuple[ModelConfig, Params]:
  """Loads a model from ``"smollm2"`` (embedded), a ``.gguf`` file or an HF directory.

  Args:
    source: ``"smollm2"``, a ``.gguf`` path or an HF model directory.
    dtype: parameter dtype.
    packed: store the projections as column panels for the CPU streaming
      matmul (``specjax.kernels``); default: when that kernel runs here and
      the weights are float32. Packed parameters are for inference only.
  """
  cfg, params = _load(source, dtype)
  if packed is None:
    packed = should_pack(params)
    if not packed and jax.default_backend() == "cpu" and not streaming_matmul.available():
      logging.warning("specjax: using XLA's dot (slower decode/verify steps on CPU): %s",
                      streaming_matmul.unavailable_reason())
  elif packed and not streaming_matmul.available():
    raise RuntimeError(f"packed=True needs the streaming matmul kernel: "
                       f"{streaming_matmul.unavailable_reason()}")
  if packed:
    params = pack_params(params, cfg.tie_embeddings)
  return cfg, params


def _load(source: str, dtype) -> tuple[ModelConfig, Params]:
  if source == EMBEDDED:
    return load_smollm2(dtype)
  if source.endswith(".gguf"):
    cfg, params, _ = load_gguf(source, dtype)
    return cfg, params
  if os.path.isdir(source):
    return load_hf(source, dtype)
  raise CheckpointError(f"model source {source!r} is neither {EMBEDDED!r}, a .gguf file "
                        "nor a Hugging Face model directory")


def load_model_tokenizer(source: str = EMBEDDED):
  """The tokenizer that belongs to ``load_model(source)``."""
  return load_tokenizer(smollm2_gguf_path() if source == EMBEDDED else source)


__all__ = ["CheckpointError", "EMBEDDED", "chat_prompt", "load_gguf", "load_hf", "load_model",
           "load_model_tokenizer", "load_smollm2", "load_tokenizer", "save_hf",
           "smollm2_gguf_path"]
