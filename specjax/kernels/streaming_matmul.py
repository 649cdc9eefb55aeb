"""Streaming small-M matmul for CPU decode and verify steps, beside its reference.

``streaming_matmul(x, panels)`` computes ``x @ w`` for x [M, K] and a weight
stored as column panels ``panels[p] = w[:, Wp : Wp + W]`` ([P, K, W]), of float32 or of
float16 (``HALF``: widened to float32 as each vector loads, so half the bytes stream and
the result is the float32 kernel's on the same float16 values, bit for bit). The panel
width W is the built library's (``panel_width``): 64 floats on AVX-512 and the
portable path, 16 (one cache line per panel row) on AVX2; ``to_panels`` packs
for it.
Decode (M = batch) and verify (M = batch x (γ + 1)) steps are dominated by such
products; XLA's CPU GEMM packs its operands and costs 2-3x the M = 1 GEMV for
M = 2..16, which by itself erases speculative decoding's gain. The kernel
(``streaming_matmul.cc``, an XLA FFI custom call) reads each contiguous panel
once and reuses it for all rows, so a verify step costs about one decode step.

The shared library is compiled on first use with the system C++ compiler and
the XLA FFI headers that ship with jaxlib, and cached under
``~/.cache/specjax/kernels`` keyed by source (and its shared headers), jaxlib version and
CPU (``build.library_path``).
``available()`` is False (with the reason in ``unavailable_reason()``) when
the backend is not CPU or the build fails; callers then keep XLA's dot.
``reference`` is the pure-jnp definition the kernel is tested against.

Variants (``VARIANTS``): ``"native"`` is built with ``-march=native`` and runs
the best path of this CPU (AVX-512, AVX2/FMA or portable vector code, see
``isa()``); ``"avx2"`` forces the AVX2/FMA path, so that path is built and
tested on AVX-512 machines too (it needs a CPU with AVX2 and FMA). Whether the
kernel or XLA's dot runs for a given number of rows, and whether the kernel
prefetches, is decided by measurement (``kernels/policy.py``), not here.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import build
from specjax.kernels.build import cache_dir, cpu_flags, cpu_model, cpu_signature, cpuinfo_field  # noqa: F401  (re-exported)

_TARGET = "specjax_streaming_matmul"
# Compiler flags per variant; "avx2" defines SPECJAX_ISA_AVX2 (see the .cc header).
VARIANTS = {
    "native": ("-march=native",),
    "avx2": ("-march=native", "-mavx2", "-mfma", "-mf16c", "-DSPECJAX_ISA_AVX2"),
}
_SOURCE = os.path.join(os.path.dirname(__file__), "streaming_matmul.cc")


# The width packing uses where no kernel is built (the reference contraction takes any).
DEFAULT_PANEL = 64
# The panel dtypes the kernel reads: float32, and float16 widened to float32 in registers.
PANEL_DTYPES = (jnp.float32, jnp.float16)
HALF = jnp.float16
# ``streaming_matmul(prefetch=)``'s modes: off, the prefetches it turns on hinted into L2
# (prefetcht1), or non-temporal (prefetchnta). Which is fastest depends on the host and M
# (``policy.py`` measures them).
PREFETCH_MODES = {0: "off", 1: "into L2", 2: "non-temporal"}


def _one_pass_rows(source: str = _SOURCE) -> int:
  """The kernel's row block ``B`` in ``Panel`` (streaming_matmul.cc), read from the source so
  that the two cannot part: up to this many rows the kernel reads each panel in one pass
  (one register block of rows over the whole panel row), so there is no pass from cache
  for ``prefetch`` to work in."""
  with open(source) as f:
    found = re.findall(r"constexpr int B = (\d+);", f.read())
  if len(found) != 1:
    raise RuntimeError(f"{source}: expected one 'constexpr int B = <rows>;' (Panel's row "
                       f"block), found {len(found)}")
  return int(found[0])


ONE_PASS_ROWS = _one_pass_rows()


def reference(x: jax.Array, panels: jax.Array) -> jax.Array:
  """x [M, K] @ panels [P, K, W] -> [M, P * W] float32, in plain jnp."""
  y = jnp.einsum("mk,pkc->mpc", x, panels, preferred_element_type=jnp.float32)
  return y.reshape(x.shape[0], -1)


def source_hash() -> str:
  return build.source_hash(_SOURCE)


def _library_path(variant: str) -> str:
  return build.library_path(_SOURCE, f"streaming_matmul-{variant}", VARIANTS[variant])


def build_library(path: str, variant: str, source: str = _SOURCE) -> None:
  """Compiles ``source`` (default: the kernel's own) with the variant's flags into ``path``."""
  build.build_library(path, VARIANTS[variant], source)


_ISA: dict[str, str] = {}
_PANEL: dict[str, int] = {}
_PREFETCH_ROWS: dict[str, int] = {}


@functools.lru_cache(maxsize=None)
def _register(variant: str = "native") -> Optional[str]:
  """Builds (once) and registers the variant's FFI target; returns why not, or None."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown kernel variant {variant!r}; choose from {sorted(VARIANTS)}")
  if os.environ.get("SPECJAX_NO_KERNELS"):
    return "disabled by SPECJAX_NO_KERNELS"
  if jax.default_backend() != "cpu":
    return f"backend is {jax.default_backend()}, not cpu"
  if variant == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
    return "this CPU has no AVX2/FMA/F16C"
  try:
    path = _library_path(variant)
    if not os.path.exists(path):
      build_library(path, variant)
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(_target(variant),
                                jax.ffi.pycapsule(lib.SpecjaxStreamingMatmul), platform="cpu")
    jax.ffi.register_ffi_target(_target(variant, HALF),
                                jax.ffi.pycapsule(lib.SpecjaxStreamingMatmulF16), platform="cpu")
    lib.SpecjaxStreamingMatmulIsa.restype = ctypes.c_char_p
    _ISA[variant] = lib.SpecjaxStreamingMatmulIsa().decode()
    lib.SpecjaxStreamingMatmulPanel.restype = ctypes.c_int
    _PANEL[variant] = int(lib.SpecjaxStreamingMatmulPanel())
    lib.SpecjaxStreamingMatmulPrefetchRows.restype = ctypes.c_int
    _PREFETCH_ROWS[variant] = int(lib.SpecjaxStreamingMatmulPrefetchRows())
  except (OSError, RuntimeError, AttributeError) as e:
    return f"could not build the streaming matmul kernel: {e}"
  return None


def _target(variant: str, dtype=jnp.float32) -> str:
  name = _TARGET if variant == "native" else f"{_TARGET}_{variant}"
  return name + ("_f16" if jnp.dtype(dtype) == jnp.float16 else "")


def available(variant: str = "native") -> bool:
  """Whether ``streaming_matmul`` runs here (CPU backend and a built kernel)."""
  return _register(variant) is None


def unavailable_reason(variant: str = "native") -> Optional[str]:
  return _register(variant)


def isa(variant: str = "native") -> Optional[str]:
  """The instruction-set path the variant was built with: "avx512", "avx2" or "portable"."""
  return _ISA.get(variant) if available(variant) else None


def panel_width(variant: str = "native") -> int:
  """Columns per panel the variant's kernel takes (``DEFAULT_PANEL`` where none is built)."""
  return _PANEL[variant] if available(variant) else DEFAULT_PANEL


def widens_halves_in_hardware(variant: str = "native") -> bool:
  """Whether the variant's kernel widens float16 panels with a vector instruction (AVX-512's
  and AVX2's paths: ``vcvtph2ps``); the portable path converts each value in software, so
  float16 panels may be slower than float32 ones there."""
  return isa(variant) in ("avx512", "avx2")


def prefetch_rows(variant: str = "native") -> int:
  """The fewest rows at which ``streaming_matmul(prefetch=...)`` differs from ``0``: 1 where
  it also drives the streaming pass's prefetch (the AVX-512 path), else ONE_PASS_ROWS + 1
  (only the passes from cache prefetch), also where no kernel is built."""
  return _PREFETCH_ROWS[variant] if available(variant) else ONE_PASS_ROWS + 1


def streaming_matmul(x: jax.Array, panels: jax.Array, variant: str = "native",
                     prefetch: int = 0) -> jax.Array:
  """x [M, K] float32 @ panels [P, K, W] float32 or float16 -> [M, P * W] float32 (CPU kernel).

  W must be the variant's ``panel_width``: pack with ``to_panels(w, variant)``. Float16
  panels are widened to float32 as they load: the bits of float32 panels holding the same
  values, with half the bytes read.

  ``prefetch`` (a mode of ``PREFETCH_MODES``: 0 off, 1 hinted into L2, 2 non-temporal; a
  bool is 0 or 1): software-prefetch the next panel while one is computed from cache
  (M > ONE_PASS_ROWS; on the AVX-512 path the row blocks then take turns over k-blocks of
  32 panel rows, prefetching the next one) and, on the AVX-512 path, the streamed panel
  ahead of the first pass (any M; the AVX2 path always does that for M > 1, into L1);
  below ``prefetch_rows(variant)`` rows it does nothing. The same bits in every mode, only
  the speed differs by host.
  """
  try:
    ok = int(prefetch) in PREFETCH_MODES and prefetch == int(prefetch)
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise ValueError(f"prefetch must be one of {PREFETCH_MODES} (or a bool), got {prefetch!r}")
  reason = _register(variant)
  if reason is not None:
    raise RuntimeError(reason)
  width = _PANEL[variant]
  if x.ndim != 2 or panels.ndim != 3 or panels.shape[1:] != (x.shape[1], width):
    raise ValueError(f"want x [M, K] and panels [P, K, {width}] (the {variant} kernel's "
                     f"panel width), got {x.shape} and {panels.shape}")
  if x.dtype != jnp.float32 or panels.dtype not in PANEL_DTYPES:
    raise ValueError(f"streaming_matmul takes float32 x and float32 or float16 panels, got "
                     f"{x.dtype} and {panels.dtype}")
  out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * width), jnp.float32)
  return jax.ffi.ffi_call(_target(variant, panels.dtype), out, vmap_method="sequential")(
      x, panels, prefetch=np.int32(prefetch))


def to_panels(w: np.ndarray | jax.Array, variant: str = "native",
              width: Optional[int] = None) -> np.ndarray:
  """[K, N] -> [ceil(N / W), K, W] column panels, zero-padded on the right.

  W is ``width`` if given, else the variant's ``panel_width``.
  """
  width = panel_width(variant) if width is None else width
  w = np.asarray(w)
  k, n = w.shape
  pad = -n % width
  if pad:
    w = np.pad(w, ((0, 0), (0, pad)))
  return np.ascontiguousarray(w.reshape(k, -1, width).transpose(1, 0, 2))
