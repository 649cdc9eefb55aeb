"""Published Medusa-1 heads (FasterDecoding/Medusa), loaded unchanged into a ``MedusaDrafter``.

A head directory holds ``config.json`` (``medusa_num_heads``,
``medusa_num_layers``, ``base_model_name_or_path``; ``hidden_size`` and
``vocab_size`` when the writer kept them) and ``medusa_lm_head.safetensors``,
or ``medusa_lm_head.pt`` (read with torch, only when torch is importable;
safetensors is preferred when both exist). The weights are the state dict of
``MedusaModel.medusa_head``, a ``ModuleList`` of ``nn.Sequential(ResBlock × L,
Linear(D, V, bias=False))`` (medusa/model/medusa_model.py), so head k's tensors
are, in torch's [out, in] layout::

  {k}.{j}.linear.weight  [D, D]   ResBlock j of head k (j < L)
  {k}.{j}.linear.bias    [D]
  {k}.{L}.weight         [V, D]   head k's own LM head

Checked before any weight is read (config.json and tensor headers only): the
config's fields, the target it was built for (hidden size and vocabulary, from
the config when present and from the heads' shapes), missing, extra and
misshapen tensors and their dtypes; then every weight must be finite. Floats
are cast to the target's compute dtype. The heads read the target's final
norm, as the reference's heads read the base model's normed ``outputs[0]``.

Departures from the reference: ``[ResBlock(D)] * L`` in the reference repeats
*one* module L times, so its checkpoints with L > 1 hold L equal blocks
(loaded into that one module); specjax applies the blocks as stored, which is
the same computation for such files and the intended one for files with
distinct blocks. ``base_model_name_or_path`` is informational: the checkpoints
carry no tokenizer, so none is fingerprinted (width and vocabulary are checked).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from specjax.config import ModelConfig
from specjax.drafters.medusa import TOP_K, MedusaDrafter, medusa_drafter
# The weight-file readers (safetensors headers; torch pickles only when torch is there).
from specjax.drafts.eagle_published import _Checkpoint, _open_pickle, _open_safetensors
from specjax.loaders.hf import CheckpointError, read_config_json, read_json_object
from specjax.model import Params, compute_dtype
from specjax.validation import all_finite

SAFETENSORS, PICKLE = "medusa_lm_head.safetensors", "medusa_lm_head.pt"
_FLOATS = ("float16", "bfloat16", "float32", "float64")


def published_medusa_weights(path: str) -> Optional[str]:
  """The weights file of ``path`` when it looks like published Medusa heads (a
  ``config.json`` naming ``medusa_num_heads`` beside ``medusa_lm_head.safetensors`` or
  ``.pt``), else None. Reads config.json only."""
  cfg_file = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_file):
    return None
  for name in (SAFETENSORS, PICKLE):
    file = os.path.join(path, name)
    if os.path.isfile(file):
      try:
        c = read_json_object(cfg_file, "config.json")
      except CheckpointError:
        return file  # corrupt: load_published_medusa reports it
      return file if "medusa_num_heads" in c else None
  return None


def _count(c: dict[str, Any], field: str, minimum: int, path: str) -> int:
  if field not in c:
    raise CheckpointError(f"config.json in {path!r} lacks the field {field!r}, which published "
                          "Medusa heads have")
  v = c[field]
  if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
    raise CheckpointError(f"config.json in {path!r}: {field} {v!r} is not an integer >= "
                          f"{minimum}")
  return v


def _expected(k: int, l: int, d: int, v: int) -> dict[str, tuple[int, ...]]:
  out = {}
  for h in range(k):
    for j in range(l):
      out[f"{h}.{j}.linear.weight"] = (d, d)
      out[f"{h}.{j}.linear.bias"] = (d,)
    out[f"{h}.{l}.weight"] = (v, d)
  return out


def _check_target(c: dict[str, Any], ckpt: _Checkpoint, l: int, target_cfg: ModelConfig,
                  path: str) -> None:
  """Width and vocabulary against the target, from config.json and from head 0's shape."""
  shape = ckpt.meta.get(f"0.{l}.weight", (None, None))[0]
  sources = [("config.json's hidden_size", c.get("hidden_size"), target_cfg.dim,
              "hidden size"),
             ("config.json's vocab_size", c.get("vocab_size"), target_cfg.vocab_size,
              "vocabulary"),
             ("head 0's width", shape[-1] if len(shape) == 2 else None, target_cfg.dim,
              "hidden size"),
             ("head 0's rows", shape[0] if len(shape) == 2 else None, target_cfg.vocab_size,
              "vocabulary")]
  for what, have, want, name in sources:
    if have is not None and have != want:
      raise ValueError(f"Medusa heads {path!r} were built for another target "
                       f"({c.get('base_model_name_or_path', 'unnamed')}): {what} is {have}, "
                       f"this target's {name} is {want}")


