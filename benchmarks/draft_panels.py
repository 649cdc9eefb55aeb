"""The EAGLE drafter's weights streamed as float32 or float16 panels (SmolLM2 target, batch 1).

Usage:
  python -m benchmarks.draft_panels [--prompts 5] [--new_tokens 64] [--repeats 2]
      [--temperatures 0,1] [--out benchmarks/results/draft_panels.md]

A draft step of the shipped EAGLE-3 drafter reads about 40 MB of float32 weights (its
layer, ``fc``, the fusion and 8,192 rows of the target's head) against the target step's
540 MB, so on a CPU, where the small-M products stream their weights
(``kernels.streaming_matmul``), c ≈ 0.07 is mostly bytes. ``pack_eagle_params(...,
panel_dtype=float16)`` stores those panels in float16 and the kernel widens them as they
load: half the bytes. The drafter's own weights ship in float16, so only the head's rows
(the target's dequantized embedding) round; any fixed draft keeps verification exact.

Per temperature, in one run on the same prompts, each prompt's plain decoding and the two
drafts' speculative decoding interleaved (prefill excluded, as ``benchmarks.step_cost``):
tokens per target call, the step over plain decoding's t₁ (the two drafts' steps differ by
their draft phases only) and the decode-only speedup; at T = 0 each output against plain
greedy.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from benchmarks.common import provenance, temperature_list, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax.drafts import default_eagle_drafter
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.calibration import loop_step_seconds
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology

PROMPTS = flags.DEFINE_integer("prompts", 5, "held-out prompts (round-robin over categories)",
                               lower_bound=1)
NEW = flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt", lower_bound=2)
REPEATS = flags.DEFINE_integer("repeats", 2, "timed runs per prompt and method", lower_bound=1)
TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "temperatures (0: greedy)")
OUT = flags.DEFINE_string("out", "benchmarks/results/draft_panels.md", "markdown output")

CACHE = 512
PANELS = ("float32", "float16")
METHODS = [(f"chain γ={g}", TreeTopology.chain(g)) for g in (1, 2, 3, 4)] + [
    ("dynamic k=4 D=4 N=4", DynamicTree(top_k=4, depth=4, num_nodes=4)),
    ("sampled w=2,1", SampledDynamicTree((2, 1)))]


def main(_):
  temperatures = temperature_list(TEMPS)
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  target = load_target("smollm2")
  draft = load_draft("eagle", target, lambda: [])
  # Each dtype packed from the stored weights (repacking packed params keeps them rounded).
  params = {p: default_eagle_drafter(target.cfg, target.params, target.tokenizer,
                                     panel_dtype=jnp.dtype(p))[1] for p in PANELS}
  evals = default_prompts(PROMPTS.value)
  prompts = [target.encode(p.text) for p in evals]
  new = NEW.value
  lines = ["# The EAGLE drafter's panels in float32 or float16 (SmolLM2-135M-Instruct, batch 1)",
           "", f"{provenance()}; draft `{draft.name}` ({draft.note}); {len(prompts)} prompts "
           f"({', '.join(sorted({p.category for p in evals}))}), {new} new tokens, "
           f"{REPEATS.value} runs per prompt and method, plain and both drafts interleaved "
           "(the drafts' order alternating by run); "
           "medians over prompts × runs, prefill excluded.", "",
           "Command: `python -m benchmarks.draft_panels " + " ".join(
               f"--{f.name}={','.join(f.value) if isinstance(f.value, list) else f.value}"
               for f in (PROMPTS, NEW, REPEATS, TEMPS)) + "`", ""]
  for temp in temperatures:
    sampler = make_sampler(temp)
    plain = lambda p, s: specjax.generate(target.params, target.cfg, [p], new, sampler, seed=s,
                                          cache_size=CACHE, eos_ids=())
    plain(prompts[0], 0)  # compile
    lines += [f"## T = {temp:g}", "",
              "| method | panels | tokens / call | step / t₁ | decode-only speedup |"
              + (" = plain greedy |" if temp == 0 else ""),
              "|---|---|---|---|---|" + ("---|" if temp == 0 else "")]
    for name, tree in METHODS:
      if not draft.drafter.supports(tree):
        continue
      dec = SpeculativeDecoder(target.cfg, draft.drafter, tree=tree, sampler=sampler, eos_ids=())
      for p in PANELS:  # compile
        dec.generate(target.params, params[p], [prompts[0]], 4, cache_size=CACHE)
      t1s, steps = [], {p: [] for p in PANELS}
      calls, toks, equal = dict.fromkeys(PANELS, 0), dict.fromkeys(PANELS, 0), {}
      for rep in range(REPEATS.value):
        for i, prompt in enumerate(prompts):
          ref = plain(prompt, i)
          t1s.append(loop_step_seconds([ref]))
          for p in PANELS[::1 if (rep + i) % 2 == 0 else -1]:
            out = dec.generate(target.params, params[p], [prompt], new, seed=i,
                               cache_size=CACHE)
            steps[p].append(loop_step_seconds([out]))
            calls[p] += int(out.per_row["target_calls"][0])
            toks[p] += int(out.per_row["emitted"][0])
            equal[p] = equal.get(p, True) and out.generated(0) == ref.generated(0)
      t1 = float(np.median(t1s))
      for p in PANELS:
        step, tpc = float(np.median(steps[p])), toks[p] / calls[p]
        row = (f"| {name} | {p} | {tpc:.2f} | {step / t1:.3f} | **{tpc * t1 / step:.2f}×** |")
        if temp == 0:
          row += f" {'yes' if equal[p] else '**NO**'} |"
        lines.append(row)
    lines.append("")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
