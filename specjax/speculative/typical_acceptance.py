"""Typical acceptance (Medusa-2, Cai et al. 2024): a LOSSY verification rule, opt-in only.

Every other rule in specjax keeps the target's output law exactly. This one
does not: it trades fidelity for longer accepted paths, and the decoder uses
it only when asked by name (``SpeculativeDecoder(verification="typical_lossy")``
or a ``TypicalAcceptance``); ``tests/test_medusa.py`` shows it moves the law.

The rule, as FasterDecoding's ``evaluate_posterior`` (sampling="typical",
fast=True) and ``get_typical_one_token``: with p the target's (warped)
distribution at a block entry, H(p) = −Σ p log(p + 1e−5) and the threshold
τ = min(ε, δ · e^(−H(p))),
  * a draft node is acceptable when p_parent(x_node) > τ_parent, and a path is
    kept as far as all its nodes are acceptable;
  * the deepest such path wins, ties broken by the larger Σ log p(x) along it;
  * the next token is drawn from p at the path's end with every token of
    probability < τ removed (renormalised).
Under a greedy sampler the decoder keeps the exact greedy rule, as Medusa does at T = 0.

Example: p = (0.5, 0.3, 0.2) has H ≈ 1.03 and τ = min(0.09, 0.3 · 0.36) = 0.09,
so any draft of those three tokens is accepted, whatever a sample would have been.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.sampling import sample_from
from specjax.speculative.acceptance import finite_probs
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import TreeTopology, node_arrays, path_to
from specjax.speculative.tree_acceptance import TreeAcceptance
from specjax import validation

TYPICAL_LOSSY = "typical_lossy"  # the verification name that selects it with the defaults


@dataclasses.dataclass(frozen=True)
class TypicalAcceptance:
  """Medusa-2's typical acceptance (lossy). Defaults are FasterDecoding's medusa_generate's.

  Attributes:
    threshold: ε, the hard cap on τ (posterior_threshold).
    alpha: δ, the entropy-scaled part of τ (posterior_alpha).
  """

  threshold: float = 0.09
  alpha: float = 0.3
  lossy = True  # a class constant, not a field: there is no lossless setting

  def __post_init__(self):
    object.__setattr__(self, "threshold",
                       validation.as_float(self.threshold, "typical threshold", 0.0, 1.0))
    object.__setattr__(self, "alpha", validation.as_float(self.alpha, "typical alpha", 0.0, 1.0))

  def tau(self, p: jax.Array) -> jax.Array:
    """[...] the acceptance threshold of distributions p [..., V]."""
    entropy = -jnp.sum(p * jnp.log(p + 1e-5), axis=-1)
    return jnp.minimum(self.threshold, jnp.exp(-entropy) * self.alpha)


def accept_typical(key: jax.Array, proposal: Proposal, p: jax.Array, topology: TreeTopology,
                   rule: TypicalAcceptance) -> TreeAcceptance:
  """The deepest typically-acceptable path (see the module docstring) of any tree.

  Args:
    key: PRNG key for the next token.
    proposal: the drafter's N nodes (static or per-row parents).
    p: [B, N + 1, V] the target's warped distributions at each block entry.
    topology: the static topology (for dynamic trees: N and the maximum depth).
    rule: ε and δ.
  """
  b, n = proposal.tokens.shape
  p = finite_probs(p)
  par, mask, depth = node_arrays(topology, b, proposal.parents)  # par [B, N] block parents
  tau = rule.tau(p)  # [B, N + 1]
  p_par = jnp.take_along_axis(p, par[:, :, None], axis=1)  # [B, N, V]
  px = jnp.take_along_axis(p_par, proposal.tokens[:, :, None], axis=-1)[:, :, 0]  # [B, N]
  ok = jnp.concatenate([jnp.ones((b, 1), bool),
                        px > jnp.take_along_axis(tau, par, axis=1)], axis=1)  # [B, N + 1]
  logp = jnp.concatenate([jnp.zeros((b, 1)), jnp.log(jnp.maximum(px, 1e-30))], axis=1)
  # An entry's path is acceptable when it and all its ancestors are (mask: ancestors + self).
  path_ok = jnp.all(ok[:, None, :] | ~mask, axis=-1)  # [B, N + 1]
  loglik = jnp.sum(jnp.where(mask, logp[:, None, :], 0.0), axis=-1)
  deepest = jnp.max(jnp.where(path_ok, depth, -1), axis=-1, keepdims=True)
  best = jnp.argmax(jnp.where(path_ok & (depth == deepest), loglik, -jnp.inf), axis=-1)
  p_end = jnp.take_along_axis(p, best[:, None, None], axis=1)[:, 0]  # [B, V]
  tau_end = jnp.take_along_axis(tau, best[:, None], axis=1)
  next_token = sample_from(key, jnp.where(p_end >= tau_end, p_end, 0.0))
  return TreeAcceptance(path=path_to(best, mask, depth, topology.max_depth),
                        num_accepted=jnp.take_along_axis(depth, best[:, None], axis=1)[:, 0],
                        next_token=next_token.astype(jnp.int32),
                        beta=jnp.zeros((b, topology.max_depth), jnp.float32))
