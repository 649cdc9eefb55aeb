"""Measures what a step costs on this machine, and how a drafter's trees are accepted, to
build an ``AdaptiveGamma`` from.

The policy needs the time of a speculative step at each draft length (and tree)
over one plain decoding step, at the batch size it will serve: on CPU a verify
forward of γ + 1 tokens costs 1.0–1.6 plain steps at batch 1 and more at large
batches, where the forward is compute-bound; on a GPU it stays near 1 far
longer. So the costs are measured, not assumed: ``measure_step_costs`` times
plain decoding and a fixed chain of each γ (and each tree) on the same prompts,
decode loop only (prefill excluded), interleaved, keeps each setting's fastest
round, and pools measured dips (``monotone_costs``): a longer chain never costs
less. A policy with trees also needs the drafter's per-depth, per-rank
acceptance (``measure_rank_accept``: decoding with a full tree and reading its
counters) and the chains' rate on the same prompts (``measure_chain_alpha``), which
ties the two kinds' prices together. How that rate varies by prompt
(``measure_chain_alphas``) prices a batch's steps for the row the batch waits on.

Example::

    template = SpeculativeDecoder(cfg, drafter, sampler=sampler)
    policy = calibrate(template, params, draft_params, prompts, gammas=(0, 1, 2, 3, 4))
    out = template.with_policy(policy).generate(params, draft_params, prompts, 128)
    # Chains and a 4-node EAGLE-2 tree, priced by the measured acceptance table:
    policy = calibrate(template, params, draft_params, prompts, gammas=(0, 1, 2),
                       trees=(DynamicTree(top_k=4, depth=4, num_nodes=4),))
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from specjax.generate import generate
from specjax.model import Params
from specjax.speculative.adaptive import AdaptiveGamma, Tree, check_evidence
from specjax.speculative.decoder import SpeculativeDecoder
from specjax.speculative.tree import TreeTopology
from specjax.speculative.tree_builders import (estimate_rank_accept, full_tree,
                                               full_tree_counts)


def measure_step_costs(template: SpeculativeDecoder, target_params: Params, draft_params: Any,
                       prompts: Sequence[Sequence[int]], gammas: Sequence[int],
                       max_new_tokens: int = 64, rounds: int = 2,
                       trees: Sequence[Tree] = ()) -> tuple[float, ...]:
  """Time of a step at each γ, then at each tree, over one plain decoding step's (1.0 for
  γ = 0; never below 1, and non-decreasing in γ).

  Args:
    template: a decoder with the drafter, sampler, EOS ids, attention and verification
      to measure (its own gamma, tree and policy are ignored).
    target_params, draft_params: the models.
    prompts: the batch to time (its size is the batch size the costs hold for).
    gammas: draft lengths, >= 0.
    max_new_tokens: tokens per timed call (the first call of each setting compiles and
      is not timed).
    rounds: timed calls per setting, interleaved; the fastest per-step time is kept.
    trees: token trees (``TreeTopology`` or ``DynamicTree``) to time as well.
  """
  if rounds < 1 or max_new_tokens < 1:
    raise ValueError(f"rounds and max_new_tokens must be >= 1, got {rounds}, {max_new_tokens}")
  gammas, trees = tuple(gammas), tuple(trees)
  if not gammas or any(isinstance(g, bool) or int(g) != g or g < 0 for g in gammas):
    raise ValueError(f"gammas must be integers >= 0, got {gammas}")
  decoders = {g: dataclasses.replace(template, policy=None, tree=None, gamma=g)
              for g in gammas if g > 0}
  decoders.update({t: _tree_decoder(template, t) for t in trees})
  headroom = max([d.cache_headroom for d in decoders.values()], default=0)
  cache = len(max(prompts, key=len)) + max_new_tokens + headroom + 1

  plain = lambda: loop_step_seconds([generate(
      target_params, template.target_cfg, prompts, max_new_tokens, template.sampler,
      cache_size=cache, eos_ids=template.eos_ids)])
  spec = lambda dec: loop_step_seconds([dec.generate(target_params, draft_params, prompts,
                                                     max_new_tokens, cache_size=cache)])
  timers = {0: plain, **{k: (lambda d=d: spec(d)) for k, d in decoders.items()}}
  for timer in timers.values():
    timer()  # compile and warm
  best = {k: float("inf") for k in timers}
  for _ in range(rounds):
    for k, timer in timers.items():
      best[k] = min(best[k], timer())
  chains = monotone_costs(gammas, [1.0 if g == 0 else best[g] / best[0] for g in gammas])
  return chains + tuple(max(best[t] / best[0], 1.0) for t in trees)


def measure_rank_accept(template: SpeculativeDecoder, target_params: Params,
                        draft_params: Any, prompts: Sequence[Sequence[int]],
                        branching: Optional[Sequence[int]] = None, max_new_tokens: int = 64,
                        seed: int = 0, cache_size: Optional[int] = None) -> dict[str, Any]:
  """The drafter's per-depth, per-rank acceptance (``tree_builders``' ``rank_accept``).

  Decodes each prompt alone with ``full_tree(branching)`` (every node at depth d − 1 has
  ``branching[d − 1]`` children, so each rank is offered whenever its parent is accepted;
  default ``default_branching(4)``) and counts which rank was accepted at each depth
  (``decode_alone``). Use prompts other than the ones the table will be judged on.

  Returns:
    dict(table=[D, K] rates, accepted=[D, K] counts, offered=[D, K] counts,
    branching=the tree's branching, prompts=how many were decoded).
  """
  branching = tuple(int(b) for b in (branching or default_branching(4)))
  # The table feeds tree_theory's model of recursive rejection, so it counts that rule's
  # outcomes; where the template verifies blocks, its trees are traversed, which kept as
  # many tokens or more on every tree measured (benchmarks/results/traversal_verification.md).
  rule = "tokenwise" if template.verification == "block" else template.verification
  full = _tree_decoder(dataclasses.replace(template, verification=rule), full_tree(branching))
  counts = decode_alone(full, target_params,
                        draft_params, prompts, max_new_tokens, seed, cache_size,
                        ("accepted_rank", "accept_len_hist"))
  accepted, offered = full_tree_counts(branching, counts["accepted_rank"],
                                       counts["accept_len_hist"])
  return dict(table=estimate_rank_accept(accepted, offered), accepted=accepted,
              offered=offered, branching=branching, prompts=len(prompts))


def measure_chain_alphas(template: SpeculativeDecoder, target_params: Params,
                         draft_params: Any, prompts: Sequence[Sequence[int]], gamma: int = 4,
                         max_new_tokens: int = 64, seed: int = 0,
                         cache_size: Optional[int] = None,
                         evidence: str = "expected") -> tuple[float, tuple[float, ...]]:
  """(α_c, ease): the chains' acceptance rate as ``AdaptiveGamma`` counts it, decoding each
  prompt alone with a chain of ``gamma``, the template's sampler and its verification (the
  chains' own draw and rule, as a policy verifies its chains; ``decode_each``), pooled over
  the prompts and clipped to [0.01, 0.99] (the policy needs a rate strictly inside (0, 1));
  and each prompt's own rate over α_c (``AdaptiveGamma.prompt_ease``). A policy with trees
  takes α_c as ``prior_alpha``, measured on the prompts its ``rank_accept`` table was.

  The rate is successes over successes plus failures, counted as the policy of that
  ``evidence`` (``AdaptiveGamma.evidence``) counts them: drafts accepted and steps that
  stopped before γ; or, under "expected", sampled drafts' βs each weighted by its
  position's chance of being scored given the drafts, over those chances (point-mass drafts,
  verified by recursive rejection: Σβ over the positions scored, over their number): the
  same expectation, less noise. A prompt with no β (a greedy target) counts outcomes."""
  if isinstance(gamma, bool) or int(gamma) != gamma or gamma < 1:
    raise ValueError(f"gamma must be an integer >= 1, got {gamma}")
  check_evidence(evidence)  # before anything decodes
  counts = decode_each(chain_decoder(template, int(gamma)), target_params, draft_params,
                       prompts, max_new_tokens, seed, cache_size, CHAIN_COUNTERS)
  return chain_alphas(counts, evidence)


def chain_decoder(template: SpeculativeDecoder, gamma: int) -> SpeculativeDecoder:
  """The decoder ``measure_chain_alphas`` measures with: ``template`` on a chain of ``gamma``
  (one compiled program for every prompt and seed), verified as ``template`` verifies (block
  verification is defined for chains, and a chains-only policy verifies its chains so)."""
  return dataclasses.replace(template, policy=None, gamma=None, tree=TreeTopology.chain(gamma))


CHAIN_COUNTERS = ("accept_len_hist", "weighted_beta_sum", "weighted_count", "lead_beta_sum",
                  "lead_beta_count")  # what ``chain_alphas`` reads


def chain_alphas(counts: dict[str, np.ndarray],
                 evidence: str = "expected") -> tuple[float, tuple[float, ...]]:
  """``measure_chain_alphas``' (α_c, ease) from its decodes' per-prompt counters
  (``decode_each`` of ``CHAIN_COUNTERS`` with ``chain_decoder(template, γ)``) counted for
  ``evidence``: one decode serves every evidence."""
  check_evidence(evidence)
  hists = counts["accept_len_hist"]  # [prompts, γ + 1]
  gamma = hists.shape[1] - 1
  successes = (hists @ np.arange(gamma + 1)).astype(np.float64)
  failures = hists[:, :gamma].sum(axis=1).astype(np.float64)
  if evidence == "expected":  # as the policy weighs (``AdaptiveGamma.evidence``): sampled
    # drafts' weighted βs under either rule, or point-mass drafts' under recursive rejection
    beta = (counts["weighted_beta_sum"] + counts["lead_beta_sum"]).astype(np.float64)
    scored = (counts["weighted_count"] + counts["lead_beta_count"]).astype(np.float64)
    weighed = scored > 0
    successes = np.where(weighed, beta, successes)
    failures = np.where(weighed, scored - beta, failures)
  rate = lambda s, f: float(s / max(s + f, 1.0))
  alpha = float(np.clip(rate(successes.sum(), failures.sum()), 0.01, 0.99))
  return alpha, tuple(rate(s, f) / alpha for s, f in zip(successes, failures))


def measure_chain_alpha(template: SpeculativeDecoder, target_params: Params,
                        draft_params: Any, prompts: Sequence[Sequence[int]], gamma: int = 4,
                        max_new_tokens: int = 64, seed: int = 0,
                        cache_size: Optional[int] = None, evidence: str = "expected") -> float:
  """α_c alone (``measure_chain_alphas``)."""
  return measure_chain_alphas(template, target_params, draft_params, prompts, gamma,
                              max_new_tokens, seed, cache_size, evidence)[0]


def decode_each(dec: SpeculativeDecoder, target_params: Params, draft_params: Any,
                prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int,
                cache_size: Optional[int], counters: Sequence[str]) -> dict[str, np.ndarray]:
  """Decodes each prompt alone (the i-th with ``seed + i``): the named per-row counters,
  stacked [prompts, ...]. Every prompt runs in one buffer length (``cache_size``, by
  default the one ``dec.pack`` gives them all together), so one compiled loop serves them
  all."""
  size = dec.pack(target_params, draft_params, prompts, max_new_tokens, cache_size)[0].shape[1]
  outs = [dec.generate(target_params, draft_params, [p], max_new_tokens, seed=seed + i,
                       cache_size=size) for i, p in enumerate(prompts)]
  return {k: np.stack([np.asarray(o.per_row[k][0]) for o in outs]) for k in counters}


def decode_alone(dec: SpeculativeDecoder, target_params: Params, draft_params: Any,
                 prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int,
                 cache_size: Optional[int], counters: Sequence[str]) -> dict[str, np.ndarray]:
  """``decode_each``'s counters summed over the prompts."""
  return {k: v.sum(axis=0) for k, v in decode_each(dec, target_params, draft_params, prompts,
                                                     max_new_tokens, seed, cache_size,
                                                     counters).items()}


