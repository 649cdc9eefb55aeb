"""Reduced draft vocabularies (FR-Spec / EAGLE-3 style): how a drafter reads and writes them.

Convention shared by the drafters, the draft files (``specjax.drafts``) and
training (``specjax.distill.vocab``, which chooses the vocabulary):
  * the draft is an ordinary specjax model with ``vocab_size = Vd``;
  * ``vocab_map`` [Vd] int32 holds the target id of each draft row;
  * the draft reads target ids through ``input_map`` [V] (target id -> draft
    row). A draft ships its own: ids outside the map read the row of the
    in-map token whose target embedding is nearest (cosine,
    ``distill.vocab.nearest_input_map``), so prompt words outside the draft
    vocabulary keep an approximate meaning. Without a shipped map,
    ``input_map(vocab_map, V)`` sends them to row 0, the fallback row
    (``vocab_map[0]`` = target id 0, ``<|endoftext|>`` for SmolLM2); a draft of
    the target's width may instead read them through the target's own rows
    (``full_input``);
  * its logits count as lifted to the target vocabulary with -inf outside the map
    (``lift_logits``) before any sampling warp, so those tokens get q = 0 and
    verification stays lossless; a drafter samples over its Vd rows instead
    (``sampling.sample_subset``, the same law) and hands q over as
    ``sampling.SubsetProbs`` on the map, which the acceptance rules read at
    width Vd.
Example: vocab_map = [0, 7, 3] -> input_map = [0, 0, 0, 2, 0, 0, 0, 1, ...].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FALLBACK_ROW = 0


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
