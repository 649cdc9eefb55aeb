"""Compiling and caching the CPU kernels' shared libraries, and the CPU facts they are keyed by.

Each kernel (``streaming_matmul.cc``, ``cpu_attention.cc``) is an XLA FFI
custom call compiled on first use with the system C++ compiler and the FFI
headers that ship with jaxlib, and cached under ``cache_dir()`` keyed by its
source and the shared headers it includes (``parallel_for.h``), the jaxlib
version, the CPU and the compiler flags (``library_path``), so a changed
source, header, jaxlib or machine rebuilds it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from typing import Optional, Sequence

import jax

from specjax import files


def cpuinfo_field(name: str, path: str = "/proc/cpuinfo") -> Optional[str]:
  """The first ``name: value`` of ``path`` ("" if absent), or None where it cannot be read."""
  try:
    with open(path) as f:
      return next((line.split(":", 1)[1].strip() for line in f
                   if line.split(":", 1)[0].strip() == name), "")
  except OSError:
    return None


def cpu_model() -> str:
  """The CPU's model name (``/proc/cpuinfo``), or the machine type where it is not readable."""
  return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
  """The CPU's feature flags (``/proc/cpuinfo``; empty where it is not readable)."""
  return frozenset((cpuinfo_field("flags") or "").split())


def cpu_signature() -> str:
  """Machine type, CPU model and flags: what a build or a timing decision is valid for."""
  return f"{platform.machine()}|{cpu_model()}|{' '.join(sorted(cpu_flags()))}"


KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))


def _local_headers(text: bytes, source: str) -> list[str]:
  """The ``#include "name"`` files of a source that lie beside it or in ``KERNELS_DIR``
  (one level: a shared header includes only system and XLA FFI headers)."""
  out = []
  for name in re.findall(rb'^\s*#\s*include\s+"([^"]+)"', text, re.M):
    for folder in (os.path.dirname(os.path.abspath(source)), KERNELS_DIR):
      path = os.path.join(folder, name.decode())
      if os.path.isfile(path):
        out.append(path)
        break
  return out


def source_hash(source: str) -> str:
  """The first 16 hex digits of the SHA-256 of the file ``source`` and its local headers
  (``#include "..."`` found beside it or in ``KERNELS_DIR``; the XLA FFI headers are
  covered by the jaxlib version in ``library_path``)."""
  with open(source, "rb") as f:
    text = f.read()
  digest = hashlib.sha256(text)
  for header in _local_headers(text, source):
    with open(header, "rb") as f:
      digest.update(b"\0" + os.path.basename(header).encode() + b"\0" + f.read())
  return digest.hexdigest()[:16]


def cache_dir() -> str:
  return os.path.join(os.path.expanduser("~"), ".cache", "specjax", "kernels")


def library_path(source: str, name: str, flags: Sequence[str]) -> str:
  """Where the library built from ``source`` with ``flags`` on this machine is cached."""
  key = hashlib.sha256("|".join((source_hash(source), jax.lib.__version__, cpu_signature(),
                                 *flags)).encode()).hexdigest()[:16]
  return os.path.join(cache_dir(), f"{name}-{key}.so")


def build_library(path: str, flags: Sequence[str], source: str) -> None:
  """Compiles ``source`` with ``flags`` (beside -O3, C++17, PIC) into the shared library ``path``.

  ``KERNELS_DIR`` is on the include path, so a copy of a kernel elsewhere (an A/B
  variant) still finds the shared headers.

  Raises:
    RuntimeError: no C++ compiler on PATH (nor ``$CXX``), or the compilation failed (its
      command and the end of its error output are in the message).
  """
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise RuntimeError("no C++ compiler (g++/c++ or $CXX) on PATH")
  with files.atomic_path(path) as out:  # concurrent builders never load a partial library
    cmd = [compiler, "-O3", *flags, "-ffp-contract=fast", "-std=c++17", "-shared",
           "-fPIC", "-w", "-I", KERNELS_DIR, "-I", jax.ffi.include_dir(), source, "-o", out]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
      raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
