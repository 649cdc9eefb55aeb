"""A draft directory's tensors on disk: one safetensors file, or shards past one file's size.

Tensors whose bytes fit ``MAX_FILE_BYTES`` go to ``weights.safetensors``. Larger sets go to
``weights-0000i-of-0000n.safetensors`` files of at most ``MAX_FILE_BYTES`` tensor bytes each
(the safetensors header adds a few kB), listed by ``weights.safetensors.index.json`` in HF's
index layout (``weight_map``: tensor name -> file). A tensor larger than one file is
stored as parts ``name@0``, ``name@1``, … whose values, read in C order one after the other,
are the tensor's; the index's ``split`` maps ``name`` to ``{"parts": n, "shape": [...]}``.
The writer cuts the flattened tensor, so no file of a shipped draft goes over 16 MB whatever
its tensors' shapes; the reader also takes parts cut along the leading axes.

The reader refuses an index that names files outside the directory pattern, tensors the
shards do not hold (or hold without listing them), or parts that do not make their tensor.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import numpy as np

from specjax.loaders.hf import CheckpointError, read_json_object

SINGLE_FILE = "weights.safetensors"
INDEX_FILE = "weights.safetensors.index.json"
MAX_FILE_BYTES = 15_000_000  # tensor bytes per file: under 16 MB with the header
PART = "@"  # "head@0": the first part of a split tensor "head"
_SHARD = re.compile(r"weights-(\d{5})-of-(\d{5})\.safetensors")


def write_tensors(path: str, tensors: dict[str, np.ndarray],
                  max_file_bytes: Optional[int] = None) -> None:
  """Writes ``tensors`` into directory ``path`` (made if needed), as one file or as shards of
  at most ``max_file_bytes`` (default ``MAX_FILE_BYTES``) tensor bytes each, after removing
  the weight files of an earlier draft there (so the directory never mixes two).

  Raises:
    ValueError: a limit below one element, or, when sharding, a name containing "@".
  """
  from safetensors.numpy import save_file

  limit = MAX_FILE_BYTES if max_file_bytes is None else max_file_bytes
  tensors = {k: np.require(v, requirements="C") for k, v in tensors.items()}  # keeps 0-d
  widest = max((t.itemsize for t in tensors.values()), default=1)
  if isinstance(limit, bool) or not isinstance(limit, int) or limit < widest:
    raise ValueError(f"max_file_bytes must be an int >= {widest} (one element), got {limit!r}")
  os.makedirs(path, exist_ok=True)
  for name in os.listdir(path):
    if name in (SINGLE_FILE, INDEX_FILE) or _SHARD.fullmatch(name):
      os.remove(os.path.join(path, name))
  if sum(t.nbytes for t in tensors.values()) <= limit:
    save_file(tensors, os.path.join(path, SINGLE_FILE))
    return
  bad = [k for k in tensors if PART in k]
  if bad:
    raise ValueError(f"tensor names {bad} contain {PART!r}, which marks the parts of a split "
                     "tensor in a sharded draft")
  parts, split = {}, {}
  for name, t in tensors.items():
    if t.nbytes <= limit:
      parts[name] = t
      continue
    flat, per = t.reshape(-1), limit // t.itemsize
    chunks = [flat[i:i + per] for i in range(0, flat.size, per)]
    split[name] = {"parts": len(chunks), "shape": list(t.shape)}
    parts.update({f"{name}{PART}{i}": c for i, c in enumerate(chunks)})
  shards: list[dict[str, np.ndarray]] = []
  sizes: list[int] = []  # tensor bytes in each shard so far
  for key, t in parts.items():  # first fit, in the tensors' order
    i = next((i for i, size in enumerate(sizes) if size + t.nbytes <= limit), len(shards))
    if i == len(shards):
      shards.append({})
      sizes.append(0)
    shards[i][key] = t
    sizes[i] += t.nbytes
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"weights-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname))
    weight_map.update(dict.fromkeys(shard, fname))
  index = dict(metadata=dict(total_size=int(sum(t.nbytes for t in parts.values()))),
               weight_map=weight_map, split=split)
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump(index, f, indent=1)


def weight_files(path: str) -> list[str]:
  """The files holding a draft directory's tensors: ``weights.safetensors``, or the index and
  the shards it names (for size reports and copies)."""
  if not os.path.exists(os.path.join(path, INDEX_FILE)):
    return [SINGLE_FILE]
  return [INDEX_FILE] + sorted(set(_read_index(path)[0].values()))


def read_tensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of draft directory ``path``, whole (shards read and split tensors joined).

  Raises:
    CheckpointError: a malformed index, or shards that do not hold what it lists.
    Whatever safetensors raises for a missing or corrupt file.
  """
  from safetensors import safe_open

  def read(fname):
    with safe_open(os.path.join(path, fname), framework="numpy") as f:
      return {k: f.get_tensor(k) for k in f.keys()}

  if not os.path.exists(os.path.join(path, INDEX_FILE)):
    return read(SINGLE_FILE)
  weight_map, split = _read_index(path)
  listed: dict[str, set[str]] = {}
  for key, fname in weight_map.items():
    listed.setdefault(fname, set()).add(key)
  parts = {}
  for fname, keys in sorted(listed.items()):
    got = read(fname)
    if set(got) != keys:
      missing, extra = sorted(keys - set(got)), sorted(set(got) - keys)
      raise CheckpointError(f"{path}/{fname}: " + "; ".join(
          ([f"lacks {missing[:4]}, which {INDEX_FILE} lists there"] if missing else [])
          + ([f"holds {extra[:4]}, which {INDEX_FILE} does not list there"] if extra else [])))
    parts.update(got)
  for name, s in split.items():
    flat = np.concatenate([parts.pop(f"{name}{PART}{i}").reshape(-1)
                           for i in range(s["parts"])])
    if flat.size != int(np.prod(s["shape"])):
      raise CheckpointError(f"{path}: the {s['parts']} parts of {name!r} hold {flat.size} "
                            f"values, not the {s['shape']} its index entry says")
    parts[name] = flat.reshape(s["shape"])
  return parts


