"""The one attention entry point: new tokens' queries against a layer's KV cache.

Every forward (prefill, decode, chain or tree verification, EAGLE's draft
layers) goes through ``attention``. Semantics: the T new tokens' keys and
values are already written at slots ``lengths[b] + j``; new token i sees every
committed slot ``< lengths[b]`` and new slot j iff ``mask[b, i, j]``
(``pallas_kernels/tree_attention/reference.py`` spells it out).

Implementations, chosen by the static ``impl`` name:

  "reference"             dense [B, T, S] visibility mask in plain jnp (the
                          model's attention before this module existed).
  "cpu"                   the CPU FFI kernel (``kernels/cpu_attention.py``):
                          reads only each row's filled slots, and scores a
                          query bit-identically whatever else is in the call.
                          Float32, head dim a multiple of 8; differentiated
                          calls compute the reference's value and gradient.
  "pallas_tpu"            Pallas Mosaic kernel (TPU).
  "pallas_gpu"            Pallas Triton kernel, flash-decoding (GPU).
  "pallas"                whichever of the two matches the default backend.
  "pallas_tpu_interpret", "pallas_gpu_interpret"
                          the same kernels in Pallas interpret mode, on CPU
                          (tests, debugging).
  "auto"                  "cpu" on CPU where it is built and takes the block
                          (the reference otherwise: longer blocks, other
                          dtypes; differentiated calls run the reference
                          inside the kernel's wrapper), "pallas" on TPU and
                          GPU (the reference there too for window masks and
                          for more new tokens than the kernels' tree budget).

Under a mesh of more than one device (``sharding``) the reference is XLA's, which
GSPMD partitions; a kernel runs under ``jax.shard_map`` on each device's rows and
kv heads (``sharding.per_device``), since GSPMD would gather a custom call's
operands whole.

``SPECJAX_ATTENTION=<name>`` in the environment replaces "auto" everywhere (e.g.
"reference", XLA's attention, as the measured alternative to the Pallas kernels
on a GPU: ``scripts/accelerator_tables.sh``); it is read when a program is traced.
The choice is logged once per (name, backend).
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_attention.reference import batched_mask, check_inputs
from specjax import sharding
from specjax.kernels import cpu_attention
from specjax.kernels.accumulate import einsum_f32

IMPLS = ("auto", "reference", "cpu", "pallas", "pallas_tpu", "pallas_gpu",
         "pallas_tpu_interpret", "pallas_gpu_interpret")

ENV = "SPECJAX_ATTENTION"  # replaces "auto" (see the module docstring)
_logged: set[tuple[str, str, str]] = set()


ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")  # backends whose "auto" is a Pallas kernel


def pallas_variant(backend: str, kernel: str) -> str:
  """The Pallas build of a kernel for ``backend``: "pallas_tpu" or "pallas_gpu".

  Raises:
    ValueError: on any other backend, naming the ``kernel`` (e.g. "attention").
  """
  if backend == "tpu":
    return "pallas_tpu"
  if backend in ACCELERATORS:
    return "pallas_gpu"
  raise ValueError(f"no Pallas {kernel} kernel for backend {backend!r}; use 'reference' or an "
                   "'*_interpret' implementation")


def resolve_impl(impl: str, backend: str | None = None) -> str:
  """Maps an implementation name to a concrete one (never "auto" or "pallas").

  Raises:
    ValueError: unknown name, "pallas" on a backend without a kernel, or "cpu" where
      the CPU kernel is not available (the reason is in the message).

  Resolving "auto" or "cpu" on CPU builds the CPU kernel (once per machine, cached).
  """
  if impl not in IMPLS:
    raise ValueError(f"unknown attention implementation {impl!r}; expected one of {IMPLS}")
  if impl == "auto" and os.environ.get(ENV):
    impl = os.environ[ENV]
    if impl not in IMPLS:
      raise ValueError(f"{ENV}={impl!r} is not an attention implementation; expected one of "
                       f"{IMPLS}")
  backend = backend or jax.default_backend()
  resolved = impl
  if impl == "auto":
    if backend in ACCELERATORS:
      resolved = "pallas"
    else:
      resolved = "cpu" if backend == "cpu" and cpu_attention.available() else "reference"
  if resolved == "cpu" and (backend != "cpu" or not cpu_attention.available()):
    why = (cpu_attention.unavailable_reason() if backend == "cpu"
           else f"backend is {backend}, not cpu")
    raise ValueError(f"the 'cpu' attention kernel does not run here ({why}); use 'reference'")
  if resolved == "pallas":
    resolved = pallas_variant(backend, "attention")
  if (impl, resolved, backend) not in _logged:
    _logged.add((impl, resolved, backend))
    logging.info("specjax attention: impl=%r -> %r on %s", impl, resolved, backend)
  return resolved


def visibility(lengths: jax.Array, mask: jax.Array, size: int) -> jax.Array:
  """[B, T, S] which cache slots each new token attends to (the reference path).

  Slots below ``lengths[b]`` are the committed prefix (always visible); the
  T new tokens sit in slots ``lengths[b] + j`` and are visible per ``mask``.
  Example: lengths=[2], T=2, causal -> token 0 sees slots {0,1,2}, token 1 {0,1,2,3}.
  """
  slots = jnp.arange(size)[None, :]
  rel = slots - lengths[:, None]  # [B, S]
  t = mask.shape[-1]
  in_new = (rel >= 0) & (rel < t)
  gathered = jnp.take_along_axis(
      mask, jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :],
                             mask.shape[:2] + (size,)), axis=2)
  return (rel < 0)[:, None, :] | (in_new[:, None, :] & gathered)


# Above this many bytes of keys per layer, dense_attention computes K q^T instead of q K^T.
CACHE_MAJOR_SCORES_BYTES = 8 << 20


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
  """Grouped-query attention: q [B,T,N,H], k/v [B,K,S,H], visible [B,T,S] -> [B,T,N,H].

  The T new tokens and the G = N/K query heads sharing a kv head are merged
  into one M = T*G axis, so each (row, kv head) is one product against the
  cache as stored. Which product is a static choice by size: q [M, H] x
  K^T is a "transposed-B" batched product that XLA:CPU runs ~2.5x slower
  once a layer's keys no longer fit in cache (B = 256, S = 320: 57 ms a
  layer, against 24 ms for K [S, H] x q^T [H, M]); below 8 MiB of keys the
  two orders are within a few percent of each other and q K^T is kept
  (``python -m benchmarks.attention_layout``, AMD EPYC). Both agree to
  rounding.
  """
  b, t, n, h = q.shape
  kh, s = k.shape[1], k.shape[2]
  g = n // kh
  if k.size * k.dtype.itemsize <= CACHE_MAJOR_SCORES_BYTES:
    q = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
    scores = einsum_f32("bkmh,bksh->bkms", q, k)
  else:
    q_t = q.reshape(b, t, kh, g, h).transpose(0, 2, 4, 1, 3).reshape(b, kh, h, t * g)
    scores = jnp.swapaxes(
        einsum_f32("bksh,bkhm->bksm", k, q_t), 2, 3)
  scores = scores.reshape(b, kh, t, g, s) * (1.0 / np.sqrt(h))
  scores = jnp.where(visible[:, None, :, None], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(b, kh, t * g, s)
  out = einsum_f32("bkms,bksh->bkmh", probs, v).astype(v.dtype).reshape(b, kh, t, g, h)
  return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def _cpu_kernel_takes(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> bool:
  """Whether "auto" sends this block to the CPU kernel: operands it takes and a window
  of at most ``cpu_attention.MAX_TOKENS`` slots (longer prefills go to the reference)."""
  return cpu_attention.supports(q, k, v) and mask.shape[-1] <= cpu_attention.MAX_TOKENS


def _reference(q, k, v, lengths, mask):
  """The reference path over a [B, T, W] mask."""
  return dense_attention(q, k, v, visibility(lengths, mask, k.shape[2]))


@jax.custom_vjp
def _cpu_kernel(q, k, v, lengths, mask):
  """The CPU kernel; differentiated (training), the reference path's value and gradient,
  so training computes exactly what it did before the kernel existed."""
  return cpu_attention.cpu_attention(q, k, v, lengths, mask)


def _cpu_kernel_fwd(q, k, v, lengths, mask):
  return _reference(q, k, v, lengths, mask), (q, k, v, lengths, mask)


def _cpu_kernel_bwd(res, g):
  q, k, v, lengths, mask = res
  _, vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, lengths, mask), q, k, v)
  return (*vjp(g), None, None)


_cpu_kernel.defvjp(_cpu_kernel_fwd, _cpu_kernel_bwd)


def _kernels_take(mask: jax.Array, t: int, block_sizes) -> bool:
  """Whether the kernels accept this block: a [.., T, T] mask and T within their budget
  (window masks, prefill and teacher-forced training are for the reference)."""
  from pallas_kernels.tree_attention.block_sizes import BlockSizes
  budget = (block_sizes or BlockSizes.get_default()).max_tree_tokens
  return mask.shape[-1] == t and t <= budget


def attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, mask: jax.Array,
              *, impl: str = "auto", block_sizes=None) -> jax.Array:
  """Attention of T new tokens over a layer's cache, through the chosen implementation.

  Args:
    q: [B, T, N, H] queries of the new tokens (RoPE applied).
    k: [B, K, S, H] the layer's keys, the new tokens' already at lengths[b] + j.
    v: [B, K, S, H] the layer's values.
    lengths: [B] int committed slots per row (before the new tokens).
    mask: [T, T] or [B, T, T] bool, which new tokens each new token sees; or
      [B, T, W], W > T (the reference and "cpu" only; "auto" picks one of them
      on every backend): the new tokens are the last T of a window of W slots
      from lengths[b], and see window slot j iff mask.
    impl: static implementation name (see the module docstring).
    block_sizes: ``pallas_kernels.tree_attention.BlockSizes`` for the kernels.

  Returns:
    [B, T, N, H]; v's dtype on the reference path, q's on the kernels (float32
    on "cpu").

  Raises:
    ValueError (at trace time, before any Pallas kernel is built): unknown ``impl``,
    mismatched shapes or head counts, a mask of the wrong shape or dtype, an
    unsupported dtype or T over the kernels' budget.
  """
  t = q.shape[1]
  resolved = resolve_impl(impl)
  if impl == "auto":
    takes = (_cpu_kernel_takes(q, k, v, mask) if resolved == "cpu"
             else _kernels_take(mask, t, block_sizes))
    resolved = resolved if takes else "reference"
  window = mask.shape[-1] != t  # W > T slots (tree drafting, EAGLE's training-time test)
  if window and (resolved not in ("reference", "cpu") or mask.shape[-2] != t
                 or mask.shape[-1] < t):
    raise ValueError(f"a [.., T, W] window mask needs W >= T={t} and the reference or cpu "
                     f"implementation; got {tuple(mask.shape)} with impl {resolved!r}")
  if not window:  # (on the global shapes: on a mesh the kernels see only their shards')
    check_inputs(q, k, v, lengths, mask, dtypes=None)
  if resolved == "reference":  # XLA's: GSPMD partitions it on a mesh
    return _reference(q, k, v, lengths, batched_mask(mask, q.shape[0]))
  # A kernel is a custom call, which GSPMD would gather whole: on a mesh each device runs
  # it on its own rows and kv heads (attention needs nothing from the other shards).
  mask = batched_mask(mask, q.shape[0]) if resolved == "cpu" else mask
  heads = ("batch", None, "kv_heads", None)
  cache = ("batch", "kv_heads", None, None)
  masks = ("batch", None, None) if mask.ndim == 3 else (None, None)
  return sharding.per_device(
      functools.partial(_kernel, resolved, block_sizes), (q, k, v, lengths, mask),
      (heads, cache, cache, ("batch",), masks), heads,
      {"batch": q.shape[0], "kv_heads": k.shape[1]})


def _kernel(resolved: str, block_sizes, q, k, v, lengths, mask) -> jax.Array:
  """The CPU or a Pallas kernel (``resolved``) on these operands."""
  if resolved == "cpu":
    return _cpu_kernel(q, k, v, lengths, mask)
  if resolved.startswith("pallas_tpu"):
    from jax.experimental.pallas import tpu as pltpu
    from pallas_kernels.tree_attention.tpu_kernel import tree_attention_tpu
    interpret = pltpu.InterpretParams() if resolved.endswith("_interpret") else False
    return tree_attention_tpu(q, k, v, lengths, mask, block_sizes=block_sizes,
                              interpret=interpret)
  from pallas_kernels.tree_attention.gpu_kernel import tree_attention_gpu
  return tree_attention_gpu(q, k, v, lengths, mask, block_sizes=block_sizes,
                            interpret=resolved.endswith("_interpret"))
