"""Where a decoding step's time goes, by operation, on the embedded SmolLM2-135M target.

Usage:
  python -m benchmarks.step_profile [--prompts 3] [--new_tokens 64] [--temperatures 0,1]
      [--methods plain,chain:2,chain:3,dynamic:4:4:4,dynamic:4:4:8,dynamic:4:5:16]
      [--draft eagle] [--top 8] [--out benchmarks/results/step_profile.md]

``benchmarks.step_cost`` times whole steps; this one opens them. For each method it traces
(``jax.profiler``) the fused decoding loop of batch-1 generations and adds up the time of
every operation the loop's XLA module runs, prefill left out, per target call:

  streaming matmul   the CPU kernel's calls (float32 panels; float16: the EAGLE drafter's);
  CPU attention      the attention kernel's calls;
  XLA ops            everything else XLA runs (norms, RoPE, the acceptance rule, sampling,
                     cache updates, the drafter's small ops, a loop's own control), with
                     its largest operations listed by their HLO name and shape.

The executor's time between operations is not counted (a loop nested in the step runs on
its own executor, whose spans name no module): a row's total falls short of a step.

The trace's own overhead makes every figure a little larger than an untraced step
(``step_cost``), so compare the rows of one run, not runs. Methods: ``plain`` (plain
decoding's loop), ``chain:γ``, ``dynamic:k:D:N`` (EAGLE-2 trees) and ``sampled:w1:w2:...``.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import jax
import jax.numpy as jnp
from absl import app, flags

import specjax
from benchmarks.common import (command_line, op_profile, provenance, temperature_list,
                               write_markdown)
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax.generate import _decode, _prefill
from specjax.prompts import pack_prompts
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology

PROMPTS = flags.DEFINE_integer("prompts", 3, "held-out prompts (round-robin over categories)",
                               lower_bound=1)
NEW = flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt", lower_bound=2)
TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "temperatures")
METHODS = flags.DEFINE_list(
    "methods", ["plain", "chain:2", "chain:3", "dynamic:4:4:4", "dynamic:4:4:8", "dynamic:4:5:16"],
    "plain, chain:γ, dynamic:k:D:N or sampled:w1:w2:...")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
TOP = flags.DEFINE_integer("top", 8, "largest XLA operations listed per method", lower_bound=0)
OUT = flags.DEFINE_string("out", "benchmarks/results/step_profile.md", "markdown output")

CACHE = 512
KERNELS = {"specjax_streaming_matmul": "streaming matmul",
           "specjax_streaming_matmul_f16": "streaming matmul",
           "specjax_cpu_attention": "CPU attention"}
COLUMNS = ("streaming matmul", "CPU attention", "XLA ops")


def parse_method(spec: str):
  """None (plain decoding) or the topology of ``spec`` (see the module docstring)."""
  name, *args = spec.split(":")
  try:
    sizes = [int(a) for a in args]
    if name == "plain" and not sizes:
      return None
    if name == "chain" and len(sizes) == 1:
      return TreeTopology.chain(sizes[0])
    if name == "dynamic" and len(sizes) == 3:
      return DynamicTree(top_k=sizes[0], depth=sizes[1], num_nodes=sizes[2])
    if name == "sampled" and sizes:
      return SampledDynamicTree(widths=tuple(sizes))
  except ValueError as e:  # a non-integer size, or one the topology refuses
    raise SystemExit(f"--methods: {spec!r}: {e}") from None
  raise SystemExit(f"--methods: {spec!r} is not plain, chain:γ, dynamic:k:D:N or "
                   "sampled:w1:w2:...")


def _shape(hlo: str, op: str) -> str:
  """The result shape of ``op`` in the compiled program ``hlo`` (for the listing)."""
  m = re.search(rf"\n\s*%?{re.escape(op)} = (\([^)]*\)|\S+)", hlo)
  return m.group(1) if m else "?"


def main(_):
  temps = temperature_list(TEMPS)
  methods = [(spec, parse_method(spec)) for spec in METHODS.value]
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target("smollm2")
  draft = load_draft(DRAFT.value, target, lambda: [])
  evals = default_prompts(PROMPTS.value)
  prompts = [target.encode(p.text) for p in evals]
  new = NEW.value
  lines = ["# Where a decoding step's time goes (SmolLM2-135M-Instruct target, batch 1)", "",
           f"{provenance()}; draft `{draft.name}` ({draft.note}); {len(prompts)} prompts "
           f"({', '.join(sorted({p.category for p in evals}))}), {new} new tokens each, one "
           "traced pass; ms per target call of the loop's own XLA module (prefill excluded), "
           "from a `jax.profiler` trace (which adds a little to every figure).", "",
           "Command: `" + command_line("step_profile", (PROMPTS, NEW, TEMPS, METHODS, DRAFT,
                                                         TOP)) + "`", ""]
  for temp in temps:
    sampler = make_sampler(temp)
    lines += [f"## T = {temp:g}", "",
              "| method | tokens / call | " + " | ".join(COLUMNS) + " | total | "
              "largest XLA operations (ms) |", "|---|---|" + "---|" * len(COLUMNS) + "---|---|"]
    for spec, tree in methods:
      row = _profile_row(target, draft, sampler, tree, prompts, new)
      if row is None:
        lines.append(f"| {spec} | – | " + " | ".join("–" for _ in COLUMNS) +
                     " | – | the draft does not serve this tree |")
        continue
      tpc, kinds, top = row
      cells = " | ".join(f"{kinds.get(c, 0.0) * 1e3:.2f}" for c in COLUMNS)
      lines.append(f"| {spec} | {tpc} | {cells} | **{sum(kinds.values()) * 1e3:.2f}** | "
                   + "; ".join(f"{name} {shape} {t * 1e3:.2f}" for name, shape, t in top) + " |")
      write_markdown(OUT.value, lines, quiet=True)
    lines.append("")
  write_markdown(OUT.value, lines)


def _profile_row(target, draft, sampler, tree, prompts, new: int
                 ) -> Optional[tuple[str, dict, list]]:
  """(tokens per call, ms-per-call by column, the largest XLA operations) of one method."""
  if tree is None:
    def call(i, p):
      return specjax.generate(target.params, target.cfg, [p], new, sampler, seed=i,
                              cache_size=CACHE, eos_ids=())
    module, hlo = "jit__decode", _plain_hlo(target, sampler, prompts[0], new)
  else:
    if not draft.drafter.supports(tree):
      return None
    dec = SpeculativeDecoder(target.cfg, draft.drafter, tree=tree, sampler=sampler, eos_ids=())

    def call(i, p):
      return dec.generate(target.params, draft.params, [p], new, seed=i, cache_size=CACHE)
    state, _ = dec.prepare(target.params, draft.params, [prompts[0]], new, cache_size=CACHE)
    module = "jit_run"
    hlo = SpeculativeDecoder.run.lower(dec, target.params, draft.params,
                                       state).compile().as_text()
  call(0, prompts[0])  # compile
  outs = []
  prof = op_profile(lambda: outs.extend(call(i, p) for i, p in enumerate(prompts)), hlo,
                    repeats=1, module=module)
  if tree is None:
    calls, tpc = len(prompts) * new, "1"
  else:
    calls = sum(int(o.per_row["target_calls"][0]) for o in outs)
    tpc = f"{sum(int(o.per_row['emitted'][0]) for o in outs) / calls:.2f}"
  kinds: dict[str, float] = {}
  for kind, seconds in prof.kinds.items():
    col = KERNELS.get(kind, kind if kind in COLUMNS else "XLA ops")
    kinds[col] = kinds.get(col, 0.0) + seconds / calls
  custom = set(re.findall(r"%?([^\s%]+) = [^\n]*custom_call_target=", hlo))
  xla = sorted(((t, op) for op, t in prof.ops.items() if op not in custom), reverse=True)
  top = [(op, _shape(hlo, op), t / calls) for t, op in xla[:TOP.value]]
  return tpc, kinds, top


def _plain_hlo(target, sampler, prompt, new: int) -> str:
  """The compiled text of plain decoding's loop (``specjax.generate._decode``) for ``prompt``."""
  tokens, lens, _ = pack_prompts([prompt], new, CACHE)
  state = _prefill(target.params, target.cfg, jnp.asarray(tokens), jnp.asarray(lens),
                   jnp.full(lens.shape, new, jnp.int32), jax.random.PRNGKey(0))
  return _decode.lower(target.params, target.cfg, state, sampler, ()).compile().as_text()


if __name__ == "__main__":
  app.run(main)
