"""Choosing a reduced draft vocabulary (FR-Spec / EAGLE-3 style) and drafts initialised
from the target: the training side.

The convention a reduced draft is read and served by (``vocab_map``,
``input_map``, logits lifted with -inf outside the map) belongs to the
runtime, ``specjax.drafters.reduced_vocab``; this module picks the map
(``select_vocab``, by expected token counts), the nearest-row input map a
draft ships (``nearest_input_map``) and the draft's initial weights
(``init_from_target``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.kernels.packed import unpack_params
from specjax.model import Params


def select_vocab(counts: np.ndarray, size: int, fallback_id: int = 0,
                 always: Sequence[int] = ()) -> np.ndarray:
  """vocab_map: ``fallback_id``, then ``always`` (e.g. chat-template special tokens),
  then the most frequent other ids. Ties are broken by the smaller id (deterministic).
  """
  counts = np.asarray(counts, np.float64).copy()
  first = [fallback_id] + [int(a) for a in always if a != fallback_id]
  if not len(first) <= size <= len(counts):
    raise ValueError(f"draft vocabulary size must be in [{len(first)}, {len(counts)}], got {size}")
  counts[first] = -np.inf
  order = np.lexsort((np.arange(len(counts)), -counts))
  return np.concatenate([first, order[:size - len(first)]]).astype(np.int32)


def nearest_input_map(vocab_map: np.ndarray, target_embed: np.ndarray,
                      chunk: int = 4096) -> np.ndarray:
  """[V] target id -> draft row: its own row if in the map, else the row of the in-map
  token with the most similar (cosine) target embedding."""
  e = np.asarray(target_embed, np.float32)
  e = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-6)
  m = e[np.asarray(vocab_map)]
  out = np.empty(len(e), np.int32)
  for i in range(0, len(e), chunk):
    out[i:i + chunk] = np.argmax(e[i:i + chunk] @ m.T, axis=1)
  out[np.asarray(vocab_map)] = np.arange(len(vocab_map), dtype=np.int32)
  return out


@dataclasses.dataclass(frozen=True)
class DraftSpec:
  """Architecture of a draft cut out of the target.

  Attributes:
    vocab_size: Vd (None = the full target vocabulary).
    layers: which target layers initialise the draft's layers (its depth).
  """

  vocab_size: Optional[int] = 8192
  layers: tuple[int, ...] = (0,)


def init_from_target(target_cfg: ModelConfig, target_params: Params, spec: DraftSpec,
                     vocab_map: Optional[np.ndarray]) -> tuple[ModelConfig, Params]:
  """A draft with the target's width: embedding rows, chosen layers and final norm copied."""
  vd = target_cfg.vocab_size if vocab_map is None else len(vocab_map)
  cfg = dataclasses.replace(target_cfg, vocab_size=vd, num_layers=len(spec.layers),
                            tie_embeddings=True, name="llama")
  embed = jnp.asarray(target_params["embed"])
  if vocab_map is not None:
    embed = embed[jnp.asarray(vocab_map)]
  copy = lambda t: jax.tree.map(lambda a: jnp.array(a, jnp.float32), t)
  layers = unpack_params(target_params, target_cfg.tie_embeddings)["layers"]
  params = {"embed": copy(embed), "layers": [copy(layers[i]) for i in spec.layers],
            "final_norm": copy(target_params["final_norm"])}
  return cfg, params


def token_counts(records: Sequence[dict], vocab_size: int) -> np.ndarray:
  """Expected counts of each target id in the responses: Σ_positions p(x) over the top-k,
  plus the produced tokens themselves (so greedy and sampled choices both count; records
  without a stored top-k count their tokens only)."""
  counts = np.zeros(vocab_size, np.float64)
  for r in records:
    np.add.at(counts, r["response"], 1.0)
    if "topk_ids" in r:  # (id-only records: the produced tokens alone)
      np.add.at(counts, r["topk_ids"].ravel(), np.exp(r["topk_logp"]).ravel())
  return counts
