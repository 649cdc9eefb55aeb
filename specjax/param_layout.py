"""The column order of the model's fused projections, chosen so that they shard cleanly.

A layer stores its q/k/v projections as one ``wqkv`` [D, K·(G+2)·H] and its
gate/up projections as one ``w_gate_up`` [D, 2F] (four matmuls a layer instead
of seven). The columns are ordered so that any split of the column axis into m
equal contiguous parts, m dividing K (resp. F), gives each part whole units:

  wqkv       per kv head k: its G query heads (G·H), its key (H), its value (H);
             i.e. [D, K, G + 2, H] flattened. Query head j = k·G + i uses kv head
             k = j // G, as in grouped-query attention. ``bqkv`` the same.
  w_gate_up  per feature f: gate f, up f; i.e. [D, F, 2] flattened.

So a tensor-parallel shard of ``wqkv`` holds whole kv groups (their queries and
their key/value heads), the matching rows of ``wo`` hold those query heads, and
a shard of ``w_gate_up`` holds the gate and up columns of the features whose
``w_down`` rows it also holds: attention and the MLP run shard-locally, with
one reduction after ``wo`` and one after ``w_down`` (Megatron's split).

Example (D = 1, K = 2 kv heads, G = 1, H = 1): q = [q0 q1], k = [k0 k1],
v = [v0 v1] are stored as [q0 k0 v0 q1 k1 v1]; gate [g0 g1], up [u0 u1] as
[g0 u0 g1 u1].

Checkpoints name the projections separately (HF: q_proj, k_proj, ...);
``fuse_*`` and ``split_*`` convert. Files written before this order existed
(``specjax-eagle-v1`` without ``param_layout``) concatenated q|k|v and gate|up;
``from_concatenated`` reorders them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

LAYOUT = "kv-grouped-v1"  # recorded in files that store fused projections as they are


def _xp(a):
  return jnp if isinstance(a, jax.Array) else np


def fuse_qkv(q: Any, k: Any, v: Any, num_kv_heads: int) -> Any:
  """[.., N·H], [.., K·H], [.., K·H] -> [.., K·(G+2)·H] grouped per kv head (weights
  [D, ·] or biases [·]); numpy in, numpy out; jax in, jax out."""
  xp = _xp(q)
  lead, kh = q.shape[:-1], num_kv_heads
  h = k.shape[-1] // kh
  if k.shape != v.shape or k.shape[-1] != kh * h or q.shape[-1] % (kh * h):
    raise ValueError(f"q/k/v widths {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} do not fit "
                     f"{kh} kv heads")
  parts = [q.reshape(*lead, kh, -1), k.reshape(*lead, kh, h), v.reshape(*lead, kh, h)]
  return xp.concatenate(parts, axis=-1).reshape(*lead, -1)


def split_qkv(w: Any, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Any, Any, Any]:
  """Inverse of ``fuse_qkv``: (q [.., N·H], k [.., K·H], v [.., K·H])."""
  lead, kh, h = w.shape[:-1], num_kv_heads, head_dim
  g = num_heads // kh
  grouped = w.reshape(*lead, kh, (g + 2) * h)
  q = grouped[..., :g * h].reshape(*lead, num_heads * h)
  k = grouped[..., g * h:(g + 1) * h].reshape(*lead, kh * h)
  v = grouped[..., (g + 1) * h:].reshape(*lead, kh * h)
  return q, k, v


def fuse_gate_up(gate: Any, up: Any) -> Any:
  """[.., F], [.., F] -> [.., 2F] with gate f and up f side by side."""
  xp = _xp(gate)
  return xp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def split_gate_up(w: Any) -> tuple[Any, Any]:
  """Inverse of ``fuse_gate_up``: (gate [.., F], up [.., F])."""
  pairs = w.reshape(*w.shape[:-1], -1, 2)
  return pairs[..., 0], pairs[..., 1]


def from_concatenated(layer: dict, num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
  """A layer whose ``wqkv``/``bqkv`` are q|k|v and ``w_gate_up`` gate|up concatenated (the
  order before ``LAYOUT``), in this module's order; other keys as they are."""
  n, kh, h = num_heads, num_kv_heads, head_dim
  out = dict(layer)
  for key in ("wqkv", "bqkv"):
    if key in layer:
      w = layer[key]
      xp = _xp(w)
      q, k, v = xp.split(w, [n * h, (n + kh) * h], axis=-1)
      out[key] = fuse_qkv(q, k, v, kh)
  if "w_gate_up" in layer:
    xp = _xp(layer["w_gate_up"])
    out["w_gate_up"] = fuse_gate_up(*xp.split(layer["w_gate_up"], 2, axis=-1))
  return out
