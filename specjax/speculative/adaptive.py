"""Adaptive draft length: each step picks γ from a static set, inside the jitted loop.

The best fixed γ depends on the acceptance rate α, which varies by prompt and
along a generation, and on what a step costs on this machine at this batch
size, which grows with γ (and grows faster at large batches, where a verify
forward is compute-bound). ``AdaptiveGamma`` holds a small static set of draft
lengths with the measured cost of a step at each, relative to one plain
decoding step, and chooses per step the γ of the highest expected speedup

    score(γ) = E[tokens | α̂, γ] / cost(γ),   E = 1 + α̂ + … + α̂^γ

(the calibrated formula of ``theory``; γ = 0 is plain decoding: one token at
cost 1). α̂ is a running per-row estimate: discounted counts of accepted drafts
(successes) and of steps that stopped short of γ (failures), with a prior of
``prior_weight`` pseudo-steps at ``prior_alpha``. While plain decoding is
chosen the counts only decay, so α̂ drifts back to the prior and a draft is
tried again: the policy keeps exploring at a cost of one short step every
few dozen.

The decoder (``SpeculativeDecoder(policy=...)``) runs each choice's steps in
an inner while loop of its own, inside the one jitted loop: no recompilation
and no host round trip. The choice depends only on steps already taken, never
on the draft or the target's scores of the step it sizes, so every step is an
ordinary lossless step: greedy output equals plain decoding and sampled
output is distributed as the target's (``tests/test_adaptive.py`` pins both,
and rejects a policy that chooses after seeing the verification).

Example (costs measured by ``calibration.measure_step_costs`` at batch 1)::

    policy = AdaptiveGamma(gammas=(0, 1, 2, 4), step_costs=(1.0, 1.15, 1.27, 1.52))
    dec = SpeculativeDecoder(cfg, drafter, policy=policy)
    # α̂ = 0.7: E = 1, 1.7, 2.19, 2.77 → scores 1, 1.48, 1.72, 1.82: γ = 4.
    # α̂ = 0.3: scores 1, 1.13, 1.09, 0.94: γ = 1.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.theory import VerifyCost, VerifyCostCurve


@flax.struct.dataclass(kw_only=True)
class PolicyState:
  """The policy's running estimates.

  Attributes:
    successes: [B] discounted count of accepted drafts.
    failures: [B] discounted count of steps that rejected a draft (stopped before γ).
  """

  successes: jax.Array
  failures: jax.Array


@dataclasses.dataclass(frozen=True)
class AdaptiveGamma:
  """Chooses each step's draft length from ``gammas`` by expected speedup.

  Attributes:
    gammas: the draft lengths it may choose (distinct integers >= 0, at least one
      >= 1; 0 is a plain decoding step, which needs a drafter that
      ``tolerates_skipped_steps``). Stored sorted.
    step_costs: the time of a step at each γ over one plain decoding step's,
      measured on this machine at this batch size (``calibration``), in the order of
      ``gammas``; γ = 0 costs 1 by definition.
    prior_alpha: α the estimate starts from and returns to while plain decoding runs.
    prior_weight: how many steps' worth of evidence the prior counts as (> 0).
    decay: the weight each step's evidence keeps per later step, in (0, 1]; memory
      of about 1 / (1 − decay) steps.
  """

  gammas: tuple[int, ...]
  step_costs: tuple[float, ...]
  prior_alpha: float = 0.5
  prior_weight: float = 1.0
  decay: float = 0.9

  def __post_init__(self):
    gammas = tuple(self.gammas)
    costs = tuple(self.step_costs)
    if not gammas or not all(isinstance(g, (int, np.integer)) and not isinstance(g, bool)
                             for g in gammas):
      raise ValueError(f"gammas must be a non-empty sequence of integers, got {self.gammas!r}")
    if min(gammas) < 0 or len(set(gammas)) != len(gammas) or max(gammas) < 1:
      raise ValueError(f"gammas must be distinct, >= 0 and include a draft length >= 1, "
                       f"got {gammas}")
    if len(costs) != len(gammas):
      raise ValueError(f"{len(costs)} step_costs for {len(gammas)} gammas {gammas}")
    if not all(isinstance(c, (int, float, np.floating, np.integer)) and math.isfinite(c)
               and c > 0 for c in costs):
      raise ValueError(f"step_costs must be finite and > 0, got {costs}")
    order = sorted(range(len(gammas)), key=lambda i: gammas[i])
    gammas = tuple(int(gammas[i]) for i in order)
    costs = tuple(float(costs[i]) for i in order)
    if gammas[0] == 0 and costs[0] != 1.0:
      raise ValueError(f"a plain decoding step (γ = 0) costs 1 by definition, got {costs[0]}: "
                       "give every cost relative to one plain step")
    if not 0.0 < self.prior_alpha < 1.0:
      raise ValueError(f"prior_alpha must be in (0, 1), got {self.prior_alpha}")
    if not (math.isfinite(self.prior_weight) and self.prior_weight > 0):
      raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
    if not 0.0 < self.decay <= 1.0:
      raise ValueError(f"decay must be in (0, 1], got {self.decay}")
    object.__setattr__(self, "gammas", gammas)
    object.__setattr__(self, "step_costs", costs)

  @classmethod
  def from_theory(cls, gammas: Sequence[int], draft_cost: float, verify_cost: VerifyCost,
                  **kwargs) -> "AdaptiveGamma":
    """Step costs from the calibrated formula: γc + T(γ + 1) (1 for γ = 0), with ``c`` the
    draft's cost per token and ``verify_cost`` a ``VerifyCostCurve`` or its points."""
    curve = verify_cost if callable(verify_cost) else VerifyCostCurve(verify_cost)
    if not (math.isfinite(draft_cost) and draft_cost >= 0):
      raise ValueError(f"draft_cost must be a finite number >= 0, got {draft_cost}")
    costs = tuple(1.0 if g == 0 else g * draft_cost + float(curve(g + 1)) for g in gammas)
    return cls(gammas=tuple(gammas), step_costs=costs, **kwargs)

  @property
  def max_gamma(self) -> int:
    return self.gammas[-1]

  @property
  def plain(self) -> bool:
    """Whether plain decoding (γ = 0) is one of the choices."""
    return self.gammas[0] == 0

  def init(self, batch_size: int) -> PolicyState:
    z = lambda: jnp.zeros((batch_size,), jnp.float32)  # two buffers: the state is donated
    return PolicyState(successes=z(), failures=z())

  def alpha(self, state: PolicyState) -> jax.Array:
    """[B] the running acceptance estimate."""
    w = self.prior_weight
    return (state.successes + w * self.prior_alpha) / (state.successes + state.failures + w)

  def scores(self, state: PolicyState, active: jax.Array) -> jax.Array:
    """[K] expected tokens per step over step cost, per γ, averaged over active rows."""
    a = self.alpha(state)[:, None]  # [B, 1]
    powers = a ** jnp.arange(self.max_gamma + 1, dtype=jnp.float32)[None, :]  # [B, Γ + 1]
    expected = jnp.cumsum(powers, axis=1)[:, jnp.asarray(self.gammas)]  # [B, K]
    weight = active.astype(jnp.float32)[:, None]
    mean = jnp.sum(expected * weight, axis=0) / jnp.maximum(jnp.sum(weight), 1.0)
    return mean / jnp.asarray(self.step_costs, jnp.float32)

  def choose(self, state: PolicyState, active: jax.Array) -> jax.Array:
    """The index (into ``gammas``) of this step's draft length: int32 scalar."""
    return jnp.argmax(self.scores(state, active)).astype(jnp.int32)

  def observe(self, state: PolicyState, index: jax.Array, num_accepted: jax.Array,
              active: jax.Array) -> PolicyState:
    """Folds in a step at ``gammas[index]`` that accepted ``num_accepted`` [B] drafts per row
    (rows not ``active`` keep their counts)."""
    gamma = jnp.asarray(self.gammas, jnp.int32)[index]
    rejected = (num_accepted < gamma).astype(jnp.float32)
    s = self.decay * state.successes + num_accepted.astype(jnp.float32)
    f = self.decay * state.failures + rejected
    return PolicyState(successes=jnp.where(active, s, state.successes),
                       failures=jnp.where(active, f, state.failures))