def _check_tensors(ckpt: _Checkpoint, expected: dict[str, tuple[int, ...]]) -> None:
  names = set(ckpt.meta)
  missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
  if missing:
    raise CheckpointError(f"{ckpt.file}: {len(missing)} tensor(s) missing, e.g. {missing[:3]}: "
                          "config.json does not describe these heads")
  if extra:
    raise CheckpointError(f"{ckpt.file}: {len(extra)} tensor(s) Medusa heads do not have, e.g. "
                          f"{extra[:3]}: config.json does not describe these heads")
  for name, shape in expected.items():
    have, dtype = ckpt.meta[name]
    if have != shape:
      raise CheckpointError(f"{ckpt.file}: tensor {name!r} has shape {have}, but config.json "
                            f"implies {shape}")
    if dtype not in _FLOATS:
      raise CheckpointError(f"{ckpt.file}: tensor {name!r} has dtype {dtype}, not a float")


def load_published_medusa(path: str, target_cfg: ModelConfig, target_params: Params,
                          top_k: int = TOP_K) -> tuple[MedusaDrafter, Params]:
  """(MedusaDrafter, draft_params) of a FasterDecoding Medusa head directory.

  Raises:
    ValueError: heads built for another target (hidden size, vocabulary).
    CheckpointError (a ValueError): missing files or fields, missing, extra or
      misshapen tensors, wrong dtypes, non-finite weights, unreadable files.
  """
  c = read_config_json(path, "Medusa head directory")
  k = _count(c, "medusa_num_heads", 1, path)
  l = _count(c, "medusa_num_layers", 0, path)
  if os.path.isfile(os.path.join(path, SAFETENSORS)):
    ckpt = _open_safetensors(os.path.join(path, SAFETENSORS))
  elif os.path.isfile(os.path.join(path, PICKLE)):
    ckpt = _open_pickle(os.path.join(path, PICKLE))
  else:
    raise CheckpointError(f"{path!r} holds no {SAFETENSORS} or {PICKLE}")
  _check_target(c, ckpt, l, target_cfg, path)
  d, v = target_cfg.dim, target_cfg.vocab_size
  _check_tensors(ckpt, _expected(k, l, d, v))

  def w(name: str) -> np.ndarray:
    a = np.asarray(ckpt.get(name), np.float32)
    if not all_finite(a):
      raise CheckpointError(f"{ckpt.file}: tensor {name!r} holds non-finite values (NaN or "
                            "inf): the checkpoint is corrupt")
    return a

  dtype = np.dtype(compute_dtype(target_params))  # held in it from the start: [K, V, D] is big
  res_w = np.zeros((k, l, d, d), dtype)
  res_b = np.zeros((k, l, d), dtype)
  head = np.zeros((k, v, d), dtype)
  for h in range(k):
    for j in range(l):
      res_w[h, j] = w(f"{h}.{j}.linear.weight").T  # [out, in] -> [in, out]
      res_b[h, j] = w(f"{h}.{j}.linear.bias")
    head[h] = w(f"{h}.{l}.weight")
  return medusa_drafter(target_cfg, target_params, {"res_w": res_w, "res_b": res_b,
                                                    "head": head}, top_k=top_k)
