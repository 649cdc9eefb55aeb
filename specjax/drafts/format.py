"""The draft directory formats, token and EAGLE, behind one checked loader.

A draft directory holds ``draft.json`` and ``weights.safetensors`` (or, past 15 MB, shards
listed by ``weights.safetensors.index.json``: ``specjax.drafts.shards``). The JSON
names the format (``FORMAT`` for token drafts, ``EAGLE_FORMAT`` for EAGLE
heads), the target vocabulary size and a sha256 fingerprint of the target
tokenizer's token list (``tokenizer_fingerprint``); the tensors are float16
unless asked otherwise, plus ``vocab_map`` [Vd] int32 when the draft has a
reduced vocabulary (``specjax.drafters.reduced_vocab`` has the convention).

  token draft   draft.json: ``config`` (HF-style), ``reduced_vocab``, ``info``;
                tensors: HF names of a whole Llama model, optionally
                ``input_map`` [V] (int16 when Vd < 32768).
  EAGLE draft   draft.json: ``target_config``, ``num_layers``, optionally
                ``feature_layers`` (EAGLE-3 fusion), ``param_layout``, ``info``;
                tensors: only the trained weights (``drafters.eagle.TRAINED_KEYS``,
                layers as ``layers.{i}.{key}``, fused projections in the order
                ``param_layout`` names; absent: the older q|k|v, gate|up
                concatenation, reordered on load): embedding, final norm and
                head rows are the target's, taken at load time.
  Medusa heads  draft.json: ``target_config``, ``num_heads``, ``num_layers``,
                optionally ``head_accuracy`` ([K][R], the measured a_k^(r) the
                default tree is built from), ``info``; tensors: ``res_w``,
                ``res_b`` and, for heads with their own rows, ``head``.
  trained exit  as Medusa heads, with one head and ``exit_layer`` (k: the head
                reads the output of the target's first k layers); with an
                attention adapter also ``adapter: true`` and ``param_layout``,
                and its decoder layer's tensors as ``adapter.{key}``.

Both loaders open a directory through ``read_checked_metadata``, which refuses
a draft made for another target (vocabulary size or tokenizer fingerprint), so
a draft is never paired with a target whose token ids mean something else.
Both refuse non-finite weights (a corrupted draft would otherwise decode with
α = 0).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters.eagle import FUSION_KEYS, TRAINED_KEYS
from specjax.loaders.hf import (CheckpointError, config_from_hf_dict, config_to_hf_dict,
                                read_json_object)
from specjax.loaders.hf_layout import params_from_hf, params_to_hf
from specjax import param_layout
from specjax.drafts import shards
from specjax.model import Params
from specjax.validation import all_finite

FORMAT = "specjax-draft-v1"
EAGLE_FORMAT = "specjax-eagle-v1"
MEDUSA_FORMAT = "specjax-medusa-v1"
EXIT_FORMAT = "specjax-exit-v1"
ADAPTER_PREFIX = "adapter."  # a trained exit's attention adapter: "adapter.wqkv", …
_LAYER_KEYS = ("attn_norm", "wqkv", "bqkv", "wo", "mlp_norm", "w_gate_up", "w_down")


def tokenizer_fingerprint(tokenizer) -> str:
  """sha256 of the token strings in id order (same ids <=> same fingerprint)."""
  tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
  return hashlib.sha256("\n".join(map(str, tokens)).encode("utf-8")).hexdigest()


# ------------------------------------------------------------------ the directory


def _write_draft_dir(path: str, tensors: dict[str, np.ndarray], meta: dict) -> None:
  """A draft directory of any format: its tensors (``shards.write_tensors``: one file, or
  shards of at most ``shards.MAX_FILE_BYTES`` each), then draft.json. An earlier draft.json
  goes first, so a write cut short leaves no directory that pairs old metadata with new
  weights."""
  os.makedirs(path, exist_ok=True)
  meta_file = os.path.join(path, "draft.json")
  if os.path.exists(meta_file):
    os.remove(meta_file)
  shards.write_tensors(path, tensors)
  with open(meta_file, "w") as f:
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


def read_checked_metadata(path: str, formats: tuple[str, ...], *,
                          target_vocab_size: Optional[int] = None,
                          tokenizer_sha256: Optional[str] = None) -> dict[str, Any]:
  """draft.json of a draft directory, refusing a draft made for another target.

  The one check both loaders share: each of ``target_vocab_size`` and
  ``tokenizer_sha256`` that is given must equal what the draft was made for.

  Raises:
    ValueError: another vocabulary size or tokenizer.
    CheckpointError (a ValueError): no draft.json, or a format not in ``formats``.
  """
  meta = read_draft_metadata(path, formats)
  what = {EAGLE_FORMAT: "EAGLE draft", MEDUSA_FORMAT: "Medusa heads",
          EXIT_FORMAT: "trained exit"}.get(meta["format"], "draft")
  if target_vocab_size is not None and meta["target_vocab_size"] != target_vocab_size:
    raise ValueError(f"{what} {path!r} was made for a target vocabulary of "
                     f"{meta['target_vocab_size']} tokens, but the target has {target_vocab_size}")
  if tokenizer_sha256 is not None and meta["tokenizer_sha256"] != tokenizer_sha256:
    raise ValueError(f"{what} {path!r} was made for another tokenizer (fingerprint "
                     f"{meta['tokenizer_sha256'][:12]}…, the target's is "
                     f"{tokenizer_sha256[:12]}…): its token ids would mean different strings")
  return meta


# ------------------------------------------------------------------ token drafts


def checked_vocab_map(vocab_map: Optional[np.ndarray], target_vocab_size: int,
                      where: str = "vocab_map", rows: Optional[int] = None
                      ) -> Optional[np.ndarray]:
  """``vocab_map`` as int32 [Vd], refused unless it names ``rows`` (when given) distinct
  target ids in [0, V): a draft row is one target token, and two rows of one token would
  count its draft probability twice in every acceptance rule."""
  if vocab_map is None:
    return None
  vm = np.asarray(vocab_map)
  if vm.ndim != 1 or (rows is not None and len(vm) != rows):
    raise CheckpointError(f"{where}: vocab_map of shape {vm.shape}, not one target id per "
                          f"draft row ({rows if rows is not None else 'Vd'})")
  if len(vm) and (vm.min() < 0 or vm.max() >= target_vocab_size):
    raise CheckpointError(f"{where}: vocab_map holds ids from {vm.min()} to {vm.max()}, outside "
                          f"the target's vocabulary [0, {target_vocab_size})")
  ids, counts = np.unique(vm, return_counts=True)
  if len(ids) != len(vm):
    dup = ids[counts > 1][:5]
    raise CheckpointError(f"{where}: vocab_map names target ids {dup.tolist()} more than once")
  return vm.astype(np.int32)


def save_draft(path: str, cfg: ModelConfig, params: Params, vocab_map: Optional[np.ndarray], *,
               target_vocab_size: int, input_map: Optional[np.ndarray] = None,
               tokenizer_sha256: str, info: Optional[dict] = None, dtype=np.float16) -> None:
  """Writes a draft directory (weights cast to ``dtype``; compute stays float32)."""
  os.makedirs(path, exist_ok=True)  # before the checks below, as it always has been
  tensors = {k: v.astype(dtype) for k, v in params_to_hf(cfg, params).items()}
  if vocab_map is not None:
    tensors["vocab_map"] = checked_vocab_map(vocab_map, target_vocab_size, path, cfg.vocab_size)
    if input_map is not None:  # draft rows fit int16 for Vd < 32768: half the bytes
      im = np.asarray(input_map)
      tensors["input_map"] = im.astype(np.int16 if cfg.vocab_size < 2**15 else np.int32)
  meta = dict(format=FORMAT, config=config_to_hf_dict(cfg), target_vocab_size=target_vocab_size,
              tokenizer_sha256=tokenizer_sha256, reduced_vocab=vocab_map is not None,
              info=info or {})
  _write_draft_dir(path, tensors, meta)


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
  meta = read_checked_metadata(path, (FORMAT,), target_vocab_size=target_vocab_size,
                               tokenizer_sha256=tokenizer_sha256)
  cfg = config_from_hf_dict(meta["config"])
  tensors = _read_weights(path, "draft", check_finite=False)  # params_from_hf checks them
  vocab_map = tensors.pop("vocab_map", None)
  if vocab_map is not None:
    vocab_map = checked_vocab_map(vocab_map, meta["target_vocab_size"], path, cfg.vocab_size)
  in_map = tensors.pop("input_map", None)
  in_map = None if in_map is None else in_map.astype(np.int32)
  if meta.get("reduced_vocab") and vocab_map is None:
    raise CheckpointError(f"draft {path!r} declares a reduced vocabulary but has no vocab_map")
  try:  # params_from_hf refuses missing, misshapen and non-finite tensors
    params = params_from_hf(cfg, tensors.__getitem__, dtype, source=path, names=tensors)
  except KeyError as e:
    raise CheckpointError(f"{path}: {e.args[0]}") from None
  if with_input_map:
    return cfg, params, vocab_map, in_map
  return cfg, params, vocab_map


# ------------------------------------------------------------------ EAGLE drafts


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
    tensors["vocab_map"] = checked_vocab_map(vocab_map, target_cfg.vocab_size, path)
  meta = dict(format=EAGLE_FORMAT, target_config=config_to_hf_dict(target_cfg),
              num_layers=len(weights["layers"]), target_vocab_size=target_cfg.vocab_size,
              tokenizer_sha256=tokenizer_sha256, param_layout=param_layout.LAYOUT, info=info or {})
  if feature_layers:
    meta["feature_layers"] = [int(l) for l in feature_layers]
  _write_draft_dir(path, tensors, meta)


def load_eagle(path: str, target_cfg: ModelConfig, target_params: Params, *,
               tokenizer_sha256: Optional[str] = None, panel_dtype=None):
  """(EagleDrafter, draft_params) for ``target``, refusing weights made for another target;
  packed like the target in panels of ``panel_dtype`` (``drafters.eagle.pack_eagle_params``).

  Raises:
    ValueError: another tokenizer, vocabulary or model width.
    CheckpointError (a ValueError): missing or corrupt files.
  """
  from specjax.drafters.eagle import eagle_drafter

  meta, weights, vocab_map = _load_eagle_weights(path, target_cfg, tokenizer_sha256)
  return eagle_drafter(target_cfg, target_params, weights, vocab_map,
                       tuple(meta.get("feature_layers", ())), panel_dtype)


def _load_eagle_weights(path: str, target_cfg: ModelConfig, tokenizer_sha256: Optional[str]
                        ) -> tuple[dict, Params, Optional[np.ndarray]]:
  """(draft.json, trained weights as float32, vocab_map) of an EAGLE directory, checked
  against the target (tokenizer, vocabulary, width)."""
  meta = read_checked_metadata(path, (EAGLE_FORMAT,), target_vocab_size=target_cfg.vocab_size,
                               tokenizer_sha256=tokenizer_sha256)
  _check_width(path, meta, target_cfg, "EAGLE draft")
  t = _read_weights(path, "EAGLE")
  f32 = lambda name: jnp.asarray(t[name], jnp.float32)
  layout = meta.get("param_layout")
  if layout not in (None, param_layout.LAYOUT):
    raise CheckpointError(f"EAGLE draft {path!r} stores its projections in layout {layout!r}; "
                          f"this version reads {param_layout.LAYOUT!r} (or none: the older order)")
  try:
    layers = [{k: f32(f"layers.{i}.{k}") for k in _LAYER_KEYS if f"layers.{i}.{k}" in t}
              for i in range(meta["num_layers"])]
    if layout is None:  # written before param_layout: q|k|v and gate|up concatenated
      layers = [param_layout.from_concatenated(l, target_cfg.num_heads, target_cfg.num_kv_heads,
                                               target_cfg.head_dim) for l in layers]
    fused = bool(meta.get("feature_layers"))
    weights = dict({k: f32(k) for k in TRAINED_KEYS
                    if k != "layers" and (fused or k not in FUSION_KEYS)}, layers=layers)
  except KeyError as e:
    raise CheckpointError(f"{path}: the weights lack tensor {e.args[0]}") from None
  return meta, weights, checked_vocab_map(t.get("vocab_map"), target_cfg.vocab_size, path)


def _read_weights(path: str, what: str, check_finite: bool = True) -> dict[str, np.ndarray]:
  """The tensors of ``path`` (``weights.safetensors`` or its shards), refusing a missing or
  corrupt file and (unless the caller checks them itself) non-finite values."""
  try:
    t = shards.read_tensors(path)
  except CheckpointError:
    raise
  except Exception as e:  # safetensors raises its own error types (missing file included)
    raise CheckpointError(f"missing or corrupt {what} weights in {path}: {e}") from None
  if check_finite:
    for name, w in t.items():
      if np.issubdtype(w.dtype, np.floating) and not all_finite(w):
        raise CheckpointError(f"{path}: tensor {name!r} holds non-finite values (NaN or "
                              "inf): the draft is corrupt")
  return t


def _check_width(path: str, meta: dict, target_cfg: ModelConfig, what: str) -> None:
  want = config_from_hf_dict(meta["target_config"])
  if (want.dim, want.num_heads, want.num_kv_heads, want.ffn_dim) != (
      target_cfg.dim, target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.ffn_dim):
    raise ValueError(f"{what} {path!r} was made for a target of width {want.dim} "
                     f"({want.num_heads}/{want.num_kv_heads} heads), not {target_cfg.dim}")


# ------------------------------------------------------------------ residual heads


def _save_heads(path: str, fmt: str, target_cfg: ModelConfig, weights: Params,
                vocab_map: Optional[np.ndarray], tokenizer_sha256: str, info: Optional[dict],
                dtype, **extra) -> None:
  """A residual-heads directory (Medusa heads or a trained exit): ``res_w``, ``res_b`` (and an
  own ``head`` when the heads have one) + ``vocab_map``; a shared head is the target's, taken
  at load time. ``extra`` goes into draft.json."""
  tensors = {k: np.asarray(weights[k], dtype) for k in ("res_w", "res_b", "head") if k in weights}
  for name, w in weights.get("adapter", {}).items():  # a trained exit's decoder layer
    tensors[ADAPTER_PREFIX + name] = np.asarray(w, dtype)
  num_heads, num_layers = tensors["res_w"].shape[:2]
  if vocab_map is not None:
    tensors["vocab_map"] = checked_vocab_map(vocab_map, target_cfg.vocab_size, path)
  meta = dict(format=fmt, target_config=config_to_hf_dict(target_cfg), num_heads=int(num_heads),
              num_layers=int(num_layers), target_vocab_size=target_cfg.vocab_size,
              tokenizer_sha256=tokenizer_sha256, **extra, info=info or {})
  _write_draft_dir(path, tensors, meta)


def _load_heads(path: str, fmt: str, what: str, target_cfg: ModelConfig,
                tokenizer_sha256: Optional[str]) -> tuple[dict, Params, Optional[np.ndarray]]:
  """(draft.json, weights as float32, vocab_map) of a residual-heads directory, checked
  against the target (tokenizer, vocabulary, width) and its own declaration."""
  meta = read_checked_metadata(path, (fmt,), target_vocab_size=target_cfg.vocab_size,
                               tokenizer_sha256=tokenizer_sha256)
  _check_width(path, meta, target_cfg, what)
  t = _read_weights(path, what)
  for name in ("res_w", "res_b"):
    if name not in t:
      raise CheckpointError(f"{path}: the weights lack tensor {name!r}")
  weights = {k: jnp.asarray(t[k], jnp.float32) for k in ("res_w", "res_b", "head") if k in t}
  adapter = {k[len(ADAPTER_PREFIX):]: jnp.asarray(w, jnp.float32) for k, w in t.items()
             if k.startswith(ADAPTER_PREFIX)}
  declared = bool(meta.get("adapter", False))
  if bool(adapter) != declared:
    raise CheckpointError(f"{path}: draft.json {'declares' if declared else 'does not declare'} "
                          f"an attention adapter, but its weights "
                          f"{'hold' if adapter else 'lack'} its tensors")
  if adapter:
    if meta.get("param_layout") != param_layout.LAYOUT:
      raise CheckpointError(f"{path}: the attention adapter's projections are stored in layout "
                            f"{meta.get('param_layout')!r}; this version reads "
                            f"{param_layout.LAYOUT!r}")
    weights["adapter"] = adapter
  if weights["res_w"].shape[:2] != (meta["num_heads"], meta["num_layers"]):
    raise CheckpointError(f"{path}: res_w of shape {weights['res_w'].shape} does not hold the "
                          f"{meta['num_heads']} heads of {meta['num_layers']} blocks draft.json "
                          "declares")
  return meta, weights, checked_vocab_map(t.get("vocab_map"), target_cfg.vocab_size, path)


def save_medusa(path: str, target_cfg: ModelConfig, weights: Params,
                vocab_map: Optional[np.ndarray], *, tokenizer_sha256: str,
                head_accuracy: Optional[np.ndarray] = None, info: Optional[dict] = None,
                dtype=np.float16) -> None:
  """Writes a Medusa heads directory. ``head_accuracy`` ([K, R], the measured a_k^(r)) is
  recorded so the loaded drafter's default tree is built from it
  (``drafters.medusa.medusa_tree``)."""
  from specjax.drafters.medusa import MedusaDrafter

  extra = {}
  if head_accuracy is not None:  # checked by the drafter that will read it
    k, l = np.shape(weights["res_w"])[:2]
    acc = MedusaDrafter(target_cfg, k, l, accuracy=head_accuracy).accuracy
    extra["head_accuracy"] = [[round(a, 6) for a in row] for row in acc]
  _save_heads(path, MEDUSA_FORMAT, target_cfg, weights, vocab_map, tokenizer_sha256, info, dtype,
              **extra)


def load_medusa(path: str, target_cfg: ModelConfig, target_params: Params, *,
                tokenizer_sha256: Optional[str] = None):
  """(MedusaDrafter, draft_params) for ``target``, refusing heads made for another target;
  the drafter's default tree comes from the stored ``head_accuracy`` when there is one.

  Raises:
    ValueError: another tokenizer, vocabulary or model width.
    CheckpointError (a ValueError): missing or corrupt files.
  """
  from specjax.drafters.medusa import medusa_drafter

  meta, weights, vocab_map = _load_heads(path, MEDUSA_FORMAT, "Medusa heads", target_cfg,
                                         tokenizer_sha256)
  return medusa_drafter(target_cfg, target_params, weights, vocab_map,
                        accuracy=meta.get("head_accuracy"))


def load_trained_weights(path: str, target_cfg: ModelConfig, *,
                         tokenizer_sha256: Optional[str] = None
                         ) -> tuple[dict, Params, Optional[np.ndarray]]:
  """(draft.json, trained weights as float32, vocab_map) of an EAGLE, Medusa heads or
  trained-exit directory, checked like their loaders: the arrays training optimises (EAGLE's
  norms, ``fc``, layers and fusion; ``res_w``, ``res_b``, an own ``head``, an exit's
  ``adapter``), e.g. to continue training them. The frozen arrays (the target's embedding,
  final norm and head rows) are not among them."""
  meta = read_draft_metadata(path, (EAGLE_FORMAT, MEDUSA_FORMAT, EXIT_FORMAT))
  if meta["format"] == EAGLE_FORMAT:
    return _load_eagle_weights(path, target_cfg, tokenizer_sha256)
  what = "trained exit" if meta["format"] == EXIT_FORMAT else "Medusa heads"
  return _load_heads(path, meta["format"], what, target_cfg, tokenizer_sha256)


def save_exit(path: str, target_cfg: ModelConfig, weights: Params,
              vocab_map: Optional[np.ndarray], *, exit_layer: int, tokenizer_sha256: str,
              info: Optional[dict] = None, dtype=np.float16) -> None:
  """Writes a trained early-exit head: one residual head on the output of the target's first
  ``exit_layer`` layers (``drafters.early_exit.trained_exit_drafter``), behind its attention
  adapter when ``weights`` hold one (tensors ``adapter.<name>`` in the target's layer layout;
  draft.json says ``"adapter": true``)."""
  if np.shape(weights["res_w"])[0] != 1:
    raise ValueError(f"a trained exit has one head, got res_w of shape {np.shape(weights['res_w'])}")
  if not 1 <= exit_layer < target_cfg.num_layers:
    raise ValueError(f"exit_layer must be in [1, {target_cfg.num_layers - 1}], got {exit_layer}")
  extra = dict(adapter=True, param_layout=param_layout.LAYOUT) if "adapter" in weights else {}
  _save_heads(path, EXIT_FORMAT, target_cfg, weights, vocab_map, tokenizer_sha256, info, dtype,
              exit_layer=int(exit_layer), **extra)


def load_exit(path: str, target_cfg: ModelConfig, target_params: Params, *,
              tokenizer_sha256: Optional[str] = None):
  """(EarlyExitDrafter, draft_params) of a trained exit for ``target`` (checked like
  ``load_medusa``; also refuses an exit layer the target does not have)."""
  from specjax.drafters.early_exit import trained_exit_drafter

  meta, weights, vocab_map = _load_heads(path, EXIT_FORMAT, "trained exit", target_cfg,
                                         tokenizer_sha256)
  if not 1 <= meta["exit_layer"] < target_cfg.num_layers:
    raise ValueError(f"trained exit {path!r} exits after layer {meta['exit_layer']}, but the "
                     f"target has {target_cfg.num_layers} layers")
  return trained_exit_drafter(target_cfg, target_params, meta["exit_layer"], weights, vocab_map)


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
  meta = read_draft_metadata(src, (EAGLE_FORMAT,))
  tensors = _read_weights(src, "EAGLE")
  if "vocab_map" not in tensors:
    raise ValueError(f"EAGLE draft {src!r} reads the target's full head: there is no "
                     "frequency-ranked vocab_map to cut")
  size = len(tensors["vocab_map"])
  if not 2 <= rows <= size:
    raise ValueError(f"rows must be in [2, {size}] (the head of {src!r}), got {rows}")
  tensors["vocab_map"] = tensors["vocab_map"][:rows]
  meta["info"] = dict(meta.get("info", {}), draft_vocab=rows, head_cut_from=size)
  _write_draft_dir(dst, tensors, meta)
