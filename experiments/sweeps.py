"""The four experiments; each returns table rows (overall and per category)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import tqdm
from absl import logging

from experiments.config import SWEEP_TEMPERATURES, sweep_tree, tree_setting
from experiments.measure import Bench, adaptive_setting, round_speedups, step_cost
from experiments.models import Draft
from experiments.prompts import ALL, batch_indices, calibration_prompts, categories
from experiments.rows import make_row
from specjax.speculative.calibration import monotone_costs
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.speculative.tree_builders import best_static_tree

ADAPTIVE_GROUP = "adaptive"  # SpecRun.group of the adaptive policy's rounds


def _rows(bench: Bench, experiment: str, draft: Draft, temperature: float,
          settings: Sequence[tuple[int, Optional[tuple]]], timed: bool = True) -> list[dict]:
  """Rows (overall and per category) of ``(γ, tree)`` settings at one temperature, the timed
  ones measured together (``Bench.spec_many``: one plain baseline per round for all)."""
  cats = [ALL] + categories(bench.batches)
  return [make_row(experiment, run, bench.batches_of(run), c)
          for run in bench.spec_many(draft, settings, temperature, timed) for c in cats]


def gamma_sweep(bench: Bench, draft: Draft) -> list[dict]:
  """Speedup vs γ at T=0 and T=1 (the measured counterpart of the paper's Figs. 2–4), with
  the ``sweep_trees`` dynamic trees (EAGLE-2 and sampled) the drafter builds beside the
  chains; the settings of one temperature share their interleaved rounds."""
  cfg = bench.config
  trees = [sweep_tree(spec) for spec in cfg.sweep_trees]
  built = [(tree, temps) for tree, temps in trees if draft.drafter.supports(tree)]
  if len(built) < len(trees):
    logging.info("gamma sweep: %s cannot build %d of the %d dynamic trees; left out",
                 draft.name, len(trees) - len(built), len(trees))
  rows = []
  for t in tqdm.tqdm(SWEEP_TEMPERATURES, desc=f"gamma sweep ({len(cfg.gammas)} γs, "
                     f"{len(built)} trees)", unit="T"):
    settings = [(g, None) for g in cfg.gammas] + [
        (tree.max_depth, tree_setting(tree)) for tree, temps in built if t in temps]
    rows += _rows(bench, "gamma_sweep", draft, t, settings)
  return rows


def adaptive(bench: Bench, draft: Draft) -> list[dict]:
  """The adaptive policy (``specjax.speculative.adaptive``) at T=0 and T=1, timed against
  plain decoding. Its choices are the γ sweep's γs, plus plain decoding (γ = 0) where the
  drafter tolerates skipped steps; its step costs are the ones the γ sweep measured on these
  batches, on this machine (its runs are reused, or measured now), pooled into a
  non-decreasing fit (``calibration.monotone_costs``). In batches of more than one row it
  is also given the chains' rate and how it varies by prompt, measured on the calibration
  prompts (held-out, never evaluated: ``_calibration_prompts``; ``Bench.chain_rates``), so it prices a batch's steps for the row the
  batch waits on (``AdaptiveGamma.prompt_ease``); at one row that changes nothing, and the
  policy starts from its default prior. It drafts only when a draft promises more than
  ``config.min_gain`` over plain decoding, and it counts ``config.evidence`` (its calibration
  too).

  It is timed in the same rounds as the sweep's best γ at that temperature, measured again
  beside it (``ADAPTIVE_GROUP``; the sweep's own measurement stays the sweep's): each row
  carries that γ (``paired_gamma``) and its speedup in those rounds (``paired_speedup``). On
  a host whose memory spells move every ratio between rounds, only such a pair says how the
  policy compares with fixing γ."""
  rows = []
  cfg = bench.config
  gammas = tuple(cfg.gammas)
  plain = draft.drafter.tolerates_skipped_steps()
  for t in tqdm.tqdm(SWEEP_TEMPERATURES, desc="adaptive γ", unit="T"):
    sweep = bench.spec_many(draft, [(g, None) for g in gammas], t)
    choices = ((0,) if plain else ()) + gammas
    costs = ((1.0,) if plain else ()) + tuple(step_cost(run) for run in sweep)
    rates = dict(min_gain=cfg.min_gain, evidence=cfg.evidence)
    if cfg.batch_size > 1:
      alpha, ease = bench.chain_rates(draft, t, _calibration_prompts(bench), max(gammas))
      rates.update(chain_alpha=alpha, prompt_ease=ease)
    setting = adaptive_setting(choices, monotone_costs(choices, costs), **rates)
    rows += _paired_rows(bench, draft, t, setting, _best_gamma_of(bench, sweep))
  return rows


def _best_gamma_of(bench: Bench, runs: Sequence) -> int:
  """γ of the timed chain run with the best speedup over every batch."""
  everything = range(len(bench.batches))
  return max(runs, key=lambda run: np.median(round_speedups(run, everything))).gamma


def _paired_rows(bench: Bench, draft: Draft, temperature: float, setting: tuple,
                 gamma: int) -> list[dict]:
  """Rows (overall and per category) of an adaptive ``setting`` timed in the same rounds as
  the chain of ``gamma`` (``ADAPTIVE_GROUP``), each with that chain's speedup in them."""
  policy, fixed = bench.spec_many(draft, [setting, (gamma, None)], temperature,
                                  group=ADAPTIVE_GROUP)
  return [dict(make_row("adaptive", policy, bench.batches, c), paired_gamma=gamma,
               paired_speedup=float(np.median(round_speedups(
                   fixed, batch_indices(bench.batches, c)))))
          for c in [ALL] + categories(bench.batches)]


CALIBRATION_SIDE = "held-out prompts never timed"  # what the records' calibrations say


def _calibration_prompts(bench: Bench) -> list[list[int]]:
  """The prompts that calibrate the policies and shape the trees: held-out ones after the
  evaluated ones (``prompts.calibration_prompts``), never evaluated themselves."""
  return [bench.target.encode(t) for t in calibration_prompts(bench.config.calibration_prompts,
                                                              bench.config.num_prompts)]


def best_gamma(rows: Sequence[dict], fallback: int) -> int:
  """γ with the best measured speedup, averaged over the sweep's temperatures."""
  by_gamma: dict[int, list[float]] = {}
  for r in rows:
    if (r["experiment"] == "gamma_sweep" and r["category"] == ALL and r["speedup"]
        and r["tree"] is None):
      by_gamma.setdefault(r["gamma"], []).append(r["speedup"])
  if not by_gamma:
    return fallback
  return max(sorted(by_gamma), key=lambda g: np.mean(by_gamma[g]))


def temperature_sweep(bench: Bench, draft: Draft, gamma: int) -> list[dict]:
  rows = []
  for t in tqdm.tqdm(bench.config.temperatures, desc=f"temperature sweep (γ={gamma})",
                     unit="T"):
    rows += _rows(bench, "temperature_sweep", draft, t, [(gamma, None)])
  return rows


def own_setting(draft: Draft, gamma: int) -> tuple[int, Optional[tuple]]:
  """The ``(γ, tree)`` setting a draft is measured at: its own tree where it brings one
  (``Drafter.default_tree``: lookahead decoding), else the chain of ``gamma``."""
  tree = draft.drafter.default_tree()
  return (gamma, None) if tree is None else (tree.max_depth, tree.parents)


def drafts_alpha(bench: Bench, drafts: Sequence[Draft]) -> list[dict]:
  """α of each draft at T=0 and T=1 (the paper's Table 3); untimed unless already timed."""
  g = bench.config.alpha_gamma
  jobs = [(d, own_setting(d, g), t) for d in drafts for t in SWEEP_TEMPERATURES]
  bench.untimed_many([(d, *s, t) for d, s, t in jobs], desc=f"drafts alpha (γ={g})")
  rows = []
  for d, setting, t in jobs:
    rows += _rows(bench, "drafts_alpha", d, t, [setting], timed=bench.has_timed(d, *setting, t))
  return rows


def draft_free(bench: Bench, drafts: Sequence[Draft]) -> list[dict]:
  """The methods without a draft model (prompt lookup, Jacobi, lookahead), timed against
  plain decoding at T=0 and T=1: chains at γ = alpha_gamma, lookahead on its own tree."""
  g = bench.config.alpha_gamma
  rows = []
  for t in tqdm.tqdm(SWEEP_TEMPERATURES, desc=f"draft-free methods ({len(drafts)})", unit="T"):
    for d in drafts:
      rows += _rows(bench, "draft_free", d, t, [own_setting(d, g)])
  return rows


def tree_sweep(bench: Bench, draft: Draft) -> tuple[list[dict], dict[str, dict]]:
  """Chains of every γ against static and dynamic trees of each node budget, at T=0 and T=1.

  The static trees come from ``tree_builders.best_static_tree`` over the
  per-depth, per-rank acceptance that ``Bench.calibrate`` measures on
  held-out prompts after the evaluated ones (``_calibration_prompts``: text the draft never
  trained on, and the evaluated prompts never shape the trees). The
  EAGLE-2 dynamic tree of budget N has the static tree's depth D and a
  frontier of k = min(4, N) (when the drafter builds dynamic trees). Last, an
  adaptive policy chooses among all of them and plain decoding each step, at
  their measured step costs, priced by the calibration table
  (``specjax.speculative.adaptive``). Returns the rows and, per temperature,
  the calibration (table and counts).
  """
  cfg = bench.config
  if not draft.drafter.supports(TreeTopology((-1, -1))):
    return [], {}
  cal_prompts = _calibration_prompts(bench)
  rows, calibration = [], {}
  for t in SWEEP_TEMPERATURES:
    cal = bench.calibrate(draft, t, cal_prompts)
    calibration[f"{t:g}"] = dict(cal, side=CALIBRATION_SIDE)  # JSON-ready (Bench.calibrate)
    jobs = [(g, None) for g in cfg.gammas]
    for n in cfg.tree_budgets:
      static = best_static_tree(cal["table"], n)
      if not static.is_chain:
        jobs.append((static.max_depth, static.parents))
      k, d = min(4, n), max(static.max_depth, 2)
      if d <= n <= k + (d - 1) * k * k and draft.drafter.supports(tree := DynamicTree(k, d, n)):
        jobs.append((d, tree_setting(tree)))
    logging.info("tree sweep (T=%g): %d settings measured together", t, len(jobs))
    rows += _rows(bench, "tree_sweep", draft, t, jobs)
    policy = _adaptive_over(bench, draft, t, jobs, cal["table"], cal["chain_alpha"],
                            cal["prompt_ease"] if cfg.batch_size > 1 else ())
    if policy is not None:
      rows += _rows(bench, "tree_sweep", draft, t, [policy])
  return rows, calibration


def _adaptive_over(bench: Bench, draft: Draft, temperature: float,
                   jobs: Sequence[tuple[int, Optional[tuple]]], table,
                   chain_alpha: float, prompt_ease: Sequence[float] = ()) -> Optional[tuple]:
  """The adaptive setting whose choices are the sweep's chains and trees (and plain decoding
  where the drafter tolerates skipped steps) at the step costs measured on them, priced by
  the calibration table and the chains' rate measured beside it (and, for batches of more
  than one row, how that rate varies by prompt), with ``config.min_gain`` as its margin
  over plain decoding and ``config.evidence`` as what it counts; trees deeper than the table are left out
  (None if no tree is left, or the table accepted no rank-0 draft)."""
  table = np.asarray(table)
  if table[0, 0] <= 0.0:  # no rank-0 draft accepted: nothing to scale the prices by
    logging.warning("tree sweep (T=%g): no adaptive row, the calibration accepted no rank-0 "
                    "draft at depth 1", temperature)
    return None
  jobs = [(g, tree) for g, tree in jobs if tree is None or g <= table.shape[0]]
  runs = bench.spec_many(draft, jobs, temperature)
  chains = [(g, step_cost(r)) for (g, tree), r in zip(jobs, runs) if tree is None]
  trees = [(tree, step_cost(r)) for (_, tree), r in zip(jobs, runs) if tree is not None]
  if not trees:
    return None
  plain = [(0, 1.0)] if draft.drafter.tolerates_skipped_steps() else []
  gammas = tuple(g for g, _ in plain + chains)
  costs = monotone_costs(gammas, [c for _, c in plain + chains])
  return adaptive_setting(gammas, costs, [t for t, _ in trees],
                          [max(c, 1.0) for _, c in trees], table, chain_alpha, prompt_ease,
                          bench.config.min_gain, bench.config.evidence)
