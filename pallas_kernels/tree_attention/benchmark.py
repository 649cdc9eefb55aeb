"""Tree attention: the Pallas kernel of this backend vs the dense jnp reference.

Usage (on a GPU or TPU machine):
  python -m pallas_kernels.tree_attention.benchmark [--out FILE] [--dtype bfloat16]
  python -m pallas_kernels.tree_attention.benchmark --smoke   # CPU, interpret mode, tiny

Times one layer's attention of T new tokens over a cache of S slots, every
row's committed length S - T (the whole cache is read), for SmolLM2-135M's
geometry (3 kv heads x 3 query heads, head dim 64) and a Llama-3-8B-like one
(8 x 4, head dim 128); T = 1 (decode), 8 (chain verify), 64 (a token tree).
Both paths are checked against each other before timing. Writes a markdown
table with the command, the device and the git revision; on CPU it refuses to
time anything except ``--smoke`` (interpret mode: a correctness run of this
script, not a measurement).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import median_time, provenance, write_markdown
from pallas_kernels.tree_attention import ancestor_mask
from specjax import attention

OUT = flags.DEFINE_string("out", None, "markdown output (default: results_<backend>.md here)")
DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "q/k/v dtype")
REPEATS = flags.DEFINE_integer("repeats", 50, "timed calls per shape (median reported)")
SMOKE = flags.DEFINE_bool("smoke", False, "tiny shapes through the interpret-mode kernels (CPU)")

GEOMETRIES = {"smollm2-135m": (3, 3, 64), "llama3-8b-like": (8, 4, 128)}  # (K, G, H)
BATCHES = (1, 8)
SIZES = (2048, 8192, 32768)
TREES = (1, 8, 64)
TOL = {"bfloat16": 2e-2, "float32": 1e-4}


def _case(b, s, t, kh, g, h, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, kh * g, h), np.float32), dtype)
  k = jnp.asarray(rng.standard_normal((b, kh, s, h), np.float32), dtype)
  v = jnp.asarray(rng.standard_normal((b, kh, s, h), np.float32), dtype)
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
  mask = jnp.asarray(ancestor_mask(parents))
  return q, k, v, jnp.full((b,), s - t, jnp.int32), mask


def main(_):
  backend = jax.default_backend()
  if SMOKE.value:
    kernel_impl = "pallas_tpu_interpret" if backend == "cpu" else "pallas"
    geometries, batches, sizes, trees, repeats = {"smollm2-135m": (3, 3, 64)}, (1,), (300,), (1, 8), 2
  elif backend == "cpu":
    raise SystemExit("no accelerator: Pallas kernels only run in interpret mode on CPU, whose "
                     "timings mean nothing. Run on a GPU/TPU, or pass --smoke to test the script.")
  else:
    kernel_impl, geometries, batches, sizes, trees, repeats = (
        "pallas", GEOMETRIES, BATCHES, SIZES, TREES, REPEATS.value)
  resolved = attention.resolve_impl(kernel_impl)
  dtype = jnp.dtype(DTYPE.value)
  ref = jax.jit(lambda *a: attention.attention(*a, impl="reference"))
  ker = jax.jit(lambda *a: attention.attention(*a, impl=kernel_impl))
  rows = []
  for name, (kh, g, h) in geometries.items():
    for b in batches:
      for s in sizes:
        for t in trees:
          args = _case(b, s, t, kh, g, h, dtype)
          np.testing.assert_allclose(np.asarray(ker(*args), np.float32),
                                     np.asarray(ref(*args), np.float32),
                                     atol=TOL[DTYPE.value], rtol=TOL[DTYPE.value])
          t_ref = median_time(lambda: ref(*args).block_until_ready(), repeats)
          t_ker = median_time(lambda: ker(*args).block_until_ready(), repeats)
          gbytes = 2 * b * kh * s * h * dtype.itemsize / 1e9  # K and V read once
          rows.append(f"| {name} | {b} | {s} | {t} | {t_ref * 1e3:.3f} | {t_ker * 1e3:.3f} | "
                      f"{t_ref / t_ker:.2f}x | {gbytes / t_ker:.0f} |")
  device = jax.devices()[0].device_kind
  out = OUT.value or f"pallas_kernels/tree_attention/results_{backend}.md"
  write_markdown(out, [
      f"# Tree attention on {device}: `{resolved}` vs the dense reference",
      "",
      f"Command: `python -m pallas_kernels.tree_attention.benchmark"
      f"{' --smoke' if SMOKE.value else ''} --dtype {DTYPE.value}` ({provenance()}). "
      f"One layer, lengths S - T, random ancestor tree, median of {repeats} calls; "
      f"outputs agree to {TOL[DTYPE.value]}."
      + (" SMOKE RUN in interpret mode: not a measurement." if SMOKE.value else ""),
      "",
      "| geometry | B | S | T | reference (ms) | kernel (ms) | speedup | kernel K+V GB/s |",
      "|---|---|---|---|---|---|---|---|",
      *rows,
  ])
  print("\n".join(rows))


if __name__ == "__main__":
  app.run(main)
