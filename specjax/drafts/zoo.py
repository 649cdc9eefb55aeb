"""The drafts zoo: the shipped SmolLM2 drafts, and any draft given as a path, served.

``default_drafter``, ``default_eagle_drafter``, ``default_medusa_drafter`` and
``default_exit_drafter`` are the drafts in ``specjax/assets/`` (token draft, EAGLE-3 head,
Medusa-1 heads and two trained early exits, with and without an attention adapter, for
SmolLM2-135M-Instruct),
ready for ``SpeculativeDecoder``; ``drafter_from_path`` is the one entry point
for a draft given as a path, whatever its kind. Every one of them checks the
draft against the target's tokenizer fingerprint.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from specjax.config import ModelConfig
from specjax.drafts.eagle_published import (load_published_eagle, published_eagle_weights,
                                            published_kind)
from specjax.drafts.format import (EAGLE_FORMAT, EXIT_FORMAT, FORMAT, MEDUSA_FORMAT, load_draft,
                                   load_eagle, load_exit, load_medusa, read_draft_metadata,
                                   tokenizer_fingerprint)
from specjax.drafts.medusa_published import load_published_medusa, published_medusa_weights
from specjax.loaders.hf import CheckpointError
from specjax.model import Params

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets")
DEFAULT_DRAFT_DIR = os.path.join(_ASSETS, "smollm2_draft")
DEFAULT_EAGLE_DIR = os.path.join(_ASSETS, "smollm2_eagle3")
DEFAULT_MEDUSA_DIR = os.path.join(_ASSETS, "smollm2_medusa")
DEFAULT_EXIT_DIR = os.path.join(_ASSETS, "smollm2_exit")
DEFAULT_ADAPTER_EXIT_DIR = os.path.join(_ASSETS, "smollm2_exit_adapter")


def load_default_draft(tokenizer=None, target_vocab_size: Optional[int] = None,
                       with_input_map: bool = False):
  """The shipped draft for SmolLM2-135M-Instruct: (cfg, params, vocab_map).

  Args:
    tokenizer: the target's tokenizer; default: the embedded target's.
    target_vocab_size: the target's vocabulary size; default: the tokenizer's.
  """
  if tokenizer is None:
    from specjax.loaders import load_model_tokenizer
    tokenizer = load_model_tokenizer()
  return load_draft(DEFAULT_DRAFT_DIR, target_vocab_size=target_vocab_size or len(tokenizer),
                    tokenizer_sha256=tokenizer_fingerprint(tokenizer),
                    with_input_map=with_input_map)


def default_drafter(tokenizer=None, target_vocab_size: Optional[int] = None,
                    target_embed=None):
  """The shipped draft ready for ``SpeculativeDecoder``: (ModelDrafter, draft_params).

  With ``target_embed`` (the target's [V, D] embedding table) the draft reads
  prompt ids outside its vocabulary through the target's rows (full-vocabulary
  input, ``ModelDrafter.make_params``) instead of the nearest in-map row.
  """
  cfg, params, vocab_map, in_map = load_default_draft(tokenizer, target_vocab_size,
                                                      with_input_map=True)
  return _model_drafter(cfg, params, vocab_map, in_map, target_vocab_size, target_embed)


def default_eagle_drafter(target_cfg: ModelConfig, target_params: Params, tokenizer=None,
                          panel_dtype=None):
  """The shipped EAGLE draft for SmolLM2-135M-Instruct: (EagleDrafter, draft_params), packed
  like the target in panels of ``panel_dtype`` (``drafters.eagle.pack_eagle_params``)."""
  return load_eagle(DEFAULT_EAGLE_DIR, target_cfg, target_params,
                    tokenizer_sha256=_fingerprint(tokenizer), panel_dtype=panel_dtype)


def default_medusa_drafter(target_cfg: ModelConfig, target_params: Params, tokenizer=None):
  """The shipped Medusa-1 heads for SmolLM2-135M-Instruct: (MedusaDrafter, draft_params),
  whose default tree is built from the heads' measured accuracies."""
  return load_medusa(DEFAULT_MEDUSA_DIR, target_cfg, target_params,
                     tokenizer_sha256=_fingerprint(tokenizer))


def default_exit_drafter(target_cfg: ModelConfig, target_params: Params, tokenizer=None,
                         adapter: bool = False):
  """A shipped trained early exit for SmolLM2-135M-Instruct: (EarlyExitDrafter,
  draft_params). ``adapter=False``: the exit head after 6 layers (``smollm2_exit``);
  True: after 10 layers, through an attention adapter (``smollm2_exit_adapter``)."""
  return load_exit(DEFAULT_ADAPTER_EXIT_DIR if adapter else DEFAULT_EXIT_DIR, target_cfg,
                   target_params, tokenizer_sha256=_fingerprint(tokenizer))


def _fingerprint(tokenizer=None) -> str:
  """The fingerprint of ``tokenizer`` (default: the embedded target's)."""
  if tokenizer is None:
    from specjax.loaders import load_model_tokenizer
    tokenizer = load_model_tokenizer()
  return tokenizer_fingerprint(tokenizer)


def reads_target_rows(cfg: ModelConfig, vocab_map: Optional[np.ndarray], target_dim: int) -> bool:
  """Whether a token draft is served with full-vocabulary input: a reduced-vocabulary
  draft of the target's width (another width keeps the input map it shipped with)."""
  return vocab_map is not None and cfg.dim == target_dim


