"""What an adaptive decoder costs beyond plain decoding when it decodes plainly.

Usage:
  python -m benchmarks.adaptive_overhead [--batch_sizes 1,4] [--new_tokens 128] [--rounds 5]
      [--draft eagle] [--target smollm2] [--out benchmarks/results/adaptive_overhead.md]

The adaptive policy's price of plain decoding is 1 (a plain step costs what plain decoding's
step does) and the calibrated whole-call figure takes the speculative prefill as measured.
This measures both claims on held-out prompts, greedy, EOS ignored, in ``--rounds``
interleaved rounds per batch size (medians reported), three ways:

  plain       ``specjax.generate``;
  loop        the speculative decoder's own loop (``prepare`` then ``run``) under a policy
              that never drafts (γ ∈ {0, 1}, γ = 1 priced at 50 plain steps): every step a
              plain step, with the drafter prefilled and its state carried;
  generate    ``SpeculativeDecoder.generate`` with that policy, which sees that it never
              drafts and runs plain decoding's loop on the packed prompts
              (``plain_only``).

For each: the prefill (validation and packing included, both models for ``loop``) and the
decode loop per generated token, with their ratios to plain decoding's. The three must
produce the same tokens (the run stops otherwise).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np
from absl import app, flags

import specjax
from benchmarks.common import int_list, provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax.sampling import Greedy
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma

BATCHES = flags.DEFINE_list("batch_sizes", ["1", "4"], "batch sizes")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens generated per prompt", lower_bound=2)
ROUNDS = flags.DEFINE_integer("rounds", 5, "interleaved timed rounds", lower_bound=1)
PROMPTS = flags.DEFINE_integer("prompts", 8, "distinct held-out prompts (cycled to fill a "
                               "batch)", lower_bound=1)
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
TARGET = flags.DEFINE_string("target", "smollm2", "target (experiments.models.load_target spec)")
OUT = flags.DEFINE_string("out", "benchmarks/results/adaptive_overhead.md", "markdown output")

METHODS = ("plain", "loop", "generate")


def _calls(target, draft, prompts: list, new: int, cache: int) -> dict:
  """{method: () -> (seconds, prefill seconds, tokens)}."""
  never = AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 50.0))
  dec = SpeculativeDecoder(target.cfg, draft.drafter, sampler=Greedy(), eos_ids=(),
                           policy=never)
  if not dec.plain_only(len(prompts)):
    raise SystemExit("the never-drafting policy would draft: nothing to measure")
  tp, dp = target.params, draft.params

  def plain():
    out = specjax.generate(tp, target.cfg, prompts, new, Greedy(), cache_size=cache,
                           eos_ids=())
    return out.seconds, out.prefill_seconds, np.asarray(out.tokens)

  def loop():  # generate's own timing of its speculative loop, without the plain_only turn
    start = time.perf_counter()
    state, _ = jax.block_until_ready(dec.prepare(tp, dp, prompts, new, cache_size=cache))
    prefill = time.perf_counter() - start
    state = jax.block_until_ready(dec.run(tp, dp, state))
    return time.perf_counter() - start, prefill, np.asarray(state.tokens)

  def generate():
    out = dec.generate(tp, dp, prompts, new, cache_size=cache)
    return out.seconds, out.prefill_seconds, np.asarray(out.tokens)

  return dict(plain=plain, loop=loop, generate=generate)


def _measure(target, draft, prompts: list, batch: int) -> dict:
  rows = [prompts[i % len(prompts)] for i in range(batch)]
  new = NEW.value
  cache = max(len(p) for p in rows) + new + 8
  calls = _calls(target, draft, rows, new, cache)
  outs = {m: f() for m, f in calls.items()}  # compile
  made = lambda tokens: [tokens[i, len(p):len(p) + new].tolist() for i, p in enumerate(rows)]
  for m in METHODS[1:]:
    if made(outs[m][2]) != made(outs["plain"][2]):
      raise SystemExit(f"B={batch}: {m}'s tokens differ from plain decoding's")
  times = {m: [] for m in METHODS}
  for r in range(ROUNDS.value):
    order = METHODS[r % 3:] + METHODS[:r % 3]
    for m in order:
      seconds, prefill, _ = calls[m]()
      times[m].append((seconds, prefill))
  cell = {"batch": batch}
  plain = np.asarray(times["plain"])
  for m in METHODS:
    t = np.asarray(times[m])
    decode = (t[:, 0] - t[:, 1]) / new
    cell[m] = dict(prefill=float(np.median(t[:, 1])), decode_per_token=float(np.median(decode)),
                   # each round's ratio to plain decoding's call in the same round
                   decode_ratios=(decode / ((plain[:, 0] - plain[:, 1]) / new)).tolist(),
                   prefill_ratios=(t[:, 1] / plain[:, 1]).tolist())
  print(f"[{time.strftime('%H:%M:%S')}] B={batch}: " + ", ".join(
      f"{m} prefill {cell[m]['prefill'] * 1e3:.0f} ms, decode "
      f"{cell[m]['decode_per_token'] * 1e3:.1f} ms/token" for m in METHODS), flush=True)
  return cell


def _report(cells: list[dict], command: str) -> list[str]:
  lines = ["# The adaptive decoder decoding plainly: its loop and prefill against plain "
           "decoding's", "", f"Command: `{command}`  ", provenance() + ".", "",
           f"{DRAFT.value} draft, greedy, {NEW.value} new tokens a row (EOS ignored), "
           f"{PROMPTS.value} held-out prompts cycled to fill a batch, {ROUNDS.value} "
           "interleaved rounds (medians). loop = the speculative decoder's own loop under a "
           "policy that never drafts (each step a plain step; both models prefilled); "
           "generate = `SpeculativeDecoder.generate` with it (plain decoding's loop on the "
           "packed prompts). Decode = the call after its prefill, per generated token. The "
           "loop's and generate's columns are ratios to plain decoding's call in the same "
           "round: the median round, in brackets the range over rounds. Tokens equal plain "
           "decoding's in every call.", "",
           "| B | plain decode ms/token | loop decode / plain | generate decode / plain | "
           "plain prefill ms | loop prefill / plain | generate prefill / plain |",
           "|---|---|---|---|---|---|---|"]
  for c in cells:
    p = c["plain"]
    ratio = lambda xs: f"{np.median(xs):.3f} ({min(xs):.2f}–{max(xs):.2f})"
    lines.append(f"| {c['batch']} | {p['decode_per_token'] * 1e3:.2f} | "
                 f"{ratio(c['loop']['decode_ratios'])} | {ratio(c['generate']['decode_ratios'])} "
                 f"| {p['prefill'] * 1e3:.0f} | {ratio(c['loop']['prefill_ratios'])} | "
                 f"{ratio(c['generate']['prefill_ratios'])} |")
  return lines


def main(_):
  batches = int_list(BATCHES)
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target(TARGET.value)
  draft = load_draft(DRAFT.value, target, lambda: [])
  if not draft.drafter.tolerates_skipped_steps():
    raise SystemExit(f"draft {DRAFT.value!r} cannot skip steps: no plain steps to measure")
  prompts = [target.encode(p.text) for p in default_prompts(PROMPTS.value)]
  cells = []
  command = " ".join(["python -m benchmarks.adaptive_overhead", *sys.argv[1:]])
  for batch in batches:
    cells.append(_measure(target, draft, prompts, batch))
    write_markdown(OUT.value, _report(cells, command), quiet=batch != batches[-1])


if __name__ == "__main__":
  app.run(main)
