"""Streaming small-M matmul for CPU decode and verify steps, beside its reference.

``streaming_matmul(x, panels)`` computes ``x @ w`` for x [M, K] and a weight
stored as column panels ``panels[p] = w[:, 64p : 64p + 64]`` ([P, K, 64]).
Decode (M = batch) and verify (M = batch x (γ + 1)) steps are dominated by such
products; XLA's CPU GEMM packs its operands and costs 2-3x the M = 1 GEMV for
M = 2..16, which by itself erases speculative decoding's gain. The kernel
(``streaming_matmul.cc``, an XLA FFI custom call) reads each contiguous panel
once and reuses it for all rows, so a verify step costs about one decode step.

The shared library is compiled on first use with the system C++ compiler and
the XLA FFI headers that ship with jaxlib, and cached under
``~/.cache/specjax/kernels`` keyed by source, jaxlib version and CPU.
``available()`` is False (with the reason in ``unavailable_reason()``) when
the backend is not CPU or the build fails; callers then keep XLA's dot.
``reference`` is the pure-jnp definition the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

PANEL = 64
_TARGET = "specjax_streaming_matmul"
_SOURCE = os.path.join(os.path.dirname(__file__), "streaming_matmul.cc")


def reference(x: jax.Array, panels: jax.Array) -> jax.Array:
  """x [M, K] @ panels [P, K, 64] -> [M, P * 64] float32, in plain jnp."""
  y = jnp.einsum("mk,pkc->mpc", x, panels, preferred_element_type=jnp.float32)
  return y.reshape(x.shape[0], -1)


def _cpu_signature() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      flags = next((line for line in f if line.startswith("flags")), "")
  except OSError:
    flags = ""
  return platform.machine() + flags


def _library_path() -> str:
  with open(_SOURCE, "rb") as f:
    source = f.read()
  key = hashlib.sha256(source + jax.lib.__version__.encode()
                       + _cpu_signature().encode()).hexdigest()[:16]
  cache = os.path.join(os.path.expanduser("~"), ".cache", "specjax", "kernels")
  return os.path.join(cache, f"streaming_matmul-{key}.so")


def _build(path: str) -> None:
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise RuntimeError("no C++ compiler (g++/c++ or $CXX) on PATH")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
    out = os.path.join(tmp, "lib.so")
    cmd = [compiler, "-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared",
           "-fPIC", "-w", "-I", jax.ffi.include_dir(), _SOURCE, "-o", out]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    os.replace(out, path)  # atomic: concurrent builders never see a partial file


@functools.lru_cache(maxsize=None)
def _register() -> Optional[str]:
  """Builds (once) and registers the FFI target; returns why not, or None."""
  if os.environ.get("SPECJAX_NO_KERNELS"):
    return "disabled by SPECJAX_NO_KERNELS"
  if jax.default_backend() != "cpu":
    return f"backend is {jax.default_backend()}, not cpu"
  try:
    path = _library_path()
    if not os.path.exists(path):
      _build(path)
    lib = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.SpecjaxStreamingMatmul),
                                platform="cpu")
  except (OSError, RuntimeError, AttributeError) as e:
    return f"could not build the streaming matmul kernel: {e}"
  return None


def available() -> bool:
  """Whether ``streaming_matmul`` runs here (CPU backend and a built kernel)."""
  return _register() is None


def unavailable_reason() -> Optional[str]:
  return _register()


def streaming_matmul(x: jax.Array, panels: jax.Array) -> jax.Array:
  """x [M, K] float32 @ panels [P, K, 64] float32 -> [M, P * 64] float32 (CPU kernel)."""
  reason = _register()
  if reason is not None:
    raise RuntimeError(reason)
  if x.ndim != 2 or panels.ndim != 3 or panels.shape[1:] != (x.shape[1], PANEL):
    raise ValueError(f"want x [M, K] and panels [P, K, {PANEL}], got {x.shape} and "
                     f"{panels.shape}")
  if x.dtype != jnp.float32 or panels.dtype != jnp.float32:
    raise ValueError(f"streaming_matmul is float32 only, got {x.dtype} and {panels.dtype}")
  out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * PANEL), jnp.float32)
  return jax.ffi.ffi_call(_TARGET, out, vmap_method="sequential")(x, panels)


def to_panels(w: np.ndarray | jax.Array) -> np.ndarray:
  """[K, N] -> [ceil(N / 64), K, 64] column panels, zero-padded on the right."""
  w = np.asarray(w)
  k, n = w.shape
  pad = -n % PANEL
  if pad:
    w = np.pad(w, ((0, 0), (0, pad)))
  return np.ascontiguousarray(w.reshape(k, -1, PANEL).transpose(1, 0, 2))
