"""Tree-masked attention over a cache, Pallas GPU (Triton) kernel, flash-decoding style.

T is small and S large, so parallelism comes from the cache: grid
(B, K, num_kv_splits, row blocks). Each program walks its split of the cache
in ``block_kv_gpu`` chunks with an online softmax and writes an unnormalised
partial output with its running max and denominator; the splits are then
combined by a log-sum-exp reduction outside the kernel.

Rows are the T tokens x G query heads of one kv head (token-major), padded to
a power of two (Triton block shapes). Within a split, chunks wholly inside the
committed prefix run unmasked; the remaining chunks up to ``lengths[b] + T``
unpack the ancestor bitmask; later chunks are never visited.

The Triton backend is selected by passing ``plgpu.CompilerParams`` explicitly
(jax 0.10 sends a bare ``pallas_call`` on GPU to Mosaic GPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_attention.block_sizes import BlockSizes
from pallas_kernels.tree_attention.reference import from_rows, kernel_rows, tree_bits_visible


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _kernel(lengths_ref,  # [B] int32
            q_ref,        # [block_q, H]
            k_ref,        # [S, H] one (row, kv head) of the cache
            v_ref,        # [S, H]
            bits_ref,     # [block_q, W] int32 ancestor bitmask of each row's token
            o_ref,        # [block_q, H] f32 unnormalised partial output of this split
            m_ref,        # [block_q] f32 running max of this split
            l_ref,        # [block_q] f32 denominator of this split
            *, sm_scale: float, block_kv: int, split_len: int, num_tokens: int, size: int):
  block_q, h = q_ref.shape
  length = lengths_ref[pl.program_id(0)]
  split_start = pl.program_id(2) * split_len
  split_end = split_start + split_len
  q = q_ref[...]
  # f32 operands are multiplied in full precision (Triton's default for an f32 dot is tf32,
  # ~1e-3 off the reference on an H100); bf16 operands use the tensor cores as they are.
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  words = [bits_ref[:, pl.ds(w, 1)] for w in range(bits_ref.shape[1])]  # W x [block_q, 1]
  chunk = jnp.arange(block_kv, dtype=jnp.int32)

  def body(masked: bool, i, carry):
    acc, m_prev, l_prev = carry
    start = split_start + i * block_kv
    slot = start + chunk  # [block_kv]
    in_cache = slot < size
    k = plgpu.load(k_ref.at[pl.ds(start, block_kv), :], mask=in_cache[:, None], other=0.0)
    v = plgpu.load(v_ref.at[pl.ds(start, block_kv), :], mask=in_cache[:, None], other=0.0)
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [block_q, block_kv] f32
    if masked:
      rel = (slot - length)[None, :]
      visible = (rel < 0) | (tree_bits_visible(words, rel, num_tokens) & in_cache[None, :])
      s = jnp.where(visible, s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # nothing seen yet: p = 0, not NaN
    alpha = jnp.exp(m_prev - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_next, alpha * l_prev + jnp.sum(p, axis=1)

  carry = (jnp.zeros((block_q, h), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  # Chunks [0, n_prefix) lie wholly below the row's length: no mask needed.
  n_prefix = jnp.clip((jnp.minimum(length, split_end) - split_start) // block_kv,
                      0, split_len // block_kv)
  end = jnp.minimum(jnp.minimum(length + num_tokens, size), split_end)
  n_chunks = jnp.clip(pl.cdiv(end - split_start, block_kv), 0, split_len // block_kv)
  carry = jax.lax.fori_loop(0, n_prefix, functools.partial(body, False), carry)
  acc, m_i, l_i = jax.lax.fori_loop(n_prefix, n_chunks, functools.partial(body, True), carry)
  o_ref[...] = acc
  m_ref[...] = m_i
  l_ref[...] = l_i


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "num_warps",
                                             "num_stages", "interpret"))
def tree_attention_gpu(q, k, v, lengths, mask, *, sm_scale: float | None = None,
                       block_sizes: BlockSizes | None = None, num_warps: int | None = None,
                       num_stages: int = 2, interpret: bool = False):
  """Tree-masked attention (semantics in ``reference.py``) as a Pallas Triton kernel.

  Args:
    q: [B, T, N, H] queries of the new tokens (H a power of two >= 16 on GPU).
    k: [B, K, S, H] keys, the new tokens' at slots lengths[b] + j.
    v: [B, K, S, H] values.
    lengths: [B] int committed slots per row.
    mask: [T, T] or [B, T, T] bool among the new tokens.
    sm_scale: score scale, default 1 / sqrt(H).
    block_sizes: static tiling, default ``BlockSizes.get_default()``.
    num_warps: Triton warps, default 4 for H <= 64 else 8.
    num_stages: Triton pipeline stages.
    interpret: run on CPU through the HLO interpreter.

  Returns:
    [B, T, N, H] in q's dtype.
  """
  block_sizes = block_sizes or BlockSizes.get_default()
  rows = kernel_rows(q, k, v, lengths, mask, max_tree_tokens=block_sizes.max_tree_tokens,
                     sm_scale=sm_scale)
  t = rows.num_tokens
  b, kh, m, h = rows.q.shape
  s = k.shape[2]
  block_q = min(block_sizes.block_q_gpu, max(16, _next_pow2(m)))
  m_pad = pl.cdiv(m, block_q) * block_q
  block_kv = min(block_sizes.block_kv_gpu, max(16, _next_pow2(s)))
  split_len = pl.cdiv(pl.cdiv(s, block_sizes.num_kv_splits), block_kv) * block_kv
  num_splits = pl.cdiv(s, split_len)

  # Triton blocks are powers of two: pad the rows to block_q and the mask words to a power.
  w = _next_pow2(rows.bits.shape[-1])
  bits = jnp.pad(rows.bits, ((0, 0), (0, m_pad - m), (0, w - rows.bits.shape[-1])))
  qm = jnp.pad(rows.q, ((0, 0), (0, 0), (0, m_pad - m), (0, 0)))

  kernel = functools.partial(_kernel, sm_scale=rows.sm_scale, block_kv=block_kv,
                             split_len=split_len,
                             num_tokens=t, size=s)
  acc, m_i, l_i = pl.pallas_call(
      kernel,
      grid=(b, kh, num_splits, m_pad // block_q),
      in_specs=[
          pl.BlockSpec((b,), lambda bi, hi, si, qi: (0,)),
          pl.BlockSpec((None, None, block_q, h), lambda bi, hi, si, qi: (bi, hi, qi, 0)),
          pl.BlockSpec((None, None, s, h), lambda bi, hi, si, qi: (bi, hi, 0, 0)),
          pl.BlockSpec((None, None, s, h), lambda bi, hi, si, qi: (bi, hi, 0, 0)),
          pl.BlockSpec((None, block_q, w), lambda bi, hi, si, qi: (bi, qi, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, block_q, h), lambda bi, hi, si, qi: (bi, hi, si, qi, 0)),
          pl.BlockSpec((None, None, None, block_q), lambda bi, hi, si, qi: (bi, hi, si, qi)),
          pl.BlockSpec((None, None, None, block_q), lambda bi, hi, si, qi: (bi, hi, si, qi)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, kh, num_splits, m_pad, h), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, num_splits, m_pad), jnp.float32),
                 jax.ShapeDtypeStruct((b, kh, num_splits, m_pad), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps or (4 if h <= 64 else 8),
                                           num_stages=num_stages),
      interpret=interpret,
      name="tree_attention_gpu",
  )(lengths.astype(jnp.int32), qm, k, v, bits)

  # Log-sum-exp combination of the splits; empty splits (m = -inf) weigh 0.
  peak = jnp.max(m_i, axis=2, keepdims=True)
  peak = jnp.where(peak == -jnp.inf, 0.0, peak)
  scale = jnp.exp(m_i - peak)  # [B, K, splits, M_pad]
  denom = jnp.sum(l_i * scale, axis=2)
  out = jnp.sum(acc * scale[..., None], axis=2) / jnp.where(denom > 0, denom, 1.0)[..., None]
  return from_rows(out[:, :, :m].astype(q.dtype), rows)
