"""Stopping at EOS or not: the default run's two settings timed in the same rounds (T = 0).

Usage:
  python -m benchmarks.stop_at_eos [--prompts 5] [--new_tokens 128] [--repeats 3]
      [--out benchmarks/results/stop_at_eos.md]

``python -m experiments.run`` stops rows at EOS (``--stop_at_eos``, the default since
2026-12-06); before, every row generated exactly ``--max_new_tokens`` tokens, running past the
end of its answer into text no draft was trained on. Two runs of the experiment cannot tell
what that changes on a host whose memory spells move a run's speedups by more than the
change (``benchmarks/results/bandwidth_spells.md``), so this times both settings in the same
rounds: per round and prompt, plain decoding and each method with EOS stopping the row, and
again with EOS ignored, in an order rotated by one per prompt and round. At T = 0 both
methods emit the target's greedy tokens, so each speedup is a plain ratio of wall times
(prefill included, as in the experiment) and the two settings' ratio is paired by round.
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

import specjax
from benchmarks.common import command_line, provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax.sampling import Greedy
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.calibration import loop_step_seconds
from specjax.speculative.tree import DynamicTree, TreeTopology

PROMPTS = flags.DEFINE_integer("prompts", 5, "held-out prompts (the default run's: round-robin "
                               "over categories)", lower_bound=1)
NEW = flags.DEFINE_integer("new_tokens", 128, "token budget per prompt", lower_bound=2)
REPEATS = flags.DEFINE_integer("repeats", 3, "timed rounds", lower_bound=1)
OUT = flags.DEFINE_string("out", "benchmarks/results/stop_at_eos.md", "markdown output")

CACHE = 512
METHODS = (("chain γ=3", TreeTopology.chain(3)),
           ("dynamic k=4 D=4 N=4", DynamicTree(top_k=4, depth=4, num_nodes=4)))
SETTINGS = (("stop at EOS", None), ("EOS ignored", ()))  # eos_ids: the config's, or none


def main(_):
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target("smollm2")
  draft = load_draft("eagle", target, lambda: [])
  evals = default_prompts(PROMPTS.value)
  prompts = [target.encode(p.text) for p in evals]
  new, tp = NEW.value, target.params
  calls = {}  # (method or "plain", setting) -> fn(prompt) -> output
  for setting, eos in SETTINGS:
    calls["plain", setting] = lambda p, eos=eos: specjax.generate(
        tp, target.cfg, [p], new, Greedy(), cache_size=CACHE, eos_ids=eos)
    for name, tree in METHODS:
      dec = SpeculativeDecoder(target.cfg, draft.drafter, tree=tree, sampler=Greedy(),
                               eos_ids=eos)
      calls[name, setting] = lambda p, dec=dec: dec.generate(tp, draft.params, [p], new,
                                                             cache_size=CACHE)
  for fn in calls.values():  # compile (one prompt length shares every program)
    fn(prompts[0])
  keys = list(calls)
  seconds = {k: np.zeros((REPEATS.value, len(prompts))) for k in keys}
  outs, t1 = {}, {s: [] for s, _ in SETTINGS}
  for r in range(REPEATS.value):
    for i, p in enumerate(prompts):
      shift = (r * len(prompts) + i) % len(keys)
      for k in keys[shift:] + keys[:shift]:
        out = calls[k](p)
        seconds[k][r, i], outs[k, i] = out.seconds, out
      for s, _ in SETTINGS:
        t1[s].append(loop_step_seconds([outs[("plain", s), i]]))
    print(f"round {r + 1} of {REPEATS.value} done", flush=True)

  lines = ["# Stopping at EOS or not: the default run's settings in the same rounds (T = 0)", "",
           f"{provenance()}; draft `{draft.name}` ({draft.note}); {len(prompts)} held-out "
           f"prompts ({', '.join(p.category for p in evals)}), batch 1, up to {new} new tokens, "
           f"{REPEATS.value} rounds, each timing every prompt with plain decoding and each "
           "method under both settings, in an order rotated by one per prompt and round.", "",
           f"Command: `{command_line('stop_at_eos', (PROMPTS, NEW, REPEATS, OUT))}`", ""]
  gen = lambda k: [int(outs[k, i].num_generated[0]) for i in range(len(prompts))]
  after = sum(a - b for a, b in zip(gen(("plain", "EOS ignored")), gen(("plain", "stop at EOS"))))
  total = sum(gen(("plain", "EOS ignored")))
  stopped = ", ".join(map(str, gen(("plain", "stop at EOS"))))
  lines += [f"Tokens per prompt stopping at EOS: {stopped}; with EOS ignored {after} of the "
            f"{total} tokens ({after / total:.0%}) come after the answer's EOS. Plain decoding's "
            "step t₁ (median over prompts and rounds, prefill excluded): "
            + ", ".join(f"{s} {1e3 * np.median(t1[s]):.1f} ms" for s, _ in SETTINGS) + ".", "",
            "| method | setting | tokens / call | = plain greedy | speedup per round | "
            "median speedup |", "|---|---|---|---|---|---|"]
  ratio = {}
  for name, _ in METHODS:
    per_round = {}
    for s, _ in SETTINGS:
      k = (name, s)
      per_round[s] = seconds["plain", s].sum(1) / seconds[k].sum(1)
      emitted = sum(int(outs[k, i].per_row["emitted"][0]) for i in range(len(prompts)))
      steps = sum(int(outs[k, i].per_row["target_calls"][0]) for i in range(len(prompts)))
      same = all(outs[k, i].generated(0) == outs[("plain", s), i].generated(0)
                 for i in range(len(prompts)))
      lines.append(f"| {name} | {s} | {emitted / steps:.2f} | {'yes' if same else '**NO**'} | "
                   + ", ".join(f"{x:.2f}×" for x in per_round[s])
                   + f" | **{np.median(per_round[s]):.2f}×** |")
    ratio[name] = per_round["stop at EOS"] / per_round["EOS ignored"]
  lines += ["", "Paired by round, the speedup stopping at EOS over the speedup with EOS ignored: "
            + "; ".join(f"{n}: " + ", ".join(f"{x:.3f}" for x in v)
                        + f" (median {np.median(v):.3f})" for n, v in ratio.items()) + "."]
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