def measure_tree_prices(template: SpeculativeDecoder, target_params: Params, draft_params: Any,
                        prompts: Sequence[Sequence[int]],
                        branching: Optional[Sequence[int]] = None, max_new_tokens: int = 64,
                        seed: int = 0, cache_size: Optional[int] = None,
                        evidence: str = "expected") -> dict[str, Any]:
  """What a policy with trees is priced by, on the same prompts: ``measure_rank_accept``'s
  dict (the table and its counts) with ``chain_alpha`` and ``prompt_ease``, the chains'
  rate from a chain as deep as the full tree and how it varies by prompt
  (``measure_chain_alphas``, counted as a policy of that ``evidence`` counts, verified as
  the template verifies)."""
  out = measure_rank_accept(template, target_params, draft_params, prompts, branching,
                            max_new_tokens, seed, cache_size)
  out["chain_alpha"], out["prompt_ease"] = measure_chain_alphas(
      template, target_params, draft_params, prompts, len(out["branching"]),
      max_new_tokens, seed, cache_size, evidence)
  return out


def default_branching(depth: int) -> tuple[int, ...]:
  """The calibration full tree's branching for ``depth`` levels: 6, 3, 2, then 1 per level
  (96 nodes at depth 4, the experiments' default)."""
  return ((6, 3, 2) + (1,) * depth)[:depth]


