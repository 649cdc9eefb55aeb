"""Cost of one draw from a [B, V] distribution: Gumbel-max against ``sample_from``'s inverse CDF.

Usage:
  python -m benchmarks.sampling [--vocab 49152] [--rows 1,4,16]
      [--out benchmarks/results/sampling.md]

Every sampled token of plain and speculative decoding at T > 0 is one such
draw over the target's vocabulary (and a speculative step's residual draw is
another), so on CPU its cost is part of t₁. ``jax.random.categorical`` draws
V uniforms and takes two logs of each (Gumbel-max); ``sample_from`` draws one
uniform per row and inverts the CDF in two levels (block sums, then one block).
Both jitted, medians of interleaved calls on a softmax of random logits.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir
from specjax.sampling import sample_from

VOCAB = flags.DEFINE_integer("vocab", 49152, "vocabulary size V (SmolLM2: 49152)")
ROWS = flags.DEFINE_list("rows", ["1", "4", "16"], "rows B")
REPEATS = flags.DEFINE_integer("repeats", 200, "timed calls per method and B")
OUT = flags.DEFINE_string("out", "benchmarks/results/sampling.md", "markdown output")


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  methods = {
      "jax.random.categorical (Gumbel-max)": jax.jit(
          lambda k, p: jax.random.categorical(k, jnp.log(p), axis=-1)),
      "sample_from (two-level inverse CDF)": jax.jit(sample_from),
  }
  lines = ["# One draw from [B, V] probabilities on CPU", "",
           f"{provenance()}; V = {VOCAB.value}; median [min, max] ms of {REPEATS.value} "
           "interleaved calls per method.", "",
           f"Command: `python -m benchmarks.sampling --vocab={VOCAB.value} "
           f"--rows={','.join(ROWS.value)} --repeats={REPEATS.value}`", "",
           "| B | " + " | ".join(methods) + " | ratio |", "|---|---|---|---|"]
  for b in [int(r) for r in ROWS.value]:
    p = jax.nn.softmax(3 * jax.random.normal(jax.random.PRNGKey(b), (b, VOCAB.value)))
    times = {name: [] for name in methods}
    for name, f in methods.items():
      f(jax.random.PRNGKey(0), p).block_until_ready()
    for i in range(REPEATS.value):
      for name, f in methods.items():
        t = time.perf_counter()
        f(jax.random.PRNGKey(i), p).block_until_ready()
        times[name].append((time.perf_counter() - t) * 1e3)
    cells = [f"{np.median(t):.3f} [{min(t):.3f}, {max(t):.3f}]" for t in times.values()]
    old, new = (np.median(t) for t in times.values())
    lines.append(f"| {b} | " + " | ".join(cells) + f" | {old / new:.1f}x |")
  write_markdown(OUT.value, lines + [""])


if __name__ == "__main__":
  app.run(main)
