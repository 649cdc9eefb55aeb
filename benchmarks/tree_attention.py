"""Tree attention: the Pallas kernel of this backend vs the dense jnp reference.

Usage (on a GPU or TPU machine):
  python -m benchmarks.tree_attention [--out FILE] [--dtype bfloat16] [--batch_sizes 1,8]
      [--sizes 1024,4096,16384] [--trees 1,16,64] [--layers 16] [--repeats 30]
  python -m benchmarks.tree_attention --smoke   # CPU, interpret mode, tiny

Times the attention of T new tokens over a cache of S slots, every row's
committed length S - T (the whole cache is read), for SmolLM2-135M's geometry
(3 kv heads x 3 query heads, head dim 64) and a Llama-3-8B-like one (8 x 4,
head dim 128); T = 1 (decode), 16 (a chain or small tree), 64 (a token tree).
One timed call runs ``--layers`` attentions over distinct caches, unrolled
(as the model's forward runs its layers), so a few-microsecond kernel is not
hidden behind one dispatch per call; the table reports time per attention. Both
paths are checked against each other on every layer before timing. Writes a markdown
table with the command, the device and the git revision; on CPU it refuses to
time anything except ``--smoke`` (interpret mode: a correctness run of this
script, not a measurement).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import int_list, median_time, provenance, write_markdown
from pallas_kernels.tree_attention import ancestor_mask
from pallas_kernels.tree_attention.block_sizes import BlockSizes
from specjax import attention

OUT = flags.DEFINE_string("out", None, "markdown output (default: "
                          "benchmarks/results/tree_attention_<backend>.md)")
DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "q/k/v dtype")
REPEATS = flags.DEFINE_integer("repeats", 30, "timed calls per shape (median reported)",
                               lower_bound=1)
LAYERS = flags.DEFINE_integer("layers", 16, "attentions per timed call (distinct caches, scanned)",
                              lower_bound=1)
SMOKE = flags.DEFINE_bool("smoke", False, "tiny shapes through the interpret-mode kernels (CPU)")

GEOMETRIES = {"smollm2-135m": (3, 3, 64), "llama3-8b-like": (8, 4, 128)}  # (K, G, H)
GEOMETRY = flags.DEFINE_multi_enum("geometry", list(GEOMETRIES), list(GEOMETRIES),
                                   "head geometries to time")
BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8"], "batch sizes B")
SIZES = flags.DEFINE_list("sizes", ["1024", "4096", "16384"], "cache slots S (committed S - T)")
TREES = flags.DEFINE_list("trees", ["1", "16", "64"], "new tokens T (a random ancestor tree)")
TOL = {"bfloat16": 2e-2, "float32": 1e-4}


def _case(layers, b, s, t, kh, g, h, dtype, seed=0):
  """Stacked per-layer q [L, B, T, N, H], k/v [L, B, K, S, H]; lengths [B]; a random tree mask."""
  key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(key_q, (layers, b, t, kh * g, h), jnp.float32).astype(dtype)
  k = jax.random.normal(key_k, (layers, b, kh, s, h), jnp.float32).astype(dtype)
  v = jax.random.normal(key_v, (layers, b, kh, s, h), jnp.float32).astype(dtype)
  rng = np.random.default_rng(seed)
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
  mask = jnp.asarray(ancestor_mask(parents))
  return q, k, v, jnp.full((b,), s - t, jnp.int32), mask


def unrolled(attend):
  """jit of ``attend`` over each layer of stacked q/k/v, unrolled (no device loop per layer)."""
  def run(q, k, v, lengths, mask):
    return jnp.stack([attend(q[i], k[i], v[i], lengths, mask) for i in range(q.shape[0])])
  return jax.jit(run)


def main(_):
  batches, sizes, trees = int_list(BATCHES), int_list(SIZES), int_list(TREES)
  budget = BlockSizes.get_default().max_tree_tokens
  if max(trees) > min(sizes) or max(trees) > budget:
    raise SystemExit(f"every T of --trees must be <= every S of --sizes and <= the kernels' "
                     f"budget of {budget} new tokens; got {trees}, {sizes}")
  backend = jax.default_backend()
  if SMOKE.value:
    kernel_impl = "pallas_tpu_interpret" if backend == "cpu" else "pallas"
    geometries, batches, sizes, trees, repeats = {"smollm2-135m": (3, 3, 64)}, (1,), (300,), (1, 8), 2
  elif backend == "cpu":
    raise SystemExit("no accelerator: Pallas kernels only run in interpret mode on CPU, whose "
                     "timings mean nothing. Run on a GPU/TPU, or pass --smoke to test the script.")
  else:
    kernel_impl, repeats = "pallas", REPEATS.value
    geometries = {name: GEOMETRIES[name] for name in GEOMETRY.value}
  layers = 2 if SMOKE.value else LAYERS.value
  resolved = attention.resolve_impl(kernel_impl)
  dtype = jnp.dtype(DTYPE.value)
  ref = unrolled(lambda *a: attention.attention(*a, impl="reference"))
  ker = unrolled(lambda *a: attention.attention(*a, impl=kernel_impl))
  device = jax.devices()[0].device_kind
  out = OUT.value or f"benchmarks/results/tree_attention_{backend}.md"
  header = [
      f"# Tree attention on {device}: `{resolved}` vs the dense reference",
      "",
      f"Command: `python -m benchmarks.tree_attention"
      f"{' --smoke' if SMOKE.value else ''} --dtype {DTYPE.value}"
      f"{''.join(f' --geometry={g}' for g in geometries) if not SMOKE.value else ''}"
      f"{'' if SMOKE.value else f' --layers={layers} --repeats={repeats}'}"
      f"{'' if SMOKE.value else ''.join(f' --{f.name}=' + ','.join(f.value) for f in (BATCHES, SIZES, TREES))}` "
      f"({provenance()}). "
      f"Lengths S - T, random ancestor tree; each call runs {layers} attentions over "
      f"distinct caches; time per attention = the better of two interleaved medians of "
      f"{repeats} calls, divided by {layers} (spread: the two medians' largest relative "
      f"difference); outputs agree to {TOL[DTYPE.value]}."
      + (" SMOKE RUN in interpret mode: not a measurement." if SMOKE.value else ""),
      "",
      "| geometry | B | S | T | reference (us) | kernel (us) | speedup | kernel K+V GB/s | spread |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  rows = []
  for name, (kh, g, h) in geometries.items():
    for b in batches:
      for s in sizes:
        for t in trees:
          args = _case(layers, b, s, t, kh, g, h, dtype)
          np.testing.assert_allclose(np.asarray(ker(*args), np.float32),
                                     np.asarray(ref(*args), np.float32),
                                     atol=TOL[DTYPE.value], rtol=TOL[DTYPE.value])
          # Interleaved, twice each: a difference smaller than a path's own spread is noise.
          t_ref1, t_ker1, t_ref2, t_ker2 = (
              median_time(lambda f=f: f(*args).block_until_ready(), repeats) / layers
              for f in (ref, ker, ref, ker))
          t_ref, t_ker = min(t_ref1, t_ref2), min(t_ker1, t_ker2)
          spread = max(abs(t_ref1 - t_ref2) / t_ref, abs(t_ker1 - t_ker2) / t_ker)
          gbytes = 2 * b * kh * s * h * dtype.itemsize / 1e9  # K and V read once
          rows.append(f"| {name} | {b} | {s} | {t} | {t_ref * 1e6:.1f} | {t_ker * 1e6:.1f} | "
                      f"{t_ref / t_ker:.2f}x | {gbytes / t_ker:.0f} | {spread:.0%} |")
          print(rows[-1], flush=True)
          write_markdown(out, header + rows, quiet=True)  # a run cut short keeps its rows
          args = None  # free the device buffers before the next shape
  write_markdown(out, header + rows)


if __name__ == "__main__":
  app.run(main)
