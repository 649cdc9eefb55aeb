"""A fixed-size n-gram pool: for every key token, up to G continuations of n − 1 tokens,
least-recently-used replacement. Lookahead decoding's memory (``lookahead``).

The pool is arrays only, so it lives in a jitted loop's state: ``tokens`` [B, V, G,
n − 1] holds each row's continuations by key (the n-gram's first token), ``stamps``
[B, V, G] when each was last inserted (−1: empty slot), ``clock`` [B] the next stamp.
Inserting a continuation that is already there refreshes its stamp; a new one takes an
empty slot, else the least recently inserted (the reference implementation's
``update_token_map``: a list per key, moved to the end on a repeat, the head dropped
when full). Memory: B·V·G·n int32s (n − 1 tokens and a stamp per slot), 7.9 MB a row for
V = 49152, G = 8, n = 5.

Example (V = 4, G = 2, 2-grams)::

    pool = NgramPool.empty(1, 4, 2, 1)
    pool = pool.insert(jnp.array([3]), jnp.array([[1]]))   # 3 -> 1
    pool = pool.insert(jnp.array([3]), jnp.array([[2]]))   # 3 -> 2
    grams, valid = pool.lookup(jnp.array([3]))             # [[[2], [1]]], [[True, True]]
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class NgramPool:
  """Per-row LRU sets of continuations keyed by token (see the module docstring).

  Attributes:
    tokens: [B, V, G, L] int32 continuations (L = n − 1 tokens after the key).
    stamps: [B, V, G] int32 insertion stamps, −1 for an empty slot.
    clock: [B] int32 the next stamp.
  """

  tokens: jax.Array
  stamps: jax.Array
  clock: jax.Array

  @classmethod
  def empty(cls, batch: int, vocab_size: int, size: int, length: int) -> "NgramPool":
    """A pool of ``size`` (G) continuations of ``length`` (L) tokens per key."""
    return cls(tokens=jnp.zeros((batch, vocab_size, size, length), jnp.int32),
               stamps=jnp.full((batch, vocab_size, size), -1, jnp.int32),
               clock=jnp.zeros((batch,), jnp.int32))

  def insert(self, keys: jax.Array, grams: jax.Array, valid: jax.Array | None = None
             ) -> "NgramPool":
    """Inserts one continuation per row: ``grams[b]`` [L] after ``keys[b]``, where
    ``valid[b]`` (default everywhere)."""
    if valid is None:
      valid = jnp.ones(keys.shape, bool)
    tokens, stamps = jax.vmap(_insert_row)(self.tokens, self.stamps, self.clock,
                                           keys.astype(jnp.int32), grams.astype(jnp.int32),
                                           valid)
    return NgramPool(tokens=tokens, stamps=stamps, clock=self.clock + valid.astype(jnp.int32))

  def insert_sequence(self, tokens: jax.Array, start: jax.Array, stop: jax.Array,
                      max_count: int) -> "NgramPool":
    """Inserts the n-grams of ``tokens`` [B, S] that end at positions ``start[b]`` …
    ``stop[b] − 1`` (those that fit: ending at >= L), oldest first; at most ``max_count``
    (static) per row."""
    length = self.tokens.shape[-1]
    offsets = jnp.arange(-length, 1)

    def body(i, pool):
      end = start + i
      idx = jnp.clip(end[:, None] + offsets[None, :], 0, tokens.shape[1] - 1)
      gram = jnp.take_along_axis(tokens, idx, axis=1)
      return pool.insert(gram[:, 0], gram[:, 1:], (end < stop) & (end >= length))

    return jax.lax.fori_loop(0, max_count, body, self)

  def lookup(self, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(continuations [B, G, L] after ``keys`` [B], most recent first; valid [B, G])."""
    rows = jnp.arange(keys.shape[0])
    grams, stamps = self.tokens[rows, keys], self.stamps[rows, keys]
    order = jnp.argsort(-stamps, axis=1, stable=True)
    return (jnp.take_along_axis(grams, order[:, :, None], axis=1),
            jnp.take_along_axis(stamps, order, axis=1) >= 0)


def _insert_row(tokens, stamps, clock, key, gram, valid):
  slots, st = tokens[key], stamps[key]  # [G, L], [G]
  same = jnp.all(slots == gram[None, :], axis=-1) & (st >= 0)
  idx = jnp.where(jnp.any(same), jnp.argmax(same), jnp.argmin(st))  # repeat, empty, else LRU
  tokens = tokens.at[key, idx].set(jnp.where(valid, gram, slots[idx]))
  stamps = stamps.at[key, idx].set(jnp.where(valid, clock, st[idx]))
  return tokens, stamps
