"""XLA's own dot in bfloat16 against float32 on the embedded model's weight shapes.

specjax's CPU path casts bfloat16 products to float32 (``kernels/accumulate.py``); this
times what it leaves aside: XLA's native bfloat16 × bfloat16 → float32 dot (random weights
of the SmolLM2 projection and tied-head shapes), per row count M, each dtype's calls
interleaved. Usage:

  python -m benchmarks.bf16_dot [--rows 1,2,4,8,16] [--out benchmarks/results/bf16_dot.md]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import int_list, interleaved_times, provenance, write_markdown
from specjax.loaders.embedded import smollm2_config

ROWS = flags.DEFINE_list("rows", ["1", "2", "4", "8", "16"], "row counts M")
REPEATS = flags.DEFINE_integer("repeats", 30, "timed calls per dtype and M (median)")
OUT = flags.DEFINE_string("out", "benchmarks/results/bf16_dot.md", "markdown output")


def shapes(cfg) -> dict[str, tuple[tuple[int, int], tuple[tuple[int], tuple[int]]]]:
  """{name: ([K, N] or [V, D] weight shape, dot_general contracting dims)}."""
  qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  mat = ((1,), (0,))
  return {"wqkv": ((cfg.dim, qkv), mat), "wo": ((cfg.num_heads * cfg.head_dim, cfg.dim), mat),
          "w_gate_up": ((cfg.dim, 2 * cfg.ffn_dim), mat),
          "w_down": ((cfg.ffn_dim, cfg.dim), mat),
          "tied head [V, D]": ((cfg.vocab_size, cfg.dim), ((1,), (1,)))}


def main(argv):
  del argv
  rows = int_list(ROWS)
  cfg = smollm2_config()
  rng = np.random.default_rng(0)
  lines = ["# XLA's dot, bfloat16 against float32 (SmolLM2-135M weight shapes)", "",
           f"{provenance()}; median of {REPEATS.value} interleaved calls, ms.", "",
           f"Command: `python -m benchmarks.bf16_dot --rows={','.join(map(str, rows))} "
           f"--repeats={REPEATS.value} --out={OUT.value}`", "",
           "| weight | dtype | " + " | ".join(f"M = {m}" for m in rows) + " |",
           "|---|---|" + "---|" * len(rows)]
  for name, (shape, contract) in shapes(cfg).items():
    w32 = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    dot = jax.jit(lambda x, w, c=contract: jax.lax.dot_general(
        x, w, (c, ((), ())), preferred_element_type=jnp.float32))
    k = shape[contract[1][0]]
    fns = {}
    for dtype in (jnp.float32, jnp.bfloat16):
      w = w32.astype(dtype)
      for m in rows:
        x = jnp.ones((m, k), dtype)
        fns[(dtype.__name__, m)] = lambda x=x, w=w: dot(x, w).block_until_ready()
    runs = interleaved_times(fns, REPEATS.value)
    for dtype in ("float32", "bfloat16"):
      cells = [f"{1e3 * np.median(runs[(dtype, m)]):.2f}" for m in rows]
      lines.append(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
