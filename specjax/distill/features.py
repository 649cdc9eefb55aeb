"""The target's features (last hidden state before the final norm) over a corpus, cached on disk.

EAGLE-style drafters read the target's features; training them teacher-forced
needs the feature at every position of every prompt + response. Features are
computed once per corpus with the frozen target (length-sorted batches, one
jitted forward per padded length) and stored as float16 next to the corpus:
``<corpus>/features-<split>.npy`` ([total tokens, D], records concatenated in
corpus order) with ``features-<split>.json`` (per-record lengths and the
target it came from). A file is never misread: one from another target is
refused; when the corpus has grown by records appended at its end (more
generation shards) only the new records are computed and appended; any other
change of the records recomputes the file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from typing import Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import files
from specjax import kv_cache as kvc
from specjax.config import ModelConfig
from specjax.distill.teacher import length_batches, target_shape
from specjax.loaders.hf import CheckpointError
from specjax.model import Params, compute_dtype, forward, target_features


@functools.partial(jax.jit, static_argnames=("cfg", "layers"))
def _hidden(params: Params, cfg: ModelConfig, tokens: jax.Array, layers=()) -> jax.Array:
  b, l = tokens.shape
  if layers:  # the layers above the highest asked for change nothing it reads
    m = max(layers) + 1
    cfg, params = dataclasses.replace(cfg, num_layers=m), dict(params, layers=params["layers"][:m])
  out = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(l), (b, l)),
                kvc.init_cache(cfg, b, l, compute_dtype(params)), compute_logits=False,
                return_layers=layers)
  return target_features(out, layers).astype(jnp.float16)


_PAD_TO = 32  # sequence lengths are padded to a multiple of this (few programs)


def _feature_batches(params: Params, cfg: ModelConfig, sequences: Sequence[np.ndarray],
                     batch_size: int, layers: tuple[int, ...], pad_to: int = _PAD_TO
                     ) -> Iterator[tuple[list[int], np.ndarray]]:
  """(indices into ``sequences``, their padded [B, L, F] float16 features), one jitted
  forward per batch of similar lengths."""
  for idx, l in length_batches([len(s) for s in sequences], batch_size, pad_to):
    tokens = np.zeros((batch_size, l), np.int32)  # fixed B: one program per length
    for r, j in enumerate(idx):
      tokens[r, :len(sequences[j])] = sequences[j]
    yield idx, np.asarray(_hidden(params, cfg, jnp.asarray(tokens), tuple(layers)))


def sequence_features(params: Params, cfg: ModelConfig, sequences: Sequence[np.ndarray],
                      batch_size: int = 8, pad_to: int = _PAD_TO,
                      progress: Optional[Callable[[int], None]] = None,
                      layers: tuple[int, ...] = ()) -> list[np.ndarray]:
  """[len(seq), F] float16 features of each token sequence (teacher-forced, causal):
  the last hidden state, or ``layers``' outputs concatenated."""
  out: list[Optional[np.ndarray]] = [None] * len(sequences)
  for idx, hidden in _feature_batches(params, cfg, sequences, batch_size, layers, pad_to):
    for r, j in enumerate(idx):
      out[j] = hidden[r, :len(sequences[j])]
    if progress:
      progress(len(idx))
  return out


def record_sequence(record: dict) -> np.ndarray:
  return np.concatenate([record["prompt"], record["response"]]).astype(np.int32)


def _tokens_digests(records: Sequence[dict], prefix: int) -> tuple[str, str]:
  """The sha256 of the first ``prefix`` records' tokens and of all of them, in one pass."""
  h = hashlib.sha256()
  head = h.hexdigest() if prefix == 0 else None
  for i, r in enumerate(records):
    h.update(record_sequence(r).tobytes())
    if i + 1 == prefix:
      head = h.hexdigest()
  return head, h.hexdigest()


def corpus_features(directory: str, split: str, records: Sequence[dict], params: Params,
                    cfg: ModelConfig, batch_size: int = 8, progress: bool = True,
                    layers: tuple[int, ...] = ()) -> None:
  """Attaches ``record["features"]`` ([prompt + response, F] float16) to every record,
  computing and caching them on the first call (one file per set of ``layers``)."""
  layers = tuple(int(l) for l in layers)
  lens = [len(r["prompt"]) + len(r["response"]) for r in records]
  tag = "" if not layers else "-layers" + "_".join(map(str, layers))
  path = os.path.join(directory, f"features-{split}{tag}")
  stored = None
  if os.path.exists(path + ".json") and os.path.exists(path + ".npy"):
    with open(path + ".json") as f:
      stored = json.load(f)
  old = stored["lengths"] if stored else []
  old_sha, sha = _tokens_digests(records, len(old))  # old_sha None: fewer records than cached
  meta = dict(target=target_shape(cfg), lengths=lens, tokens_sha256=sha)
  if layers:
    meta["layers"] = list(layers)
  width = cfg.dim * max(1, len(layers))
  kept = 0  # leading records whose stored features are reused
  if stored:
    apart = ("lengths", "tokens_sha256", "target")  # (the records; the target below)
    # every target field the file records must be ours (files written before 2026-12-05
    # recorded four of them)
    theirs = stored.get("target") or {}
    same_target = bool(theirs) and all(meta["target"].get(f) == v for f, v in theirs.items())
    if (not same_target or {k: v for k, v in stored.items() if k not in apart}
        != {k: v for k, v in meta.items() if k not in apart}):
      raise CheckpointError(f"{path}.npy was computed for another target; delete it to "
                            "recompute")
    flat = np.load(path + ".npy", mmap_mode="r")
    if flat.shape != (sum(old), width):
      raise CheckpointError(f"{path}.npy has shape {flat.shape}, expected {(sum(old), width)}")
    if old == lens[:len(old)] and stored.get("tokens_sha256") == old_sha:
      kept = len(old)
    else:
      logging.warning("%s.npy was computed for other records: recomputing it", path)
  offs = np.concatenate([[0], np.cumsum(lens)])
  if kept < len(records):
    import tqdm
    bar = tqdm.tqdm(total=len(records) - kept, desc=f"target features ({split})",
                    disable=not progress)
    # Written into the file as computed, not gathered in memory first: EAGLE-3's fused
    # features of one 1.8 M-position corpus are 6.2 GB.
    with files.atomic_path(path + ".npy", ".npy") as tmp:
      out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16,
                                      shape=(int(offs[-1]), width))
      for start in range(0, int(offs[kept]), 1 << 20):  # the cached records, in chunks
        stop = min(int(offs[kept]), start + (1 << 20))
        out[start:stop] = flat[start:stop]
      new = [record_sequence(r) for r in records[kept:]]
      for idx, hidden in _feature_batches(params, cfg, new, batch_size, layers):
        for row, j in enumerate(idx):
          out[offs[kept + j]:offs[kept + j + 1]] = hidden[row, :len(new[j])]
        bar.update(len(idx))
      out.flush()
      del out
    bar.close()
    if kept:
      logging.info("%s.npy: %d records appended to the %d cached", path,
                   len(records) - kept, kept)
    files.write_text(path + ".json", json.dumps(meta))
    flat = np.load(path + ".npy", mmap_mode="r")  # as on a cache hit: mapped, not in memory
  for i, r in enumerate(records):
    r["features"] = flat[offs[i]:offs[i + 1]]
