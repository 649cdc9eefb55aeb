"""Tree-masked attention over a cache, Pallas TPU (Mosaic) kernel.

Grid (B, K, cdiv(S, block_kv)): one (row, kv head) per pair of outer indices,
cache blocks innermost and sequential ("arbitrary"), with an online softmax in
VMEM scratch. The G query heads of a kv head and the T tokens are one
M = T * G row axis (token-major: row m is token m // G), so each block is one
[M, H] x [H, block_kv] product.

Per-row lengths are scalar-prefetched: blocks past ``lengths[b] + T`` are
skipped and their index map is clamped to the last needed block, so no DMA is
issued for them. Blocks wholly inside the committed prefix run without a mask;
only blocks that overlap the tree slots unpack the ancestor bitmask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_attention.block_sizes import BlockSizes
from pallas_kernels.tree_attention.reference import from_rows, kernel_rows, tree_bits_visible

LANES = 128  # m and l scratch are lane-replicated, as in the upstream TPU kernels


def _kernel(lengths_ref,  # [B] int32, SMEM (scalar prefetch)
            q_ref,        # [M, H]
            k_ref,        # [block_kv, H]
            v_ref,        # [block_kv, H]
            bits_ref,     # [M, W] int32 ancestor bitmask of each row's token
            o_ref,        # [M, H]
            m_scr,        # [M, LANES] f32 running max
            l_scr,        # [M, LANES] f32 running denominator
            acc_scr,      # [M, H] f32 running numerator
            *, sm_scale: float, block_kv: int, num_tokens: int, size: int):
  b, c = pl.program_id(0), pl.program_id(2)
  length = lengths_ref[b]
  start = c * block_kv

  @pl.when(c == 0)
  def _init():
    m_scr[...] = jnp.full(m_scr.shape, -jnp.inf, jnp.float32)
    l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
    acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

  def step(masked: bool):
    q = q_ref[...]
    k = k_ref[...]
    v = v_ref[...]
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale  # [M, block_kv]
    if masked:
      slot = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
      rel = slot - length
      words = [bits_ref[:, w:w + 1] for w in range(bits_ref.shape[1])]
      visible = (rel < 0) | (tree_bits_visible(words, rel, num_tokens) & (slot < size))
      s = jnp.where(visible, s, -jnp.inf)
      # Slots past S in a partial last block hold garbage: keep NaNs out of p @ v.
      slot_col = start + jax.lax.broadcasted_iota(jnp.int32, (block_kv, 1), 0)
      v = jnp.where(slot_col < size, v, jnp.zeros_like(v))
    m_prev = m_scr[:, :1]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # nothing seen yet: p = 0, not NaN
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe)
    l_next = alpha * l_scr[:, :1] + jnp.sum(p, axis=1, keepdims=True)
    acc_scr[...] = alpha * acc_scr[...] + jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    m_scr[...] = jnp.broadcast_to(m_next, m_scr.shape)
    l_scr[...] = jnp.broadcast_to(l_next, l_scr.shape)

  prefix_only = start + block_kv <= length
  needed = start < jnp.minimum(length + num_tokens, size)
  pl.when(prefix_only)(lambda: step(masked=False))
  pl.when(jnp.logical_and(needed, jnp.logical_not(prefix_only)))(lambda: step(masked=True))

  @pl.when(c == pl.num_programs(2) - 1)
  def _finish():
    l = l_scr[:, :1]
    o_ref[...] = (acc_scr[...] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def tree_attention_tpu(q, k, v, lengths, mask, *, sm_scale: float | None = None,
                       block_sizes: BlockSizes | None = None, interpret=False):
  """Tree-masked attention (semantics in ``reference.py``) as a Pallas TPU kernel.

  Args:
    q: [B, T, N, H] queries of the new tokens.
    k: [B, K, S, H] keys, the new tokens' at slots lengths[b] + j.
    v: [B, K, S, H] values.
    lengths: [B] int committed slots per row.
    mask: [T, T] or [B, T, T] bool among the new tokens.
    sm_scale: score scale, default 1 / sqrt(H).
    block_sizes: static tiling, default ``BlockSizes.get_default()``.
    interpret: False on TPU; ``pltpu.InterpretParams()`` (or True) on CPU.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  block_sizes = block_sizes or BlockSizes.get_default()
  rows = kernel_rows(q, k, v, lengths, mask, max_tree_tokens=block_sizes.max_tree_tokens,
                     sm_scale=sm_scale)
  qm, bits, t = rows.q, rows.bits, rows.num_tokens  # [B, K, M, H], [B, M, W]
  b, kh, m, h = qm.shape
  s, w = k.shape[2], bits.shape[-1]
  block_kv = min(block_sizes.block_kv, s)
  num_blocks = pl.cdiv(s, block_kv)

  def kv_index(bi, hi, ci, lengths_ref):
    # Clamp to the last block the row needs: repeated indices issue no new DMA.
    last = jnp.maximum(pl.cdiv(jnp.minimum(lengths_ref[bi] + t, s), block_kv) - 1, 0)
    return bi, hi, jnp.minimum(ci, last), 0

  kernel = functools.partial(_kernel, sm_scale=rows.sm_scale, block_kv=block_kv, num_tokens=t,
                             size=s)
  out = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, kh, num_blocks),
          in_specs=[
              pl.BlockSpec((None, None, m, h), lambda bi, hi, ci, _: (bi, hi, 0, 0)),
              pl.BlockSpec((None, None, block_kv, h), kv_index),
              pl.BlockSpec((None, None, block_kv, h), kv_index),
              pl.BlockSpec((None, m, w), lambda bi, hi, ci, _: (bi, 0, 0)),
          ],
          out_specs=pl.BlockSpec((None, None, m, h), lambda bi, hi, ci, _: (bi, hi, 0, 0)),
          scratch_shapes=[pltpu.VMEM((m, LANES), jnp.float32),
                          pltpu.VMEM((m, LANES), jnp.float32),
                          pltpu.VMEM((m, h), jnp.float32)],
      ),
      out_shape=jax.ShapeDtypeStruct((b, kh, m, h), q.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="tree_attention_tpu",
  )(lengths.astype(jnp.int32), qm, k, v, bits)
  return from_rows(out, rows)
