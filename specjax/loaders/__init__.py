"""Offline model and tokenizer loaders."""

from __future__ import annotations

import os

import jax.numpy as jnp

from specjax.config import ModelConfig
from specjax.loaders.embedded import load_smollm2, smollm2_gguf_path
from specjax.loaders.gguf_loader import load_gguf
from specjax.loaders.hf import CheckpointError, load_hf, save_hf
from specjax.loaders.tokenizer import chat_prompt, load_tokenizer
from specjax.model import Params

EMBEDDED = "smollm2"


def load_model(source: str = EMBEDDED, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
  """Loads a model from ``"smollm2"`` (embedded), a ``.gguf`` file or an HF directory."""
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
