"""The three experiments; each returns table rows (overall and per category)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tqdm

from experiments.measure import Bench
from experiments.models import Draft
from experiments.prompts import categories
from experiments.rows import ALL, make_row

SWEEP_TEMPERATURES = (0.0, 1.0)  # the paper's T=0 (argmax) and T=1 (standard sampling)


def _rows(bench: Bench, experiment: str, draft: Draft, gamma: int, temperature: float,
          timed: bool = True) -> list[dict]:
  run = bench.spec(draft, gamma, temperature, timed=timed)
  cats = [ALL] + categories(bench.batches)
  return [make_row(experiment, run, bench.batches_of(run), c) for c in cats]


def gamma_sweep(bench: Bench, draft: Draft) -> list[dict]:
  """Speedup vs γ at T=0 and T=1 (the measured counterpart of the paper's Figs. 2–4)."""
  jobs = [(t, g) for t in SWEEP_TEMPERATURES for g in bench.config.gammas]
  rows = []
  for t, g in tqdm.tqdm(jobs, desc="gamma sweep", unit="setting"):
    rows += _rows(bench, "gamma_sweep", draft, g, t)
  return rows


def best_gamma(rows: Sequence[dict], fallback: int) -> int:
  """γ with the best measured speedup, averaged over the sweep's temperatures."""
  by_gamma: dict[int, list[float]] = {}
  for r in rows:
    if r["experiment"] == "gamma_sweep" and r["category"] == ALL and r["speedup"]:
      by_gamma.setdefault(r["gamma"], []).append(r["speedup"])
  if not by_gamma:
    return fallback
  return max(sorted(by_gamma), key=lambda g: np.mean(by_gamma[g]))


def temperature_sweep(bench: Bench, draft: Draft, gamma: int) -> list[dict]:
  rows = []
  for t in tqdm.tqdm(bench.config.temperatures, desc=f"temperature sweep (γ={gamma})",
                     unit="T"):
    rows += _rows(bench, "temperature_sweep", draft, gamma, t)
  return rows


def drafts_alpha(bench: Bench, drafts: Sequence[Draft]) -> list[dict]:
  """α of each draft at T=0 and T=1 (the paper's Table 3); untimed unless already timed."""
  g = bench.config.alpha_gamma
  jobs = [(d, t) for d in drafts for t in SWEEP_TEMPERATURES]
  rows = []
  for d, t in tqdm.tqdm(jobs, desc=f"drafts alpha (γ={g})", unit="run"):
    rows += _rows(bench, "drafts_alpha", d, g, t, timed=bench.has_timed(d, g, t))
  return rows
