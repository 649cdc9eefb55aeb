"""Reduced draft vocabularies (FR-Spec / EAGLE-3 style) and drafts initialised from the target.

Convention shared with the speculative drafters:
  * the draft is an ordinary specjax model with ``vocab_size = Vd``;
  * ``vocab_map`` [Vd] int32 holds the target id of each draft row;
  * the draft reads target ids through ``input_map`` [V] (target id -> draft
    row). A draft ships its own: ids outside the map read the row of the
    in-map token whose target embedding is nearest (cosine), so prompt words
    outside the draft vocabulary keep an approximate meaning. Without a
    shipped map, ``input_map(vocab_map, V)`` sends them to row 0, the fallback
    row (``vocab_map[0]`` = target id 0, ``<|endoftext|>`` for SmolLM2);
  * its logits are lifted to the target vocabulary with -inf outside the map
    (``lift_logits``) before any sampling warp, so those tokens get q = 0 and
    verification stays lossless.
Example: vocab_map = [0, 7, 3] -> input_map = [0, 0, 0, 2, 0, 0, 0, 1, ...].
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

FALLBACK_ROW = 0


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


def _check_target_table(target_embed, target_vocab_size: int, dim: int) -> None:
  want = (target_vocab_size, dim)
  if tuple(np.shape(target_embed)) != want:
    raise ValueError(f"input_embed must be the target's {list(want)} embedding table, got "
                     f"{tuple(np.shape(target_embed))}")


def full_input(vocab_map: np.ndarray, target_embed, target_vocab_size: int,
               dim: int) -> dict[str, jax.Array]:
  """The arrays a reduced draft of width ``dim`` adds to its params to read every target id
  (``model.embed_inputs``): ``input_embed``, the target's [V, D] table (shared, not
  copied), and ``input_rows`` [V], the draft row of each id in ``vocab_map``, else -1.

  Example: vocab_map [0, 7, 3], V = 8 -> input_rows [0, -1, -1, 2, -1, -1, -1, 1].

  Raises:
    ValueError: ``target_embed`` is not [target_vocab_size, dim].
  """
  _check_target_table(target_embed, target_vocab_size, dim)
  rows = np.full((target_vocab_size,), -1, np.int32)
  vocab_map = np.asarray(vocab_map)
  rows[vocab_map] = np.arange(len(vocab_map), dtype=np.int32)
  return dict(input_embed=jnp.asarray(target_embed, jnp.float32), input_rows=jnp.asarray(rows))


def full_input_embed(own_embed, vocab_map: np.ndarray, target_embed,
                     target_vocab_size: int) -> np.ndarray:
  """[V, D] the table ``full_input`` reads, written out (a new array): the target's rows,
  with the draft's own (trained) rows at its ``vocab_map`` ids. For exports that need
  one table (``specjax.drafts.expand_to_full_vocab``).

  Example: vocab_map [0, 7, 3] -> row 7 is the draft's row 1, row 5 the target's row 5.

  Raises:
    ValueError: ``target_embed`` is not [target_vocab_size, D] for the draft's width D.
  """
  own = np.asarray(own_embed, np.float32)
  _check_target_table(target_embed, target_vocab_size, own.shape[1])
  table = np.array(target_embed, np.float32)
  table[np.asarray(vocab_map)] = own
  return table


def input_map(vocab_map: jax.Array, target_vocab_size: int) -> jax.Array:
  """[V] target id -> draft row; ids outside the map -> FALLBACK_ROW (0)."""
  vm = jnp.asarray(vocab_map, jnp.int32)
  return jnp.zeros((target_vocab_size,), jnp.int32).at[vm].set(
      jnp.arange(vm.shape[0], dtype=jnp.int32))


def lift_logits(draft_logits: jax.Array, vocab_map: jax.Array, target_vocab_size: int) -> jax.Array:
  """[..., Vd] draft logits -> [..., V] with -inf for target ids outside the map."""
  full = jnp.full(draft_logits.shape[:-1] + (target_vocab_size,), -jnp.inf, draft_logits.dtype)
  return full.at[..., jnp.asarray(vocab_map)].set(draft_logits)


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
