"""The verify-cost curve of a large target with random weights, and the speedup the
calibrated theory then predicts with α measured on the embedded model (a prediction).

Usage:
  python -m benchmarks.verify_curve [--shape=llama3_8b] [--dtype=bfloat16]
      [--tokens=1,2,4,8,16,32,64] [--batch_sizes=1,2,4,8,16,32] [--context=512]
      [--attention=auto] [--results=experiments/results/results.json]
      [--out=benchmarks/results/verify_curve.md]

For each batch size B the target's forward over T new tokens per row (after
``context`` cached slots) is timed, and cost(T) = time(T) / time(1) is the curve
of ``specjax.theory.VerifyCostCurve``. The draft's cost ratio c is timed the same
way on an EAGLE-3-shaped drafter of that target (one decoder layer of its width
and a ``draft_vocab`` head: its T = 1 forward over the target's). The prediction
is ``theory.calibrated_walltime_improvement(α, γ, c, curve)`` at the best γ,
with α the EAGLE drafter's on SmolLM2 at T = 0 and T = 1 from ``--results`` (the
default run's results.json): an α measured on a 135M target, carried over to an
8B-shaped one, and weights that are random — a prediction, labelled as such.

``--shape=tiny`` runs the same code on a small model (CPU tests of the script).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import forward_fn, median_time, provenance, write_markdown
from benchmarks.shapes import DRAFT_VOCAB, SHAPES
from experiments.machine import probe_output_dir
from specjax import theory, validation
from specjax.config import ModelConfig
from specjax.model import init_params

SHAPE = flags.DEFINE_enum("shape", "llama3_8b", list(SHAPES), "target shape")
DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "weights and cache")
TOKENS = flags.DEFINE_list("tokens", ["1", "2", "4", "8", "16", "32", "64"], "new tokens T")
BATCHES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32"], "batch sizes B")
CONTEXT = flags.DEFINE_integer("context", 512, "cached slots before the new tokens")
ATTENTION = flags.DEFINE_string("attention", "auto", "attention implementation "
                                "(specjax.attention.IMPLS)")
REPEATS = flags.DEFINE_integer("repeats", 10, "timed forwards per point (median)")
RESULTS = flags.DEFINE_string("results", "experiments/results/results.json",
                              "results.json of a default run: α of its EAGLE rows")
OUT = flags.DEFINE_string("out", "benchmarks/results/verify_curve.md", "markdown output")


def timer(cfg: ModelConfig, params, batch: int, tokens: int, context: int, impl: str):
  """Median seconds of one forward over ``tokens`` new tokens per row."""
  return median_time(forward_fn(cfg, params, tokens, context, batch, dtype=DTYPE.value,
                                attention_impl=impl, min_cache=0), REPEATS.value)


def measured_alpha(path: str) -> dict[float, float]:
  """{temperature: α} of the γ sweep's EAGLE rows over all categories (mean over γ)."""
  with open(path) as f:
    rows = json.load(f)["rows"]
  alphas: dict[float, list[float]] = {}
  for r in rows:
    if (r["experiment"] == "gamma_sweep" and r["category"] == "all" and r["alpha"] is not None
        and r["draft"] == "eagle" and r.get("tree") is None):
      alphas.setdefault(r["temperature"], []).append(r["alpha"])
  if not alphas:
    raise ValueError(f"{path} holds no γ-sweep rows of the EAGLE drafter")
  return {t: float(np.mean(a)) for t, a in sorted(alphas.items())}


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  validation.compute_dtype(DTYPE.value)
  alphas = measured_alpha(RESULTS.value)  # fail before building an 8B model
  cfg = SHAPES[SHAPE.value]
  dtype = jnp.dtype(DTYPE.value)
  params = init_params(cfg, jax.random.PRNGKey(0), dtype)
  dcfg = dataclasses.replace(cfg, num_layers=1, vocab_size=DRAFT_VOCAB[SHAPE.value],
                             name=f"{cfg.name}-eagle3-shaped")
  dparams = init_params(dcfg, jax.random.PRNGKey(1), dtype)
  tokens = sorted({1, *(int(t) for t in TOKENS.value)})
  batches = [int(b) for b in BATCHES.value]
  lines = [f"# Verify cost of a {cfg.name} target (random {DTYPE.value} weights)", "",
           f"{provenance()} ({jax.default_backend()}: {jax.devices()[0].device_kind}); "
           f"context {CONTEXT.value} cached slots; attention `{ATTENTION.value}`; median of "
           f"{REPEATS.value} forwards per point.", "",
           "Command: `python -m benchmarks.verify_curve " + " ".join(
               f"--{f.name}={','.join(f.value) if isinstance(f.value, list) else f.value}"
               for f in (SHAPE, DTYPE, TOKENS, BATCHES, CONTEXT, ATTENTION, RESULTS)) + "`", "",
           "## cost(T) = forward over T new tokens / forward over 1, per batch size", "",
           "| B | t(1) (ms) | " + " | ".join(f"T={t}" for t in tokens) + " | draft c |",
           "|---|---|" + "---|" * len(tokens) + "---|"]
  curves = {}
  for b in batches:
    times = {t: timer(cfg, params, b, t, CONTEXT.value, ATTENTION.value) for t in tokens}
    c = timer(dcfg, dparams, b, 1, CONTEXT.value, ATTENTION.value) / times[1]
    curves[b] = (theory.VerifyCostCurve(times), c)
    lines.append(f"| {b} | {times[1] * 1e3:.2f} | " + " | ".join(
        f"{times[t] / times[1]:.2f}" for t in tokens) + f" | {c:.3f} |")
    print(lines[-1], flush=True)  # a run cut short still leaves its rows in the log
  lines += ["", "## Predicted speedup (calibrated theory; a prediction, not a measurement)", "",
            f"α of the EAGLE drafter on SmolLM2-135M ({RESULTS.value}, γ-sweep mean): " +
            ", ".join(f"T={t:g}: {a:.3f}" for t, a in alphas.items()) + ". Speedup = "
            "E[tokens](α, γ) / (γ·c + cost(γ + 1)) at the best γ ≤ 8 "
            "(and γ + 1 ≤ the largest T measured) of each row.", "",
            "| B | " + " | ".join(f"T={t:g}: speedup (γ)" for t in alphas) + " |",
            "|---|" + "---|" * len(alphas)]
  gammas = np.arange(1, max(2, min(9, tokens[-1])))  # γ + 1 within the measured T
  for b, (curve, c) in curves.items():
    cells = []
    for a in alphas.values():
      pred = np.asarray(theory.calibrated_walltime_improvement(a, gammas, c, curve))
      cells.append(f"{pred.max():.2f}× ({gammas[pred.argmax()]})")
    lines.append(f"| {b} | " + " | ".join(cells) + " |")
  write_markdown(OUT.value, lines + [""])


if __name__ == "__main__":
  app.run(main)
