"""This host's roofline for the verify forward, beside the measured verify cost.

Usage:
  python -m benchmarks.roofline [--tokens=1,2,3,4,5,6,8,12,16] [--context=200]
      [--repeats=11] [--bandwidth_mib=1024] [--target=smollm2]
      [--out=benchmarks/results/roofline_<kernel path>.md]

A forward over T new tokens (batch 1, ``context`` cached slots) must at least read
every weight matrix once and do T multiply-adds (2 T FLOPs) per matrix parameter, so it
cannot take less than

    roofline(T) = max(bytes(T) / bandwidth, flops(T) / peak)

bytes: the projections and the LM head once (float32; the input embedding's T
rows), the cache's filled slots read by attention and the new keys and values
written. flops: 2 T per matrix parameter and the attention scores and sums over
context + T slots. Two numbers of this machine, each measured here:

* bandwidth: the best of a STREAM-like read (an array of ``--bandwidth_mib``
  summed by numpy on every core, and by XLA) and the streaming kernel's own read of a
  weight of that size at M = 1 (where it builds: on some hosts it reads faster than
  any sum, and a roofline the decode step beats is no bound), GB/s, measured before and
  again after the forwards (the best of both; a change of more than 10% is flagged);
* peak: the best GFLOP/s of the matmul paths (the streaming kernel where it
  builds, and XLA's dot) on the target's largest projection at M = 256 and 512
  rows, the "large M" where a matmul is compute-bound.

The same forward is then timed on the weights as ``load_model`` stores them on
this machine (the measured kernel/XLA policy), all T timed in turn within each
repeat so that load from elsewhere hits them alike. The verify cost
T(t) / T(1) divides speculative decoding's speedup; its roofline R(t) / R(1) is
what it would be if every forward ran at the roofline. Both gaps are reported:
measured / roofline time (how far a forward is from the machine's limits) and
measured cost / roofline cost (how much wider verification costs than it must).

``--target=tiny`` runs the same code on a small random model (CPU tests of the
script).
"""

from __future__ import annotations

import os
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import (forward_fn, int_list, interleaved_times, op_times, provenance,
                               write_markdown)
from benchmarks.shapes import SHAPES
from experiments.machine import matmul_path, probe_output_dir
from specjax.config import ModelConfig
from specjax.kernels import streaming_matmul as sm
from specjax.loaders import load_model
from specjax.model import init_params

TOKENS = flags.DEFINE_list("tokens", ["1", "2", "3", "4", "5", "6", "8", "12", "16"],
                           "new tokens T per forward (1 must be among them)")
CONTEXT = flags.DEFINE_integer("context", 200, "cached slots before the new tokens")
REPEATS = flags.DEFINE_integer("repeats", 11, "timed forwards per T (median)")
BANDWIDTH_MIB = flags.DEFINE_integer("bandwidth_mib", 1024,
                                     "array read to measure bandwidth (MiB; far above the "
                                     "caches)")
TARGET = flags.DEFINE_enum("target", "smollm2", ["smollm2", "tiny"],
                           "the embedded model, or a tiny random one (tests)")
OUT = flags.DEFINE_string("out", None, "markdown output (default "
                          "benchmarks/results/roofline_<kernel path or xla>.md)")
PROFILE = flags.DEFINE_bool("profile", True, "also trace 5 forwards per T with jax.profiler "
                            "and report the time per kind of operation")
GOAL = 1.15  # the verify of <= 5 tokens should cost within 15% of its roofline (#31)


def matrix_params(cfg: ModelConfig) -> int:
  """Parameters of the matrices every forward multiplies by: the layers' projections and the
  LM head (the input embedding is a lookup of T rows)."""
  h, d = cfg.head_dim, cfg.dim
  attn = d * h * (cfg.num_heads * 2 + cfg.num_kv_heads * 2)
  return cfg.num_layers * (attn + 3 * d * cfg.ffn_dim) + cfg.vocab_size * d


def forward_bytes(cfg: ModelConfig, tokens: int, context: int, itemsize: int = 4) -> int:
  """Bytes one forward must move: every matrix once, the T embedding rows, the norms, the
  cache's filled slots read and the new keys and values written. (With tied embeddings the
  T rows are also rows of the LM head already counted: T x dim floats too many, negligible.)"""
  kv_per_slot = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
  norms = (2 * cfg.num_layers + 1) * cfg.dim
  return itemsize * (matrix_params(cfg) + tokens * cfg.dim + norms
                     + kv_per_slot * (context + 2 * tokens))


def forward_flops(cfg: ModelConfig, tokens: int, context: int) -> int:
  """Floating-point operations of one forward: 2 per matrix parameter and token, and the
  attention scores and weighted sums (2 x 2 x head_dim per query head, token and slot)."""
  attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (context + tokens)
  return 2 * tokens * matrix_params(cfg) + attention


def roofline_seconds(nbytes: float, flops: float, bandwidth: float, peak: float
                     ) -> tuple[float, str]:
  """(seconds, "memory" or "compute"): the larger of the two lower bounds."""
  memory, compute = nbytes / bandwidth, flops / peak
  return (memory, "memory") if memory >= compute else (compute, "compute")


