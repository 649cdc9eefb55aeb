"""Sweep the GPU kernel's tiling (BlockSizes, warps, stages) on a real GPU.

Usage (GPU only):
  python -m benchmarks.tune_tree_attention_gpu [--tune_out FILE] [--layers 16] [--repeats 30]

For SmolLM2-135M's geometry (3 kv x 3 query heads, head dim 64), bf16, rows at
length S - T, it times every tiling in the grid below on each shape of issue
#14's target grid (B in {1, 8}, T in {16, 64}, S in {1024, 4096}) with the
method of ``benchmarks.tree_attention`` (``--layers`` unrolled attentions per
call, per-attention time, interleaved with the XLA reference), checks each
tiling's output against the reference first, and writes a markdown table: the
best tiling per shape and every tiling's time. Use it to choose ``BlockSizes``
defaults for a GPU; the benchmark then reports the chosen defaults.
"""

from __future__ import annotations

import concurrent.futures
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import median_time, provenance, write_markdown
from benchmarks.tree_attention import LAYERS, REPEATS, TOL, _case, unrolled
from pallas_kernels.tree_attention.block_sizes import BlockSizes
from pallas_kernels.tree_attention.gpu_kernel import tree_attention_gpu
from specjax import attention

TUNE_OUT = flags.DEFINE_string("tune_out", "benchmarks/results/tune_tree_attention_gpu.md",
                               "markdown output")

SHAPES = tuple(itertools.product((1, 8), (1024, 4096), (16, 64)))  # (B, S, T)
BLOCK_KV = (32, 64, 128)
SPLITS = (4, 8, 16, 32)
WARPS_STAGES = ((4, 2), (4, 3))


def main(_):
  if jax.default_backend() != "gpu":
    raise SystemExit("tune_tree_attention_gpu needs a GPU (the Triton kernel cannot be timed "
                     "in interpret mode)")
  layers, repeats = LAYERS.value, REPEATS.value
  ref = unrolled(lambda *a: attention.attention(*a, impl="reference"))
  rows, best = [], []
  for b, s, t in SHAPES:
    args = _case(layers, b, s, t, 3, 3, 64, jnp.bfloat16)
    want = np.asarray(ref(*args), np.float32)
    t_ref = median_time(lambda: ref(*args).block_until_ready(), repeats) / layers
    tilings = list(itertools.product(BLOCK_KV, SPLITS, WARPS_STAGES))

    def compile_one(tiling):
      block_kv, splits, (warps, stages) = tiling
      sizes = BlockSizes(block_kv_gpu=block_kv, num_kv_splits=splits)
      return unrolled(lambda *a: tree_attention_gpu(
          *a, block_sizes=sizes, num_warps=warps, num_stages=stages)).lower(*args).compile()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # compiling is host work: overlap it
      compiled = list(pool.map(compile_one, tilings))
    timed = []
    for (block_kv, splits, (warps, stages)), ker in zip(tilings, compiled):
      np.testing.assert_allclose(np.asarray(ker(*args), np.float32), want,
                                 atol=TOL["bfloat16"], rtol=TOL["bfloat16"])
      t_ker = median_time(lambda: ker(*args).block_until_ready(), repeats) / layers
      timed.append((t_ker, block_kv, splits, warps, stages))
      rows.append(f"| {b} | {s} | {t} | {block_kv} | {splits} | {warps} | {stages} | "
                  f"{t_ker * 1e6:.1f} | {t_ref / t_ker:.2f}x |")
    t_ker, block_kv, splits, warps, stages = min(timed)
    t_ref2 = median_time(lambda: ref(*args).block_until_ready(), repeats) / layers
    best.append(f"| {b} | {s} | {t} | {t_ref * 1e6:.1f} / {t_ref2 * 1e6:.1f} | "
                f"block_kv_gpu={block_kv}, num_kv_splits={splits}, warps={warps}, "
                f"stages={stages} | {t_ker * 1e6:.1f} | {min(t_ref, t_ref2) / t_ker:.2f}x |")
    print(best[-1], flush=True)
    args = None  # free the device buffers before the next shape
  write_markdown(TUNE_OUT.value, [
      f"# GPU tree-attention kernel: tiling sweep on {jax.devices()[0].device_kind}",
      "",
      f"Command: `python -m benchmarks.tune_tree_attention_gpu --layers {layers} "
      f"--repeats {repeats}` "
      f"({provenance()}). SmolLM2-135M geometry (3 kv x 3 query heads, head dim 64), bf16, "
      f"random ancestor tree, lengths S - T; per-attention time = median of {repeats} calls "
      f"of {layers} unrolled attentions, divided by {layers}. Every tiling was checked "
      f"against the reference (tolerance {TOL['bfloat16']}) before timing. The best of "
      f"{len(BLOCK_KV) * len(SPLITS) * len(WARPS_STAGES)} tilings per shape is a maximum over "
      "noisy timings: expect it to be optimistic by the spread the benchmark reports.",
      "",
      "## Best tiling per shape",
      "",
      "| B | S | T | reference (us, before / after) | best tiling | kernel (us) | speedup |",
      "|---|---|---|---|---|---|---|",
      *best,
      "",
      "## Every tiling",
      "",
      "| B | S | T | block_kv_gpu | num_kv_splits | warps | stages | kernel (us) | speedup |",
      "|---|---|---|---|---|---|---|---|---|",
      *rows,
  ])


if __name__ == "__main__":
  app.run(main)
