"""Attention over the KV cache: the [B, K, S, H] layout specjax uses vs [B, S, K, H].

Usage:
  python -m benchmarks.attention_layout [--out benchmarks/results/attention_layout.md]

Times one layer's grouped-query attention (SmolLM2 shapes: 3 kv heads, 3 query
heads each, head dim 64) for decode, verify and batched-generation shapes.
"Slots-first" is the formulation specjax used before: einsums against a
[B, S, K, H] cache, which XLA:CPU transposes on every call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import median_time, provenance, write_markdown
from specjax.attention import dense_attention

OUT = flags.DEFINE_string("out", "benchmarks/results/attention_layout.md", "markdown output")
K, G, H = 3, 3, 64
SHAPES = [(1, 512, 1), (1, 512, 5), (1, 1024, 9), (32, 320, 1)]  # (B, S, T)


def slots_first(q, k, v, visible):
  """The previous formulation: q [B,T,N,H], k/v [B,S,K,H]."""
  b, t, n, h = q.shape
  q = q.reshape(b, t, K, n // K, h)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k) / np.sqrt(h)
  scores = jnp.where(visible[:, None, None], scores, -1e30)
  out = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(scores, axis=-1), v)
  return out.reshape(b, t, n, h)


def main(_):
  rows = []
  for b, s, t in SHAPES:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, t, K * G, H), np.float32))
    kv = jnp.asarray(rng.standard_normal((b, K, s, H), np.float32))
    kv_slots = jnp.swapaxes(kv, 1, 2)
    visible = jnp.ones((b, t, s), bool)
    new, old = jax.jit(dense_attention), jax.jit(slots_first)
    np.testing.assert_allclose(np.asarray(new(q, kv, kv, visible)),
                               np.asarray(old(q, kv_slots, kv_slots, visible)), atol=1e-4)
    t_new = median_time(lambda: new(q, kv, kv, visible).block_until_ready(), 50)
    t_old = median_time(lambda: old(q, kv_slots, kv_slots, visible).block_until_ready(), 50)
    rows.append(f"| {b} | {s} | {t} | {t_old * 1e3:.3f} | {t_new * 1e3:.3f} | "
                f"{t_old / t_new:.2f}x |")
  write_markdown(OUT.value, [
      "# Attention layout: [B, K, S, H] (specjax) vs [B, S, K, H]",
      "",
      f"Command: `python -m benchmarks.attention_layout` ({provenance()}). One layer, f32, "
      "median of 50 calls; both formulations agree to 1e-4.",
      "",
      "| B | cache slots S | new tokens T | slots-first (ms) | heads-first, specjax (ms) | speedup |",
      "|---|---|---|---|---|---|",
      *rows,
  ])


if __name__ == "__main__":
  app.run(main)