def _best(fn, repeats: int) -> float:
  """Fastest of ``repeats`` calls after a warm-up (a bound wants the best, not the median)."""
  return min(interleaved_times({0: fn}, repeats)[0])


def measure_bandwidth(mib: int, repeats: int = 5) -> dict[str, float]:
  """Read bandwidth (bytes/s) of a ``mib``-MiB float32 array summed by numpy on one thread,
  by numpy on every core (one contiguous share per thread) and by XLA, and, where the
  streaming kernel builds, read by it as a [576, ·] weight times one row (M = 1)."""
  x = np.random.default_rng(0).random(mib * 2**18, dtype=np.float32)
  threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
      os.cpu_count() or 1)
  shares = np.array_split(x, threads)

  def threaded():
    workers = [threading.Thread(target=np.sum, args=(s,)) for s in shares]
    for w in workers:
      w.start()
    for w in workers:
      w.join()

  xj = jnp.asarray(x)
  total = jax.jit(jnp.sum)
  out = {"numpy, 1 thread": x.nbytes / _best(lambda: np.sum(x), repeats),
         f"numpy, {threads} threads": x.nbytes / _best(threaded, repeats),
         "XLA sum": x.nbytes / _best(lambda: total(xj).block_until_ready(), repeats)}
  del xj
  if sm.available():
    k = 576  # SmolLM2's model width: the kernel's panels as the forward reads them
    panels = jnp.asarray(sm.to_panels(x[:x.size // k * k].reshape(k, -1)))
    row = jnp.ones((1, k), jnp.float32)
    matvec = jax.jit(sm.streaming_matmul)
    out["streaming kernel, M = 1"] = panels.nbytes / _best(
        lambda: matvec(row, panels).block_until_ready(), repeats)
  return out


def measure_peak(k: int, n: int, rows=(256, 512), repeats: int = 5) -> dict[str, float]:
  """FLOP/s of x [M, k] @ w [k, n] at each M in ``rows`` for XLA's dot and, where it builds,
  the streaming kernel (float32)."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((k, n), dtype=np.float32)
  paths = {"XLA dot": (jax.jit(jnp.dot), jnp.asarray(w))}
  if sm.available():
    paths["streaming kernel"] = (jax.jit(sm.streaming_matmul), jnp.asarray(sm.to_panels(w)))
  out = {}
  for m in rows:
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    for name, (f, weight) in paths.items():
      out[f"{name}, M = {m}"] = 2 * m * k * n / _best(
          lambda: f(x, weight).block_until_ready(), repeats)
  return out


def _model(target: str):
  if target == "tiny":
    cfg = SHAPES["tiny"]
    return cfg, init_params(cfg, jax.random.PRNGKey(0))
  return load_model()


def main(_):
  tokens = int_list(TOKENS)
  if 1 not in tokens:
    raise SystemExit("--tokens must include 1: the verify cost is T(t) / T(1)")
  for flag, low in ((CONTEXT, 0), (REPEATS, 1), (BANDWIDTH_MIB, 1)):
    if flag.value < low:
      raise SystemExit(f"--{flag.name} must be >= {low}, got {flag.value}")
  out = OUT.value or f"benchmarks/results/roofline_{sm.isa() or 'xla'}.md"
  probe_output_dir(os.path.dirname(out) or ".")
  tokens = sorted(set(tokens))
  cfg, params = _model(TARGET.value)

  bandwidths = measure_bandwidth(BANDWIDTH_MIB.value)
  biggest = max(((cfg.dim, cfg.num_heads * cfg.head_dim), (cfg.dim, 2 * cfg.ffn_dim),
                 (cfg.ffn_dim, cfg.dim)), key=lambda s: s[0] * s[1])
  peaks = measure_peak(*biggest)
  bandwidth, peak = max(bandwidths.values()), max(peaks.values())
  print({k: f"{v / 1e9:.1f} GB/s" for k, v in bandwidths.items()},
        {k: f"{v / 1e9:.1f} GFLOP/s" for k, v in peaks.items()}, flush=True)

  fns = {t: forward_fn(cfg, params, t, CONTEXT.value) for t in tokens}
  runs = interleaved_times(fns, REPEATS.value)
  measured = {t: float(np.median(r)) for t, r in runs.items()}
  breakdown = {t: op_times(f, f.hlo_text()) for t, f in fns.items()} if PROFILE.value else {}
  # Measured again after the forwards: a shared host's bandwidth drifts (2-core Zen 4 hosts
  # read 43.2 GB/s at e3f9944 and 30.8-33.2 at f3a5c9d: benchmarks/results/roofline_*), and
  # a bound taken at another moment than the forwards shows as a gap that is not theirs.
  after = measure_bandwidth(BANDWIDTH_MIB.value)
  drift = max(after.values()) / bandwidth
  bandwidth = max(bandwidth, max(after.values()))
  bound = {t: roofline_seconds(forward_bytes(cfg, t, CONTEXT.value),
                               forward_flops(cfg, t, CONTEXT.value), bandwidth, peak)
           for t in tokens}

  rows, gaps = [], {}
  for t in tokens:
    roof, kind = bound[t]
    cost, roof_cost = measured[t] / measured[1], roof / bound[1][0]
    gaps[t] = (measured[t] / roof, cost / roof_cost)
    rows.append(f"| {t} | {measured[t] * 1e3:.1f} ({max(runs[t]) / min(runs[t]):.2f}) | "
                f"{roof * 1e3:.1f} ({kind}) | {gaps[t][0]:.2f} | {cost:.2f} | {roof_cost:.2f} | "
                f"{gaps[t][1]:.2f} |")
  verify = [t for t in tokens if 2 <= t <= 5]
  verdict = []
  if verify:
    worst_time = max(gaps[t][0] for t in verify)
    worst_cost = max(gaps[t][1] for t in verify)
    verdict = [
        "",
        f"Verify of T = {verify[0]}–{verify[-1]} tokens: measured cost at most "
        f"{worst_cost:.2f}x the roofline cost (goal {GOAL}x: "
        f"{'met' if worst_cost <= GOAL else 'not met'}); measured time at most "
        f"{worst_time:.2f}x the roofline time, where the decode step T = 1 runs at "
        f"{gaps[1][0]:.2f}x.",
    ]
  g = 1e9
  write_markdown(out, [
      f"# Roofline of the verify forward on this host "
      f"({'SmolLM2-135M' if TARGET.value == 'smollm2' else cfg.name})",
      "",
      f"Command: `{' '.join(['python -m benchmarks.roofline', *sys.argv[1:]])}` "
      f"({provenance()}). Batch 1, float32, {CONTEXT.value} cached slots, median of "
      f"{REPEATS.value} forwards per T (all T in turn within each repeat); in parentheses the "
      f"spread (slowest / fastest). Matmul path: {matmul_path(params)}.",
      "",
      f"- **bandwidth {bandwidth / g:.1f} GB/s**, the best STREAM-like read of "
      f"{BANDWIDTH_MIB.value} MiB, before the forwards: " + ", ".join(
          f"{k} {v / g:.1f}" for k, v in bandwidths.items()) + " GB/s; after them: "
      + ", ".join(f"{k} {v / g:.1f}" for k, v in after.items()) + " GB/s"
      + (f" (⚠ the best read moved {drift - 1:+.0%} during the run: the host's bandwidth "
         "changed)" if abs(drift - 1) > 0.1 else ""),
      f"- **peak {peak / g:.1f} GFLOP/s**, the best matmul on the largest projection "
      f"[{biggest[0]}, {biggest[1]}]: " + ", ".join(f"{k} {v / g:.1f}" for k, v in
                                                  peaks.items()) + " GFLOP/s",
      f"- one forward moves {forward_bytes(cfg, 1, CONTEXT.value) / 2**20:.0f} MiB at T = 1 "
      f"({matrix_params(cfg) / 1e6:.1f}M matrix parameters); "
      + _crossover(cfg, CONTEXT.value, bandwidth, peak),
      "",
      "| T | measured (ms) | roofline (ms) | measured / roofline | verify cost T(t)/T(1) | "
      "roofline cost R(t)/R(1) | cost / roofline cost |",
      "|---|---|---|---|---|---|---|",
      *rows,
      *verdict,
      *_breakdown_table(breakdown),
  ])


def _breakdown_table(breakdown: dict[int, dict[str, float]]) -> list[str]:
  """Where each forward's time goes, by kind of operation (``benchmarks.common.op_times``)."""
  if not breakdown:
    return []
  kinds = sorted({k for b in breakdown.values() for k in b},
                 key=lambda k: (k == "between ops", -sum(b.get(k, 0) for b in breakdown.values())))
  names = {"specjax_streaming_matmul": "streaming matmul kernel",
           "specjax_cpu_attention": "CPU attention kernel"}
  return [
      "",
      "Where a forward's time goes (a `jax.profiler` trace of 5 more forwards per T; ms per "
      "forward by kind of operation: each custom call under its kernel's name, \"XLA ops\" "
      "for the program's other thunks, \"between ops\" for the executor's time outside "
      "them):",
      "",
      "| T | " + " | ".join(names.get(k, k) for k in kinds) + " | total |",
      "|---|" + "---|" * (len(kinds) + 1),
      *(f"| {t} | " + " | ".join(f"{b.get(k, 0) * 1e3:.1f}" for k in kinds)
        + f" | {sum(b.values()) * 1e3:.1f} |" for t, b in breakdown.items()),
  ]


def _crossover(cfg: ModelConfig, context: int, bandwidth: float, peak: float) -> str:
  """Where the roofline turns compute-bound: the smallest such T up to 4096, in words."""
  for t in range(1, 4097):
    if roofline_seconds(forward_bytes(cfg, t, context), forward_flops(cfg, t, context),
                        bandwidth, peak)[1] == "compute":
      return f"the roofline turns compute-bound from T = {t}"
  return "the roofline stays memory-bound up to T = 4096"


if __name__ == "__main__":
  app.run(main)
