"""Weights stored as column panels for the CPU streaming matmul, and ``dense``.

``pack_params`` turns a model's float32 projection matrices (and its output
head) into ``PackedWeight``s once, at load. ``dense(x, w)`` is the one place
the model multiplies by a weight: plain arrays go to XLA's dot, packed weights
to the streaming kernel, for any number of rows (it also beats XLA's GEMM on
prefill chunks of 64-256 rows: ``benchmarks/results/streaming_matmul.md``).
Packed parameters are for inference; train on the plain ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax.kernels import streaming_matmul as sm

_PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclasses.dataclass(frozen=True)
class PackedWeight:
  """A [K, N] weight as [ceil(N/64), K, 64] column panels (``n`` = true N)."""

  panels: jax.Array
  n: int

  @property
  def dtype(self):
    return self.panels.dtype

  @property
  def shape(self) -> tuple[int, int]:
    return (self.panels.shape[1], self.n)

  def unpack(self) -> jax.Array:
    """The [K, N] matrix back."""
    p, k, c = self.panels.shape
    return jnp.transpose(self.panels, (1, 0, 2)).reshape(k, p * c)[:, :self.n]


jax.tree_util.register_dataclass(PackedWeight, data_fields=["panels"], meta_fields=["n"])


def pack(w: Any) -> PackedWeight:
  """[K, N] float32 -> PackedWeight."""
  return PackedWeight(panels=jnp.asarray(sm.to_panels(np.asarray(w, np.float32))),
                      n=int(w.shape[1]))


def unpacked(w: Any) -> jax.Array:
  """The plain [K, N] matrix of a weight, packed or not."""
  return w.unpack() if isinstance(w, PackedWeight) else w


def dense(x: jax.Array, w: Any) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N], for a plain or packed ``w``."""
  if not isinstance(w, PackedWeight):
    return x @ w
  lead, k = x.shape[:-1], x.shape[-1]
  y = sm.streaming_matmul(x.reshape(-1, k).astype(jnp.float32), w.panels)
  if y.shape[1] != w.n:
    y = y[:, :w.n]
  return y.reshape(*lead, w.n)


def should_pack(params: dict) -> bool:
  """Packing pays off when the kernel runs here and the weights are float32."""
  return sm.available() and all(w.dtype == jnp.float32 for p in params["layers"]
                                for name, w in p.items() if name in _PROJECTIONS)


def pack_params(params: dict, tie_embeddings: bool) -> dict:
  """The projections and the output head of a model as PackedWeights.

  With tied embeddings the head is packed from ``embed`` (kept for the input
  lookup), which costs one more copy of the embedding table. Idempotent.
  """
  def pack_layer(p):
    return {name: (pack(v) if name in _PROJECTIONS and not isinstance(v, PackedWeight) else v)
            for name, v in p.items()}

  out = dict(params, layers=[pack_layer(p) for p in params["layers"]])
  head = params.get("lm_head")
  if not isinstance(head, PackedWeight):
    out["lm_head"] = pack(np.asarray(params["embed"], np.float32).T if tie_embeddings
                          else head)
  return out


def unpack_params(params: dict, tie_embeddings: bool) -> dict:
  """Inverse of ``pack_params``: plain arrays everywhere (for export or training)."""
  out = dict(params, layers=[{name: unpacked(v) for name, v in p.items()}
                             for p in params["layers"]])
  if isinstance(params.get("lm_head"), PackedWeight):
    if tie_embeddings:
      del out["lm_head"]
    else:
      out["lm_head"] = params["lm_head"].unpack()
  return out
