"""How far apart two drafts' α are, over the prompts of committed drafts_alpha runs (no decoding).

Usage:
  python -m benchmarks.alpha_pairs --runs=DIR[,DIR...] --pairs=A:B[,A:B...]
      [--draws 5000] [--out benchmarks/results/alpha_pairs.md]

Reads each ``experiments.run --experiment=drafts_alpha`` output directory's ``progress.jsonl``
(every draft's per-prompt counters at each temperature; a draft measured in several runs, as
the shipped one beside each candidate, must have the same counters in each) and, for each
pair A:B and temperature, prints α(A) − α(B) with the standard deviation of a paired
bootstrap over the prompts: each draw resamples the prompts with replacement and recomputes
both drafts' pooled α = Σβ / Σ(positions) on the same draw. At T = 0 both drafts score the
same greedy text, so the pairing is tight; at T > 0 each prompt's sampled answer differs
between drafts and the spread is the one that matters.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from benchmarks.common import provenance, write_markdown
from experiments.measure import SpecRun

RUNS = flags.DEFINE_list("runs", None, "drafts_alpha output directories", required=True)
PAIRS = flags.DEFINE_list("pairs", None, "A:B draft names to compare (A − B)", required=True)
DRAWS = flags.DEFINE_integer("draws", 5000, "bootstrap draws")
SEED = flags.DEFINE_integer("seed", 0, "bootstrap seed")
OUT = flags.DEFINE_string("out", "benchmarks/results/alpha_pairs.md", "markdown output")


def per_prompt(directories: list[str]) -> dict[tuple[str, float], tuple[np.ndarray, np.ndarray]]:
  """(draft, T) -> (Σβ, positions) of each prompt, from the runs' untimed α records."""
  out = {}
  for directory in directories:
    path = os.path.join(directory, "progress.jsonl")
    if not os.path.exists(path):
      raise SystemExit(f"--runs: no progress.jsonl in {directory}")
    with open(path) as f:
      records = [json.loads(line)["run"] for line in f if '"run"' in line]
    for rec in records:
      run = SpecRun.from_record(rec)
      sums = np.concatenate([c["beta_sum"] for c in run.counters]).astype(np.float64)
      counts = np.concatenate([c["beta_count"] for c in run.counters]).astype(np.float64)
      key = (run.draft, float(run.temperature))
      if key in out and not (np.array_equal(out[key][0], sums)
                             and np.array_equal(out[key][1], counts)):
        raise SystemExit(f"{run.draft} at T = {run.temperature} differs between --runs")
      out[key] = (sums, counts)
  return out


def paired_difference(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray],
                      draws: int, seed: int) -> tuple[float, float]:
  """(α(a) − α(b), the standard deviation of that difference over prompt-bootstrap draws)."""
  (sa, ca), (sb, cb) = a, b
  if len(sa) != len(sb):
    raise SystemExit(f"the two drafts were measured on {len(sa)} and {len(sb)} prompts")
  idx = np.random.default_rng(seed).integers(0, len(sa), (draws, len(sa)))
  boot = sa[idx].sum(1) / ca[idx].sum(1) - sb[idx].sum(1) / cb[idx].sum(1)
  return float(sa.sum() / ca.sum() - sb.sum() / cb.sum()), float(boot.std())


def main(argv):
  del argv
  data = per_prompt(RUNS.value)
  pairs = []
  for spec in PAIRS.value:
    a, sep, b = spec.partition(":")
    if not sep or not a or not b:
      raise SystemExit(f"--pairs: {spec!r} is not A:B")
    pairs.append((a, b))
  temps = sorted({t for _, t in data})
  lines = [f"# α differences between drafts, paired bootstrap over prompts", "",
           f"`python -m benchmarks.alpha_pairs --runs={','.join(RUNS.value)} "
           f"--pairs={','.join(PAIRS.value)} --draws={DRAWS.value}`  ",
           f"{provenance()} (nothing decoded: the runs' committed counters)", "",
           "| draft | T | prompts | α |", "|---|---|---|---|"]
  for (draft, t), (s, c) in sorted(data.items()):
    lines.append(f"| {draft} | {t:g} | {len(s)} | {s.sum() / c.sum():.4f} |")
  lines += ["", "| A − B | T | difference | ± (bootstrap sd) |", "|---|---|---|---|"]
  for a, b in pairs:
    for t in temps:
      missing = [d for d in (a, b) if (d, t) not in data]
      if missing:
        raise SystemExit(f"--pairs: no run of {', '.join(missing)} at T = {t:g}")
      diff, sd = paired_difference(data[(a, t)], data[(b, t)], DRAWS.value, SEED.value)
      lines.append(f"| {a} − {b} | {t:g} | {diff:+.4f} | {sd:.4f} |")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
