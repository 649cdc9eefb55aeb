"""Where a run measures and where it writes: the machine's CPU and SIMD flags, the matmul
path a loaded model runs (for result headers), and a probe that an output directory can
be written before anything is measured. Shared by experiments/ and benchmarks/.
"""

from __future__ import annotations

import os
import platform

from specjax.kernels import streaming_matmul as sm


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
  """Which matmul a loaded model runs for its layers' projections and for its head
  (``specjax/kernels/policy.py`` decides them apart), for result headers."""
  from specjax.kernels.packed import PackedWeight  # pylint: disable=g-import-not-at-top
  weights = params["layers"][0]["wqkv"], params.get("lm_head")
  layers, head = (w.policy.describe() if isinstance(w, PackedWeight) else
                  "XLA's dot for every M" for w in weights)
  text = layers if layers == head else f"layers: {layers}; head: {head}"
  if any(isinstance(w, PackedWeight) for w in weights):
    text += f" [kernel path {sm.isa()}]"
  return text


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
