"""Decode-phase cost of speculative steps, prefill excluded, on the embedded SmolLM2-135M target.

Usage:
  python -m benchmarks.step_cost [--prompts 5] [--new_tokens 32] [--repeats 2]
      [--temperatures 0,1] [--draft eagle] [--out benchmarks/results/step_cost.md]

The experiments time whole generations, prefill included (``experiments.run``:
end-to-end speedup). With 32 new tokens a prompt's prefill is a large share of
plain decoding's time, and speculative decoding cannot shorten it, so the
end-to-end speedup understates what a step gains. This benchmark separates
the two, in one run on the same prompts (batch 1):

  t₁    = one plain decode step: a ``generate`` call's decode-loop time (its wall time
          minus its ``prefill_seconds``) / its steps;
  step  = one speculative step, the same of a speculative ``generate`` call (whose
          ``prefill_seconds`` covers both models' prefill);
  decode-only speedup = tokens per call × t₁ / step;
  prefill share = prefill / plain generation time.

Methods: chains γ = 1…4 and EAGLE-2 dynamic trees (k, D, N) ∈ {(3, 3, 4),
(4, 4, 4), (4, 4, 8)}. At T = 0 every output is checked against plain greedy.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

import specjax
from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.calibration import loop_step_seconds
from specjax.speculative.tree import DynamicTree, TreeTopology

PROMPTS = flags.DEFINE_integer("prompts", 5, "held-out prompts (round-robin over categories)")
NEW = flags.DEFINE_integer("new_tokens", 32, "tokens generated per prompt")
REPEATS = flags.DEFINE_integer("repeats", 2, "timed runs per prompt and method")
TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "temperatures")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
OUT = flags.DEFINE_string("out", "benchmarks/results/step_cost.md", "markdown output")

CACHE = 512
METHODS = [(f"chain γ={g}", TreeTopology.chain(g)) for g in (1, 2, 3, 4)] + [
    (f"dynamic k={k} D={d} N={n}", DynamicTree(top_k=k, depth=d, num_nodes=n))
    for k, d, n in ((3, 3, 4), (4, 4, 4), (4, 4, 8))]


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  target = load_target("smollm2")
  draft = load_draft(DRAFT.value, target, lambda: [])
  evals = default_prompts(PROMPTS.value)
  prompts = [target.encode(p.text) for p in evals]
  new = NEW.value
  lines = ["# Speculative step cost, prefill excluded (SmolLM2-135M-Instruct target, batch 1)", "",
           f"{provenance()}; draft `{draft.name}` ({draft.note}); {len(prompts)} prompts "
           f"({', '.join(sorted({p.category for p in evals}))}), {new} new tokens, "
           f"{REPEATS.value} runs per prompt and method; medians over prompts × runs.", "",
           "Command: `python -m benchmarks.step_cost " + " ".join(
               f"--{f.name}={','.join(f.value) if isinstance(f.value, list) else f.value}"
               for f in (PROMPTS, NEW, REPEATS, TEMPS, DRAFT)) + "`", ""]
  for temp in [float(t) for t in TEMPS.value]:
    sampler = make_sampler(temp)
    plain = lambda p, n, s: specjax.generate(target.params, target.cfg, [p], n, sampler, seed=s,
                                             cache_size=CACHE, eos_ids=())
    plain(prompts[0], new, 0)  # compile
    t1s, shares, refs = [], [], {}
    for _ in range(REPEATS.value):
      for i, p in enumerate(prompts):
        full = plain(p, new, i)
        t1s.append(loop_step_seconds([full]))
        shares.append(full.prefill_seconds / full.seconds)
        refs[i] = full.generated(0)
    t1 = float(np.median(t1s))
    lines += [f"## T = {temp:g}", "",
              f"Plain decode step t₁ = {t1 * 1e3:.2f} ms (spread {min(t1s) * 1e3:.1f}–"
              f"{max(t1s) * 1e3:.1f}); the prefill is {np.median(shares):.0%} of a plain "
              f"generation of {new} tokens.", "",
              "| method | tokens / call | step (ms) | step / t₁ | prefill (ms) | "
              "decode-only speedup |" + (" = plain greedy |" if temp == 0 else ""),
              "|---|---|---|---|---|---|" + ("---|" if temp == 0 else "")]
    for name, tree in METHODS:
      dec = SpeculativeDecoder(target.cfg, draft.drafter, tree=tree, sampler=sampler, eos_ids=())
      if not draft.drafter.supports(tree):
        continue
      dec.generate(target.params, draft.params, [prompts[0]], 4, cache_size=CACHE)  # compile
      steps, prefills, calls, toks, equal = [], [], 0, 0, True
      for _ in range(REPEATS.value):
        for i, p in enumerate(prompts):
          out = dec.generate(target.params, draft.params, [p], new, seed=i, cache_size=CACHE)
          steps.append(loop_step_seconds([out]))
          prefills.append(out.prefill_seconds)
          calls += int(out.per_row["target_calls"][0])
          toks += int(out.per_row["emitted"][0])
          if temp == 0:
            equal &= out.generated(0) == refs[i]
      step, tpc = float(np.median(steps)), toks / calls
      row = (f"| {name} | {tpc:.2f} | {step * 1e3:.2f} | {step / t1:.2f} | "
             f"{np.median(prefills) * 1e3:.0f} | **{tpc * t1 / step:.2f}×** |")
      lines.append(row + (f" {'yes' if equal else '**NO**'} |" if temp == 0 else ""))
    lines.append("")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
