"""Warm, timed runs of plain and speculative decoding on the same prompt batches.

Protocol, for every (sampler) and every (draft, γ, sampler):
  1. compile: one call with ``max_new_tokens=1`` on the first batch (budgets
     are arrays and every batch has the same shape and cache size, so this is
     the program that is then timed);
  2. time one call per batch with the full budget (the fastest of ``repeats``
     calls); the reported seconds are their sum (prefill included, identically
     for both methods);
  3. step time of the fused loop, prefill excluded: (time of the first batch −
     time of a warm 1-token call) / (steps − 1); for plain decoding this is
     t₁, the unit of c and of the verify cost;
  4. draft cost (speculative only, once per draft and temperature):
     ``SpeculativeDecoder.stream`` at γ = ``alpha_gamma`` on the first batch
     times draft / verify / other phase by phase for ``cost_steps`` steps
     after a warm one (medians). c = draft seconds / (γ t₁); the verify cost
     of every γ is then the rest of its fused step: step/t₁ − γc.
Runs that are not timed (α of the Table-3 drafts) use mixed-category batches
of up to 16 rows: fewer sequential steps, and α needs no timing.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

import numpy as np

import specjax
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder

from experiments.config import ExperimentConfig
from experiments.models import Draft, Target
from experiments.prompts import Batch, merge_batches

COUNTERS = ("target_calls", "drafted", "accepted", "emitted", "accepted_at", "accept_len_hist",
            "beta_sum", "beta_count")


@dataclasses.dataclass
class Baseline:
  """Plain autoregressive decoding (``specjax.generate``) at one temperature.

  Attributes:
    seconds: [num_batches] warm wall time per batch.
    generated: per batch, the generated ids of each real row.
    step_seconds: t₁, one target decode step.
    compile_seconds: the first (compiling) call.
  """

  temperature: float
  seconds: list[float]
  generated: list[list[list[int]]]
  step_seconds: float
  compile_seconds: float


@dataclasses.dataclass
class SpecRun:
  """Speculative decoding of every batch with one (draft, γ, temperature).

  Attributes:
    seconds: [num_batches] warm wall time per batch (None when not timed).
    counters: per batch, ``SpecCounters`` arrays of the real rows.
    generated: per batch, generated ids of each real row.
    steps: per batch, speculative steps.
    step_seconds: fused-loop seconds per step, prefill excluded (timed runs).
    costs: the draft's phase costs (``Bench.draft_cost``), timed runs.
    compile_seconds: the first (compiling) call, when timed.
  """

  draft: str
  gamma: int
  temperature: float
  seconds: Optional[list[float]]
  counters: list[dict[str, np.ndarray]]
  generated: list[list[list[int]]]
  steps: list[int]
  step_seconds: Optional[float] = None
  costs: Optional[dict[str, float]] = None
  compile_seconds: Optional[float] = None


def cache_size_for(batches: Sequence[Batch], config: ExperimentConfig) -> int:
  """One cache size for every call (so shapes, hence compiles, are shared)."""
  longest = max(len(ids) for b in batches for ids in b.ids)
  need = longest + config.max_new_tokens + max(config.all_gammas) + 1
  return -(-need // 64) * 64


class Bench:
  """Runs and caches measurements; every result is computed at most once per run."""

  def __init__(self, target: Target, batches: Sequence[Batch], config: ExperimentConfig):
    self.target, self.batches, self.config = target, list(batches), config
    self.cache_size = cache_size_for(batches, config)
    self.untimed_batches = merge_batches(self.batches)
    self.eos_ids = None if config.stop_at_eos else ()
    self._baselines: dict[float, Baseline] = {}
    self._specs: dict[tuple, SpecRun] = {}
    self._draft_costs: dict[tuple, dict[str, float]] = {}

  def batches_of(self, run: SpecRun) -> list[Batch]:
    return self.batches if run.seconds is not None else self.untimed_batches

  def _fastest(self, call, repeats: Optional[int] = None):
    """The output of ``call()`` with the smallest ``.seconds`` over ``repeats`` calls (the
    calls are deterministic for a fixed seed, so only the timing differs)."""
    return min((call() for _ in range(repeats or self.config.repeats)),
               key=lambda out: out.seconds)

  # ---------------------------------------------------------------- plain decoding

  def _generate(self, batch: Batch, max_new: int, sampler, seed: int):
    t = self.target
    return specjax.generate(t.params, t.cfg, batch.ids, max_new, sampler, seed=seed,
                            cache_size=self.cache_size, eos_ids=self.eos_ids)

  def baseline(self, temperature: float) -> Baseline:
    if temperature in self._baselines:
      return self._baselines[temperature]
    sampler, seed, first = make_sampler(temperature), self.config.seed, self.batches[0]
    start = time.perf_counter()
    self._generate(first, 1, sampler, seed)
    compile_s = time.perf_counter() - start
    one_step = self._fastest(lambda: self._generate(first, 1, sampler, seed)).seconds
    budget = self.config.max_new_tokens
    outs = [self._fastest(lambda: self._generate(b, budget, sampler, seed + i))
            for i, b in enumerate(self.batches)]
    step = _step_seconds(outs[0].seconds, one_step, outs[0].steps)
    base = Baseline(temperature=temperature, seconds=[o.seconds for o in outs],
                    generated=[[o.generated(r) for r in range(b.num_real)]
                               for o, b in zip(outs, self.batches)],
                    step_seconds=step, compile_seconds=compile_s)
    self._baselines[temperature] = base
    return base

  # ---------------------------------------------------------------- speculative decoding

  def decoder(self, draft: Draft, gamma: int, temperature: float) -> SpeculativeDecoder:
    return SpeculativeDecoder(self.target.cfg, draft.drafter, gamma=gamma,
                              sampler=make_sampler(temperature), eos_ids=self.eos_ids)

  def spec(self, draft: Draft, gamma: int, temperature: float, timed: bool = True) -> SpecRun:
    key = (draft.name, gamma, temperature)
    cached = self._specs.get(key)
    if cached is not None and (cached.seconds is not None or not timed):
      return cached
    dec, tp, seed = self.decoder(draft, gamma, temperature), self.target.params, self.config.seed
    run = lambda b, n, s: dec.generate(tp, draft.params, b.ids, n, seed=s,
                                       cache_size=self.cache_size)
    batches = self.batches if timed else self.untimed_batches
    compile_s = one_step = None
    if timed:
      start = time.perf_counter()
      run(batches[0], 1, seed)
      compile_s = time.perf_counter() - start
      one_step = self._fastest(lambda: run(batches[0], 1, seed)).seconds
    repeats = self.config.repeats if timed else 1
    outs = [self._fastest(lambda: run(b, self.config.max_new_tokens, seed + i), repeats)
            for i, b in enumerate(batches)]
    result = SpecRun(
        draft=draft.name, gamma=gamma, temperature=temperature,
        seconds=[o.seconds for o in outs] if timed else None,
        counters=[{k: np.asarray(o.per_row[k])[:b.num_real] for k in COUNTERS}
                  for o, b in zip(outs, batches)],
        generated=[[o.generated(r) for r in range(b.num_real)]
                   for o, b in zip(outs, batches)],
        steps=[o.steps for o in outs], compile_seconds=compile_s)
    if timed:
      result.step_seconds = _step_seconds(outs[0].seconds, one_step, outs[0].steps)
      result.costs = self.draft_cost(draft, temperature)
    self._specs[key] = result
    return result

  def draft_cost(self, draft: Draft, temperature: float) -> dict[str, float]:
    """Median draft / verify / other seconds per step at γ = alpha_gamma, from ``stream``
    (first step dropped); measured once per (draft, temperature)."""
    key = (draft.name, temperature)
    if key not in self._draft_costs:
      gamma = self.config.alpha_gamma
      costs = self._phase_costs(self.decoder(draft, gamma, temperature), draft)
      self._draft_costs[key] = dict(costs, gamma=gamma)
    return self._draft_costs[key]

  def _phase_costs(self, dec: SpeculativeDecoder, draft: Draft) -> dict[str, float]:
    times = []
    stream = dec.stream(self.target.params, draft.params, self.batches[0].ids,
                        self.config.max_new_tokens, seed=self.config.seed,
                        cache_size=self.cache_size)
    for i, (_, t) in enumerate(stream):
      if i > 0:
        times.append(t)
      if len(times) >= self.config.cost_steps:
        break
    if not times:  # finished in one step: keep the compiling step rather than nothing
      times = [t]
    return {k: float(np.median([t[k] for t in times])) for k in ("draft", "verify", "other")}

  def has_timed(self, draft: Draft, gamma: int, temperature: float) -> bool:
    run = self._specs.get((draft.name, gamma, temperature))
    return run is not None and run.seconds is not None

  def runs(self) -> list[SpecRun]:
    return list(self._specs.values())

  def baselines(self) -> list[Baseline]:
    return list(self._baselines.values())


def _step_seconds(full: float, one_step: float, steps: int) -> float:
  """Seconds per loop step, prefill excluded: (full call − 1-step call) / (steps − 1)."""
  step = (full - one_step) / max(steps - 1, 1)
  if not step > 0:  # timer noise on a tiny model: fall back to the mean including prefill
    step = full / max(steps, 1)
  return step
