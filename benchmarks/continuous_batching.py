"""Continuous batching against fixed batches: tokens/s of a queue of requests.

Usage:
  python -m benchmarks.continuous_batching [--slots 1,4,8] [--temperatures 0]
      [--num_prompts 16] [--new_tokens 128] [--budget_spread 0] [--gamma 3]
      [--draft eagle] [--prefill_chunk 64] [--rounds 2]
      [--out benchmarks/results/continuous_batching.md]

The companion of ``benchmarks.batch_sweep`` (whose fixed batches run until their last row
stops, the finished rows idle meanwhile): here requests stop at EOS, and with
``--budget_spread=f`` their budgets are drawn uniformly from [(1 − f)·new_tokens,
new_tokens] (seeded), so a fixed batch runs until its slowest row. For each slot count B
and temperature, the ``--num_prompts`` held-out prompts are served, in order, by

  * plain decoding in fixed batches of B (``specjax.generate``, one call per batch);
  * speculative decoding in fixed batches of B (``SpeculativeDecoder.generate``);
  * plain decoding with continuous batching over B slots: the same ``serve`` loop with
    every step a plain decoding step (the decoder's ``plain_step``, chosen by an adaptive
    policy for which a draft never pays, beside a stateless prompt-lookup drafter; checked:
    no step drafts);
  * speculative decoding with continuous batching over B slots
    (``specjax.speculative.continuous.serve``, one call for the whole queue; an admitted
    prompt prefills ``--prefill_chunk`` tokens per step of the other slots);
  * the same with ``interleave_prefill=False``: each admitted prompt prefills whole, and
    every empty slot is filled, before the next step;

in ``--rounds`` interleaved rounds (the order rotated by one per round), whole runs
(prefill included) timed; tokens/s = tokens generated / seconds, the median round
reported, and a speedup is a method's tokens/s over plain fixed batches' in the same round
(at T > 0 the methods' samples stop at different EOS, so their token counts differ and a
ratio of times would mislead).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from absl import app, flags

import specjax
from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax.drafters import PromptLookupDrafter
from specjax.generate import PREFILL_CHUNK
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.speculative.continuous import serve

SLOTS = flags.DEFINE_list("slots", ["1", "4", "8"], "slot counts (batch sizes)")
TEMPS = flags.DEFINE_list("temperatures", ["0"], "temperatures")
PROMPTS = flags.DEFINE_integer("num_prompts", 16, "held-out prompts in the queue", lower_bound=1)
NEW = flags.DEFINE_integer("new_tokens", 128, "largest budget per request", lower_bound=1)
SPREAD = flags.DEFINE_float("budget_spread", 0.0, "budgets uniform in [(1 − f)·new_tokens, "
                            "new_tokens]; 0: every request new_tokens", lower_bound=0.0,
                            upper_bound=1.0)
GAMMA = flags.DEFINE_integer("gamma", 3, "draft length of the chain", lower_bound=1)
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
TARGET = flags.DEFINE_string("target", "smollm2", "target (experiments.models.load_target; "
                             "'tiny' for a smoke run)")
CHUNK = flags.DEFINE_integer("prefill_chunk", PREFILL_CHUNK, "prompt tokens an admitted request "
                             "prefills per step of the other slots", lower_bound=1)
ROUNDS = flags.DEFINE_integer("rounds", 2, "interleaved timed rounds", lower_bound=1)
OUT = flags.DEFINE_string("out", "benchmarks/results/continuous_batching.md", "markdown output")

METHODS = ("plain, fixed batches", "speculative, fixed batches", "plain, continuous",
           "speculative, continuous", "speculative, continuous, whole prefills")


def _log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _check_flags() -> tuple[list[int], list[float]]:
  try:
    slots = [int(b) for b in SLOTS.value]
    temps = [float(t) for t in TEMPS.value]
  except ValueError as e:
    raise app.UsageError(f"bad flag value: {e}")
  if not slots or min(slots) < 1:
    raise app.UsageError(f"slot counts must be >= 1, got {slots}")
  if not temps or min(temps) < 0:
    raise app.UsageError(f"temperatures must be >= 0, got {temps}")
  return slots, temps


def _budgets(n: int) -> list[int]:
  low = max(1, int(round((1 - SPREAD.value) * NEW.value)))
  return np.random.default_rng(0).integers(low, NEW.value + 1, n).tolist()


def _measure(target, draft, prompts, budgets, slots: int, temp: float) -> dict:
  """One (slots, temperature) cell: every method once to compile, then timed rounds."""
  sampler = make_sampler(temp)
  dec = SpeculativeDecoder(target.cfg, draft.drafter, gamma=GAMMA.value, sampler=sampler)
  cache = max(len(p) for p in prompts) + NEW.value + dec.cache_headroom + 16
  groups = [(prompts[i:i + slots], budgets[i:i + slots]) for i in range(0, len(prompts), slots)]

  def plain():
    outs = [specjax.generate(target.params, target.cfg, p, max(b), sampler, cache_size=cache,
                             eos_ids=None) for p, b in groups]
    return _trimmed(outs, budgets), sum(o.seconds for o in outs), sum(o.steps for o in outs)

  def fixed():
    outs = [dec.generate(target.params, draft.params, p, max(b), cache_size=cache)
            for p, b in groups]
    return _trimmed(outs, budgets), sum(o.seconds for o in outs), sum(o.steps for o in outs)

  def continuous(d, params, interleave=True):
    out = serve(d, target.params, params, prompts, budgets, slots=slots, cache_size=cache,
                prefill_chunk=CHUNK.value, interleave_prefill=interleave)
    return out, (int(out.num_generated.sum()), out.seconds, out.steps)

  def plain_continuous():
    out, row = continuous(only_plain, ())
    if out.per_row["depth_hist"][:, 1:].any():
      raise RuntimeError("the plain continuous run drafted")
    return row

  only_plain = SpeculativeDecoder(
      target.cfg, PromptLookupDrafter(target.cfg.vocab_size), sampler=sampler,
      policy=AdaptiveGamma(gammas=(0, 1), step_costs=(1.0, 1e6)))
  runs = dict(zip(METHODS, (plain, fixed, plain_continuous,
                            lambda: continuous(dec, draft.params)[1],
                            lambda: continuous(dec, draft.params, interleave=False)[1])))
  t0 = time.perf_counter()
  for fn in runs.values():
    fn()
  _log(f"B={slots} T={temp:g}: warm ({time.perf_counter() - t0:.0f} s)")
  tps = lambda row: row[0] / row[1]  # row: (tokens, seconds, steps)
  rounds = []
  for r in range(ROUNDS.value):
    order = list(METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)])
    rounds.append({name: runs[name]() for name in order})
    base = tps(rounds[-1][METHODS[0]])
    _log(f"B={slots} T={temp:g} round {r + 1}: " + ", ".join(
        f"{n}: {tps(row):.1f} tok/s ({tps(row) / base:.2f}×, {row[0]} tokens)"
        for n, row in rounds[-1].items()))
  cell = {"slots": slots, "temperature": temp, "methods": {}}
  for name in METHODS:
    speed = [tps(rd[name]) / tps(rd[METHODS[0]]) for rd in rounds]
    cell["methods"][name] = {"tokens": rounds[0][name][0], "steps": rounds[0][name][2],
                             "tokens_per_second": float(np.median([tps(rd[name])
                                                                   for rd in rounds])),
                             "speedup": float(np.median(speed)), "rounds": speed}
  return cell


def _trimmed(outs, budgets) -> int:
  """Tokens of fixed-batch outputs up to each request's own budget (a fixed batch is run
  at its largest budget; what a row makes past its own is not counted, though its time is)."""
  made = np.concatenate([o.num_generated for o in outs])
  return int(np.minimum(made, budgets).sum())


def _report(cells: list[dict], command: str, minutes: float, budgets) -> list[str]:
  spread = (f"budgets uniform in [{min(budgets)}, {max(budgets)}] (`--budget_spread="
            f"{SPREAD.value:g}`)" if SPREAD.value else f"budget {NEW.value} for every request")
  lines = [f"# Continuous batching against fixed batches ({TARGET.value} target)", "",
           f"Command: `{command}`  ", f"{provenance()}; draft `{DRAFT.value}`, chain γ = "
           f"{GAMMA.value}; {PROMPTS.value} held-out prompts served in order, stopping at EOS, "
           f"{spread}; whole runs (prefill included); median of {ROUNDS.value} interleaved "
           f"rounds; {minutes:.1f} min.", "",
           "Fixed batches take the queue B requests at a time, each batch running until its "
           "slowest row is done (at its largest budget; tokens past a request's own budget are "
           "not counted). Continuous batching refills a slot as soon as its request is done "
           f"(`specjax.speculative.continuous`; an admitted prompt prefills {CHUNK.value} tokens "
           "per step of the other slots, or, with whole prefills, all of it before the next "
           "step). A speedup is tokens/s over plain fixed batches' "
           "in the same round (at T > 0 each method's samples stop at other EOS, so token "
           "counts differ); steps are target forwards of the whole queue, in the first round.",
           ""]
  for temp in sorted({c["temperature"] for c in cells}):
    rows = sorted((c for c in cells if c["temperature"] == temp), key=lambda c: c["slots"])
    lines += [f"## T = {temp:g}", "",
              "| slots B | " + " | ".join(f"{m} tok/s (speedup, steps)" for m in METHODS)
              + " | speculative continuous / fixed |", "|---" * (2 + len(METHODS)) + "|"]
    for c in rows:
      m = c["methods"]
      lines.append(f"| {c['slots']} | " + " | ".join(
          f"{m[n]['tokens_per_second']:.1f} ({m[n]['speedup']:.2f}×, {m[n]['steps']})"
          for n in METHODS) + f" | {m[METHODS[3]]['speedup'] / m[METHODS[1]]['speedup']:.2f}× |")
    lines.append("")
  return lines


def main(_):
  slots, temps = _check_flags()
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target(TARGET.value)
  draft = load_draft(DRAFT.value, target, lambda: [])
  prompts = [target.encode(p.text) for p in default_prompts(PROMPTS.value)]
  budgets = _budgets(len(prompts))
  start = time.perf_counter()
  cells = [_measure(target, draft, prompts, budgets, b, t) for t in temps for b in slots]
  command = " ".join(["python -m benchmarks.continuous_batching", *sys.argv[1:]])
  write_markdown(OUT.value, _report(cells, command, (time.perf_counter() - start) / 60,
                                    budgets))


if __name__ == "__main__":
  app.run(main)
