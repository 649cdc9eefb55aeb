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

Compiled programs also live in memory, each holding memory mappings, and a process may hold
only so many: ``release_if_crowded`` frees them all when a long run nears that limit.
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


# A process may hold at most vm.max_map_count memory mappings (65,530 by default on Linux),
# and every compiled XLA:CPU program holds some for as long as it lives; jitted methods with
# a static ``self`` keep their programs for the life of the process. A long benchmark that
# builds decoder after decoder can reach the limit ("LLVM compilation error: Cannot allocate
# memory", then a segfault): a batch sweep did, 74 minutes in (counts taken by hand then:
# 2,049 mappings after loading the embedded model, 7,603 after one temperature's
# calibration). tests/test_compile_cache.py shows the growth and the release on small programs.
MAPS = "/proc/self/maps"
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"


def memory_mappings() -> Optional[int]:
  """This process's memory mappings (None where ``/proc`` does not say)."""
  try:
    with open(MAPS, "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def mapping_limit() -> Optional[int]:
  """The most memory mappings a process may hold (``vm.max_map_count``; None where unknown)."""
  try:
    with open(MAX_MAP_COUNT) as f:
      return int(f.read().strip())
  except (OSError, ValueError):
    return None


def release_if_crowded(fraction: float = 0.5) -> bool:
  """Frees every compiled program of this process (``jax.clear_caches``) when it holds more
  than ``fraction`` of the memory mappings it may; True if it did. A program used again is
  compiled again (from the persistent cache when it is on), so call this between pieces of
  work, never inside a timed region, and warm up what is timed next. Where the counts are
  unknown (not Linux) it does nothing."""
  if not 0 < fraction <= 1:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}")
  held, limit = memory_mappings(), mapping_limit()
  if held is None or limit is None or held <= fraction * limit:
    return False
  jax.clear_caches()
  return True
