"""The CPU streaming matmul (specjax/kernels) vs XLA's dot on the embedded model.

Usage:
  python -m benchmarks.streaming_matmul [--out benchmarks/results/streaming_matmul.md]

Times one forward of SmolLM2-135M (f32, 200 cached tokens) over T new tokens
per row, the shape of a decode step (T = 1) and of a verify step (T = γ + 1),
with the weights as plain arrays (XLA's GEMV/GEMM) and packed into column
panels (``load_model``'s default on CPU), which the kernel multiplies for any
number of rows (T = 128 and B = 4 x T = 16: prefill-sized calls). "verify cost" is T(t) / T(1) of the
same backend: the number speculative decoding's speedup divides by.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from benchmarks.common import forward_time, provenance, write_markdown
from specjax.kernels import streaming_matmul as sm
from specjax.loaders import load_model

OUT = flags.DEFINE_string("out", "benchmarks/results/streaming_matmul.md", "markdown output")
SHAPES = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 8), (1, 11), (1, 16), (1, 128), (1, 256),
          (4, 1), (4, 2), (4, 4), (4, 8), (4, 16)]  # (B, T)


def main(_):
  if not sm.available():
    raise SystemExit(f"the streaming matmul kernel is not available: {sm.unavailable_reason()}")
  cfg, plain = load_model(packed=False)
  _, packed = load_model(packed=True)
  times = {}
  for b, t in SHAPES:
    times[b, t] = [forward_time(cfg, p, t, batch_size=b) for p in (plain, packed)]
    print(b, t, np.round(np.array(times[b, t]) * 1e3, 1), flush=True)
  rows = []
  for (b, t), (xla, kern) in times.items():
    x1, k1 = times[b, 1]
    rows.append(f"| {b} | {t} | {xla * 1e3:.1f} | {kern * 1e3:.1f} | {xla / kern:.2f}x | "
                f"{xla / x1:.2f} | {kern / k1:.2f} |")
  write_markdown(OUT.value, [
      "# Streaming matmul kernel vs XLA's dot: one forward of SmolLM2-135M",
      "",
      f"Command: `python -m benchmarks.streaming_matmul` ({provenance()}). f32, 200 cached "
      "tokens, median of 15 calls after a warm-up. Same model, same jit; only the weights' "
      "storage differs (plain [K, N] arrays vs [N/64, K, 64] column panels).",
      "",
      "| B | new tokens T | XLA dot (ms) | streaming kernel (ms) | speedup | verify cost "
      "T(t)/T(1), XLA | verify cost, kernel |",
      "|---|---|---|---|---|---|---|",
      *rows,
  ])


if __name__ == "__main__":
  app.run(main)
