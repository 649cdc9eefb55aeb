"""JAX's persistent compilation cache, kept beside specjax's other caches.

An experiment compiles dozens of programs (one per draft, γ or tree, and temperature).
With the cache on, a later process that compiles the same program (same HLO, jax
version, flags and device) reads the executable from disk instead, so a rerun or a
resumed run skips most compiling: the first speculative call of a fresh process on the
embedded model spends about 10 s compiling cold and 3.5 s warm on the 2-core development
machine, tracing and lowering included (``python -m benchmarks.cold_start``).
Outputs are unchanged: the cache key covers everything the program depends on.

  >>> import specjax.compile_cache
  >>> path = specjax.compile_cache.enable()   # before anything compiles
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from specjax.loaders.embedded import cache_dir


def default_path() -> str:
  """``$SPECJAX_CACHE/xla`` (``~/.cache/specjax/xla`` by default)."""
  return os.path.join(cache_dir(), "xla")


def enable(path: Optional[str] = None, min_compile_seconds: float = 0.5) -> Optional[str]:
  """Turns the persistent compilation cache on for this process.

  Call it before the first compilation: JAX decides once, at its first compile,
  whether a cache is in use. A ``JAX_COMPILATION_CACHE_DIR`` already set in the
  environment wins over ``path``.

  Args:
    path: the cache directory (default ``default_path()``); created if missing.
    min_compile_seconds: programs that compile faster than this are not stored.

  Returns:
    The directory in use, or None when it cannot be created (the cache stays off).
  """
  path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or path or default_path()
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
  return path
