"""Table rows: acceptance statistics, measured and predicted speedups for one setting.

Conventions (those of ``specjax.speculative.metrics``):
  * α = E[β], β = Σₓ min(p, q), over draft positions up to and including the
    first rejection of each step;
  * acceptance rate = accepted drafts / drafted (γ per step);
  * tokens per call = emitted tokens / target calls, counting the corrected
    or bonus token; emitted = accepted + calls − tokens cut at the budget;
  * measured speedup = the median over interleaved rounds of plain-decoding
    seconds / speculative seconds on the same batches, both warm; its spread
    is (max − min) / median over the rounds, and ``flags`` lists what
    ``checks.setting_flags`` found;
  * decode-only speedup = the same median with each call's prefill taken out
    (plain / speculative decode-loop seconds), and ``ar_prefill_share`` the
    share of plain decoding's wall time spent in its prefill: the measured
    speedup lies between the decode-only one and the prefill ratio (plain /
    speculative prefill seconds, below 1 where the draft has its own
    prefill), closer to the latter the larger that share;
  * predicted = ``walltime_improvement(α, γ, c)`` (paper Thm 3.8) and
    calibrated = ``calibrated_walltime_improvement`` with the measured verify
    cost and E[tokens] taken for batches that wait for their slowest row
    (``theory.batched_expected_tokens`` at each row's own α; at batch 1 within
    0.3% of E at the pooled α in the committed runs), where c = draft seconds
    per draft token / t₁ (``Bench.draft_cost``) and verify cost T(γ+1)/T(1)
    = the rest of the measured fused step, step/t₁ − γc (target forward over
    γ+1 tokens, acceptance, bookkeeping);
    step times are medians over the rounds, t₁ from the same rounds;
  * calibrated, whole call = ``theory.whole_call_improvement``: the calibrated
    prediction of the decode loop combined with the prefill as measured (plain
    decoding's prefill share and the prefill ratio, medians over the rounds), what
    the measured speedup, prefill included, is to be compared with.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from specjax import theory
from specjax.speculative.metrics import mean_estimates

from experiments import checks
from experiments.config import DYNAMIC, SAMPLED
from experiments.measure import (ADAPTIVE, SpecRun, costs, median_known, own_tree_costs,
                                 as_tuple, policy_of, round_decode_speedups,
                                 round_prefill_ratios, round_prefill_shares, round_speedups,
                                 run_flags, same_length_seconds, setting_evidence)
from experiments.prompts import ALL, Batch, batch_indices



def row_mask(batch: Batch, category: str) -> np.ndarray:
  return np.array([category in (ALL, c) for c in batch.row_categories], bool)


def sum_counters(run: SpecRun, batches: Sequence[Batch], category: str) -> dict[str, np.ndarray]:
  return {k: sum(run.counters[i][k][row_mask(b, category)].sum(axis=0)
                 for i, b in enumerate(batches)) for k in run.counters[0]}


def _div(a, b) -> float:
  return float(a) / float(b) if b else float("nan")


def _finite(x: Optional[float]) -> Optional[float]:
  return None if x is None or not np.isfinite(x) else float(x)


# Experiments that measure each draft on the shape it brings (``sweeps.own_setting``).
OWN_SHAPE_EXPERIMENTS = ("drafts_alpha", "draft_free")


def _per_row(run: SpecRun, batches: Sequence[Batch], category: str, numerator: str,
             denominator: str) -> list[np.ndarray]:
  """Per batch of ``category``, its rows' counter ratio (rows whose denominator is 0 are
  left out; a batch where every row's is: [0])."""
  out = []
  for i in batch_indices(batches, category):
    mask = row_mask(batches[i], category)
    num, den = (np.asarray(run.counters[i][k], np.float64)[mask] for k in (numerator, denominator))
    out.append(num[den > 0] / den[den > 0] if (den > 0).any() else np.zeros(1))
  return out


def slowest_row_tokens(run: SpecRun, batches: Sequence[Batch], category: str) -> float:
  """``theory.batched_expected_tokens`` at the rows' own α (a batch where no row drafted made
  one token a step: α = 0)."""
  alphas = _per_row(run, batches, category, "beta_sum", "beta_count")
  return theory.batched_expected_tokens([np.minimum(a, 1.0) for a in alphas], run.gamma)


def shape_name(tree, gamma: int) -> str:
  """"chain", "best tree" (static parents), "dynamic k=4" (EAGLE-2), "sampled w=3,3,2"
  (sampled dynamic) or "adaptive"."""
  if tree is None:
    return "chain"
  if tree[0] == ADAPTIVE:
    return "adaptive"
  if tree[0] == SAMPLED:
    return "sampled w=" + ",".join(map(str, tree[1:]))
  return f"dynamic k={tree[1]}" if tree[0] == DYNAMIC else "best tree"


def _min_gain(tree) -> Optional[float]:
  """An adaptive setting's policy's ``min_gain`` (what it ran with); None for other settings."""
  policy = policy_of(None if tree is None else as_tuple(tree))
  return None if policy is None else policy.min_gain


