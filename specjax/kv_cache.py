"""Static-shape key/value cache with per-row lengths.

The cache is a pytree of fixed shape. Row ``b`` holds ``lengths[b]`` committed
entries in slots ``[0, lengths[b])``; anything beyond is scratch that the next
write overwrites. Rolling back (rejecting draft tokens) is therefore only a
length update, never a re-slice.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specjax.config import ModelConfig


@flax.struct.dataclass(kw_only=True)
class KVCache:
  """Per-layer keys and values.

  Attributes:
    k: L-tuple of [B, S, K, H] keys (RoPE already applied). One array per
      layer, so each layer's write is an in-place scatter with no slicing.
    v: L-tuple of [B, S, K, H] values.
    lengths: [B] int32, number of committed slots per row.
  """

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  lengths: jax.Array

  @property
  def size(self) -> int:
    """S, the number of slots per row."""
    return self.k[0].shape[1]

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  def rollback(self, lengths: jax.Array) -> "KVCache":
    """Keeps only the first ``lengths[b]`` entries of each row (never grows a row)."""
    return self.replace(lengths=jnp.minimum(self.lengths, lengths.astype(jnp.int32)))

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return self.replace(lengths=lengths.astype(jnp.int32))


def init_cache(cfg: ModelConfig, batch_size: int, size: int,
               dtype: jnp.dtype = jnp.float32) -> KVCache:
  """An empty cache of ``size`` slots per row."""
  shape = (batch_size, size, cfg.num_kv_heads, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                 lengths=jnp.zeros((batch_size,), jnp.int32))


def write_layer(cache_layer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes ``new`` [B, T, K, H] into ``cache_layer`` [B, S, K, H] at slots start[b] + t.

  Writes past the end of the cache are dropped (the callers validate capacity
  up front, so only scratch writes of finished rows can fall off the end).
  """
  b, t = new.shape[:2]
  rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
  slots = start[:, None] + jnp.arange(t)[None, :]
  return cache_layer.at[rows, slots].set(new.astype(cache_layer.dtype), mode="drop")
