"""Which measured figures cannot be trusted: impossible values and unstable timings.

A setting is flagged when
  * its verify cost T(γ+1)/T(1) is <= 0 or > γ + 1: one forward over γ + 1
    tokens can neither be free nor cost more than γ + 1 sequential steps, so
    the timings it came from were disturbed;
  * the spread of its speedup over the interleaved rounds, (max − min) / median,
    exceeds SPREAD_BOUND;
  * the interquartile spread of the draft phase over the timed ``stream`` steps
    behind c, (q75 − q25) / median, exceeds DRAFT_SPREAD_BOUND (the draft does
    the same work every step; one phase of ~10 ms carries dispatch jitter, so
    single outliers, which the median behind c ignores, are not counted).
A flagged setting is measured once more (``Bench.spec_many``); what is still flagged
afterwards is marked in tables.md. Before that, ``unsteady`` picks the settings whose
speedup over some batch group spreads more than SPREAD_BOUND, and the groups that do;
they (and no others) get one more interleaved round on those groups' batches only
(``--extra_rounds`` at most), so a median of three can outvote a disturbed round. Such a
round leaves the other batches untimed (None), and a speedup over a group of batches is
taken from the rounds that timed all of them (``complete_rounds``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

SPREAD_BOUND = 0.10
DRAFT_SPREAD_BOUND = 0.25
IDLE_LOAD = 0.5  # a 1-minute load average at the start above this: the machine was busy


def spread(values: Sequence[float]) -> Optional[float]:
  """(max − min) / median, or None for fewer than two values."""
  if len(values) < 2:
    return None
  med = float(np.median(values))
  return (max(values) - min(values)) / med if med > 0 else float("inf")


def quartile_spread(values: Sequence[float]) -> Optional[float]:
  """(q75 − q25) / median, or None for fewer than four values."""
  if len(values) < 4:
    return None
  q25, med, q75 = np.percentile(values, [25, 50, 75])
  return float((q75 - q25) / med) if med > 0 else float("inf")


def complete_rounds(seconds: Sequence[Sequence[Optional[float]]],
                    batch_indices: Sequence[int]) -> list[int]:
  """Indices of the rounds that timed every given batch (an added round times only the
  batches of a setting's unsteady groups and leaves the others None)."""
  return [r for r, row in enumerate(seconds) if all(row[i] is not None for i in batch_indices)]


def round_sums(seconds: Sequence[Sequence[Optional[float]]],
               batch_indices: Sequence[int]) -> list[float]:
  """Per round that timed all the given batches: the sum of its times over them. Plain and
  speculative times of a setting leave the same batches out, so their sums pair up."""
  return [sum(seconds[r][i] for i in batch_indices)
          for r in complete_rounds(seconds, batch_indices)]


def round_ratios(plain_seconds: Sequence[Sequence[Optional[float]]],
                 seconds: Sequence[Sequence[Optional[float]]],
                 batch_indices: Sequence[int]) -> list[float]:
  """Per round that timed all the given batches: Σ plain / Σ speculative seconds over them
  (the speedup)."""
  return [p / s for p, s in zip(round_sums(plain_seconds, batch_indices),
                                round_sums(seconds, batch_indices))]


def unsteady(timings: Sequence[tuple[Sequence[Sequence[Optional[float]]],
                                     Sequence[Sequence[Optional[float]]]]],
             groups: Sequence[Sequence[int]], bound: float = SPREAD_BOUND
             ) -> dict[int, list[int]]:
  """The settings whose speedup over some group of batches spreads more than ``bound``
  over their rounds so far (the ones that get another round), each with the batches of
  its unsteady groups (the ones that round times).

  Args:
    timings: per setting, (plain [rounds][batches], speculative [rounds][batches]) wall
      times of the rounds it took part in (None: a batch that round did not time).
    groups: batch indices whose times are pooled into one speedup (all batches, and
      each category's), as the tables report them.
    bound: the largest spread accepted.

  Returns:
    {index into ``timings``: sorted batch indices} for the unsteady settings, in order.

  Example: two rounds of batches 0 and 1, batch 1's plain call 20% slower in the second:
  with ``plain = [[1, 1], [1, 1.2]]`` and ``spec = [[1, 1], [1, 1]]``, the speedup
  pooled over both batches goes 1.0 → 1.1 (a 9.5% spread) but batch 1's goes
  1.0 → 1.2 (18%): ``unsteady([(plain, spec)], [(0, 1)])`` is ``{}``,
  ``unsteady([(plain, spec)], [(0, 1), (1,)])`` is ``{0: [1]}``: one more round of
  batch 1 only.
  """
  def spreads(plain, spec, group) -> bool:
    value = spread(round_ratios(plain, spec, group))
    return value is not None and value > bound

  out = {}
  for i, (plain, spec) in enumerate(timings):
    batches = {b for group in groups if spreads(plain, spec, group) for b in group}
    if batches:
      out[i] = sorted(batches)
  return out


def setting_flags(gamma: int, verify_cost: Optional[float], speedup_spread: Optional[float],
                  draft_spread: Optional[float] = None, bound: float = SPREAD_BOUND,
                  draft_bound: float = DRAFT_SPREAD_BOUND) -> list[str]:
  """Short reasons (empty when nothing is wrong) for one measured setting.

  Args:
    gamma: draft length; the verify pass covers γ + 1 tokens.
    verify_cost: T(γ+1)/T(1) as measured, before any clipping (None: not measured).
    speedup_spread: ``spread`` of the per-round speedups.
    draft_spread: ``quartile_spread`` of the per-step draft-phase times behind c.
    bound: the largest speedup spread accepted.
    draft_bound: the largest draft-phase spread accepted.
  """
  out = []
  if verify_cost is not None and not 0 < verify_cost <= gamma + 1:
    out.append(f"verify cost {verify_cost:.2f} outside (0, γ+1 = {gamma + 1}]")
  if speedup_spread is not None and speedup_spread > bound:
    out.append(f"speedup spread {speedup_spread:.0%} > {bound:.0%}")
  draft_flag = draft_phase_flag(draft_spread, draft_bound)
  if draft_flag:
    out.append(draft_flag)
  return out


def draft_phase_flag(draft_spread: Optional[float],
                     bound: float = DRAFT_SPREAD_BOUND) -> Optional[str]:
  """Why the draft-phase timings behind c are not to be trusted (None: they are): their
  ``quartile_spread`` above ``bound``."""
  if draft_spread is not None and draft_spread > bound:
    return f"draft-phase spread {draft_spread:.0%} > {bound:.0%} (c)"
  return None
