"""Tree-masked attention over a cache: semantics, input checks, the compact mask.

Axes: B batch, T new (tree) tokens, S cache slots, N query heads, K kv heads,
G = N / K query heads per kv head, H head dim, W = ceil(T / 32) mask words.

The T new tokens' keys and values are already written to the cache at slots
``lengths[b] + j``. New token i of row b sees:

* every committed slot ``s < lengths[b]`` (no mask is read there);
* tree slot ``s = lengths[b] + j`` (j < T, s < S) iff ``mask[b, i, j]``;
* nothing else.

Example: lengths=[2], T=3, mask=[[1,0,0],[1,1,0],[1,0,1]] (node 0 the root,
nodes 1 and 2 its children): token 2 sees slots {0, 1, 2, 4}.

A row with no visible slot is undefined (the kernels return zeros); a token
that sees itself never hits that case.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_inputs(q, k, v, lengths, mask, *, max_tree_tokens: int | None = None,
                 dtypes=SUPPORTED_DTYPES) -> None:
  """Raises ValueError on inconsistent shapes or dtypes (static: runs before tracing).

  Args:
    q: [B, T, N, H] queries of the new tokens.
    k: [B, K, S, H] the layer's keys, new tokens included.
    v: [B, K, S, H] the layer's values.
    lengths: [B] int committed slots per row.
    mask: [T, T] or [B, T, T] bool, which new tokens each new token sees.
    max_tree_tokens: largest T accepted (the kernels' budget), or None.
    dtypes: accepted dtypes of q, k and v, or None for any float.
  """
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"q must be [B, T, N, H] and k [B, K, S, H]; got q {q.shape}, k {k.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
  b, t, n, h = q.shape
  kb, kh, s, kd = k.shape
  if kb != b:
    raise ValueError(f"batch of q ({b}) and of the cache ({kb}) differ")
  if kd != h:
    raise ValueError(f"head dim of q ({h}) and of the cache ({kd}) differ")
  if kh == 0 or n % kh:
    raise ValueError(f"{n} query heads are not a multiple of {kh} kv heads")
  if t > s:
    raise ValueError(f"T={t} new tokens do not fit a cache of {s} slots")
  if max_tree_tokens is not None and t > max_tree_tokens:
    raise ValueError(f"T={t} new tokens exceed the kernels' budget of {max_tree_tokens} "
                     "(BlockSizes.max_tree_tokens)")
  if tuple(lengths.shape) != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be [B]=[{b}] integers, got {lengths.shape} {lengths.dtype}")
  if tuple(mask.shape) not in ((t, t), (b, t, t)):
    raise ValueError(f"mask must be [T, T]=[{t}, {t}] or [B, T, T]=[{b}, {t}, {t}], "
                     f"got {tuple(mask.shape)}")
  if mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be bool, got {mask.dtype}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if dtypes is None:
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got {x.dtype}")
    elif jnp.dtype(x.dtype) not in dtypes:
      raise ValueError(f"{name} dtype {x.dtype} unsupported; expected one of "
                       f"{[str(d) for d in dtypes]}")


def ancestor_mask(parents) -> np.ndarray:
  """[T, T] bool: node i sees itself and its ancestors (parents[i] < i, the root's -1).

  Example: parents (-1, 0, 0) -> [[1,0,0], [1,1,0], [1,0,1]].
  """
  t = len(parents)
  mask = np.eye(t, dtype=bool)
  for i, p in enumerate(parents):
    while p >= 0:
      mask[i, p] = True
      p = parents[p]
  return mask


def batched_mask(mask: jax.Array, batch_size: int) -> jax.Array:
  """[T, T] or [B, T, T] -> [B, T, T]."""
  return mask if mask.ndim == 3 else jnp.broadcast_to(mask, (batch_size,) + mask.shape)


def pack_mask(mask: jax.Array) -> jax.Array:
  """Ancestor bitmask: [B, T, T] bool -> [B, T, W] int32, bit j % 32 of word j // 32.

  Example: the row [1, 0, 1] packs to the word 0b101 = 5.
  """
  b, t, _ = mask.shape
  w = -(-t // 32)
  bits = jnp.pad(mask, ((0, 0), (0, 0), (0, 32 * w - t))).reshape(b, t, w, 32)
  weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
  words = jnp.sum(bits.astype(jnp.uint32) * weights, axis=-1, dtype=jnp.uint32)  # distinct bits
  return jax.lax.bitcast_convert_type(words, jnp.int32)


def tree_bits_visible(words, rel, num_tokens: int):
  """In-kernel unpacking: which (row, slot) pairs are visible tree slots.

  Args:
    words: list of W arrays [M, 1] int32, word w of each query row's bitmask.
    rel: [1, C] int32 slot minus the row's length (tree index j where 0 <= j < T).
    num_tokens: T.

  Returns:
    [M, C] bool: 0 <= rel < T and bit rel of the row's mask is set. Only
    elementwise ops (shifts, compares), so it lowers on Mosaic and Triton.
  """
  bit = jnp.bitwise_and(rel, 31)
  word_index = jnp.right_shift(rel, 5)
  seen = None
  for w, word in enumerate(words):
    hit = (jnp.bitwise_and(jnp.right_shift(word, bit), 1) == 1) & (word_index == w)
    seen = hit if seen is None else seen | hit
  return seen & (rel >= 0) & (rel < num_tokens)


class KernelRows(NamedTuple):
  """What both kernels start from: queries regrouped into rows, and the packed tree mask.

  Rows are the T tokens x G query heads of one kv head, token-major (M = T*G),
  so one (row, kv head) is a single [M, H] x [S, H]^T product.

  Attributes:
    q: [B, K, M, H] the regrouped queries.
    bits: [B, M, W] int32 ancestor bitmask of each row's token (``pack_mask``).
    num_tokens: T.
    group: G.
    sm_scale: the score scale (1 / sqrt(H) unless given).
  """

  q: jax.Array
  bits: jax.Array
  num_tokens: int
  group: int
  sm_scale: float


def kernel_rows(q, k, v, lengths, mask, *, max_tree_tokens: int,
                sm_scale: float | None = None) -> KernelRows:
  """Checks the inputs (``check_inputs``) and regroups them for a kernel (``KernelRows``)."""
  check_inputs(q, k, v, lengths, mask, max_tree_tokens=max_tree_tokens)
  b, t, n, h = q.shape
  kh = k.shape[1]
  g = n // kh
  bits = jnp.repeat(pack_mask(batched_mask(mask, b)), g, axis=1)
  qm = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
  return KernelRows(qm, bits, t, g, 1.0 / np.sqrt(h) if sm_scale is None else sm_scale)


def from_rows(out: jax.Array, rows: KernelRows) -> jax.Array:
  """[B, K, M, H] kernel output rows -> [B, T, N, H] (the inverse of the regrouping)."""
  b, kh, _, h = out.shape
  t, g = rows.num_tokens, rows.group
  return out.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, kh * g, h)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def tree_attention_reference(q, k, v, lengths, mask, *, sm_scale: float | None = None):
  """Dense reference with fp32 accumulation: [B, T, N, H] -> [B, T, N, H] (q's dtype).

  Args: as ``check_inputs``; ``sm_scale`` defaults to 1 / sqrt(H).
  """
  check_inputs(q, k, v, lengths, mask, dtypes=None)
  b, t, n, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  g = n // kh
  sm_scale = 1.0 / np.sqrt(h) if sm_scale is None else sm_scale
  mask = batched_mask(mask, b)
  rel = jnp.arange(s)[None, :] - lengths[:, None].astype(jnp.int32)  # [B, S]
  tree = jnp.take_along_axis(mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :],
                                                    (b, t, s)), axis=2)
  visible = (rel < 0)[:, None, :] | (((rel >= 0) & (rel < t))[:, None, :] & tree)  # [B, T, S]
  qg = q.astype(jnp.float32).reshape(b, t, kh, g, h)
  scores = jnp.einsum("btkgh,bksh->btkgs", qg, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * sm_scale
  scores = jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)
  peak = jnp.max(scores, axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  probs = jnp.exp(scores - peak)
  total = jnp.sum(probs, axis=-1, keepdims=True)
  probs = probs / jnp.where(total > 0, total, 1.0)  # rows seeing nothing -> zeros
  out = jnp.einsum("btkgs,bksh->btkgh", probs, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(b, t, n, h).astype(q.dtype)