def _model_drafter(cfg: ModelConfig, params: Params, vocab_map: Optional[np.ndarray],
                   input_map: Optional[np.ndarray], target_vocab_size: Optional[int],
                   target_embed=None):
  """(ModelDrafter, draft_params) of a draft model, reduced-vocabulary or not; a reduced
  one of the target's width reads ``target_embed`` (if given) for ids outside its map."""
  from specjax.drafters import ModelDrafter
  if vocab_map is None:
    if target_vocab_size is not None and cfg.vocab_size != target_vocab_size:
      raise ValueError(f"the draft has a vocabulary of {cfg.vocab_size} tokens but the target "
                       f"has {target_vocab_size}")
    drafter = ModelDrafter(cfg)
    return drafter, drafter.make_params(params)
  drafter = ModelDrafter(cfg, target_vocab_size=target_vocab_size or len(input_map))
  if target_embed is not None and not reads_target_rows(cfg, vocab_map,
                                                        np.shape(target_embed)[-1]):
    target_embed = None
  return drafter, drafter.make_params(params, vocab_map, input_map=input_map,
                                      input_embed=target_embed)


def drafter_from_path(path: str, target_cfg: ModelConfig, target_params: Params, tokenizer,
                      *, target_input: bool = True):
  """(drafter, draft_params, note) of a draft at ``path``, checked against the target.

  ``path`` is a specjax draft directory (token, EAGLE, Medusa heads or a trained exit), a
  published EAGLE-1/2 or
  EAGLE-3 checkpoint (SafeAILab's ``config.json`` + ``model.safetensors`` or
  ``pytorch_model.bin``, ``eagle_published``), published Medusa-1 heads
  (FasterDecoding's ``config.json`` + ``medusa_lm_head.safetensors`` or ``.pt``,
  ``medusa_published``), a Hugging Face model directory or a
  ``.gguf`` file. Every kind but the published EAGLE and Medusa checkpoints goes through a
  fingerprint check against ``tokenizer``, the target's: the stored fingerprint for
  specjax drafts, the fingerprint of the model's own tokenizer otherwise. Only a
  target without a tokenizer (``tokenizer=None``, e.g. a random test model) skips
  the check. A published EAGLE checkpoint carries no tokenizer: it is checked against
  the target's hidden size, vocabulary size and (EAGLE-3) depth, and its d2t map's range;
  Medusa heads against the hidden size and vocabulary.

  A reduced-vocabulary specjax token draft of the target's width reads input
  ids outside its vocabulary through the target's rows (full-vocabulary input,
  what ``experiments.train_draft`` trains with by default); ``target_input=False``
  keeps the input map it shipped with instead (how drafts trained with
  ``--notarget_input``, like the shipped one, were trained).

  Raises:
    ValueError: the draft belongs to another tokenizer or vocabulary.
    CheckpointError (a ValueError): missing or corrupt files, or a model
      whose tokenizer cannot be read to check it.
  """
  sha = None if tokenizer is None else tokenizer_fingerprint(tokenizer)
  if os.path.exists(os.path.join(path, "draft.json")):
    kind = read_draft_metadata(path, (FORMAT, EAGLE_FORMAT, MEDUSA_FORMAT, EXIT_FORMAT))["format"]
    if kind == EAGLE_FORMAT:
      drafter, dp = load_eagle(path, target_cfg, target_params, tokenizer_sha256=sha)
      return drafter, dp, f"EAGLE drafter {path}"
    if kind == MEDUSA_FORMAT:
      drafter, dp = load_medusa(path, target_cfg, target_params, tokenizer_sha256=sha)
      return drafter, dp, (f"Medusa heads {path} ({drafter.num_heads} heads of "
                           f"{drafter.num_layers} blocks)")
    if kind == EXIT_FORMAT:
      drafter, dp = load_exit(path, target_cfg, target_params, tokenizer_sha256=sha)
      return drafter, dp, f"trained exit {path} (after layer {drafter.cfg.num_layers})"
    cfg, params, vocab_map, in_map = load_draft(
        path, target_vocab_size=target_cfg.vocab_size, tokenizer_sha256=sha,
        with_input_map=True)
    return (*_model_drafter(cfg, params, vocab_map, in_map, target_cfg.vocab_size,
                            target_params["embed"] if target_input else None), path)
  if published_medusa_weights(path) is not None:
    drafter, dp = load_published_medusa(path, target_cfg, target_params)
    return drafter, dp, (f"published Medusa heads {path} ({drafter.num_heads} heads of "
                         f"{drafter.num_layers} blocks; no tokenizer to fingerprint: width and "
                         "vocabulary checked)")
  if published_eagle_weights(path) is not None:
    drafter, dp = load_published_eagle(path, target_cfg, target_params)
    return drafter, dp, (f"published {published_kind(drafter)} drafter {path} (no tokenizer "
                         "to fingerprint: width and vocabulary checked)")
  from specjax.loaders import load_model, load_model_tokenizer
  if sha is not None:
    try:
      draft_sha = tokenizer_fingerprint(load_model_tokenizer(path))
    except CheckpointError as e:
      raise CheckpointError(f"cannot check that draft {path!r} shares the target's tokenizer: "
                            f"{e}") from None
    if draft_sha != sha:
      raise ValueError(f"draft {path!r} has another tokenizer than the target (fingerprint "
                       f"{draft_sha[:12]}…, the target's is {sha[:12]}…): its token ids would "
                       "mean different strings")
  cfg, params = load_model(path)
  return (*_model_drafter(cfg, params, None, None, target_cfg.vocab_size), path)