def _read_index(path: str) -> tuple[dict[str, str], dict[str, dict]]:
  """(weight_map, split) of ``path``'s index, checked for shape and consistency."""
  where = f"{INDEX_FILE} in {path!r}"
  index = read_json_object(os.path.join(path, INDEX_FILE), where)
  weight_map, split = index.get("weight_map"), index.get("split", {})
  if (not isinstance(weight_map, dict) or not weight_map
      or not all(isinstance(k, str) and isinstance(f, str) for k, f in weight_map.items())):
    raise CheckpointError(f"{where}: no weight_map of tensor names to files")
  bad = sorted({f for f in weight_map.values() if not _SHARD.fullmatch(f)})
  if bad:
    raise CheckpointError(f"{where}: {bad[:4]} are not shard names of this directory "
                          "(weights-0000i-of-0000n.safetensors)")
  if not isinstance(split, dict) or not all(
      isinstance(s, dict) and isinstance(s.get("parts"), int) and s["parts"] >= 1
      and isinstance(s.get("shape"), list)
      and all(isinstance(d, int) and d >= 0 for d in s["shape"]) for s in split.values()):
    raise CheckpointError(f"{where}: split must map names to {{'parts': n >= 1, 'shape': "
                          "[...]}}")
  part_keys = {f"{name}{PART}{i}" for name, s in split.items() for i in range(s["parts"])}
  if set(split) & set(weight_map):
    raise CheckpointError(f"{where}: {sorted(set(split) & set(weight_map))[:4]} are listed "
                          "both whole and split")
  missing = sorted(part_keys - set(weight_map))
  if missing:
    raise CheckpointError(f"{where}: the split tensors' parts {missing[:4]} are not in "
                          "weight_map")
  stray = sorted(k for k in weight_map if PART in k and k not in part_keys)
  if stray:
    raise CheckpointError(f"{where}: {stray[:4]} look like parts of a split tensor, but no "
                          "split entry has them")
  return weight_map, split
