"""Prompt lookup beside the EAGLE drafter (``drafters.hybrid``): tokens per target call.

Usage:
  python -m benchmarks.hybrid_lookup [--min_matches 2,3,4,6] [--gamma 3] [--prompts 20]
      [--new_tokens 128] [--temperatures 0,1] [--seeds 2] [--draft eagle]
      [--out benchmarks/results/hybrid_lookup.md]

For a chain of ``--gamma`` and the default EAGLE-2 dynamic tree (top-4, depth 4, 4 nodes),
the draft alone and the draft with prompt lookup on rows whose last ``min_match`` tokens
(up to ``max(min_match, 4)``) recur in their context, on two prompt sets: training-side
prompts (where ``min_match`` would be chosen) and the held-out evaluation prompts (where it
is judged). Reported: α = Σβ / scored drafts and tokens per target call (emitted / calls),
every prompt of a set decoded as one batch, up to ``--new_tokens`` tokens, each answer
stopped at the target's EOS (past it a chat model repeats itself, which lookup copies for
free: it would flatter the hybrid); T = 0 is deterministic (one seed), T > 0 pools
``--seeds`` seeds. Untimed: a
copied step also skips the draft's forward where the whole batch copies, which only a timed
batch-1 run (``experiments.run --draft=eagle+lookup``) prices.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from benchmarks.common import (acceptance, command_line, int_list, prompt_sets, provenance,
                               temperature_list, write_markdown)
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from specjax.drafters import hybrid_drafter
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.tree import DynamicTree

MIN_MATCHES = flags.DEFINE_list("min_matches", ["2", "3", "4", "6"],
                                "shortest suffix match that copies (each a row)")
GAMMA = flags.DEFINE_integer("gamma", 3, "chain length γ")
PROMPTS = flags.DEFINE_integer("prompts", 20, "prompts of each set")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens per prompt")
TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "temperatures (0: greedy)")
SEEDS = flags.DEFINE_integer("seeds", 2, "seeds at T > 0 (each decodes every prompt once)")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft model (experiments.models.load_draft spec)")
OUT = flags.DEFINE_string("out", "benchmarks/results/hybrid_lookup.md", "markdown output")

TREE = DynamicTree(top_k=4, depth=4, num_nodes=4)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  matches = int_list(MIN_MATCHES)
  if len(set(matches)) != len(matches):
    raise app.UsageError(f"--min_matches lists a value twice: {MIN_MATCHES.value}")
  temps = temperature_list(TEMPS)
  for flag in (GAMMA, PROMPTS, SEEDS, NEW):
    if flag.value < 1:
      raise app.UsageError(f"--{flag.name} must be >= 1")
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target("smollm2")
  draft = load_draft(DRAFT.value, target, lambda: [])
  drafters = {"draft alone": draft.drafter}
  drafters.update({f"+ lookup, min_match {m}": hybrid_drafter(draft.drafter, m, max(m, 4))
                   for m in matches})
  sets = prompt_sets(target, PROMPTS.value)
  start = time.perf_counter()
  command = command_line("hybrid_lookup", (MIN_MATCHES, GAMMA, PROMPTS, NEW, TEMPS, SEEDS, DRAFT))
  head = ["# Prompt lookup beside a draft model: tokens per target call", "",
          f"Command: `{command}`  ",
          f"{provenance()}; draft `{draft.name}` ({draft.note}); {PROMPTS.value} prompts a "
          f"set, one batch each, up to {NEW.value} new tokens (stopped at EOS); T = 0 one seed, "
          f"T > 0 {SEEDS.value} seeds; untimed.", "",
          "A row copies (prompt lookup, point masses) when its last `min_match` tokens "
          "(up to max(min_match, 4)) occurred earlier in its context, and takes the draft "
          "model's proposal otherwise; lossless either way. α = Σβ / scored drafts (chains; – "
          "for trees); tokens per call = emitted / target calls. Best per column in bold.", ""]
  shapes = {f"chain γ = {GAMMA.value}": dict(gamma=GAMMA.value),
            "dynamic tree 4:4:4": dict(tree=TREE)}
  body = []
  for temp in temps:
    sampler = make_sampler(temp)
    seeds = 1 if temp == 0 else SEEDS.value
    results = {}
    for label, drafter in drafters.items():
      for shape, kw in shapes.items():
        dec = SpeculativeDecoder(target.cfg, drafter, sampler=sampler, **kw)  # the target's EOS
        for name, prompts in sets.items():
          results[label, shape, name] = acceptance(dec, target, draft, prompts, NEW.value, seeds)
    cols = [(shape, name) for shape in shapes for name in sets]
    body += [f"## T = {temp:g}", "",
             "| drafter | " + " | ".join(f"{s}, {n}: α / tokens/call" for s, n in cols) + " |",
             "|---|" + "---|" * len(cols)]
    best = {c: max(drafters, key=lambda d: results[(d,) + c]["tokens_per_call"]) for c in cols}
    for label in drafters:
      cells = []
      for c in cols:
        r = results[(label,) + c]
        tpc = f"{r['tokens_per_call']:.3f}"
        alpha = "–" if r["alpha"] is None else f"{r['alpha']:.3f}"
        cells.append(f"{alpha} / " + (f"**{tpc}**" if best[c] == label else tpc))
      body.append(f"| {label} | " + " | ".join(cells) + " |")
    body.append("")
    write_markdown(OUT.value, head + body, quiet=True)
  body.append(f"{time.perf_counter() - start:.0f} s.")
  write_markdown(OUT.value, head + body)


if __name__ == "__main__":
  app.run(main)
