"""Attention inside the model: whole forwards with one attention implementation against
another, the measurement a Pallas/XLA dispatch rule is to be chosen from.

Usage (on a GPU or TPU machine):
  python -m benchmarks.attention_dispatch [--shape=smollm2_135m] [--dtype=bfloat16]
      [--impls=pallas,reference] [--batch_sizes=1,8,32] [--tokens=1,4,16,64]
      [--contexts=512,4096] [--repeats=10] [--out=benchmarks/results/attention_dispatch.md]

``benchmarks.tree_attention`` times attention alone, over caches nothing writes; in a
decoder each layer first writes the new tokens' keys and values into its cache and then
attends, and what the compiler does around that write is part of the cost. Here each
point is one forward of a target with random weights (``benchmarks.shapes``) over T new
tokens per row after ``context`` cached slots, the cache updated in place as decoding
does (``benchmarks.common.forward_fn``), timed with the first implementation of
``--impls`` (the candidate) and the second (the baseline), interleaved twice (the better
median of each is kept; spread = the two medians' largest relative difference); ratio =
baseline time / candidate time, above 1 where the candidate is faster. The table is
rewritten after every point. ``--shape=tiny --impls=cpu,reference`` runs it on CPU (the
test).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks.common import forward_fn, int_list, median_time, provenance, write_markdown
from benchmarks.shapes import SHAPES
from experiments.machine import probe_output_dir
from pallas_kernels.tree_attention.block_sizes import BlockSizes
from specjax import attention, validation
from specjax.model import init_params

SHAPE = flags.DEFINE_enum("shape", "smollm2_135m", list(SHAPES), "target shape")
DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "weights and cache")
IMPLS = flags.DEFINE_list("impls", ["pallas", "reference"],
                          "candidate,baseline attention implementations (specjax.attention)")
BATCHES = flags.DEFINE_list("batch_sizes", ["1", "8", "32"], "batch sizes B")
TOKENS = flags.DEFINE_list("tokens", ["1", "4", "16", "64"], "new tokens T per row")
CONTEXTS = flags.DEFINE_list("contexts", ["512", "4096"], "cached slots before the new tokens")
REPEATS = flags.DEFINE_integer("repeats", 10, "timed forwards per median", lower_bound=1)
OUT = flags.DEFINE_string("out", "benchmarks/results/attention_dispatch.md", "markdown output")


def main(_):
  batches, tokens, contexts = int_list(BATCHES), int_list(TOKENS), int_list(CONTEXTS)
  if len(IMPLS.value) != 2:
    raise SystemExit(f"--impls takes two implementations, got {IMPLS.value}")
  if "auto" in IMPLS.value:
    raise SystemExit("--impls names concrete implementations ('auto' is what is being chosen)")
  try:
    resolved = [attention.resolve_impl(impl) for impl in IMPLS.value]
  except ValueError as e:
    raise SystemExit(f"--impls: {e}") from None
  if resolved[0] == resolved[1]:
    raise SystemExit(f"--impls takes two different implementations; {IMPLS.value} are both "
                     f"{resolved[0]!r} here")
  budget = BlockSizes.get_default().max_tree_tokens
  if any(r.startswith("pallas") for r in resolved) and max(tokens) > budget:
    raise SystemExit(f"--tokens up to {budget} for the Pallas kernels, got {tokens}")
  probe_output_dir(OUT.value.rsplit("/", 1)[0] if "/" in OUT.value else ".")
  validation.compute_dtype(DTYPE.value)
  cfg = SHAPES[SHAPE.value]
  params = init_params(cfg, jax.random.PRNGKey(0), jnp.dtype(DTYPE.value))
  candidate, baseline = resolved
  header = [
      f"# Attention inside the model: `{candidate}` against `{baseline}` "
      f"({cfg.name}, random {DTYPE.value} weights)", "",
      f"{provenance()} ({jax.default_backend()}: {jax.devices()[0].device_kind}).", "",
      "Command: `python -m benchmarks.attention_dispatch " + " ".join(
          f"--{f.name}={','.join(f.value) if isinstance(f.value, list) else f.value}"
          for f in (SHAPE, DTYPE, IMPLS, BATCHES, TOKENS, CONTEXTS, REPEATS)) + "`", "",
      "One forward of the whole target over T new tokens per row after `context` cached "
      "slots (each layer writes its cache in place, then attends); the better of two "
      f"interleaved medians of {REPEATS.value}; ratio = `{baseline}` time / `{candidate}` "
      f"time (above 1: `{candidate}` is faster).", "",
      f"| context | B | T | {baseline} (ms) | {candidate} (ms) | ratio | spread |",
      "|---|---|---|---|---|---|---|"]
  rows = []
  for context in contexts:
    for b in batches:
      for t in tokens:
        fns = [forward_fn(cfg, params, t, context, b, dtype=DTYPE.value, attention_impl=impl,
                          min_cache=0) for impl in (candidate, baseline)]
        c1, b1, c2, b2 = (median_time(f, REPEATS.value) for f in (*fns, *fns))
        tc, tb = min(c1, c2), min(b1, b2)
        spread = max(abs(c1 - c2) / tc, abs(b1 - b2) / tb)
        rows.append(f"| {context} | {b} | {t} | {tb * 1e3:.3f} | {tc * 1e3:.3f} | "
                    f"{tb / tc:.3f} | {spread:.0%} |")
        print(rows[-1], flush=True)
        write_markdown(OUT.value, header + rows + [""], quiet=True)  # kept if cut short
        fns = None  # free the caches before the next point
  write_markdown(OUT.value, header + rows + [""])


if __name__ == "__main__":
  app.run(main)
