"""Export of a token draft as a standard Hugging Face Llama directory.

A reduced-vocabulary draft is first expanded to the target's full vocabulary
(``expand_to_full_vocab``), so any HF stack can serve it as an assistant model
of the target with the same predictions on the draft's vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters import reduced_vocab
from specjax.model import Params


def expand_to_full_vocab(cfg: ModelConfig, params: Params, vocab_map: Optional[np.ndarray],
                         target_vocab_size: int, input_map: Optional[np.ndarray] = None,
                         input_embed=None) -> tuple[ModelConfig, Params]:
  """A full-vocabulary, untied model with the same predictions on the draft's vocabulary.

  Input embeddings: row t = the row that specjax reads for t, so the exported
  model sees exactly what the reduced draft sees: with ``input_embed`` (the
  target's [V, D] table, ``ModelDrafter.make_params``) the target's row for
  ids outside the map, else the row ``input_map`` names (default: the fallback
  row). Output: column t = the draft row of t, and zero
  for ids outside the map, so their logit is exactly 0 instead of -inf. Such a
  token can only be proposed when every in-map logit is below 0 (greedy) or
  with probability e^0 / Z (sampling); the target rejects what it would not
  produce, so verification stays lossless either way.
  """
  if vocab_map is None:
    return cfg, params
  vm = np.asarray(vocab_map)
  im = np.asarray(reduced_vocab.input_map(vm, target_vocab_size) if input_map is None
                  else input_map)
  embed = np.asarray(params["embed"], np.float32)
  head = np.zeros((cfg.dim, target_vocab_size), np.float32)
  head[:, vm] = embed.T
  inputs = (embed[im] if input_embed is None else
            reduced_vocab.full_input_embed(embed, vm, input_embed, target_vocab_size))
  full = dict(params, embed=jnp.asarray(inputs), lm_head=jnp.asarray(head))
  return dataclasses.replace(cfg, vocab_size=target_vocab_size, tie_embeddings=False), full


def export_hf(out_dir: str, cfg: ModelConfig, params: Params, vocab_map: Optional[np.ndarray],
              target_vocab_size: int, tokenizer=None, input_map: Optional[np.ndarray] = None,
              input_embed=None) -> None:
  """Writes a standard HF Llama directory (config.json, model.safetensors, tokenizer);
  ``input_map`` / ``input_embed`` as in ``expand_to_full_vocab``."""
  from specjax.loaders import save_hf
  full_cfg, full_params = expand_to_full_vocab(cfg, params, vocab_map, target_vocab_size,
                                               input_map, input_embed)
  save_hf(out_dir, full_cfg, full_params)
  if tokenizer is not None:
    tokenizer.save_pretrained(out_dir)
