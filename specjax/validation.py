"""Checks of user inputs and loaded weights, shared by samplers, loaders and decoders.

Each check raises before anything is compiled or allocated and names the
input and the rule it broke, so a bad argument never surfaces as a message
from JAX's tracer or as silently wrong tokens.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np


class CheckpointError(ValueError):
  """A checkpoint is missing, corrupt or of an unsupported kind."""


def as_int(value: Any, name: str, minimum: Optional[int] = None) -> int:
  """``value`` as a Python int; numpy integers are accepted, bools and floats are not."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
  value = int(value)
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")
  return value


def as_float(value: Any, name: str, low: float, high: float) -> float:
  """``value`` as a finite Python float in [low, high] (numpy floats and ints accepted)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                   np.floating)):
    raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
  value = float(value)
  if not math.isfinite(value) or not low <= value <= high:
    raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value!r}")
  return value


def token_ids(value: Any, name: str) -> tuple[int, ...]:
  """A hashable tuple of int token ids from an int, a sequence of ints or None (empty)."""
  if value is None:
    return ()
  if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
    value = (value,)
  if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
    raise TypeError(f"{name} must be a sequence of token ids, got {type(value).__name__}")
  return tuple(as_int(v, f"{name}[{i}]", 0) for i, v in enumerate(value))


def layer_indices(value: Any, name: str, num_layers: Optional[int] = None) -> tuple[int, ...]:
  """A sorted tuple of distinct layer indices >= 0 (and < ``num_layers`` when given)."""
  layers = tuple(int(l) for l in value)
  if list(layers) != sorted(set(layers)) or (layers and layers[0] < 0):
    raise ValueError(f"{name} must be sorted, distinct and >= 0, got {layers}")
  if num_layers is not None and layers and layers[-1] >= num_layers:
    raise ValueError(f"{name} {layers} do not exist in a target of {num_layers} layers")
  return layers


def model_source(source: Any) -> str:
  """A model source (name or path) as a str; ``os.PathLike`` accepted."""
  if isinstance(source, os.PathLike):
    return os.fspath(source)
  if not isinstance(source, str):
    raise TypeError(f"model source must be a str or os.PathLike, got "
                    f"{type(source).__name__} {source!r}")
  return source


COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


def compute_dtype(value: Any, name: str = "dtype") -> jnp.dtype:
  """A model's compute dtype: "auto" is bfloat16 on GPU and TPU and float32 on CPU (where
  the CPU kernels take float32 only and XLA emulates bfloat16 products); "float32" or
  "bfloat16" (or those jnp dtypes) as asked. Anything else is refused."""
  import jax  # local: validation is imported before the backend is chosen
  if isinstance(value, str) and value == "auto":
    return jnp.dtype(jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32)
  try:
    dt = jnp.dtype(value)
  except TypeError:
    dt = None
  if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"{name} must be one of {', '.join(COMPUTE_DTYPES)}; got {value!r}")
  return dt


def float_dtype(dtype: Any, name: str = "dtype") -> jnp.dtype:
  """``dtype`` as a jnp dtype, refusing non-float ones (int weights compute garbage)."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{name} {dtype!r} is not a dtype") from None
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"{name} must be a floating-point dtype, got {dt}")
  return dt


def all_finite(a: np.ndarray) -> bool:
  """True when every value of a float array is finite (one reduction in the common case)."""
  # A sum is finite when every term is (overflow of huge finite values is
  # ruled out by the exact check that only then runs).
  return bool(np.isfinite(np.sum(a))) or bool(np.isfinite(a).all())


@functools.lru_cache(maxsize=16)
def _param_shapes(cfg) -> dict[str, tuple[int, ...]]:
  from specjax.model import init_params  # local: model imports kernels at import time
  tree = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))
  return {jax.tree_util.keystr(p): tuple(x.shape)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check_params(params: Any, cfg, what: str) -> None:
  """Checks that ``params`` has every array of a model of config ``cfg``, with its shape.

  Packed weights (``specjax.kernels.packed``) are compared by their logical shape.

  Raises:
    ValueError naming ``what`` and the first array that is missing or of the wrong shape.
  """
  from specjax.kernels.packed import PackedWeight

  is_packed = lambda x: isinstance(x, PackedWeight)
  try:
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_packed)[0]
  except Exception as e:  # pylint: disable=broad-except
    raise TypeError(f"{what} is not a parameter pytree: {e}") from None
  have = {jax.tree_util.keystr(p): tuple(getattr(x, "shape", ())) for p, x in leaves}
  for key, shape in _param_shapes(cfg).items():
    if key not in have:
      raise ValueError(f"{what} lack the array {key} of a model with this config "
                       f"(dim={cfg.dim}, layers={cfg.num_layers}, vocab={cfg.vocab_size})")
    if have[key] != shape:
      raise ValueError(f"{what}{key} has shape {have[key]}, but the config (dim={cfg.dim}, "
                       f"layers={cfg.num_layers}, vocab={cfg.vocab_size}) needs {shape}")


def available_memory_bytes() -> Optional[int]:
  """Free memory of the default device (host RAM on CPU), or None when unknown."""
  device = jax.devices()[0]
  if device.platform == "cpu":
    try:
      with open("/proc/meminfo") as f:
        for line in f:
          if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    except OSError:
      return None
    return None
  stats = device.memory_stats() or {}
  if "bytes_limit" not in stats:
    return None
  return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
