"""The CPU streaming matmul vs XLA's dot vs the path ``load_model`` chose, on the embedded model.

Usage:
  python -m benchmarks.streaming_matmul [--out benchmarks/results/streaming_matmul.md]

Times one forward of SmolLM2-135M (f32, 200 cached tokens) over T new tokens
per row, the shape of a decode step (T = 1), of a verify step (T = γ + 1) and
of prefill chunks (T = 64...256), with the weights as plain arrays (XLA's
GEMV/GEMM), packed for the kernel at every row count (``packed=True``), and as
``load_model`` packs them by default (the policy measured on this machine,
``specjax/kernels/policy.py``). The three are timed alternately, so load from
elsewhere on the machine hits them alike; medians and the spread (max / min
of the repeats) are reported. "verify cost" is T(t) / T(1) of the same path:
the number speculative decoding's speedup divides by.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from benchmarks.common import forward_fn, interleaved_times, provenance, write_markdown
from experiments.machine import matmul_path
from specjax.kernels import streaming_matmul as sm
from specjax.loaders import load_model

OUT = flags.DEFINE_string("out", "benchmarks/results/streaming_matmul.md", "markdown output")
REPEATS = flags.DEFINE_integer("repeats", 11, "timed calls per shape and path")
SHAPES = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 8), (1, 11), (1, 16), (1, 64), (1, 128),
          (1, 256), (4, 1), (4, 2), (4, 4), (4, 8), (4, 16)]  # (B, T)
CONTEXT = 200


def main(_):
  if not sm.available():
    raise SystemExit(f"the streaming matmul kernel is not available: {sm.unavailable_reason()}")
  cfg, plain = load_model(packed=False)
  paths = {"XLA dot": plain, "kernel": load_model(packed=True)[1],
           "chosen": load_model()[1]}
  chosen = matmul_path(paths["chosen"])
  times = {}
  for b, t in SHAPES:
    fns = {name: forward_fn(cfg, p, t, CONTEXT, b) for name, p in paths.items()}
    runs = interleaved_times(fns, REPEATS.value)
    times[b, t] = {name: (float(np.median(r)), max(r) / min(r)) for name, r in runs.items()}
    print(b, t, {k: round(v[0] * 1e3, 1) for k, v in times[b, t].items()}, flush=True)
  rows = []
  for (b, t), tt in times.items():
    (x, xs), (k, ks), (c, cs) = tt["XLA dot"], tt["kernel"], tt["chosen"]
    x1, k1, c1 = (times[b, 1][n][0] for n in ("XLA dot", "kernel", "chosen"))
    rows.append(f"| {b} | {t} | {x * 1e3:.1f} ({xs:.2f}) | {k * 1e3:.1f} ({ks:.2f}) | "
                f"{c * 1e3:.1f} ({cs:.2f}) | {x / k:.2f}x | {x / c:.2f}x | {x / x1:.2f} | "
                f"{k / k1:.2f} | {c / c1:.2f} |")
  write_markdown(OUT.value, [
      "# Streaming matmul kernel vs XLA's dot: one forward of SmolLM2-135M",
      "",
      f"Command: `python -m benchmarks.streaming_matmul` ({provenance()}; kernel path "
      f"{sm.isa()}). f32, {CONTEXT} cached tokens, median of {REPEATS.value} calls per path "
      "after a warm-up, the three paths timed alternately; in parentheses the spread "
      "(slowest / fastest call). Same model, same jit; only the weights' storage differs: "
      "plain [K, N] arrays, [N/W, K, W] column panels for the kernel at every M, and what "
      "`load_model()` chose on this machine (for the layers' projections and the head, "
      "measured apart):",
      "",
      f"> {chosen}",
      "",
      "| B | new tokens T | XLA dot (ms) | kernel (ms) | chosen (ms) | kernel speedup | "
      "chosen speedup | verify cost T(t)/T(1), XLA | verify cost, kernel | verify cost, chosen |",
      "|---|---|---|---|---|---|---|---|---|---|",
      *rows,
  ])


if __name__ == "__main__":
  app.run(main)
