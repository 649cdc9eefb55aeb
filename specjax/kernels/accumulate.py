"""Products that accumulate in float32 whatever their operands' dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def einsum_f32(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """``jnp.einsum(subscripts, a, b)`` accumulated and returned in float32.

  float32 operands go as they are. bfloat16 ones go with
  ``preferred_element_type=float32`` (tensor cores and the MXU multiply bfloat16 and
  accumulate in float32), except on CPU, whose XLA runtime lacks some bfloat16 ×
  bfloat16 → float32 dots ("Unsupported element type for DotThunk"): there they are
  cast to float32 first, which is the same arithmetic (a product of two bfloat16
  numbers is exact in float32).
  """
  if (a.dtype != jnp.float32 or b.dtype != jnp.float32) and jax.default_backend() == "cpu":
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)