def _tree_decoder(template: SpeculativeDecoder, tree: Tree) -> SpeculativeDecoder:
  """``template`` on a fixed tree (validated against its drafter), verified as the template
  verifies (block: by traversal verification)."""
  return dataclasses.replace(template, policy=None, gamma=None, tree=tree)


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
              max_new_tokens: int = 64, rounds: int = 2, trees: Sequence[Tree] = (),
              rank_accept=None, **policy_kwargs) -> AdaptiveGamma:
  """An ``AdaptiveGamma`` over ``gammas`` and ``trees`` with step costs measured on
  ``prompts`` (``measure_step_costs``). With trees and no ``rank_accept``, the table is
  measured on the same prompts, one at a time, with a full tree as deep as the deepest
  tree (``measure_rank_accept``, with the template's sampler: the trees' own draw); with
  trees and no ``prior_alpha``, the chains' rate is measured there too
  (``measure_chain_alphas``, counted as the policy's ``evidence`` counts, its chains
  verified as the template verifies); with more than
  one prompt and no ``prompt_ease``, how the chains' rate varies over them is measured too
  (the policy then prices a batch's steps for the row it waits on), and that rate, which
  the spread is relative to, becomes the prior unless ``prior_alpha`` is given.
  ``policy_kwargs`` go to ``AdaptiveGamma``."""
  trees = tuple(trees)
  costs = measure_step_costs(template, target_params, draft_params, prompts, gammas,
                             max_new_tokens, rounds, trees)
  depth = max(t.max_depth for t in trees) if trees else max(int(g) for g in gammas)
  if trees and rank_accept is None:
    rank_accept = measure_rank_accept(template, target_params, draft_params, prompts,
                                      default_branching(depth), max_new_tokens)["table"]
  need_alpha = bool(trees) and "prior_alpha" not in policy_kwargs
  # (no chain to measure by: AdaptiveGamma refuses such a set below)
  need_ease = len(prompts) > 1 and depth >= 1 and "prompt_ease" not in policy_kwargs
  if need_alpha or need_ease:
    alpha, ease = measure_chain_alphas(template, target_params, draft_params, prompts, depth,
                                       max_new_tokens,
                                       evidence=policy_kwargs.get("evidence", "expected"))
    policy_kwargs.setdefault("prior_alpha", alpha)
    if need_ease:
      policy_kwargs["prompt_ease"] = ease
  return AdaptiveGamma(gammas=tuple(gammas), step_costs=costs[:len(gammas)], trees=trees,
                       tree_costs=costs[len(gammas):], rank_accept=rank_accept,
                       **policy_kwargs)
