"""Offline model and tokenizer loaders."""

from __future__ import annotations

import os
from typing import Optional

from specjax import validation
from specjax.config import ModelConfig
from specjax.kernels import streaming_matmul
from specjax.kernels import policy as matmul_policy
from specjax.kernels.packed import pack_params
from specjax.loaders.embedded import load_smollm2, smollm2_gguf_path
from specjax.loaders.gguf_loader import load_gguf
from specjax.loaders.hf import CheckpointError, load_hf, save_hf
from specjax.loaders.tokenizer import chat_prompt, load_tokenizer
from specjax.model import Params

EMBEDDED = "smollm2"


def load_model(source: str = EMBEDDED, dtype="auto", packed: Optional[bool] = None
               ) -> tuple[ModelConfig, Params]:
  """Loads a model from ``"smollm2"`` (embedded), a ``.gguf`` file or an HF directory.

  On CPU, the projections and the head are packed for the streaming matmul
  kernel (``specjax.kernels``) for the row counts where it beat XLA's dot when
  timed on this machine, the layers and the head each on their own
  (``kernels/policy.py``: measured once, ~10-30 s, then cached; the decisions are
  logged). ``SPECJAX_MATMUL=xla|kernel|auto`` overrides it.

  Args:
    source: ``"smollm2"``, a ``.gguf`` path or an HF model directory.
    dtype: the dtype of the weights, and so of the activations and the KV cache
      (``model.compute_dtype``): "auto" (default) is bfloat16 on GPU and TPU and float32
      on CPU (``validation.compute_dtype``); "float32", "bfloat16" or another float dtype.
      Products accumulate in float32 and logits are float32 whatever it is.
    packed: None (default): the measured policy; True: the kernel for every
      product (an error when it cannot run here); False: XLA's dot only.
      Packed parameters are for inference only.
  """
  cfg, params = _load(source, dtype)
  if packed is None:  # the layers' projections and the head, each as measured
    policy, head = (matmul_policy.policy_for(params, cfg.tie_embeddings, part=part)
                    for part in matmul_policy.PARTS)
  elif packed:
    if not streaming_matmul.available():
      raise RuntimeError(f"packed=True needs the streaming matmul kernel: "
                         f"{streaming_matmul.unavailable_reason()}")
    policy = head = matmul_policy.KERNEL
  else:
    policy = head = matmul_policy.XLA
  return cfg, pack_params(params, cfg.tie_embeddings, policy, head_policy=head)


def _load(source: str, dtype) -> tuple[ModelConfig, Params]:
  source = validation.model_source(source)
  dtype = (validation.compute_dtype(dtype) if isinstance(dtype, str) and dtype == "auto"
           else validation.float_dtype(dtype))
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
  source = validation.model_source(source)
  return load_tokenizer(smollm2_gguf_path() if source == EMBEDDED else source)


__all__ = ["CheckpointError", "EMBEDDED", "chat_prompt", "load_gguf", "load_hf", "load_model",
           "load_model_tokenizer", "load_smollm2", "load_tokenizer", "save_hf",
           "smollm2_gguf_path"]