def make_row(experiment: str, run: SpecRun, batches: Sequence[Batch],
             category: str = ALL) -> dict[str, Any]:
  """One table row; an untimed run leaves the timing columns empty."""
  sel = batch_indices(batches, category)
  c = sum_counters(run, batches, category)
  alpha = _div(c["beta_sum"], c["beta_count"])
  g = run.gamma
  row = dict(
      experiment=experiment, draft=run.draft, gamma=g, temperature=run.temperature,
      tree=None if run.tree is None else list(run.tree), num_nodes=run.num_nodes,
      shape=("own tree" if run.tree is not None and experiment in OWN_SHAPE_EXPERIMENTS
             else shape_name(run.tree, g)),
      category=category, prompts=int(sum(row_mask(batches[i], category).sum() for i in sel)),
      alpha=_finite(alpha), acceptance_rate=_finite(_div(c["accepted"], c["drafted"])),
      tokens_per_call=_finite(_div(c["emitted"], c["target_calls"])),
      expected_tokens_per_call=(_finite(theory.expected_tokens_per_step(min(alpha, 1.0), g))
                                if np.isfinite(alpha) else None),
      target_calls=int(c["target_calls"]), drafted=int(c["drafted"]),
      accepted=int(c["accepted"]), emitted=int(c["emitted"]),
      generated_tokens=int(sum(len(t) for i in sel
                               for t, m in zip(run.generated[i], row_mask(batches[i], category))
                               if m)),
      steps=int(sum(run.steps[i] for i in sel)),
      accept_len_hist=[int(x) for x in c["accept_len_hist"]],
      depth_hist=[int(x) for x in c["depth_hist"]] if "depth_hist" in c else None,
      choice_steps=[int(x) for x in c["choice_steps"]] if "choice_steps" in c else None,
      choice_estimate=(mean_estimates(c["choice_estimate"], c["choice_steps"])
                       if "choice_estimate" in c else None),
      spec_seconds=None, ar_seconds=None, speedup=None, speedup_spread=None, rounds=None,
      decode_speedup=None, ar_prefill_share=None, prefill_ratio=None,
      step_seconds=None, c=None, verify_cost=None, predicted_speedup=None,
      calibrated_speedup=None, calibrated_call_speedup=None, greedy_match=None, flags=[],
      remeasured=bool(run.first_flags),
      c_remeasured=bool(run.costs and run.costs.get("first_draft_spread") is not None),
      replayed=run.replayed, min_gain=_min_gain(run.tree),
      evidence=setting_evidence(None if run.tree is None else as_tuple(run.tree)))
  if not run.timed:
    return row
  ratios = round_speedups(run, sel)
  decode = round_decode_speedups(run, sel)
  ar_seconds = checks.round_sums(run.plain_seconds, sel)
  if decode is not None:
    row.update(decode_speedup=float(np.median(decode)),
               ar_prefill_share=float(np.median(round_prefill_shares(run, sel))),
               prefill_ratio=float(np.median(round_prefill_ratios(run, sel))))
  spec_seconds = checks.round_sums(same_length_seconds(run), sel)  # at plain's lengths
  row.update(spec_seconds=float(np.median(spec_seconds)),
             ar_seconds=float(np.median(ar_seconds)),
             speedup=float(np.median(ratios)), speedup_spread=checks.spread(ratios),
             rounds=len(ratios),
             ar_generated_tokens=int(sum(len(t) for i in sel for t in run.plain_generated[i])),
             step_seconds=median_known(run.plain_step_seconds))
  # c and the verify cost are defined from a chain's γ draft forwards; a tree
  # row reports its measured speedup and tokens per call only.
  cc, verify = costs(run) if run.tree is None else (None, None)
  row["flags"] = run_flags(run, sel)
  if cc is not None and row["alpha"] is not None:
    a = min(row["alpha"], 1.0)
    row.update(c=cc, spec_step_seconds=median_known(run.step_seconds),
               predicted_speedup=theory.walltime_improvement(a, g, cc))
    if verify is not None and verify > 0:  # an impossible one is flagged, never printed
      row["verify_cost"] = verify
      # E at the pooled α, replaced by what batches that wait for their slowest row make
      slowest = slowest_row_tokens(run, batches, category)
      row["calibrated_speedup"] = theory.calibrated_walltime_improvement(
          a, g, cc, theory.VerifyCostCurve({1: 1.0, g + 1: verify})) * (
              slowest / theory.expected_tokens_per_step(a, g))
  tree_costs = own_tree_costs(run)
  if tree_costs is not None and row["tokens_per_call"]:
    # A drafter's own tree (no single α): tokens per call (each batch's slowest row's,
    # harmonic over batches) over the step's cost in plain steps, from the phase timings
    # taken on that tree (draft + verify).
    verify_tree, draft_tree = tree_costs
    calls = _per_row(run, batches, category, "emitted", "target_calls")
    row.update(verify_cost=verify_tree, calibrated_speedup=theory.slowest_row_tokens(
        [np.maximum(c, 1.0) for c in calls]) / (verify_tree + draft_tree))
  if row["calibrated_speedup"] is not None and row["prefill_ratio"]:
    row["calibrated_call_speedup"] = theory.whole_call_improvement(
        row["calibrated_speedup"], row["ar_prefill_share"], row["prefill_ratio"])
  if run.temperature == 0:
    same = [run.generated[i][r] == run.plain_generated[i][r]
            for i in sel for r in range(batches[i].num_real)]
    row["greedy_match"] = _div(sum(same), len(same))
  return row


def verify_cost_curve(rows: Sequence[dict], temperature: float) -> dict[int, float]:
  """Measured T -> T(T)/T(1) points at one temperature (T = γ + 1), from all-category rows."""
  pts = {1: 1.0}
  for r in rows:
    if r["category"] == ALL and r["temperature"] == temperature and r["verify_cost"]:
      pts[r["gamma"] + 1] = r["verify_cost"]
  return dict(sorted(pts.items()))
