"""Products that accumulate in float32 whatever their operands' dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def einsum_f32(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """``jnp.einsum(subscripts, a, b)`` accumulated and returned in float32.

  float32 operands go in full float32 precision (``Precision.HIGHEST``: XLA's default lets
  a GPU multiply float32 in TF32 and a TPU in one bfloat16 pass). bfloat16 ones go with
  ``preferred_element_type=float32`` (tensor cores and the MXU multiply bfloat16 and
  accumulate in float32), except on CPU, whose XLA runtime lacks some bfloat16 ×
  bfloat16 → float32 dots ("Unsupported element type for DotThunk"): there they are
  cast to float32 first, which is the same arithmetic (a product of two bfloat16
  numbers is exact in float32).
  """
  both_f32 = a.dtype == jnp.float32 and b.dtype == jnp.float32
  if not both_f32 and jax.default_backend() == "cpu":
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  precision = jax.lax.Precision.HIGHEST if both_f32 else None
  return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32, precision=precision)
