"""Measures what a step costs on this machine, to build an ``AdaptiveGamma`` from.

The policy needs the time of a speculative step at each draft length over one
plain decoding step, at the batch size it will serve: on CPU a verify forward of
γ + 1 tokens costs 1.0–1.6 plain steps at batch 1 and more at large batches,
where the forward is compute-bound; on a GPU it stays near 1 far longer. So the
costs are measured, not assumed: ``measure_step_costs`` times plain decoding and
a fixed chain of each γ on the same prompts, decode loop only (prefill
excluded), interleaved, keeps each setting's fastest round, and pools measured
dips (``monotone_costs``): a longer chain never costs less.

Example::

    template = SpeculativeDecoder(cfg, drafter, sampler=sampler)
    policy = calibrate(template, params, draft_params, prompts, gammas=(0, 1, 2, 3, 4))
    out = template.with_policy(policy).generate(params, draft_params, prompts, 128)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from specjax.generate import generate
from specjax.model import Params
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.speculative.decoder import SpeculativeDecoder


def measure_step_costs(template: SpeculativeDecoder, target_params: Params, draft_params: Any,
                       prompts: Sequence[Sequence[int]], gammas: Sequence[int],
                       max_new_tokens: int = 64, rounds: int = 2) -> tuple[float, ...]:
  """Time of a step at each γ over one plain decoding step's (1.0 for γ = 0).

  Args:
    template: a decoder with the drafter, sampler, EOS ids, attention and verification
      to measure (its own gamma, tree and policy are ignored).
    target_params, draft_params: the models.
    prompts: the batch to time (its size is the batch size the costs hold for).
    gammas: draft lengths, >= 0.
    max_new_tokens: tokens per timed call (the first call of each setting compiles and
      is not timed).
    rounds: timed calls per setting, interleaved; the fastest per-step time is kept.
  """
  if rounds < 1 or max_new_tokens < 1:
    raise ValueError(f"rounds and max_new_tokens must be >= 1, got {rounds}, {max_new_tokens}")
  gammas = tuple(gammas)
  if not gammas or any(isinstance(g, bool) or int(g) != g or g < 0 for g in gammas):
    raise ValueError(f"gammas must be integers >= 0, got {gammas}")
  decoders = {g: dataclasses.replace(template, policy=None, tree=None, gamma=g)
              for g in gammas if g > 0}
  cache = len(max(prompts, key=len)) + max_new_tokens + max(gammas) + 1

  plain = lambda: loop_step_seconds([generate(
      target_params, template.target_cfg, prompts, max_new_tokens, template.sampler,
      cache_size=cache, eos_ids=template.eos_ids)])
  spec = lambda dec: loop_step_seconds([dec.generate(target_params, draft_params, prompts,
                                                     max_new_tokens, cache_size=cache)])
  timers = {0: plain, **{g: (lambda d=d: spec(d)) for g, d in decoders.items()}}
  for timer in timers.values():
    timer()  # compile and warm
  best = {g: float("inf") for g in timers}
  for _ in range(rounds):
    for g, timer in timers.items():
      best[g] = min(best[g], timer())
  return monotone_costs(gammas, [1.0 if g == 0 else best[g] / best[0] for g in gammas])


def loop_step_seconds(outs: Sequence[Any]) -> float:
  """Seconds per fused-loop step, prefill excluded, pooled over calls (``generate`` or
  ``SpeculativeDecoder.generate`` outputs): Σ (seconds − prefill_seconds) / Σ steps."""
  return (sum(o.seconds - o.prefill_seconds for o in outs)
          / max(sum(o.steps for o in outs), 1))


def monotone_costs(gammas: Sequence[int], costs: Sequence[float]) -> tuple[float, ...]:
  """Costs made non-decreasing in γ and at least 1: a step of γ + 1 does all the work of a
  step of γ and more, so a measured dip is timing noise. Adjacent violators are pooled
  (their mean replaces them, the least-squares monotone fit), in the order of ``gammas``.

  Example: γ = (0, 1, 2, 3) measured (1.0, 1.05, 0.99, 1.08) gives (1.0, 1.025, 1.025, 1.08).
  """
  order = sorted(range(len(gammas)), key=lambda i: gammas[i])
  blocks: list[list[float]] = []  # [sum, count] of pooled runs, in γ order
  for i in order:
    blocks.append([max(float(costs[i]), 1.0), 1.0])
    while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
      total, count = blocks.pop()
      blocks[-1][0] += total
      blocks[-1][1] += count
  fitted = [total / count for total, count in blocks for _ in range(int(count))]
  out = [0.0] * len(gammas)
  for rank, i in enumerate(order):
    out[i] = 1.0 if gammas[i] == 0 else fitted[rank]
  return tuple(out)


def calibrate(template: SpeculativeDecoder, target_params: Params, draft_params: Any,
              prompts: Sequence[Sequence[int]], gammas: Sequence[int] = (0, 1, 2, 3, 4),
              max_new_tokens: int = 64, rounds: int = 2, **policy_kwargs) -> AdaptiveGamma:
  """An ``AdaptiveGamma`` over ``gammas`` with step costs measured on ``prompts``
  (``measure_step_costs``); ``policy_kwargs`` go to ``AdaptiveGamma``."""
  costs = measure_step_costs(template, target_params, draft_params, prompts, gammas,
                             max_new_tokens, rounds)
  return AdaptiveGamma(gammas=tuple(gammas), step_costs=costs, **policy_kwargs)
