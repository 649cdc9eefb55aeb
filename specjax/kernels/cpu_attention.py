"""Decode and verify attention on CPU (an XLA FFI kernel), beside its reference.

``cpu_attention(q, k, v, lengths, mask)`` has the semantics of
``specjax.attention.attention``: new token i of row b sees every committed slot
``< lengths[b]`` and window slot ``lengths[b] + j`` iff ``mask[b, i, j]``, and a
query that sees nothing gets zeros. With a [B, T, T] mask that is
``pallas_kernels.tree_attention.reference``; with a [B, T, W] window (W > T:
the new tokens are the last T of W slots, as a drafter extending a tree writes
them) it is the reference path's ``visibility``. ``reference`` below spells
both out in jnp, and the tests hold the kernel to it.

The kernel (``cpu_attention.cc``) reads only the slots below ``lengths[b] + W``
and streams each (row, kv head)'s keys and values once for all the queries that
share them; XLA's CPU attention over the static cache costs several times that
(``benchmarks/cpu_attention.py``). It is float32 only and has no derivative:
``specjax.attention`` runs its own reference whenever the call is
differentiated. Negative lengths count as 0; the scratch per pool thread is
T x G x (lengths + W) floats, which ``MAX_TOKENS`` bounds for "auto".

``specjax.attention`` routes CPU calls with windows of at most ``MAX_TOKENS``
slots here ("auto"); the library is built like the streaming matmul's
(``kernels/build.py``). ``available()`` is False, with the reason in
``unavailable_reason()``, off CPU, under ``SPECJAX_NO_KERNELS`` or when the
build fails; "auto" then keeps the jnp reference.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention.reference import tree_attention_reference
from specjax.kernels import build

_TARGET = "specjax_cpu_attention"
_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_attention.cc")
_FLAGS = ("-march=native",)
# Widest window "auto" sends here: decode, verify, tree drafting and prefill chunks. In
# benchmarks/cpu_attention.py (S = 512 slots, empty cache) prefills of 32 / 64 / 256 tokens
# ran 11x / 6x / 1.4x faster than the reference, but 512 tokens 0.66x: the kernel costs
# about 90 ns per (query, visible slot) against the reference's 60 ns per (query, cache
# slot), so it wins by reading fewer slots, which a window filling most of the cache
# does not offer. (A one-off probe with S = 1024 had measured 2.0x at 512 tokens.)
MAX_TOKENS = 256


def reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
              mask: jax.Array) -> jax.Array:
  """What ``cpu_attention`` computes, in jnp: ``tree_attention_reference`` over a window.

  A [B, T, W] mask (W > T) is widened to the [B, W, W] mask of all W window
  tokens (the first W - T rows see nothing and are dropped), which is the
  same visibility.
  """
  b, t, w = mask.shape
  if w > t:
    q = jnp.concatenate([jnp.zeros((b, w - t) + q.shape[2:], q.dtype), q], axis=1)
    mask = jnp.concatenate([jnp.zeros((b, w - t, w), bool), mask], axis=1)
  return tree_attention_reference(q, k, v, lengths, mask)[:, w - t:]


@functools.lru_cache(maxsize=None)
def _register() -> Optional[str]:
  """Builds (once) and registers the FFI target; returns why not, or None."""
  if os.environ.get("SPECJAX_NO_KERNELS"):
    return "disabled by SPECJAX_NO_KERNELS"
  if jax.default_backend() != "cpu":
    return f"backend is {jax.default_backend()}, not cpu"
  try:
    path = build.library_path(_SOURCE, "cpu_attention", _FLAGS)
    if not os.path.exists(path):
      build.build_library(path, _FLAGS, _SOURCE)
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.SpecjaxCpuAttention),
                                platform="cpu")
  except (OSError, RuntimeError, AttributeError) as e:
    return f"could not build the CPU attention kernel: {e}"
  return None


def available() -> bool:
  """Whether ``cpu_attention`` runs here (CPU backend and a built kernel)."""
  return _register() is None


def unavailable_reason() -> Optional[str]:
  return _register()


def supports(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
  """Whether the kernel takes these operands: float32, head dim a multiple of 8 up to 256."""
  h = q.shape[-1]
  return (all(x.dtype == jnp.float32 for x in (q, k, v)) and h % 8 == 0 and h <= 256)


def _call(q, k, v, lengths, mask):
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  return jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(
      q, k, v, lengths.astype(jnp.int32), mask)


def cpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                  mask: jax.Array) -> jax.Array:
  """Attention of T new tokens over a layer's cache, on the CPU kernel.

  Args:
    q: [B, T, N, H] float32 queries of the new tokens (RoPE applied).
    k: [B, K, S, H] float32 keys, the new tokens' already at lengths[b] + j.
    v: [B, K, S, H] float32 values.
    lengths: [B] int committed slots per row.
    mask: [B, T, W] bool, W >= T: new token i sees window slot lengths[b] + j iff
      mask[b, i, j] (W = T: the new tokens themselves).

  Returns:
    [B, T, N, H] float32.

  Raises:
    RuntimeError: the kernel is not available here (``unavailable_reason``).
    ValueError: operands it does not take (``supports``), no kv heads, or inconsistent
      shapes.

  Example: lengths [2], T = 2 causal: token 0 sees slots {0, 1, 2}, token 1 {0, 1, 2, 3},
  as ``tree_attention_reference`` says.
  """
  reason = _register()
  if reason is not None:
    raise RuntimeError(reason)
  if not supports(q, k, v):
    raise ValueError(f"cpu_attention takes float32 operands with a head dim that is a "
                     f"multiple of 8 up to 256; got {q.dtype}/{k.dtype}/{v.dtype}, head dim "
                     f"{q.shape[-1]}")
  b, t = q.shape[:2]
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[1] < 1 \
      or k.shape[3] != q.shape[3] or q.shape[2] % k.shape[1] or mask.ndim != 3 \
      or mask.shape[:2] != (b, t) or mask.shape[2] < t or mask.dtype != jnp.bool_ \
      or lengths.shape != (b,):
    raise ValueError(f"want q [B, T, N, H], k and v [B, K, S, H], lengths [B], mask [B, T, W] "
                     f"bool; got {q.shape}, {k.shape}, {v.shape}, {lengths.shape}, "
                     f"{mask.shape} {mask.dtype}")
  return _call(q, k, v, lengths, mask)
