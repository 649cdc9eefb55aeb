"""How the experiments' calibrated prediction should read a batched run (no timing).

Usage:
  python -m benchmarks.calibrated_batches --runs=experiments/results/intel_xeon_batch4_adaptive,...
      [--out benchmarks/results/calibrated_batches.md]

Reads each experiments output directory's ``progress.jsonl`` (every timed chain run: its
per-row counters, its rounds' times and phase costs) and prints, per chain setting, the
measured speedup (decode-only beside it) against the calibrated formula
E[tokens] / (γc + verify) with E taken two ways: at the pooled α (the column before git
90ee412) and for batches that wait for their slowest row, each row at its own α
(``rows.slowest_row_tokens``, the column since), and the slowest-row prediction for the whole
call, its prefill as the run measured it (``theory.whole_call_improvement``, the experiments'
"calibrated, whole call" column). Nothing is decoded or timed here: the runs are the committed
ones.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from benchmarks.common import write_markdown
from experiments.measure import (SpecRun, costs, round_decode_speedups, round_prefill_ratios,
                                 round_prefill_shares, round_speedups)
from experiments.prompts import ALL, Batch
from experiments.rows import slowest_row_tokens
from specjax import theory

RUNS = flags.DEFINE_list("runs", None, "experiments output directories (with progress.jsonl)",
                         required=True)
OUT = flags.DEFINE_string("out", "benchmarks/results/calibrated_batches.md", "markdown output")


def _runs(directory: str) -> tuple[dict, list[SpecRun]]:
  """The log's header config and its last record of every timed chain setting."""
  path = os.path.join(directory, "progress.jsonl")
  if not os.path.exists(path):
    raise SystemExit(f"--runs: no progress.jsonl in {directory}")
  with open(path) as f:
    lines = [json.loads(line) for line in f if line.strip()]
  runs = {}
  for rec in (line["run"] for line in lines if "run" in line):
    run = SpecRun.from_record(rec)
    if run.timed and run.tree is None and not run.group:  # (a group's: the sweep's again)
      runs[run.key] = run  # a re-measured setting's second record replaces the first
  return lines[0]["header"]["config"], list(runs.values())


def _row(run: SpecRun) -> list[str] | None:
  cc, verify = costs(run)
  if cc is None or not verify or verify <= 0:
    return None
  g = run.gamma
  sums = sum(c["beta_sum"].sum() for c in run.counters)
  alpha = min(float(sums / sum(c["beta_count"].sum() for c in run.counters)), 1.0)
  # every row of every batch ("all"): the batches as ``rows`` reads them
  batches = [Batch(ALL, tuple(range(len(c["beta_sum"]))), (), (ALL,) * len(c["beta_sum"]))
             for c in run.counters]
  cost = g * cc + theory.VerifyCostCurve({1: 1.0, g + 1: verify})(g + 1)
  pooled = theory.expected_tokens_per_step(alpha, g) / cost
  slowest = slowest_row_tokens(run, batches, ALL) / cost
  everything = list(range(len(run.counters)))
  measured = float(np.median(round_speedups(run, everything)))
  decode = round_decode_speedups(run, everything)
  decode = None if decode is None else float(np.median(decode))
  err = lambda p: f"{p / measured - 1:+.1%}" + ("" if decode is None
                                                 else f" / {p / decode - 1:+.1%}")
  whole = "–"
  if decode is not None:
    share = float(np.median(round_prefill_shares(run, everything)))
    ratio = float(np.median(round_prefill_ratios(run, everything)))
    call = theory.whole_call_improvement(slowest, share, ratio)
    whole = f"**{call:.3f}×** ({call / measured - 1:+.1%}; prefill {share:.0%}, ×{ratio:.2f})"
  return [f"{run.temperature:g}", str(g), f"{alpha:.2f}", f"{measured:.3f}×",
          "–" if decode is None else f"{decode:.3f}×",
          f"{pooled:.3f}× ({err(pooled)})", f"**{slowest:.3f}×** ({err(slowest)})", whole]


def main(_):
  lines = ["# Calibrated predictions of batched runs: pooled α against each batch's slowest row, "
           "and the whole call",
           "", f"Command: `python -m benchmarks.calibrated_batches --runs={','.join(RUNS.value)}`",
           "", "Per chain setting of each committed run: measured speedup (median over its "
           "interleaved rounds, prefill included), decode-only, and the calibrated formula "
           "E[tokens] / (γc + verify) with E at the pooled α and with E for batches that wait "
           "for their slowest row (harmonic mean over batches of the slowest row's E at its own "
           "α); in brackets each prediction's error against the measured speedup / against the "
           "decode-only one (the formula models the decode loop: prefill excluded); last, the "
           "slowest-row prediction for the whole call, 1 / (s / r_p + (1 − s) / prediction) "
           "with the run's own plain prefill share s and prefill ratio r_p (plain / "
           "speculative prefill time; `theory.whole_call_improvement`), its error against the "
           "measured speedup and (s, r_p) in brackets. Counters, costs and times are the runs' "
           "own (their `progress.jsonl`); nothing is re-measured."]
  for directory in RUNS.value:
    config, runs = _runs(directory)
    lines += ["", f"## `{directory}` (batches of {config['batch_size']}, "
              f"{config['max_new_tokens']} new tokens, draft `{config['draft']}`)", "",
              "| T | γ | α | measured | decode-only | calibrated, pooled α | "
              "calibrated, slowest row | slowest row, whole call |",
              "|---|---|---|---|---|---|---|---|"]
    table = [r for r in map(_row, sorted(runs, key=lambda r: (r.temperature, r.gamma))) if r]
    lines += ["| " + " | ".join(r) + " |" for r in table]
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
