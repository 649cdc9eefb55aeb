"""Weights stored as column panels for the CPU streaming matmul, and ``dense``.

``pack_params`` turns a model's float32 projection matrices (and its output
head) into ``PackedWeight``s once, at load, under a ``MatmulPolicy``
(``policy.py``: measured on this machine by ``load_model``). ``dense(x, w)`` is
the one place the model multiplies by a weight: plain arrays go to XLA's dot;
a packed weight goes to the streaming kernel for the row counts where its
policy says the kernel is faster, and to XLA's dot on the plain matrix it then
also keeps for the others. Packed parameters are for inference; train on the
plain ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from specjax.kernels import streaming_matmul as sm
from specjax.kernels.accumulate import einsum_f32
from specjax.kernels.policy import KERNEL, XLA, MatmulPolicy

PROJECTIONS = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclasses.dataclass(frozen=True)
class PackedWeight:
  """A [K, N] weight as [ceil(N/W), K, W] column panels for the streaming kernel.

  Attributes:
    panels: [ceil(N/W), K, W] the columns in panels of W (the kernel's ``panel_width``),
      zero-padded; float32, or float16 (half the bytes to stream; the kernel widens them to
      float32 as they load, so products and sums stay float32).
    n: the true N.
    plain: the [K, N] matrix for XLA's dot where ``policy`` does not take the
      kernel (None when it always does, or for a tied head: ``lm_head`` then
      contracts against the embedding); with float16 panels, their values in float32.
    policy: for which row counts the kernel runs (static).
  """

  panels: jax.Array
  n: int
  plain: Optional[jax.Array] = None
  policy: MatmulPolicy = KERNEL

  @property
  def dtype(self):
    """The dtype of the weight's products: float32 (float16 panels are widened)."""
    return jnp.float32 if self.panels.dtype == jnp.float16 else self.panels.dtype

  @property
  def shape(self) -> tuple[int, int]:
    return (self.panels.shape[1], self.n)

  def unpack(self) -> jax.Array:
    """The [K, N] matrix back."""
    p, k, c = self.panels.shape
    w = jnp.transpose(self.panels, (1, 0, 2)).reshape(k, p * c)[:, :self.n]
    return w.astype(self.dtype)


jax.tree_util.register_dataclass(PackedWeight, data_fields=["panels", "plain"],
                                 meta_fields=["n", "policy"])


def pack(w: Any, policy: MatmulPolicy = KERNEL, keep_plain: Optional[bool] = None,
         dtype: Any = jnp.float32) -> PackedWeight:
  """[K, N] float32 -> PackedWeight with panels of ``dtype`` (``sm.PANEL_DTYPES``); keeps the
  plain matrix when the policy ever takes XLA.

  Float16 rounds the weight once, here, and the plain copy then holds the rounded values in
  float32, so both paths multiply by the same weight. A weight float16 cannot hold (a finite
  value beyond ±65504) stays in float32 panels, with a warning.
  """
  if jnp.dtype(dtype) not in sm.PANEL_DTYPES:
    raise ValueError(f"panels are float32 or float16, not {jnp.dtype(dtype)}")
  keep_plain = not policy.always if keep_plain is None else keep_plain
  values = np.asarray(w, np.float32)
  plain = w
  if jnp.dtype(dtype) == jnp.float16:
    with np.errstate(over="ignore"):  # checked just below
      half = values.astype(np.float16)
    if np.array_equal(np.isfinite(half), np.isfinite(values)):
      values, plain = half, half.astype(np.float32)
    else:
      logging.warning("specjax: a [%d, %d] weight exceeds float16's range (max |w| %.3g); its "
                      "panels stay float32", *values.shape, np.nanmax(np.abs(values)))
  return PackedWeight(panels=jnp.asarray(sm.to_panels(values)), n=int(values.shape[1]),
                      plain=jnp.asarray(plain) if keep_plain else None, policy=policy)


def pack_under(w: Any, policy: MatmulPolicy, dtype: Any = jnp.float32) -> Any:
  """A [K, N] weight, plain or packed, as ``policy`` wants it: kept when already packed under
  it in panels of ``dtype``, plain where the policy never takes the kernel, packed (again)
  otherwise."""
  if isinstance(w, PackedWeight):
    if w.policy == policy and w.panels.dtype == jnp.dtype(dtype):
      return w
    w = unpacked(w)
  return w if policy.never else pack(w, policy, dtype=dtype)


def unpacked(w: Any) -> jax.Array:
  """The plain [K, N] matrix of a weight, packed or not."""
  if isinstance(w, PackedWeight):
    return w.plain if w.plain is not None else w.unpack()
  return w


def uses_kernel(w: Any, rows: int) -> bool:
  """Whether ``dense`` sends a product with ``rows`` rows by ``w`` to the kernel."""
  return isinstance(w, PackedWeight) and w.policy.use_kernel(rows)


def streaming(x: jax.Array, w: PackedWeight) -> jax.Array:
  """x [M, K] float32 @ a packed ``w`` -> [M, P * W]: the kernel, prefetching as ``w``'s
  policy says for M rows (``dense``'s default ``kernel``)."""
  return sm.streaming_matmul(x, w.panels, prefetch=w.policy.prefetch_at(x.shape[0]))


def dense(x: jax.Array, w: Any,
          kernel: Callable[[jax.Array, PackedWeight], jax.Array] = streaming) -> jax.Array:
  """x [..., K] @ w [K, N] -> [..., N], for a plain or packed ``w``.

  ``kernel`` computes the products the policy gives the kernel, x [M, K] float32 by the
  packed weight -> [M, P * W] (``sharding.dense`` passes one that runs it per device).

  Plain weights go through ``accumulate.einsum_f32``, which owns the precision rule: float32
  products in full float32 (not a GPU's TF32 or a TPU's one bfloat16 pass, which could flip
  the near-ties float32's greedy equality rests on: reasoned, not measured on a GPU; a CPU
  computes the same bits as plain ``@``, tested), bfloat16 ones accumulated in float32. The
  result comes back in the activation dtype.
  """
  if not isinstance(w, PackedWeight):
    return einsum_f32("...k,kn->...n", x, w).astype(x.dtype)
  lead, k = x.shape[:-1], x.shape[-1]
  rows = int(np.prod(lead))
  if not w.policy.use_kernel(rows):
    if w.plain is not None:
      return einsum_f32("...k,kn->...n", x, w.plain).astype(x.dtype)
    # No plain copy (a tied head, or a weight packed for the kernel only):
    # the reference contraction over the panels, correct if slower.
    return sm.reference(x.reshape(rows, k), w.panels)[:, :w.n].reshape(*lead, w.n)
  y = kernel(x.reshape(rows, k).astype(jnp.float32), w)
  if y.shape[1] != w.n:
    y = y[:, :w.n]
  return y.reshape(*lead, w.n)


def policy_of(params: dict) -> MatmulPolicy:
  """The policy a model's layer projections were packed under (``XLA`` for plain params; its
  head may have another), so that weights used beside them (a drafter's) can be packed the
  same way."""
  for layer in params.get("layers", ()):
    for name in PROJECTIONS:
      if isinstance(layer.get(name), PackedWeight):
        return layer[name].policy
  return XLA


def head_policy_of(params: dict) -> MatmulPolicy:
  """The policy a model's output head was packed under (``policy.policy_for(part="head")``):
  ``XLA`` for a plain head, or a tied one that contracts against ``embed``. A drafter's own
  head (an EAGLE head of a few thousand rows) is packed under it: of the two measurements the
  one of the nearer shape (a wide [D, V] matrix), though neither was made at the draft head's
  own width."""
  head = params.get("lm_head")
  return head.policy if isinstance(head, PackedWeight) else XLA


def pack_params(params: dict, tie_embeddings: bool, policy: MatmulPolicy = KERNEL,
                head_policy: Optional[MatmulPolicy] = None) -> dict:
  """The projections of a model as PackedWeights under ``policy``, its output head under
  ``head_policy`` (default: ``policy``; ``policy.policy_for`` measures the two apart).

  Where a policy never takes the kernel the weights stay plain arrays. With tied
  embeddings the head is packed from ``embed`` (kept for the input lookup),
  which costs one more copy of the embedding table; where the policy takes
  XLA's dot the head contracts against ``embed`` instead. A mixed policy keeps
  the plain matrices beside the panels (twice the projection memory).
  Idempotent for weights packed under the same policies.
  """
  head_policy = policy if head_policy is None else head_policy
  if policy.never and head_policy.never:
    return unpack_params(params, tie_embeddings)
  out = dict(params, layers=[{name: (pack_under(v, policy) if name in PROJECTIONS else v)
                              for name, v in p.items()} for p in params["layers"]])
  head = params.get("lm_head")
  if not tie_embeddings:
    out["lm_head"] = pack_under(head, head_policy)
  elif head_policy.never:
    out.pop("lm_head", None)  # contracts against ``embed``
  elif not (isinstance(head, PackedWeight) and head.policy == head_policy):
    out["lm_head"] = pack(np.asarray(params["embed"], np.float32).T, head_policy,
                          keep_plain=False)
  return out


def unpack_params(params: dict, tie_embeddings: bool) -> dict:
  """Inverse of ``pack_params``: plain arrays everywhere (for export or training)."""
  out = dict(params, layers=[{name: unpacked(v) for name, v in p.items()}
                             for p in params["layers"]])
  if isinstance(params.get("lm_head"), PackedWeight):
    if tie_embeddings:
      del out["lm_head"]
    else:
      out["lm_head"] = unpacked(params["lm_head"])
  return out
