"""Warm, timed runs of plain and speculative decoding on the same prompt batches.

Protocol, for a group of (draft, γ or tree) settings at one sampler (``Bench.spec_many``:
the γ sweep at one temperature, the tree sweep's jobs at one temperature, or one setting):
  1. compile: one call with ``max_new_tokens=1`` on the first batch, for each
     method (budgets are arrays and every batch has the same shape and cache
     size, so this is the program that is then timed), ``config.workers`` at a
     time, all before the first timed call;
  2. ``repeats`` interleaved rounds, then one more at a time (``extra_rounds`` at
     most) for just the settings whose speedup over all batches or over one
     category's spreads more than ``checks.SPREAD_BOUND``, on just the batches of
     the groups that spread: each round times, batch by batch, a plain call and
     each of its settings' speculative calls with the full budget (in an order
     rotated by one per batch and round). Plain and speculative
     decoding thus alternate every few seconds and share the machine's state,
     and one plain call per batch and round is the baseline of every setting of
     the group (so a γ sweep times plain decoding once per round, not once per
     γ). The speedup of a setting in a round is Σ plain / Σ speculative seconds
     (prefill included, identically for both; where rows stop at EOS at T > 0, each
     speculative decode loop scaled to plain decoding's length, ``same_length_seconds``);
     the reported figure is the median over the rounds that timed all the batches
     it pools;
  3. every call reports when its prefill ended (``prefill_seconds``), so each
     round also gives the decode-only speedup (Σ plain / Σ speculative loop
     seconds) and the step time of each fused loop, prefill excluded: Σ loop
     seconds / Σ steps over the round's batches (rounds over every batch only);
     for plain decoding this is t₁, the unit of c and of the verify cost (c
     divides a draft phase timed on the first batch by this t₁ of all batches:
     within 1% of the first batch's own t₁ in the committed run);
  4. draft cost (once per draft and temperature, right after the rounds of its
     first group): at γ = ``alpha_gamma`` on the first batch, the draft and verify
     phases are timed each in a fused loop from the state after two steps
     (``phase_timing``: what a phase costs inside the decode loop, without the
     per-call dispatch that a GPU adds to separately synchronised calls), and
     ``SpeculativeDecoder.stream`` times the rest (accept, commit, bookkeeping)
     over ``cost_steps`` steps after a warm one (medians). c = draft seconds /
     (γ t₁), with the t₁ of those rounds; the verify cost of every γ is then
     step/t₁ − γc. A draft phase whose timings spread more than
     ``checks.DRAFT_SPREAD_BOUND`` is timed once more and the second kept
     (``first_draft_spread`` in the costs): that flag is about c alone, so it
     re-measures c, not the settings' rounds;
  5. the settings flagged by ``checks.setting_flags`` for their rounds (speedup
     spread, an impossible verify cost) are measured once more, together (with a
     plain baseline of their own), and the second measurement is kept (with the
     flags that caused it).
Every finished setting goes to the progress log at once (``progress.py``), and so does
every calibration of a policy (``Bench.calibrate``, ``Bench.chain_rates``), so a resumed run
prices its policies as the first did instead of measuring their rates again (at T = 1,
sampled again on another machine or JAX version, they could differ, and the policy
settings they enter with them, which would then be timed again).
Runs that are not timed (α of the Table-3 drafts) use mixed-category batches
of up to 16 rows: fewer sequential steps, and α needs no timing. At T = 0 they
are replayed against the target's greedy continuations (``Bench._untimed``). They run
``config.workers`` at a time (``Bench.untimed_many``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
import tqdm
from absl import logging

import specjax
from specjax import compile_cache
from specjax.sampling import make_sampler, scale_temperature
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import MIN_GAIN, AdaptiveGamma, check_evidence
from specjax.speculative.calibration import (loop_step_seconds, measure_chain_alphas,
                                             measure_tree_prices)
from specjax.speculative.replay import replay_greedy
from specjax.speculative.tree import DynamicTree, TreeTopology

from experiments import checks
from experiments.config import DYNAMIC, SAMPLED, ExperimentConfig, setting_tree
from experiments.models import Draft, Target
from experiments.phase_timing import fused_phase_seconds
from experiments.progress import ProgressLog
from experiments.prompts import ALL, Batch, batch_indices, categories, merge_batches

COUNTERS = ("target_calls", "drafted", "accepted", "emitted", "accepted_at", "accept_len_hist",
            "depth_hist", "accepted_rank", "beta_sum", "beta_count", "choice_steps",
            "choice_estimate")


@dataclasses.dataclass
class SpecRun:
  """Speculative decoding of every batch with one (draft, γ or tree, temperature).

  Attributes:
    gamma: the chain's γ, or the tree's depth D.
    tree: the static tree's parents; ("dynamic", k, D, N) for an EAGLE-2
      dynamic tree; ("sampled", w₁, …, w_D) for a sampled dynamic tree; ("adaptive",
      γ₁ … γ_K, cost₁ … cost_K) for an adaptive policy over chains, ("adaptive", γs,
      costs, trees, tree costs, table, α_c) for one with trees (``adaptive_setting``;
      ``gamma`` is then its deepest choice's depth; records that predate α_c, the chains'
      calibrated rate, lack it); None for a chain.
    counters: per batch, ``SpecCounters`` arrays of the real rows.
    generated: per batch, generated ids of each real row.
    steps: per batch, speculative steps.
    seconds: [rounds][batches] speculative wall times (None when not timed; a batch
      that an added round left out is None in that round).
    plain_seconds: [rounds][batches] plain-decoding wall times, interleaved.
    prefill_seconds, plain_prefill_seconds: [rounds][batches] the part of each
      wall time until the prompts were prefilled (None in records of runs that
      predate them).
    plain_generated: per batch, plain decoding's ids of each real row.
    step_seconds: [rounds] speculative seconds per fused-loop step (pooled over batches;
      None for an added round that left batches out).
    plain_step_seconds: [rounds] t₁, plain seconds per step (likewise).
    costs: the draft's phase costs (``Bench.draft_cost``), timed runs.
    compile_seconds: the first (compiling) speculative call, when timed (the group's first
      calls run ``config.workers`` at a time, so these overlap).
    load_average: the load averages (``load_average()``) before and after the setting.
    first_flags: why the setting's rounds were measured twice (empty: measured once).
    replayed: an untimed greedy run replayed against the target's greedy continuations
      (``specjax.speculative.replay``: the outputs and counters of a real run, without its
      verification forwards).
    loop_tokens, plain_loop_tokens: per batch, the tokens of the longest row of each call,
      padded rows included (a batch's loop runs until its last row stops), in the last
      round over every batch (None in records before them).
    group: "" for a setting's own measurement; a name where a setting is timed again in
      the rounds of another group (``Bench.spec_many``'s ``group``): the adaptive policy's
      rounds time the sweep's best γ beside it, so that the two compare in the same rounds
      without replacing the sweep's measurement of that γ.
  """

  draft: str
  gamma: int
  temperature: float
  counters: list[dict[str, np.ndarray]]
  generated: list[list[list[int]]]
  steps: list[int]
  seconds: Optional[list[list[float]]] = None
  plain_seconds: Optional[list[list[float]]] = None
  plain_generated: Optional[list[list[list[int]]]] = None
  step_seconds: Optional[list[float]] = None
  plain_step_seconds: Optional[list[float]] = None
  prefill_seconds: Optional[list[list[float]]] = None
  plain_prefill_seconds: Optional[list[list[float]]] = None
  costs: Optional[dict[str, float]] = None
  compile_seconds: Optional[float] = None
  load_average: Optional[list[Optional[list[float]]]] = None
  first_flags: list[str] = dataclasses.field(default_factory=list)
  tree: Optional[tuple] = None
  replayed: bool = False
  loop_tokens: Optional[list[int]] = None
  plain_loop_tokens: Optional[list[int]] = None
  group: str = ""

  @property
  def key(self) -> tuple:
    return (self.draft, self.gamma, self.temperature, self.tree, self.group)

  @property
  def num_nodes(self) -> int:
    return tree_shape(self.tree, self.gamma).num_nodes

  @property
  def timed(self) -> bool:
    return self.seconds is not None

  def to_record(self) -> dict[str, Any]:
    """JSON-ready (counters as lists); ``from_record`` inverts it."""
    rec = dataclasses.asdict(self)
    rec["counters"] = [{k: np.asarray(v).tolist() for k, v in c.items()} for c in self.counters]
    return rec

  @classmethod
  def from_record(cls, rec: dict[str, Any]) -> "SpecRun":
    rec = dict(rec, counters=[{k: np.asarray(v) for k, v in c.items()} for c in rec["counters"]])
    if rec.get("tree") is not None:
      rec["tree"] = as_tuple(rec["tree"])
    return cls(**rec)


ADAPTIVE = "adaptive"


def adaptive_setting(gammas: Sequence[int], step_costs: Sequence[float],
                     trees: Sequence[tuple] = (), tree_costs: Sequence[float] = (),
                     rank_accept=None, chain_alpha: Optional[float] = None,
                     prompt_ease: Sequence[float] = (),
                     min_gain: Optional[float] = None,
                     evidence: Optional[str] = None) -> tuple[int, tuple]:
  """The ``(γ, tree)`` setting of an adaptive policy over ``gammas`` with these step costs;
  with ``trees`` (``SpecRun.tree`` encodings of static or dynamic trees), their costs and the
  acceptance table that prices them; with the chains' rate measured on the calibration
  prompts (``AdaptiveGamma.prior_alpha``; None: the policy's default) and how it varies over
  them (``AdaptiveGamma.prompt_ease``, which prices a batch's steps for the row it waits on;
  empty: for the rows' mean); with the margin a draft must promise over plain decoding
  (``AdaptiveGamma.min_gain``; None: not carried, the policy's default); with what a sampled
  chain step counts (``AdaptiveGamma.evidence``; None: not carried, the policy's default,
  which a record from before git 3d3668c did not run with). ``γ`` is the deepest choice's depth.

  A chains-only policy with neither rate, spread, margin nor evidence keeps the flat form
  ``(ADAPTIVE, *gammas, *costs)``; any other, ``(ADAPTIVE, gammas, costs, trees, tree costs,
  table or None[, α_c or None[, ease[, min_gain[, evidence]]]])`` (the later slots present
  when one of them is carried; evidence without a margin carries the default margin)."""
  round4 = lambda xs: tuple(round(float(c), 4) for c in xs)
  if evidence is not None:
    check_evidence(evidence)
    if min_gain is None:
      min_gain = MIN_GAIN
  if not trees and chain_alpha is None and not prompt_ease and min_gain is None:
    return max(gammas), (ADAPTIVE, *(int(g) for g in gammas), *round4(step_costs))
  table = (None if rank_accept is None
           else tuple(round4(row) for row in np.asarray(rank_accept, np.float64)))
  setting = (ADAPTIVE, tuple(int(g) for g in gammas), round4(step_costs),
             tuple(as_tuple(t) for t in trees), round4(tree_costs), table)
  if chain_alpha is not None or prompt_ease or min_gain is not None:
    setting += (None if chain_alpha is None else round(float(chain_alpha), 4),)
  if prompt_ease or min_gain is not None:
    setting += (round4(prompt_ease),)
  if min_gain is not None:
    setting += (float(min_gain),)
  if evidence is not None:
    setting += (evidence,)
  return policy_of(setting).max_depth, setting


def policy_of(tree: Optional[tuple]) -> Optional[AdaptiveGamma]:
  """The ``AdaptiveGamma`` of an adaptive setting's tree; None for chains and trees. A
  setting that does not carry its margin or its evidence (the flat form, records before
  them) gets the policy's default ``min_gain`` or ``evidence``."""
  if tree is None or tree[0] != ADAPTIVE:
    return None
  if isinstance(tree[1], tuple):  # (ADAPTIVE, γs, costs, trees, costs, table[, α_c[, ease[, g[, e]]]])
    _, gammas, costs, trees, tree_costs, table = tree[:6]
    chain_alpha = setting_chain_alpha(tree)
    return AdaptiveGamma(gammas=gammas, step_costs=costs,
                         trees=tuple(tree_shape(t, 0) for t in trees), tree_costs=tree_costs,
                         rank_accept=table, prompt_ease=tree[7] if len(tree) > 7 else (),
                         **({} if chain_alpha is None else {"prior_alpha": chain_alpha}),
                         **({"min_gain": tree[8]} if len(tree) > 8 else {}),
                         **({"evidence": tree[9]} if len(tree) > 9 else {}))
  k = (len(tree) - 1) // 2
  return AdaptiveGamma(gammas=tuple(int(g) for g in tree[1:1 + k]), step_costs=tree[1 + k:])


def setting_chain_alpha(tree: Optional[tuple]) -> Optional[float]:
  """α_c, the chains' measured rate, of an adaptive setting that carries it; None for any
  other setting and for records that predate it (their policies priced chains and trees on
  separate estimates, and load at the default ``prior_alpha``)."""
  structured = tree is not None and tree[0] == ADAPTIVE and isinstance(tree[1], tuple)
  return tree[6] if structured and len(tree) > 6 else None


def setting_evidence(tree: Optional[tuple]) -> Optional[str]:
  """What an adaptive setting's policy counted of a sampled chain step
  (``AdaptiveGamma.evidence``) where the setting carries it; None for any other setting and
  for records that predate it (outcomes before git 3d3668c, βs after)."""
  structured = tree is not None and tree[0] == ADAPTIVE and isinstance(tree[1], tuple)
  return tree[9] if structured and len(tree) > 9 else None


def choice_names(policy: AdaptiveGamma) -> list[str]:
  """A label for each of the policy's choices, in its order: "plain", "γ = 2", "tree N=8 D=4",
  "dynamic k=4 N=4 D=4"."""
  return [f"γ = {g}" if g else "plain" for g in policy.gammas] + [
      f"dynamic k={t.top_k} N={t.num_nodes} D={t.depth}" if isinstance(t, DynamicTree)
      else f"tree N={t.num_nodes} D={t.max_depth}" for t in policy.trees]


def as_tuple(x):
  """Nested lists (a setting read back from JSON) as nested tuples (hashable)."""
  return tuple(as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def step_cost(run: SpecRun) -> float:
  """A timed run's fused-loop step over plain decoding's, both medians over its rounds."""
  return median_known(run.step_seconds) / median_known(run.plain_step_seconds)


def tree_shape(tree: Optional[tuple], gamma: int):
  """``SpecRun.tree`` (None, parents, ("dynamic", k, D, N), ("sampled", w₁, …) or an adaptive
  policy's) -> the decoder's topology (an adaptive policy's: the chain of its largest γ)."""
  if tree is None or tree[0] == ADAPTIVE:
    return TreeTopology.chain(gamma)
  if tree[0] in (DYNAMIC, SAMPLED):
    return setting_tree(tree)
  return TreeTopology(tree)


def load_average() -> Optional[list[float]]:
  """The 1-, 5- and 15-minute load averages (None where the platform has none)."""
  try:
    return list(os.getloadavg())
  except OSError:
    return None


def length_scales(run: SpecRun) -> list[float]:
  """Per batch: the tokens plain decoding's call ran for over the speculative call's (each
  call's longest row, padded rows included where recorded (``SpecRun.loop_tokens``): a
  batch's loop runs until its last row stops; the calls of a seed generate the same tokens
  every round). 1 where every row runs to its budget (EOS ignored) and at T = 0 (both methods
  emit the target's greedy tokens); at T > 0 with rows stopping at EOS the two methods'
  samples end at different lengths."""
  if run.loop_tokens is not None and run.plain_loop_tokens is not None:
    return _ratios(run.plain_loop_tokens, run.loop_tokens)
  if run.plain_generated is None:
    return [1.0] * len(run.generated)
  longest = lambda batches: [max([len(r) for r in rows] + [1]) for rows in batches]
  return _ratios(longest(run.plain_generated), longest(run.generated))  # real rows: old records


def _ratios(plain: Sequence[int], spec: Sequence[int]) -> list[float]:
  """Per batch, plain decoding's loop length over the speculative call's."""
  return [p / s for p, s in zip(plain, spec)]


def same_length_seconds(run: SpecRun) -> list[list[Optional[float]]]:
  """``run.seconds`` with each call's decode loop (its time after prefill) scaled to the
  length plain decoding's call ran for (``length_scales``): the speculative time of the
  plain call's output length, so that a speedup compares the same amount of generated text
  while each call's prefill, a cost per prompt, stays as measured. Unchanged where the
  lengths agree; records without prefill times scale the whole call."""
  return scale_loops(run.seconds, run.prefill_seconds, length_scales(run))


def scale_loops(seconds: Sequence[Sequence[Optional[float]]],
                prefill_seconds: Optional[Sequence[Sequence[Optional[float]]]],
                scales: Sequence[float]) -> list[list[Optional[float]]]:
  """[rounds][batches] call times with each batch's decode loop (time after prefill) times
  its scale; without prefill times, the whole call."""
  prefill = prefill_seconds or [[0.0] * len(row) for row in seconds]
  return [[None if t is None else pre + (t - pre) * k for t, pre, k in zip(row, pres, scales)]
          for row, pres in zip(seconds, prefill)]


def round_speedups(run: SpecRun, indices: Sequence[int]) -> list[float]:
  """Per interleaved round: Σ plain / Σ speculative seconds over the given batches, the
  speculative decode loops at plain decoding's lengths (``same_length_seconds``: as timed
  unless rows stop at EOS at T > 0)."""
  return checks.round_ratios(run.plain_seconds, same_length_seconds(run), indices)


def round_decode_speedups(run: SpecRun, indices: Sequence[int]) -> Optional[list[float]]:
  """Per round that timed the given batches: Σ plain / Σ speculative decode-loop seconds
  (wall time − prefill) over them, at plain decoding's lengths as ``round_speedups``; None
  for runs recorded without prefill times."""
  if run.prefill_seconds is None or run.plain_prefill_seconds is None:
    return None
  loop = lambda total, pre: np.subtract(checks.round_sums(total, indices),
                                        checks.round_sums(pre, indices))
  return (loop(run.plain_seconds, run.plain_prefill_seconds) /
          loop(same_length_seconds(run), run.prefill_seconds)).tolist()


def round_prefill_ratios(run: SpecRun, indices: Sequence[int]) -> Optional[list[float]]:
  """Per round that timed the given batches: Σ plain / Σ speculative prefill seconds over
  them (below 1 where the draft has a prefill of its own); None for runs recorded without
  prefill times."""
  if run.prefill_seconds is None or run.plain_prefill_seconds is None:
    return None
  return checks.round_ratios(run.plain_prefill_seconds, run.prefill_seconds, indices)


def round_prefill_shares(run: SpecRun, indices: Sequence[int]) -> Optional[list[float]]:
  """Per round that timed the given batches: plain decoding's Σ prefill / Σ wall seconds over
  them (its share of time in prefill, ``theory.whole_call_improvement``'s s); None for runs
  recorded without prefill times."""
  if run.prefill_seconds is None or run.plain_prefill_seconds is None:
    return None
  return np.divide(checks.round_sums(run.plain_prefill_seconds, indices),
                   checks.round_sums(run.plain_seconds, indices)).tolist()


def median_known(values: Sequence[Optional[float]]) -> float:
  """The median of the values that were measured (an added round's step times are None)."""
  return float(np.median([v for v in values if v is not None]))


def costs(run: SpecRun) -> tuple[Optional[float], Optional[float]]:
  """(c, verify cost T(γ+1)/T(1)) of a timed run, relative to t₁; the verify cost is as
  measured (possibly impossible: see ``checks``). None for a tree, whose draft phase is
  not γ single-token forwards, and for a draft phase timed at or below zero (its slopes
  lost in timer noise; its draft-phase spread flags it), which gives neither."""
  if (run.costs is None or not run.step_seconds or run.tree is not None
      or run.costs["draft"] <= 0):
    return None, None
  t1 = median_known(run.plain_step_seconds)
  c = run.costs["draft"] / (run.costs["gamma"] * run.costs["t1"])
  return c, median_known(run.step_seconds) / t1 - run.gamma * c


def own_tree_costs(run: SpecRun) -> Optional[tuple[float, float]]:
  """(verify cost T(N+1)/T(1), draft phase / t₁) of a timed tree run whose phase timings
  were taken on that same tree (a drafter's own tree: ``Drafter.default_tree``); None
  otherwise (chains, and trees timed beside a chain's phase costs)."""
  if run.tree is None or run.costs is None or run.costs.get("tree") is None:
    return None
  if tuple(run.costs["tree"]) != tuple(run.tree):
    return None
  return run.costs["verify"] / run.costs["t1"], run.costs["draft"] / run.costs["t1"]


def run_flags(run: SpecRun, indices: Optional[Sequence[int]] = None,
              draft_phase: bool = True) -> list[str]:
  """``checks.setting_flags`` of a timed run, its speedup taken over the given batches
  (default: all); without the draft phase's (c's) flag when ``draft_phase`` is False:
  what measuring the setting's rounds again could mend."""
  _, verify = costs(run)
  sel = range(len(run.seconds[0])) if indices is None else indices
  draft_spread = run.costs.get("draft_spread") if run.costs and draft_phase else None
  return checks.setting_flags(run.gamma, verify, checks.spread(round_speedups(run, sel)),
                              draft_spread)


def cache_size_for(batches: Sequence[Batch], config: ExperimentConfig,
                   draft_nodes: int = 0) -> int:
  """One cache size for every call (so shapes, hence compiles, are shared); ``draft_nodes``:
  the largest tree a drafter brings of its own (``Drafter.default_tree``)."""
  longest = max(len(ids) for b in batches for ids in b.ids)
  need = longest + config.max_new_tokens + max(config.max_draft_nodes, draft_nodes) + 1
  return -(-need // 64) * 64


class Bench:
  """Runs and caches measurements; every result is computed at most once per run, and
  appended to ``log`` (whose earlier records it starts from) as soon as it exists."""

  def __init__(self, target: Target, batches: Sequence[Batch], config: ExperimentConfig,
               log: Optional[ProgressLog] = None, draft_nodes: int = 0):
    self.target, self.batches, self.config, self.log = target, list(batches), config, log
    self.cache_size = cache_size_for(batches, config, draft_nodes)
    self.untimed_batches = merge_batches(self.batches)
    self.eos_ids = None if config.stop_at_eos else ()
    self.plain_compile_seconds: dict[float, float] = {}  # compiled in this process
    self._specs: dict[tuple, SpecRun] = {}
    self._draft_costs: dict[tuple, dict[str, float]] = {}
    self._continuations: Optional[list[list[list[int]]]] = None
    self._calibrations: dict[str, Any] = {}
    self.reused = 0
    for rec in log.records if log else ():
      if "calibration" in rec:
        self._calibrations[rec["calibration"]["key"]] = rec["calibration"]["value"]
        continue
      self._store(SpecRun.from_record(rec["run"]))
      self.reused += 1

  def _store(self, run: SpecRun) -> None:
    old = self._specs.get(run.key)
    if old is None or run.timed or not old.timed:
      self._specs[run.key] = run
    if run.costs is not None:
      self._draft_costs.setdefault((run.draft, run.temperature), run.costs)

  def batches_of(self, run: SpecRun) -> list[Batch]:
    return self.batches if run.timed else self.untimed_batches

  # ---------------------------------------------------------------- the two methods

  def _plain(self, temperature: float) -> Callable:
    """``(batch, max_new, seed) -> output`` of plain decoding, compiled on first use."""
    t, sampler = self.target, make_sampler(temperature)
    call = lambda b, n, s: specjax.generate(t.params, t.cfg, b.ids, n, sampler, seed=s,
                                            cache_size=self.cache_size, eos_ids=self.eos_ids)
    if temperature not in self.plain_compile_seconds:
      start = time.perf_counter()
      call(self.batches[0], 1, self.config.seed)
      self.plain_compile_seconds[temperature] = time.perf_counter() - start
    return call

  def decoder(self, draft: Draft, gamma: int, temperature: float,
              tree: Optional[tuple] = None) -> SpeculativeDecoder:
    policy = policy_of(tree)
    sampler = make_sampler(temperature)
    ratio = self.config.draft_temperature
    common = dict(sampler=sampler, eos_ids=self.eos_ids,
                  draft_sampler=None if temperature == 0 or ratio == 1
                  else scale_temperature(sampler, ratio))
    common["verification"] = self.config.verification
    if policy is not None:
      return SpeculativeDecoder(self.target.cfg, draft.drafter, policy=policy, **common)
    return SpeculativeDecoder(self.target.cfg, draft.drafter, tree=tree_shape(tree, gamma),
                              **common)

  def spec_many(self, draft: Draft, settings: Sequence[tuple[int, Optional[tuple]]],
                temperature: float, timed: bool = True, group: str = "") -> list[SpecRun]:
    """Runs (or returns the cached) ``(γ, tree)`` settings of ``draft`` at one temperature
    (``tree``: None for a chain of γ, else see ``SpecRun.tree``).

    The timed settings that are not cached are measured together, in shared
    interleaved rounds (module docstring); untimed ones go through ``untimed_many``. Each
    is logged as it is stored. A ``group`` (timed only) keeps its runs apart from the same
    settings' own (``SpecRun.group``): when one of its settings is not cached, all of them
    are timed again together, so that the group's runs always share their rounds.
    """
    if group and not timed:
      raise ValueError("a group of settings is timed together; untimed runs have none")
    def cached(setting) -> bool:
      run = self.stored(draft, *setting, temperature, group)
      return run is not None and (run.timed or not timed)

    todo = [s for s in dict.fromkeys(settings) if not cached(s)]
    if group and todo:
      todo = list(dict.fromkeys(settings))
    if timed and todo:
      calls = [(g, tree, self._call(self.decoder(draft, g, temperature, tree), draft))
               for g, tree in todo]
      for run in self._timed(draft, temperature, calls, together=bool(group)):
        run.group = group
        self._store_and_log(run)
    elif todo:
      self.untimed_many([(draft, g, tree, temperature) for g, tree in todo])
    return [self.stored(draft, *s, temperature, group) for s in settings]

  def untimed_many(self, jobs: Sequence[tuple[Draft, int, Optional[tuple], float]],
                   desc: str = "untimed runs") -> None:
    """Runs the ``(draft, γ, tree, T)`` jobs that have no run yet, untimed,
    ``config.workers`` at a time in threads, and stores (and logs) each in job order.

    Nothing is timed, so nothing is lost by sharing the cores, and one job's compiling (XLA
    releases the GIL) overlaps another's decoding. Each job's tokens and counters are those
    of a run alone: its seeds are its own, and the kernels give one result whatever else
    runs (``specjax/kernels/parallel_for.h``); tests/test_measurement_protocol.py compares
    the records of one and two workers on the tiny model, and
    experiments/results/avx512_zen4/README.md#workers-ab on SmolLM2 (with what it saves).
    """
    todo = list({(d.name, g, tree, t): (d, g, tree, t) for d, g, tree, t in jobs
                 if self.stored(d, g, tree, t) is None}.values())
    if not todo:
      return
    replays = [self.decoder(d, g, t, tree).tree.max_depth for d, g, tree, t in todo
               if self._replays(d, tree, t)]
    if replays:  # computed here, once, not by racing threads
      self.greedy_continuations(self.config.max_new_tokens + max(replays))
    for result in tqdm.tqdm(_concurrently(lambda job: self._untimed(*job), todo,
                                          self.config.workers), total=len(todo),
                            desc=desc, unit="run"):
      self._store_and_log(result)

  def _store_and_log(self, run: SpecRun) -> None:
    self._store(run)
    if self.log is not None:
      self.log.append({"run": run.to_record()})

  def _replays(self, draft: Draft, tree: Optional[tuple], temperature: float) -> bool:
    """Whether an untimed run is replayed against the greedy continuations (``_untimed``)."""
    return (temperature == 0 and not draft.drafter.reads_target_predictions()
            and policy_of(tree) is None)

  def _untimed(self, draft: Draft, gamma: int, tree: Optional[tuple],
               temperature: float) -> SpecRun:
    """An untimed run on the mixed batches. At T = 0 it is replayed against the target's
    greedy continuations (``specjax.speculative.replay``): the same tokens and counters as
    decoding gives, at the drafter's cost, with no verification forwards (except for
    drafters that read the target's whole block, which run for real)."""
    budget, batches = self.config.max_new_tokens, self.untimed_batches
    replay = self._replays(draft, tree, temperature)
    dec = self.decoder(draft, gamma, temperature, tree)
    if replay:
      conts = self.greedy_continuations(budget + dec.tree.max_depth)
      outs = [replay_greedy(dec, self.target.params, draft.params, b.ids, c, budget,
                            seed=self.config.seed + i, cache_size=self.cache_size)
              for i, (b, c) in enumerate(zip(batches, conts))]
    else:
      call = self._call(dec, draft)
      outs = [call(b, budget, self.config.seed + i) for i, b in enumerate(batches)]
    return SpecRun(draft.name, gamma, temperature, tree=tree, replayed=replay,
                   **_spec_outputs(outs, batches))

  def greedy_continuations(self, length: int) -> list[list[list[int]]]:
    """Per untimed batch, each row's greedy continuation of ``length`` tokens (plain
    decoding, EOS not stopping it; untimed; computed once for the longest length asked)."""
    if self._continuations is None or len(self._continuations[0][0]) < length:
      t = self.target
      outs = [specjax.generate(t.params, t.cfg, b.ids, length, cache_size=self.cache_size,
                               eos_ids=()) for b in self.untimed_batches]
      self._continuations = [[o.generated(r) for r in range(len(b.ids))]
                             for o, b in zip(outs, self.untimed_batches)]
    return [[c[:length] for c in rows] for rows in self._continuations]

  def _call(self, dec: SpeculativeDecoder, draft: Draft) -> Callable:
    tp = self.target.params
    return lambda b, n, s: dec.generate(tp, draft.params, b.ids, n, seed=s,
                                        cache_size=self.cache_size)

  def _timed(self, draft: Draft, temperature: float,
             settings: Sequence[tuple[int, Optional[tuple], Callable]],
             together: bool = False) -> list[SpecRun]:
    """Timed runs of ``(γ, tree, call)`` settings sharing interleaved rounds, the flagged
    ones measured once more (together); ``together``: every setting in every round, an
    added one or a second measurement included, whenever one of them needs it (a group
    compared round by round)."""
    released = compile_cache.release_if_crowded()  # a long run's programs near the limit
    plain, first = self._plain(temperature), self.batches[0]
    if released:
      logging.info("freed this process's compiled programs (%s memory mappings of %s after)",
                   compile_cache.memory_mappings(), compile_cache.mapping_limit())
      plain(first, 1, self.config.seed)  # compiled again before anything is timed
    load_before = load_average()
    def compile_one(call: Callable) -> float:
      start = time.perf_counter()
      call(first, 1, self.config.seed)
      return time.perf_counter() - start
    compile_s = list(_concurrently(compile_one, [call for _, _, call in settings],
                                   self.config.workers))
    runs = self._rounds(draft, temperature, plain, settings, together)
    self._add_costs(draft, temperature, runs)
    for run in runs:
      run.first_flags = run_flags(run, draft_phase=False)
    flagged = [i for i, run in enumerate(runs) if run.first_flags]
    if together and flagged:
      for run in runs:
        run.first_flags = run.first_flags or ["measured again with its group"]
      flagged = list(range(len(runs)))
    if flagged:
      for i in flagged:
        logging.warning("re-measuring %s γ=%d T=%g%s: %s", draft.name, runs[i].gamma,
                        temperature, " (tree)" if runs[i].tree else "",
                        "; ".join(runs[i].first_flags))
      again = self._rounds(draft, temperature, plain, [settings[i] for i in flagged], together)
      self._add_costs(draft, temperature, again)
      for i, run in zip(flagged, again):
        run.first_flags = runs[i].first_flags
        runs[i] = run
    load_after = load_average()
    for run, s in zip(runs, compile_s):
      run.compile_seconds, run.load_average = s, [load_before, load_after]
    return runs

  def _add_costs(self, draft: Draft, temperature: float, runs: Sequence[SpecRun]) -> None:
    t1 = median_known(runs[0].plain_step_seconds)
    for run in runs:
      run.costs = self.draft_cost(draft, temperature, t1)

  def _rounds(self, draft: Draft, temperature: float, plain: Callable,
              settings: Sequence[tuple[int, Optional[tuple], Callable]],
              together: bool = False) -> list[SpecRun]:
    """``repeats`` interleaved rounds of every setting, then one more at a time
    (``extra_rounds`` at most) for the settings ``checks.unsteady`` picks, on the batches
    of their unsteady groups only: those whose speedup, overall or over one category's
    batches, spreads more than the bound. A round runs, per batch, plain decoding and each
    setting that times it, in an order rotated by one per batch and round, so no setting
    always runs first (or right after plain decoding) and position effects spread over all
    of them. Each setting keeps the plain times of the rounds (and batches) it took part
    in; a batch a round left out is None. ``together``: an added round times every setting
    on the batches any of them needs."""
    cfg = self.config
    seed, budget, n = cfg.seed, cfg.max_new_tokens, len(self.batches)
    timings = [dict(seconds=[], prefill_seconds=[], step_seconds=[], plain_seconds=[],
                    plain_prefill_seconds=[], plain_step_seconds=[]) for _ in settings]
    groups = [batch_indices(self.batches, c) for c in [ALL] + categories(self.batches)]
    bar = tqdm.tqdm(total=cfg.repeats * n, leave=False, unit="batch",
                    desc=f"{draft.name} T={temperature:g}: {len(settings)} setting(s)")
    need = {j: list(range(n)) for j in range(len(settings))}
    spec_outs, plain_outs = {}, None  # outputs of each one's last round over every batch
    loops, plain_loops = {}, None  # ``SpecRun.loop_tokens`` of those outputs
    for r in range(cfg.repeats + cfg.extra_rounds):
      if r >= cfg.repeats:  # spreads of the speedups as reported, at equal lengths
        need = checks.unsteady([(t["plain_seconds"],
                                 scale_loops(t["seconds"], t["prefill_seconds"],
                                             _ratios(plain_loops, loops[j])))
                                for j, t in enumerate(timings)], groups)
        if not need:
          break
        timed = set().union(*need.values())
        if together:
          need = {j: sorted(timed) for j in range(len(settings))}
        bar.total += len(timed)
        logging.info("%s T=%g: round %d for %d setting(s) whose speedup spread > %.0f%%, "
                     "on %d of %d batches", draft.name, temperature, r + 1, len(need),
                     100 * checks.SPREAD_BOUND, len(timed), n)
      outs = {j: {} for j in [-1, *need]}  # -1: plain decoding; {batch: output}
      for i, b in enumerate(self.batches):
        calls = [(-1, plain)] + [(j, settings[j][2]) for j in need if i in need[j]]
        if len(calls) == 1:
          continue
        shift = (r * n + i) % len(calls)
        for j, call in calls[shift:] + calls[:shift]:
          outs[j][i] = call(b, budget, seed + i)
        bar.update()
      if len(outs[-1]) == n:
        plain_outs = [outs[-1][i] for i in range(n)]
        plain_loops = [longest_row(o) for o in plain_outs]
      for j, batches in need.items():
        t, full = timings[j], len(batches) == n
        for prefix, o in (("plain_", outs[-1]), ("", outs[j])):
          for field in ("seconds", "prefill_seconds"):
            t[prefix + field].append([getattr(o[i], field) if i in batches else None
                                      for i in range(n)])
          t[prefix + "step_seconds"].append(
              loop_step_seconds([o[i] for i in range(n)]) if full else None)
        if full:
          spec_outs[j] = [outs[j][i] for i in range(n)]
          loops[j] = [longest_row(o) for o in spec_outs[j]]
    bar.close()
    plain_generated = [[o.generated(r) for r in range(b.num_real)]
                       for o, b in zip(plain_outs, self.batches)]
    return [SpecRun(draft.name, g, temperature, **_spec_outputs(spec_outs[j], self.batches),
                    plain_generated=plain_generated, tree=tree,
                    loop_tokens=loops[j], plain_loop_tokens=plain_loops, **timings[j])
            for j, (g, tree, _) in enumerate(settings)]

  def draft_cost(self, draft: Draft, temperature: float, t1: float) -> dict[str, float]:
    """Median draft / verify / other seconds per step at γ = alpha_gamma, from ``stream``
    (first step dropped), with ``t1`` (the plain step measured just before) and the spread
    of the draft phase; measured once per (draft, temperature), and once more when the
    first's draft phase is flagged (``checks.draft_phase_flag``): the second is kept, the
    first's spread recorded as ``first_draft_spread``."""
    key = (draft.name, temperature)
    if key not in self._draft_costs:
      gamma, own = self.config.alpha_gamma, draft.drafter.default_tree()
      tree = None if own is None else own.parents  # where the phases were timed
      dec = self.decoder(draft, gamma, temperature, tree)
      cost = self._phase_costs(dec, draft)
      flag = checks.draft_phase_flag(cost["draft_spread"])
      if flag:
        logging.warning("re-measuring the draft phase of %s at T=%g: %s", draft.name,
                        temperature, flag)
        cost = dict(self._phase_costs(dec, draft), first_draft_spread=cost["draft_spread"])
      self._draft_costs[key] = dict(cost, gamma=gamma, t1=t1, tree=tree)
    return self._draft_costs[key]

  def _phase_costs(self, dec: SpeculativeDecoder, draft: Draft) -> dict[str, float]:
    """Draft and verify seconds of one step, each timed in a fused loop from the state after
    the first two steps (``phase_timing``: device time, which per-call timing overstates on
    a GPU); "other" (accept, commit, bookkeeping) and the per-call figures (``stream_*``)
    from ``stream``'s separately synchronised phases, first step dropped."""
    times, warm = [], None
    stream = dec.stream(self.target.params, draft.params, self.batches[0].ids,
                        self.config.max_new_tokens, seed=self.config.seed,
                        cache_size=self.cache_size)
    for i, (state, t) in enumerate(stream):
      if i > 0:
        times.append(t)
      if i <= 1:
        warm = state
      if len(times) >= self.config.cost_steps:
        break
    if not times:  # finished in one step: keep the compiling step rather than nothing
      times = [t]
    stream_costs = {k: float(np.median([t[k] for t in times]))
                    for k in ("draft", "verify", "other")}
    fused = fused_phase_seconds(dec, self.target.params, draft.params, warm,
                                min_seconds=self.config.phase_seconds)
    return dict(draft=fused["draft"], verify=fused["verify"], other=stream_costs["other"],
                stream_draft=stream_costs["draft"], stream_verify=stream_costs["verify"],
                draft_spread=checks.quartile_spread(fused["draft_samples"]))

  def calibrate(self, draft: Draft, temperature: float,
                prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per-depth, per-rank acceptance of ``draft`` from the calibration full tree's counters,
    and the chains' rate on the same prompts.

    Decodes ``prompts`` (calibration prompts, never the evaluated ones) one at a
    time with ``config.calibration_tree``, then with a chain as deep
    (``calibration.measure_tree_prices``): the table, its counts and ``chain_alpha``
    counted as ``config.evidence`` counts (arrays as nested lists, tuples as lists: what
    the progress log gives back on a resume, ``_calibrated``, keyed by the evidence too).
    """
    # (the template's chain is replaced by the calibration tree; block verification by
    # token-wise, as trees verify)
    evidence = self.config.evidence
    measure = lambda: measure_tree_prices(
        self.decoder(draft, 1, temperature), self.target.params, draft.params, prompts,
        self.config.calibration_tree, self.config.max_new_tokens, self.config.seed,
        self.cache_size, evidence=evidence)
    return self._calibrated("tree_prices", draft, temperature, prompts, (evidence,), measure)

  def chain_rates(self, draft: Draft, temperature: float, prompts: Sequence[Sequence[int]],
                  gamma: int) -> tuple[float, tuple[float, ...]]:
    """The chains' rate α_c of ``draft`` and each prompt's own rate over it, decoding
    ``prompts`` (calibration prompts, never the evaluated ones) one at a time with a chain of
    ``gamma`` (``calibration.measure_chain_alphas``, counted as ``config.evidence``
    counts; logged and reused like ``calibrate``)."""
    evidence = self.config.evidence
    measure = lambda: measure_chain_alphas(
        self.decoder(draft, gamma, temperature), self.target.params, draft.params, prompts,
        gamma, self.config.max_new_tokens, self.config.seed, self.cache_size,
        evidence=evidence)
    alpha, ease = self._calibrated("chain_rates", draft, temperature, prompts,
                                   (gamma, evidence), measure)
    return float(alpha), tuple(float(e) for e in ease)

  def _calibrated(self, kind: str, draft: Draft, temperature: float,
                  prompts: Sequence[Sequence[int]], extra: tuple, measure: Callable) -> Any:
    """``measure()``'s value, JSON-normalised, from this run's progress log when an earlier
    run of the same header logged it (keyed by ``kind``, the draft, the temperature, a
    digest of the prompts' ids and ``extra``), else measured now and logged at once."""
    digest = hashlib.sha256(json.dumps([[int(i) for i in p] for p in prompts]).encode())
    key = json.dumps([kind, draft.name, float(temperature), digest.hexdigest()[:16],
                      list(extra)])
    if key not in self._calibrations:
      value = json.loads(json.dumps(measure(), default=_jsonable))
      self._calibrations[key] = value
      if self.log is not None:
        self.log.append({"calibration": {"key": key, "value": value}})
    else:
      logging.info("%s of %s at T=%g reused from %s", kind, draft.name, temperature,
                   self.log.path if self.log is not None else "this run")
    return self._calibrations[key]

  def stored(self, draft: Draft, gamma: int, tree: Optional[tuple],
             temperature: float, group: str = "") -> Optional[SpecRun]:
    """The run of a setting (timed in ``group``'s rounds: ``SpecRun.group``) measured in this
    run or reused from its log, if any."""
    return self._specs.get((draft.name, gamma, temperature, tree, group))

  def has_timed(self, draft: Draft, gamma: int, tree: Optional[tuple],
                temperature: float) -> bool:
    run = self.stored(draft, gamma, tree, temperature)
    return run is not None and run.timed

  def runs(self) -> list[SpecRun]:
    return list(self._specs.values())


def _concurrently(fn: Callable, items: Sequence[Any], workers: int):
  """Yields ``fn(item)`` for each item, in order, computed ``workers`` at a time in threads
  (XLA compiles and runs with the GIL released); the first exception is raised."""
  if workers == 1 or len(items) <= 1:
    yield from map(fn, items)
    return
  with concurrent.futures.ThreadPoolExecutor(min(workers, len(items))) as pool:
    for future in [pool.submit(fn, item) for item in items]:
      yield future.result()


def _jsonable(x: Any) -> Any:
  """numpy values as JSON has them (arrays as nested lists)."""
  if hasattr(x, "tolist"):
    return x.tolist()
  raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def longest_row(out) -> int:
  """Tokens the longest row of a call generated, padded rows included (at least 1):
  ``SpecRun.loop_tokens``, and the length a batch's decode loop ran for."""
  return max([int(n) for n in out.num_generated] + [1])


def _spec_outputs(outs: Sequence[Any], batches: Sequence[Batch]) -> dict[str, Any]:
  """Counters, generated ids and steps of one speculative call per batch (real rows only)."""
  return dict(counters=[{k: np.asarray(o.per_row[k])[:b.num_real] for k in COUNTERS}
                        for o, b in zip(outs, batches)],
              generated=[[o.generated(r) for r in range(b.num_real)]
                         for o, b in zip(outs, batches)],
              steps=[int(o.steps) for o in outs])


