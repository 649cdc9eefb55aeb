"""Token trees against chains and plain decoding on the embedded SmolLM2-135M target.

Usage:
  python -m benchmarks.tree_speed [--prompts 20] [--new_tokens 32] [--temperatures 0,1]
      [--budgets 4,8,16,32] [--gammas 1,2,3,4] [--repeats 2]
      [--out benchmarks/results/tree_speed.md]

Per temperature:
  1. calibration: a wide full tree decodes ``--calibration_prompts`` prompts
     from the draft's *training* side (never the evaluated ones) and its
     counters give the per-depth, per-rank acceptance table;
  2. ``tree_builders.best_static_tree`` builds the best static tree for each
     node budget N from that table;
  3. every method (chains of each γ, the best trees, dynamic trees when the
     drafter supports them; for Medusa heads also the trees their stored held-out
     accuracies give and their per-step dynamic trees) decodes the held-out prompts one at a time,
     interleaved with plain decoding of the same prompt in every round;
     speedup = Σ plain seconds / Σ method seconds over the prompts, per round
     (median and range reported); at T = 0 every output is checked against
     plain greedy decoding token for token.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

import specjax
from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts, training_prompts
from specjax.drafters import MedusaDrafter
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.speculative.tree_builders import (best_static_tree, estimate_rank_accept,
                                               expected_tokens_per_step, full_tree,
                                               full_tree_counts)

PROMPTS = flags.DEFINE_integer("prompts", 20, "held-out prompts (round-robin over categories)")
CAL_PROMPTS = flags.DEFINE_integer("calibration_prompts", 8, "training-side calibration prompts")
NEW = flags.DEFINE_integer("new_tokens", 32, "tokens generated per prompt")
TEMPS = flags.DEFINE_list("temperatures", ["0", "1"], "temperatures")
BUDGETS = flags.DEFINE_list("budgets", ["4", "8", "16", "32"], "tree node budgets N")
GAMMAS = flags.DEFINE_list("gammas", ["1", "2", "3", "4"], "chain lengths")
CAL_TREE = flags.DEFINE_list("calibration_tree", ["6", "3", "2", "1"],
                             "branching of the calibration full tree")
REPEATS = flags.DEFINE_integer("repeats", 2, "interleaved timing rounds")
DRAFT = flags.DEFINE_string("draft", "default", "draft (experiments.models.load_draft spec)")
OUT = flags.DEFINE_string("out", "benchmarks/results/tree_speed.md", "markdown output")

CACHE = 512  # slots per row: the longest prompt + new tokens + the calibration tree


def calibrate(target, draft, sampler, prompts, branching):
  """[D, K] per-depth, per-rank acceptance from a full tree's counters."""
  tree = full_tree(branching)
  dec = SpeculativeDecoder(target.cfg, draft.drafter, tree=tree, sampler=sampler, eos_ids=())
  outs = [dec.generate(target.params, draft.params, [p], NEW.value, cache_size=CACHE)
          for p in prompts]
  counts = full_tree_counts(branching, sum(o.per_row["accepted_rank"][0] for o in outs),
                            sum(o.per_row["accept_len_hist"][0] for o in outs))
  return estimate_rank_accept(*counts), tree


def methods_for(draft, table):
  """Chains, the best static tree per budget, an EAGLE-2 dynamic tree of the same N and
  depth (frontier k = min(4, N)) where the drafter builds them; for Medusa heads instead
  the tree their own held-out accuracies give at each budget (``MedusaDrafter.tree``) and
  their per-step best tree of all heads and ranks (``MedusaDrafter.dynamic_tree``)."""
  out = [(f"chain γ={g}", TreeTopology.chain(int(g))) for g in GAMMAS.value]
  for n in map(int, BUDGETS.value):
    tree = best_static_tree(table, n)
    if not tree.is_chain:
      out.append((f"best tree N={n}", tree))
    if isinstance(draft.drafter, MedusaDrafter):
      if draft.drafter.accuracy is not None:
        out.append((f"heads' tree N={n}", draft.drafter.tree(n)))
      out.append((f"heads' dynamic N={n}", draft.drafter.dynamic_tree(n)))
      continue
    k, d = min(4, n), max(tree.max_depth, 2)
    if d <= n <= DynamicTree.candidates(k, d):
      out.append((f"dynamic k={k} N={n}", DynamicTree(k, d, n)))
  return [(name, t) for name, t in out if draft.drafter.supports(t)]


