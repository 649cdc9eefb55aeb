"""Shipped draft models: storage format, the default SmolLM2 draft, and HF export.

A draft directory holds ``draft.json`` (format tag, HF-style config, the
target vocabulary size and a sha256 fingerprint of the target tokenizer's
token list) and ``weights.safetensors`` (HF tensor names in float16, plus
``vocab_map`` [Vd] int32 when the draft has a reduced vocabulary; see
``specjax.drafters.reduced_vocab`` for the convention). Loading checks the
fingerprint, so a draft is never paired with a target whose token ids mean
something else, and refuses non-finite weights (a corrupted draft would
otherwise decode with α = 0). ``drafter_from_path`` is the one entry point
for a draft given as a path, whatever its kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.loaders.hf import (CheckpointError, config_from_hf_dict, config_to_hf_dict,
                                read_json_object)
from specjax.loaders.hf_layout import params_from_hf, params_to_hf
from specjax.drafters import reduced_vocab
from specjax.drafters.eagle import FUSION_KEYS, TRAINED_KEYS
from specjax.model import Params
from specjax.validation import all_finite

FORMAT = "specjax-draft-v1"
DEFAULT_DRAFT_DIR = os.path.join(os.path.dirname(__file__), "assets", "smollm2_draft")


def tokenizer_fingerprint(tokenizer) -> str:
  """sha256 of the token strings in id order (same ids <=> same fingerprint)."""
  tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
  return hashlib.sha256("\n".join(map(str, tokens)).encode("utf-8")).hexdigest()


def save_draft(path: str, cfg: ModelConfig, params: Params, vocab_map: Optional[np.ndarray], *,
               target_vocab_size: int, input_map: Optional[np.ndarray] = None, tokenizer_sha256: str, info: Optional[dict] = None,
               dtype=np.float16) -> None:
  """Writes a draft directory (weights cast to ``dtype``; compute stays float32)."""
  from safetensors.numpy import save_file

  os.makedirs(path, exist_ok=True)
  tensors = {k: v.astype(dtype) for k, v in params_to_hf(cfg, params).items()}
  if vocab_map is not None:
    vm = np.asarray(vocab_map, np.int32)
    if len(vm) != cfg.vocab_size or vm.min() < 0 or vm.max() >= target_vocab_size:
      raise ValueError("vocab_map must have one target id in [0, V) per draft row")
    tensors["vocab_map"] = vm
    if input_map is not None:  # draft rows fit int16 for Vd < 32768: half the bytes
      im = np.asarray(input_map)
      tensors["input_map"] = im.astype(np.int16 if cfg.vocab_size < 2**15 else np.int32)
  save_file(tensors, os.path.join(path, "weights.safetensors"))
  meta = dict(format=FORMAT, config=config_to_hf_dict(cfg), target_vocab_size=target_vocab_size,
              tokenizer_sha256=tokenizer_sha256, reduced_vocab=vocab_map is not None,
              info=info or {})
  with open(os.path.join(path, "draft.json"), "w") as f:
    json.dump(meta, f, indent=2)


def read_draft_metadata(path: str, formats: tuple[str, ...] = (FORMAT,)) -> dict[str, Any]:
  """draft.json of a draft directory whose format is one of ``formats``
  (token drafts: FORMAT; EAGLE drafts: EAGLE_FORMAT)."""
  meta_file = os.path.join(path, "draft.json")
  if not os.path.exists(meta_file):
    raise CheckpointError(f"{path!r} is not a draft directory (no draft.json)")
  meta = read_json_object(meta_file, f"draft.json in {path!r}")
  if meta.get("format") not in formats:
    raise CheckpointError(f"{path!r} has draft format {meta.get('format')!r}, expected "
                          f"{' or '.join(map(repr, formats))}")
  return meta


def load_draft(path: str, *, target_vocab_size: Optional[int] = None,
               tokenizer_sha256: Optional[str] = None, dtype=jnp.float32,
               with_input_map: bool = False):
  """Loads (cfg, params, vocab_map or None), refusing a draft made for another target.

  With ``with_input_map=True`` returns a fourth element, the [V] int32 map
  target id -> draft row the draft was trained with (nearest in-map token for
  ids outside the map), or None when the draft has none (then use
  ``specjax.drafters.reduced_vocab.input_map``, which sends such ids to row 0).

  Raises:
    ValueError: the draft was made for a different vocabulary size or tokenizer.
    CheckpointError (a ValueError): missing or corrupt files.
  """
  from safetensors import safe_open

  meta = read_draft_metadata(path)
  if target_vocab_size is not None and meta["target_vocab_size"] != target_vocab_size:
    raise ValueError(f"draft {path!r} was made for a target vocabulary of "
                     f"{meta['target_vocab_size']} tokens, but the target has {target_vocab_size}")
  if tokenizer_sha256 is not None and meta["tokenizer_sha256"] != tokenizer_sha256:
    raise ValueError(f"draft {path!r} was made for another tokenizer (fingerprint "
                     f"{meta['tokenizer_sha256'][:12]}…, the target's is {tokenizer_sha256[:12]}…): "
                     "its token ids would mean different strings")
  cfg = config_from_hf_dict(meta["config"])
  weights = os.path.join(path, "weights.safetensors")
  if not os.path.exists(weights):
    raise CheckpointError(f"draft {path!r} has no weights.safetensors")
  try:
    with safe_open(weights, framework="numpy") as f:
      tensors = {k: f.get_tensor(k) for k in f.keys()}
  except Exception as e:  # safetensors raises its own error types
    raise CheckpointError(f"corrupt draft weights {weights}: {e}") from None
  vocab_map = tensors.pop("vocab_map", None)
  in_map = tensors.pop("input_map", None)
  in_map = None if in_map is None else in_map.astype(np.int32)
  if meta.get("reduced_vocab") and vocab_map is None:
    raise CheckpointError(f"draft {path!r} declares a reduced vocabulary but has no vocab_map")
  try:
    params = params_from_hf(cfg, tensors.__getitem__, dtype, source=weights, names=tensors)
  except KeyError as e:
    raise CheckpointError(f"{path}: {e.args[0]}") from None
  if with_input_map:
    return cfg, params, vocab_map, in_map
  return cfg, params, vocab_map


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

  ``path`` is a specjax draft directory (token or EAGLE), a Hugging Face model
  directory or a ``.gguf`` file. Every kind goes through a fingerprint check
  against ``tokenizer``, the target's: the stored fingerprint for specjax
  drafts, the fingerprint of the model's own tokenizer otherwise. Only a
  target without a tokenizer (``tokenizer=None``, e.g. a random test model)
  skips the check.

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
    if read_draft_metadata(path, (FORMAT, EAGLE_FORMAT))["format"] == EAGLE_FORMAT:
      drafter, dp = load_eagle(path, target_cfg, target_params, tokenizer_sha256=sha)
      return drafter, dp, f"EAGLE drafter {path}"
    cfg, params, vocab_map, in_map = load_draft(
        path, target_vocab_size=target_cfg.vocab_size, tokenizer_sha256=sha,
        with_input_map=True)
    return (*_model_drafter(cfg, params, vocab_map, in_map, target_cfg.vocab_size,
                            target_params["embed"] if target_input else None), path)
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


# ------------------------------------------------------------------ EAGLE drafts

EAGLE_FORMAT = "specjax-eagle-v1"
DEFAULT_EAGLE_DIR = os.path.join(os.path.dirname(__file__), "assets", "smollm2_eagle3")
_LAYER_KEYS = ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down")


def save_eagle(path: str, target_cfg: ModelConfig, weights: Params,
               vocab_map: Optional[np.ndarray], *, tokenizer_sha256: str,
               info: Optional[dict] = None, dtype=np.float16,
               feature_layers: tuple[int, ...] = ()) -> None:
  """Writes an EAGLE draft directory: only its trained weights (+ ``vocab_map``); the
  embedding, final norm and head rows are the target's and are taken at load time.
  ``feature_layers`` (EAGLE-3 fusion) is recorded in draft.json."""
  tensors = {k: np.asarray(weights[k], dtype) for k in TRAINED_KEYS
             if k != "layers" and k in weights}
  for i, layer in enumerate(weights["layers"]):
    for k, v in layer.items():
      tensors[f"layers.{i}.{k}"] = np.asarray(v, dtype)
  if vocab_map is not None:
    tensors["vocab_map"] = np.asarray(vocab_map, np.int32)
  meta = dict(format=EAGLE_FORMAT, target_config=config_to_hf_dict(target_cfg),
              num_layers=len(weights["layers"]), target_vocab_size=target_cfg.vocab_size,
              tokenizer_sha256=tokenizer_sha256, info=info or {})
  if feature_layers:
    meta["feature_layers"] = [int(l) for l in feature_layers]
  _write_eagle(path, tensors, meta)


def _write_eagle(path: str, tensors: dict[str, np.ndarray], meta: dict) -> None:
  """An EAGLE draft directory: weights.safetensors and draft.json."""
  from safetensors.numpy import save_file

  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "weights.safetensors"))
  with open(os.path.join(path, "draft.json"), "w") as f:
    json.dump(meta, f, indent=2)


def load_eagle(path: str, target_cfg: ModelConfig, target_params: Params, *,
               tokenizer_sha256: Optional[str] = None):
  """(EagleDrafter, draft_params) for ``target``, refusing weights made for another target.

  Raises:
    ValueError: another tokenizer, vocabulary or model width.
    CheckpointError (a ValueError): missing or corrupt files.
  """
  from safetensors import safe_open
  from specjax.drafters.eagle import eagle_drafter

  meta = read_draft_metadata(path, (EAGLE_FORMAT,))
  if meta["target_vocab_size"] != target_cfg.vocab_size:
    raise ValueError(f"EAGLE draft {path!r} was made for a target vocabulary of "
                     f"{meta['target_vocab_size']} tokens, but the target has "
                     f"{target_cfg.vocab_size}")
  if tokenizer_sha256 is not None and meta["tokenizer_sha256"] != tokenizer_sha256:
    raise ValueError(f"EAGLE draft {path!r} was made for another tokenizer: its token ids would "
                     "mean different strings")
  want = config_from_hf_dict(meta["target_config"])
  if (want.dim, want.num_heads, want.num_kv_heads, want.ffn_dim) != (
      target_cfg.dim, target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.ffn_dim):
    raise ValueError(f"EAGLE draft {path!r} was made for a target of width {want.dim} "
                     f"({want.num_heads}/{want.num_kv_heads} heads), not {target_cfg.dim}")
  weights_file = os.path.join(path, "weights.safetensors")
  try:
    with safe_open(weights_file, framework="numpy") as f:
      t = {k: f.get_tensor(k) for k in f.keys()}
  except Exception as e:  # safetensors raises its own error types (missing file included)
    raise CheckpointError(f"missing or corrupt EAGLE weights {weights_file}: {e}") from None
  f32 = lambda name: jnp.asarray(t[name], jnp.float32)
  try:
    layers = [{k: f32(f"layers.{i}.{k}") for k in _LAYER_KEYS if f"layers.{i}.{k}" in t}
              for i in range(meta["num_layers"])]
    fused = bool(meta.get("feature_layers"))
    weights = dict({k: f32(k) for k in TRAINED_KEYS
                    if k != "layers" and (fused or k not in FUSION_KEYS)}, layers=layers)
  except KeyError as e:
    raise CheckpointError(f"{weights_file} lacks tensor {e.args[0]}") from None
  for name, w in t.items():
    if np.issubdtype(w.dtype, np.floating) and not all_finite(w):
      raise CheckpointError(f"{weights_file}: tensor {name!r} holds non-finite values (NaN or "
                            "inf): the draft is corrupt")
  return eagle_drafter(target_cfg, target_params, weights, t.get("vocab_map"),
                       tuple(meta.get("feature_layers", ())))


def cut_eagle_head(src: str, dst: str, rows: int) -> None:
  """Copies the EAGLE draft ``src`` to ``dst`` with its output head cut to the first ``rows``
  rows of its ``vocab_map``: the same trained weights over the ``rows`` most frequent ids
  (``distill.vocab.select_vocab`` orders the map by frequency). A smaller head makes every
  draft step cheaper (the head is most of the bytes a step reads) and loses the draft's
  probability on the dropped ids, which stays lossless (they get q = 0).

  Example: a 16,384-row head cut to 8,192 rows keeps ``vocab_map[:8192]``.

  Raises:
    ValueError: ``rows`` < 2 or beyond the head, or a ``src`` without a reduced vocabulary.
  """
  from safetensors.numpy import load_file

  meta = read_draft_metadata(src, (EAGLE_FORMAT,))
  tensors = load_file(os.path.join(src, "weights.safetensors"))
  if "vocab_map" not in tensors:
    raise ValueError(f"EAGLE draft {src!r} reads the target's full head: there is no "
                     "frequency-ranked vocab_map to cut")
  size = len(tensors["vocab_map"])
  if not 2 <= rows <= size:
    raise ValueError(f"rows must be in [2, {size}] (the head of {src!r}), got {rows}")
  tensors["vocab_map"] = tensors["vocab_map"][:rows]
  meta["info"] = dict(meta.get("info", {}), draft_vocab=rows, head_cut_from=size)
  _write_eagle(dst, tensors, meta)


def default_eagle_drafter(target_cfg: ModelConfig, target_params: Params, tokenizer=None):
  """The shipped EAGLE draft for SmolLM2-135M-Instruct: (EagleDrafter, draft_params)."""
  if tokenizer is None:
    from specjax.loaders import load_model_tokenizer
    tokenizer = load_model_tokenizer()
  return load_eagle(DEFAULT_EAGLE_DIR, target_cfg, target_params,
                    tokenizer_sha256=tokenizer_fingerprint(tokenizer))
