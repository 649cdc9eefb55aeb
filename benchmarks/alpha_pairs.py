"""How far apart two drafts' α are, over the prompts of committed drafts_alpha runs (no decoding).

Usage:
  python -m benchmarks.alpha_pairs --runs=DIR[,DIR...] --pairs=A:B[,A:B...]
      [--draws 5000] [--out benchmarks/results/alpha_pairs.md]

Reads each ``experiments.run --experiment=drafts_alpha`` output directory's ``progress.jsonl``
(every draft's per-prompt counters at each temperature; a draft measured in several runs of
one seed, as the shipped one beside each candidate, must have the same counters in each) and,
for each pair A:B and temperature, prints α(A) − α(B) with the standard deviation of a paired
bootstrap over the prompts: each draw resamples the prompts with replacement and recomputes
both drafts' pooled α = Σβ / Σ(positions) on the same draw. At T = 0 both drafts score the
same greedy text, so the pairing is tight; at T > 0 each prompt's sampled answer differs
between drafts and the spread is the one that matters. Runs of other seeds (``--seed``) add
answers at T > 0: each (seed, prompt) is then one unit of the bootstrap, and a pair must
have been drawn under the same seeds. At T = 0 the seed draws nothing, so runs of any seed
must agree there and count once.
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


def per_prompt(directories: list[str]
               ) -> dict[tuple[str, float], tuple[np.ndarray, np.ndarray, tuple[int, ...]]]:
  """(draft, T) -> (Σβ, positions) of each (seed, prompt), seeds in order, and the seeds, from
  the runs' untimed α records (at T = 0 one seed stands for all)."""
  by_seed = {}
  for directory in directories:
    path = os.path.join(directory, "progress.jsonl")
    if not os.path.exists(path):
      raise SystemExit(f"--runs: no progress.jsonl in {directory}")
    with open(path) as f:
      lines = [json.loads(line) for line in f if line.strip()]
    seed = next((l["header"]["config"].get("seed", 0) for l in lines if "header" in l), 0)
    for rec in (l["run"] for l in lines if "run" in l):
      run = SpecRun.from_record(rec)
      sums = np.concatenate([c["beta_sum"] for c in run.counters]).astype(np.float64)
      counts = np.concatenate([c["beta_count"] for c in run.counters]).astype(np.float64)
      key = (run.draft, float(run.temperature), seed if run.temperature > 0 else 0)
      if key in by_seed and not (np.array_equal(by_seed[key][0], sums)
                                 and np.array_equal(by_seed[key][1], counts)):
        where = f"seed {seed}" if run.temperature > 0 else "any seed"
        raise SystemExit(f"{run.draft} at T = {run.temperature} differs between --runs "
                         f"({where})")
      by_seed[key] = (sums, counts)
  out = {}
  for (draft, t, seed), (sums, counts) in sorted(by_seed.items()):
    s, c, seeds = out.get((draft, t), (np.zeros(0), np.zeros(0), ()))
    out[(draft, t)] = (np.concatenate([s, sums]), np.concatenate([c, counts]), seeds + (seed,))
  return out


def paired_difference(a: tuple, b: tuple, draws: int, seed: int) -> tuple[float, float]:
  """(α(a) − α(b), the standard deviation of that difference over prompt-bootstrap draws);
  ``a``, ``b``: (Σβ per unit, positions per unit, the seeds), as ``per_prompt`` gives them."""
  (sa, ca, seeds_a), (sb, cb, seeds_b) = a, b
  if seeds_a != seeds_b:  # (seed, prompt) units pair only under the same seeds
    raise SystemExit(f"the two drafts were drawn under seeds {seeds_a} and {seeds_b}")
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
           "| draft | T | seeds | answers (seeds × prompts) | α |", "|---|---|---|---|---|"]
  for (draft, t), (s, c, seeds) in sorted(data.items()):
    shown = ", ".join(map(str, seeds)) if t > 0 else "any (greedy)"
    lines.append(f"| {draft} | {t:g} | {shown} | {len(s)} | {s.sum() / c.sum():.4f} |")
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
