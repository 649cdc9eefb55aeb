"""The speculative loop's state pytree and its per-row counters."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from specjax import kv_cache as kvc


@flax.struct.dataclass(kw_only=True)
class SpecCounters:
  """Per-row acceptance statistics, accumulated over steps in which the row was active.

  Attributes:
    target_calls: [B] verification forwards (one per step) that served the row.
    drafted: [B] draft tokens proposed (N tree nodes per step; γ for a chain).
    accepted: [B] draft tokens accepted by the rule (before EOS/budget trimming).
    emitted: [B] tokens appended to the output (accepted + corrected/bonus,
      trimmed at EOS and at the budget).
    accepted_at: [B, D] how often a node at depth i + 1 was accepted (for a
      chain, draft position i).
    accept_len_hist: [B, D+1] how often exactly n drafts were accepted.
    depth_hist: [B, D+1] how many steps verified a draft of each depth: all at γ (a
      tree's depth D) for a fixed topology, spread by an adaptive policy, whose
      plain decoding steps count at 0 (and nowhere in ``accept_len_hist``).
    accepted_rank: [B, D, R] how often the accepted node at depth d + 1 was
      its parent's child of rank r (R = the most children a node has); with
      ``accept_len_hist`` this gives the per-depth, per-rank acceptance that
      ``tree_builders`` turns into the best static tree.
    beta_sum: [B] Σ β over scored positions (positions up to the first
      rejection, whose prefix is a target sample — the paper's E[β] protocol).
    beta_count: [B] number of such positions.
    weighted_beta_sum: [B] for sampled chains (either verification rule): Σᵢ wᵢ βᵢ over every
      draft position, wᵢ = Πⱼ<ᵢ min(1, pⱼ(dⱼ)/qⱼ(dⱼ)) the chance token-wise verification
      scores position i given the drafts (``acceptance.scoring_chances``): ``beta_sum``'s
      expectation over the acceptance flips, which have no part in it (what an adaptive
      policy weighs, ``AdaptiveGamma.evidence``).
    weighted_count: [B] Σᵢ wᵢ over the same positions (``beta_count``'s expectation).
    lead_beta_sum: [B] for steps verified by recursive rejection (trees, chains of point-mass
      drafts; sampled, not greedy): Σ β over the first-ranked chain's scored nodes (up to its
      first rejected node or its end), β a node's chance of
      acceptance when its parent is reached (``tree_acceptance.first_chain_beta``).
    lead_beta_count: [B] number of such nodes.
    choice_steps: [B, K] steps of each of an adaptive policy's K choices (its order:
      the sorted gammas, then the trees) that served the row; K = 0 without a policy.
    choice_estimate: [B, K] the sum, over those steps, of the running acceptance estimate
      the policy chose on (the chains' α̂ for a chain or plain step, the trees' for a
      tree): divided by ``choice_steps``, the mean estimate behind each choice.
  """

  target_calls: jax.Array
  drafted: jax.Array
  accepted: jax.Array
  emitted: jax.Array
  accepted_at: jax.Array
  accept_len_hist: jax.Array
  depth_hist: jax.Array
  accepted_rank: jax.Array
  beta_sum: jax.Array
  beta_count: jax.Array
  weighted_beta_sum: jax.Array
  weighted_count: jax.Array
  lead_beta_sum: jax.Array
  lead_beta_count: jax.Array
  choice_steps: jax.Array
  choice_estimate: jax.Array

  @classmethod
  def zeros(cls, batch_size: int, max_depth: int, max_rank: int = 1,
            num_choices: int = 0) -> "SpecCounters":
    z = lambda *s: jnp.zeros(s, jnp.int32)
    return cls(target_calls=z(batch_size), drafted=z(batch_size), accepted=z(batch_size),
               emitted=z(batch_size), accepted_at=z(batch_size, max_depth),
               accept_len_hist=z(batch_size, max_depth + 1),
               depth_hist=z(batch_size, max_depth + 1),
               accepted_rank=z(batch_size, max_depth, max_rank),
               beta_sum=jnp.zeros((batch_size,), jnp.float32), beta_count=z(batch_size),
               weighted_beta_sum=jnp.zeros((batch_size,), jnp.float32),
               weighted_count=jnp.zeros((batch_size,), jnp.float32),
               lead_beta_sum=jnp.zeros((batch_size,), jnp.float32),
               lead_beta_count=z(batch_size),
               choice_steps=z(batch_size, num_choices),
               choice_estimate=jnp.zeros((batch_size, num_choices), jnp.float32))

  def add_plain_steps(self, steps: jax.Array, emitted: jax.Array) -> "SpecCounters":
    """These counters after ``steps`` [B] more plain decoding steps (one target call each,
    counted at depth 0) that emitted ``emitted`` [B] tokens."""
    return self.replace(target_calls=self.target_calls + steps, emitted=self.emitted + emitted,
                        depth_hist=self.depth_hist.at[:, 0].add(steps))

  def add_choices(self, steps: jax.Array, estimate) -> "SpecCounters":
    """These counters after ``steps`` [B, K] more steps of each policy choice, each chosen on
    the running acceptance estimate ``estimate`` ([B] or a scalar)."""
    estimate = jnp.asarray(estimate, jnp.float32)
    return self.replace(choice_steps=self.choice_steps + steps,
                        choice_estimate=self.choice_estimate
                        + steps * jnp.reshape(estimate, estimate.shape + (1,)))


@flax.struct.dataclass(kw_only=True)
class SpecState:
  """Everything the jitted speculative step reads and writes.

  Attributes:
    tokens: [B, S] prompt followed by committed output (right-padded).
    seq_lens: [B] committed tokens per row; the target cache holds seq_lens - 1.
    max_lens: [B] prompt length + max_new_tokens.
    done: [B] row finished.
    target_cache: the target's KV cache.
    draft_state: the drafter's state (e.g. its own KV cache).
    rng: PRNG key.
    steps: scalar, speculative steps taken.
    counters: acceptance statistics.
    policy: the adaptive policy's state (``adaptive.PolicyState``); () without one.
  """

  tokens: jax.Array
  seq_lens: jax.Array
  max_lens: jax.Array
  done: jax.Array
  target_cache: kvc.KVCache
  draft_state: Any
  rng: jax.Array
  steps: jax.Array
  counters: SpecCounters
  policy: Any = ()
