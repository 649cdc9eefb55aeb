"""Helpers shared by the benchmark scripts (and experiments/): timing, a warm forward, the
machine's CPU, an output-directory probe, and the markdown footer."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax.kernels import streaming_matmul as sm
from specjax.model import forward


def median_time(fn: Callable[[], object], repeats: int = 15) -> float:
  """Median seconds of ``fn()`` after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def forward_fn(cfg, params, num_tokens: int, context: int = 200,
               batch_size: int = 1) -> Callable[[], object]:
  """A warm-callable forward over ``num_tokens`` new tokens per row after ``context`` cached."""
  cache = kvc.init_cache(cfg, batch_size, max(256, context + num_tokens)).with_lengths(
      jnp.full((batch_size,), context, jnp.int32))
  tok = jnp.ones((batch_size, num_tokens), jnp.int32)
  pos = jnp.broadcast_to(context + jnp.arange(num_tokens), (batch_size, num_tokens))
  return lambda: forward(params, cfg, tok, pos, cache).logits.block_until_ready()


def forward_time(cfg, params, num_tokens: int, context: int = 200, repeats: int = 15,
                 batch_size: int = 1) -> float:
  """Median seconds of one forward (``forward_fn``)."""
  return median_time(forward_fn(cfg, params, num_tokens, context, batch_size), repeats)


SIMD_FLAGS = ("avx512f", "avx2")


def cpu_info(path: str = "/proc/cpuinfo") -> dict[str, object]:
  """The CPU model and which of SIMD_FLAGS it has: ``{"model": str, "avx512f": bool, ...}``.

  Values are None where ``path`` cannot be read (not Linux): unknown, not absent.
  """
  model = sm.cpuinfo_field("model name", path)
  if model is None:
    return {"model": platform.processor() or None, **{k: None for k in SIMD_FLAGS}}
  cpu_flags = set((sm.cpuinfo_field("flags", path) or "").split())
  return {"model": model or None, **{k: k in cpu_flags for k in SIMD_FLAGS}}


def describe_cpu(info: dict[str, object]) -> str:
  """``Intel(R) Xeon(R) ... (avx512f, avx2)``, naming only the flags present."""
  present = [k for k in SIMD_FLAGS if info.get(k)]
  unknown = all(info.get(k) is None for k in SIMD_FLAGS)
  simd = "flags unknown" if unknown else ", ".join(present) or "no avx2/avx512f"
  return f"{info.get('model') or 'unknown CPU'} ({simd})"


def matmul_path(params) -> str:
  """Which matmul a loaded model runs (``specjax/kernels/policy.py``), for result headers."""
  from specjax.kernels.packed import PackedWeight  # pylint: disable=g-import-not-at-top
  w = params["layers"][0]["wqkv"]
  if not isinstance(w, PackedWeight):
    return "XLA's dot for every M"
  return f"{w.policy.describe()} [kernel path {sm.isa()}]"


def provenance() -> str:
  """git revision, CPU, cores and library versions, for the line under a results title."""
  rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True).stdout.strip()
  return (f"git {rev}, {describe_cpu(cpu_info())}, {os.cpu_count()} cores, "
          f"jax {jax.__version__}")


class OutputError(ValueError):
  """An output path that cannot be written; the message names it and the reason."""


def probe_output_dir(path: str, flag: str = "--out") -> None:
  """Creates directory ``path`` and writes and removes a file in it, so a run that could not
  save its results fails before it measures anything.

  Raises:
    OutputError: naming ``flag``, the path and the operating system's reason.
  """
  if os.path.exists(path) and not os.path.isdir(path):
    raise OutputError(f"{flag} {path!r} cannot be written: it is a file, not a directory")
  probe = os.path.join(path, f".write-probe-{os.getpid()}")
  try:
    os.makedirs(path, exist_ok=True)
    with open(probe, "w") as f:
      f.write("probe")
    os.remove(probe)
  except OSError as e:
    raise OutputError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None


def write_markdown(path: str, lines: list[str]) -> None:
  """Prints the report and writes it to ``path``."""
  text = "\n".join(lines) + "\n"
  print(text)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
