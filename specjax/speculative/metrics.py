"""Acceptance metrics of a speculative generation, per row and per call.

Conventions:
  * α (``alpha``) is the paper's E[β], β = Σₓ min(p(x), q(x)), averaged over
    draft positions up to and including the first rejection of each step;
    defined for chains of sampled drafts only (NaN for trees and point-mass drafts).
  * ``acceptance_rate`` is accepted drafts / proposed drafts (γ per step for a
    chain, the N nodes for a tree, of which at most D can be accepted).
  * ``depth_hist[γ]`` counts steps that verified a draft of depth γ (an adaptive
    policy's mix; 0 = plain decoding steps, which ``accept_len_hist`` leaves out);
  * ``accepted_at[d]`` counts steps that accepted a node at depth d + 1 and
    ``accepted_rank[d, r]`` those whose accepted depth-(d + 1) node had sibling
    rank r: the per-depth, per-rank acceptance of ``tree_builders``.
  * ``choice_steps[k]`` counts the steps of an adaptive policy's choice k (the sorted
    gammas, then the trees) and ``choice_estimate[k]`` the mean running acceptance
    estimate on which the policy chose it (empty without a policy);
  * ``tokens_per_call`` counts every emitted token, including the corrected or
    bonus token drawn from the target, per target forward: it estimates the
    paper's E[#tokens per iteration] = (1 − α^{γ+1}) / (1 − α) (before EOS or
    budget trimming).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from specjax.sharding import to_host


@dataclasses.dataclass
class SpecResult:
  """Tokens and metrics of ``SpeculativeDecoder.generate``.

  Attributes:
    tokens: [B, S] prompt + output.
    prompt_lens, seq_lens: [B].
    steps: speculative steps (= target verify forwards) of the batch.
    seconds: wall time of the call.
    gamma: the draft length (a tree's depth D).
    per_row: dict of [B] / [B, γ(+1)] arrays (see ``SpecCounters``).
    timing: seconds in draft / verify / other, when generated with ``profile=True``.
    prefill_seconds: the part of ``seconds`` until both models were prefilled
      (the fused loop only; None with ``profile=True``).
  """

  tokens: np.ndarray
  prompt_lens: np.ndarray
  seq_lens: np.ndarray
  steps: int
  seconds: float
  gamma: int
  per_row: dict[str, np.ndarray]
  timing: Optional[dict[str, float]] = None
  prefill_seconds: Optional[float] = None

  def generated(self, row: int) -> list[int]:
    return self.tokens[row, self.prompt_lens[row]:self.seq_lens[row]].tolist()

  @property
  def num_generated(self) -> np.ndarray:
    return self.seq_lens - self.prompt_lens

  def row_metrics(self, row: int) -> dict[str, float]:
    return _rates({k: v[row] for k, v in self.per_row.items()})

  def metrics(self) -> dict[str, Any]:
    """Totals over the batch, plus timing."""
    total = _rates({k: v.sum(axis=0) for k, v in self.per_row.items()})
    total.update(steps=self.steps, seconds=self.seconds,
                 tokens_per_second=float(self.num_generated.sum()) / max(self.seconds, 1e-9))
    if self.timing is not None:
      total.update({f"{k}_seconds": v for k, v in self.timing.items()})
    if self.prefill_seconds is not None:
      total.update(prefill_seconds=self.prefill_seconds)
    return total


def _rates(c: dict[str, np.ndarray]) -> dict[str, Any]:
  div = lambda a, b: float(a) / float(b) if b else float("nan")
  return {
      "tokens": int(c["emitted"]), "target_calls": int(c["target_calls"]),
      "drafted": int(c["drafted"]), "accepted": int(c["accepted"]),
      "alpha": div(c["beta_sum"], c["beta_count"]),
      "acceptance_rate": div(c["accepted"], c["drafted"]),
      "tokens_per_call": div(c["emitted"], c["target_calls"]),
      "accepted_at": np.asarray(c["accepted_at"]).tolist(),
      "accept_len_hist": np.asarray(c["accept_len_hist"]).tolist(),
      "depth_hist": np.asarray(c["depth_hist"]).tolist(),
      "choice_steps": np.asarray(c["choice_steps"]).tolist(),
      "choice_estimate": mean_estimates(c["choice_estimate"], c["choice_steps"]),
  }


def mean_estimates(estimate_sum, steps) -> list[Optional[float]]:
  """The mean running estimate behind each adaptive choice (None for one never taken)."""
  return [float(e) / float(n) if n else None for e, n in zip(np.asarray(estimate_sum),
                                                            np.asarray(steps))]


def counters_to_host(counters) -> dict[str, np.ndarray]:
  """A ``SpecCounters``' fields as host arrays, by name (a result's ``per_row``)."""
  return {f.name: to_host(getattr(counters, f.name)) for f in dataclasses.fields(counters)}


def summarize(state, prompt_lens: np.ndarray, gamma: int, seconds: float) -> SpecResult:
  counters = counters_to_host(state.counters)
  return SpecResult(tokens=to_host(state.tokens), prompt_lens=np.asarray(prompt_lens),
                    seq_lens=to_host(state.seq_lens), steps=int(state.steps), seconds=seconds,
                    gamma=gamma, per_row=counters)
