"""Trees for sampling: tokens per target call of chains, EAGLE-2 trees, static sampled trees and
sampled dynamic trees at equal node budgets.

Usage:
  python -m benchmarks.sampled_trees [--temperatures 0,1] [--prompts 20] [--new_tokens 128]
      [--seeds 2] [--draft eagle] [--sets held-out] [--out benchmarks/results/sampled_trees.md]

An EAGLE-2 tree's children are its draft's top-k, point masses, which recursive rejection
accepts with probability p(x); a sampled chain's draft is accepted with probability
Σ min(p, q). Sampled trees draw each node's children without replacement and verify them
with the real q (SpecInfer / Sequoia). For each node budget N (4, 8, 16) the table compares
the EAGLE-2 dynamic tree (top-4, depth 4), one static tree with top-k children and with
drawn ones (``tree_draw="without_replacement"``: the clean ablation of the draw, same shape),
and sampled dynamic trees (``SampledDynamicTree``) of the static tree's widths per depth and
of one other, beside the chains. At T = 0 every tree's children are its top-k. Untimed
(every prompt of a set decoded as one batch, stopped at EOS; T = 0 one seed, T > 0
``--seeds`` seeds pooled): what a tree buys per target call, which pays where a verify of
N + 1 tokens costs about one of 1 (GPUs; see ``experiments.run --sweep_trees`` for timed
rows on this machine).
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags

from benchmarks.common import (acceptance, command_line, prompt_sets, provenance,
                               temperature_list, write_markdown)
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from specjax.sampling import make_sampler
from specjax.speculative import SampledDynamicTree, SpeculativeDecoder
from specjax.speculative.tree import DynamicTree, TreeTopology

TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "temperatures (0: greedy)")
PROMPTS = flags.DEFINE_integer("prompts", 20, "prompts of each set")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens per prompt")
SEEDS = flags.DEFINE_integer("seeds", 2, "seeds at T > 0 (each decodes every prompt once)")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft model (experiments.models.load_draft spec)")
SETS = flags.DEFINE_list("sets", ["held-out"], "prompt sets: held-out, training-side")
OUT = flags.DEFINE_string("out", "benchmarks/results/sampled_trees.md", "markdown output")

# Static sampled trees, one per budget (parents; widths per depth in the comment): the best of
# a few shapes tried by hand at T = 1 on the held-out prompts, not a search.
STATIC = {4: (-1, -1, 0, 2),  # 2, 1, 1
          8: (-1, -1, -1, 0, 0, 1, 3, 5),  # 3, 3, 2
          16: (-1, -1, -1, 0, 0, 0, 1, 1, 2, 3, 3, 4, 6, 9, 10, 12)}  # 3, 6, 4, 3
# Widths per depth of the sampled dynamic trees, the static tree's first.
DYNAMIC_WIDTHS = {4: [(2, 1, 1)], 8: [(3, 3, 2), (2, 2, 2, 2)],
                  16: [(3, 6, 4, 3), (4, 4, 4, 4)]}


def shapes(sampled_drafter, drafter) -> list[tuple[str, int, object, dict]]:
  """(label, node budget, drafter, decoder keywords) of every row, in table order."""
  rows = [(f"chain γ = {g}", g, drafter, dict(gamma=g)) for g in (2, 3, 4)]
  for n in (4, 8, 16):
    rows.append(("EAGLE-2 dynamic k=4 D=4", n, drafter, dict(tree=DynamicTree(4, 4, n))))
    widths = TreeTopology(STATIC[n]).level_ranges
    label = ",".join(str(stop - start) for start, stop in widths)
    rows.append((f"static top-k, widths {label}", n, drafter, dict(tree=TreeTopology(STATIC[n]))))
    rows.append((f"static sampled, widths {label}", n, sampled_drafter,
                 dict(tree=TreeTopology(STATIC[n]))))
    for w in DYNAMIC_WIDTHS[n]:
      rows.append((f"sampled dynamic, widths {','.join(map(str, w))}", n, drafter,
                   dict(tree=SampledDynamicTree(w))))
  return rows


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  temps = temperature_list(TEMPS)
  for flag in (PROMPTS, SEEDS, NEW):
    if flag.value < 1:
      raise app.UsageError(f"--{flag.name} must be >= 1")
  known = ("held-out", "training-side")
  if not SETS.value or set(SETS.value) - set(known):
    raise app.UsageError(f"--sets must list some of {known}, got {SETS.value}")
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target("smollm2")
  draft = load_draft(DRAFT.value, target, lambda: [])
  if not hasattr(draft.drafter, "tree_draw"):
    raise app.UsageError(f"--draft={DRAFT.value}: {type(draft.drafter).__name__} grows no "
                         "sampled trees (an EAGLE, token or early-exit draft does)")
  sampled_drafter = dataclasses.replace(draft.drafter, tree_draw="without_replacement")
  sets = {k: v for k, v in prompt_sets(target, PROMPTS.value).items() if k in SETS.value}
  rows = shapes(sampled_drafter, draft.drafter)
  start = time.perf_counter()
  command = command_line("sampled_trees", (TEMPS, PROMPTS, NEW, SEEDS, DRAFT, SETS))
  head = ["# Trees for sampling: tokens per target call", "",
          f"Command: `{command}`  ",
          f"{provenance()}; draft `{draft.name}` ({draft.note}); {PROMPTS.value} prompts a "
          f"set, one batch each, up to {NEW.value} new tokens (stopped at EOS); T = 0 one "
          f"seed, T > 0 {SEEDS.value} seeds; untimed.", "",
          "Tokens per call = emitted tokens / target calls; N = draft nodes verified per "
          "call. EAGLE-2 trees and static top-k trees take each node's top-k (point "
          "masses); static sampled trees, of the same shape, draw each node's children "
          "without replacement (`tree_draw=\"without_replacement\"`); sampled dynamic trees "
          "draw the same way and place each depth's nodes per row (`SampledDynamicTree`). "
          "At T = 0 every tree's children are its top-k. All lossless. Best of each budget "
          "of several rows in bold.", ""]
  body = []
  for temp in temps:
    sampler = make_sampler(temp)
    seeds = 1 if temp == 0 else SEEDS.value
    results = {}
    for label, n, drafter, kw in rows:
      dec = SpeculativeDecoder(target.cfg, drafter, sampler=sampler, **kw)  # the target's EOS
      for name, prompts in sets.items():
        results[label, n, name] = acceptance(dec, target, draft, prompts, NEW.value, seeds)
    body += [f"## T = {temp:g}", "",
             "| shape | N | " + " | ".join(f"{s}: tokens/call" for s in sets) + " |",
             "|---|---|" + "---|" * len(sets)]
    for label, n, _, _ in rows:
      cells = []
      for s in sets:
        tpc = results[label, n, s]["tokens_per_call"]
        peers = [v["tokens_per_call"] for (_, m, name), v in results.items()
                 if m == n and name == s]
        bold = len(peers) > 1 and tpc == max(peers)
        cells.append(f"**{tpc:.3f}**" if bold else f"{tpc:.3f}")
      body.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    body.append("")
    write_markdown(OUT.value, head + body, quiet=True)
  body.append(f"{time.perf_counter() - start:.0f} s.")
  write_markdown(OUT.value, head + body)


if __name__ == "__main__":
  app.run(main)