def main(argv):
  del argv
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  start = time.perf_counter()
  target = load_target("smollm2")
  draft = load_draft(DRAFT.value, target, lambda: [])
  evals = default_prompts(PROMPTS.value)
  prompts = [target.encode(p.text) for p in evals]
  cal = [target.encode(t) for t in training_prompts(CAL_PROMPTS.value)]
  branching = tuple(int(b) for b in CAL_TREE.value)
  lines = ["# Token trees vs chains vs plain decoding (SmolLM2-135M-Instruct target)", "",
           f"{provenance()}; draft `{draft.name}` ({draft.note}); {len(prompts)} held-out "
           f"prompts ({', '.join(sorted({p.category for p in evals}))}), {NEW.value} new tokens "
           f"each, batch 1, {REPEATS.value} interleaved rounds; calibration on "
           f"{len(cal)} training-side prompts with full tree {branching}.", "",
           "Command: `python -m benchmarks.tree_speed " + " ".join(
               f"--{f.name}={','.join(f.value) if isinstance(f.value, list) else f.value}"
               for f in (DRAFT, PROMPTS, CAL_PROMPTS, NEW, TEMPS, BUDGETS, GAMMAS, REPEATS, OUT)) + "`", ""]
  plain_ref = {}
  for temp in [float(t) for t in TEMPS.value]:
    sampler = make_sampler(temp)
    if draft.drafter.supports(full_tree(branching)):
      table, _ = calibrate(target, draft, sampler, cal, branching)
      methods = methods_for(draft, table)
    else:  # a chain-only drafter (n-grams): its chains against plain decoding
      table = None
      methods = [(f"chain γ={g}", TreeTopology.chain(int(g))) for g in GAMMAS.value]
    decs = {name: SpeculativeDecoder(target.cfg, draft.drafter, tree=tree, sampler=sampler,
                                     eos_ids=()) for name, tree in methods}
    plain = lambda p, s: specjax.generate(target.params, target.cfg, [p], NEW.value, sampler,
                                          seed=s, cache_size=CACHE, eos_ids=())
    plain(prompts[0], 0)
    for dec in decs.values():  # compile
      dec.generate(target.params, draft.params, [prompts[0]], 2, cache_size=CACHE)
    secs = {name: np.zeros(REPEATS.value) for name in ["plain"] + list(decs)}
    calls = {name: 0 for name in decs}
    toks = {name: 0 for name in decs}
    equal = {name: True for name in decs}
    for r in range(REPEATS.value):
      for i, p in enumerate(prompts):
        ref = plain(p, i)
        secs["plain"][r] += ref.seconds
        if temp == 0:
          plain_ref[i] = ref.generated(0)
        for name, dec in decs.items():
          out = dec.generate(target.params, draft.params, [p], NEW.value, seed=i,
                             cache_size=CACHE)
          secs[name][r] += out.seconds
          if r == 0:
            m = out.metrics()
            calls[name] += m["target_calls"]
            toks[name] += m["tokens"]
            if temp == 0:
              equal[name] &= out.generated(0) == plain_ref[i]
      print(f"T={temp:g} round {r + 1}/{REPEATS.value} done "
            f"({time.perf_counter() - start:.0f} s)", flush=True)
    best_chain = max((toks[n] / calls[n] for n, t in methods if t.is_chain), default=np.nan)
    lines += [f"## T = {temp:g}", ""]
    if table is not None:
      lines += ["Calibrated acceptance P(rank r accepted | parent accepted), rows = depth 1…:",
                "", "```", np.array2string(table, precision=3, suppress_small=True), "```", ""]
    lines += ["| method | N | D | tokens / call | × best chain | model tokens / call | "
              "speedup vs plain (median [min, max]) |" + (" = plain greedy |" if temp == 0 else ""),
              "|---|---|---|---|---|---|---|" + ("---|" if temp == 0 else "")]
    plain_s = secs["plain"]
    for name, tree in methods:
      tpc = toks[name] / calls[name]
      ratios = plain_s / secs[name]
      model = (f"{expected_tokens_per_step(tree, table):.2f}"
               if isinstance(tree, TreeTopology) and table is not None else "–")
      row = (f"| {name} | {tree.num_nodes} | {tree.max_depth} | {tpc:.2f} | "
             f"{tpc / best_chain:.2f} | {model} | "
             f"{np.median(ratios):.2f} [{ratios.min():.2f}, {ratios.max():.2f}] |")
      lines.append(row + (f" {'yes' if equal[name] else '**NO**'} |" if temp == 0 else ""))
    lines += ["", f"Plain decoding: {plain_s.mean() / (len(prompts) * NEW.value) * 1e3:.1f} ms "
              "per token (mean over rounds).", ""]
    for name, tree in methods:
      if isinstance(tree, TreeTopology) and not tree.is_chain:
        lines.append(f"- {name}: parents {tree.parents}")
    lines.append("")
  lines.append(f"Total benchmark time {time.perf_counter() - start:.0f} s.")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
