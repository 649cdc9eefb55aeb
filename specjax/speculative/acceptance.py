"""Modified rejection sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

Given γ draft tokens with the draft's warped distributions q₁…q_γ and the
target's warped distributions p₁…p_{γ+1} at the same prefixes:
  * draft token i is accepted with probability min(1, pᵢ(dᵢ)/qᵢ(dᵢ));
  * at the first rejection the replacement is drawn from norm(max(0, pᵢ − qᵢ));
  * if all γ are accepted, a bonus token is drawn from p_{γ+1}.
The output is then distributed exactly as the target's warped distribution.
With one-hot p and q (greedy) this reduces to "accept while the draft equals
the target's argmax, then emit the target's argmax".

The rule is total: entries of p or q that are NaN, ±inf or negative count as
0 (a sampler's distributions never hold them, see ``specjax.sampling``), and a
draw from a row with no positive entry is uniform (``sample_from``), so
garbage in gives valid token ids and finite β, never NaN.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from specjax.sampling import SubsetProbs, sample_from


class Acceptance(NamedTuple):
  """Outcome of one verification.

  Attributes:
    num_accepted: [B] n, the number of leading draft tokens accepted (0..γ).
    next_token: [B] the corrected token (at a rejection) or the bonus token.
    accepted: [B, γ] bool, accepted[b, i] = i < n.
    beta: [B, γ] β = Σₓ min(pᵢ, qᵢ) per draft position (the paper's α = E[β]).
  """

  num_accepted: jax.Array
  next_token: jax.Array
  accepted: jax.Array
  beta: jax.Array


def finite_probs(x: jax.Array) -> jax.Array:
  """``x`` with NaN, ±inf and negative entries set to 0 (what every rule reads)."""
  return jnp.where((x >= 0) & (x < jnp.inf), x, 0.0)


def normalized(x: jax.Array, fallback: jax.Array) -> jax.Array:
  """``x`` [..., K] over its last axis, ``fallback`` where a row has no mass (a residual
  that is empty only where reaching it has probability 0)."""
  mass = jnp.sum(x, axis=-1, keepdims=True)
  return jnp.where(mass > 0, x / jnp.where(mass > 0, mass, 1.0), fallback)


def support_view(q: jax.Array | SubsetProbs,
                 p: jax.Array) -> tuple[jax.Array, jax.Array, Optional[jax.Array]]:
  """(q's entries, p's at the same ids, those ids or None): q [..., V] or ``SubsetProbs``
  [..., K] (``finite_probs`` applied) and p [..., V] (already finite) where q can be
  non-zero."""
  if isinstance(q, SubsetProbs):
    return finite_probs(q.probs), p[..., q.ids], q.ids
  return finite_probs(q), p, None


def mass_outside(p: jax.Array, ids: jax.Array) -> jax.Array:
  """p [..., V]'s mass outside the vocabulary ids ``ids`` [K] (where a ``SubsetProbs`` is 0)."""
  in_support = jnp.zeros((p.shape[-1],), bool).at[ids].set(True)
  return jnp.sum(jnp.where(in_support, 0.0, p), axis=-1)


def probs_at(q: jax.Array | SubsetProbs, tokens: jax.Array) -> jax.Array:
  """q [..., N, V or K] at ``tokens`` [..., N] (0 outside a subset's ids; ``finite_probs``)."""
  if isinstance(q, SubsetProbs):
    slot, found = q.slots(tokens)
    at = jnp.take_along_axis(q.probs, slot[..., None], axis=-1)[..., 0]
    return jnp.where(found, finite_probs(at), 0.0)
  return finite_probs(jnp.take_along_axis(q, tokens[..., None], axis=-1)[..., 0])


def overlap(p: jax.Array, q: jax.Array | SubsetProbs) -> jax.Array:
  """β = Σₓ min(p, q) over the last axis (p [..., V] finite, q [..., V] or ``SubsetProbs``)."""
  q_k, p_k, _ = support_view(q, p)
  return jnp.sum(jnp.minimum(p_k, q_k), axis=-1)


def keep_probabilities(drafts: jax.Array, q: jax.Array | SubsetProbs,
                       p: jax.Array) -> jax.Array:
  """[B, γ] the chance token-wise verification keeps each draft once it is reached:
  min(1, pᵢ(dᵢ)/qᵢ(dᵢ)), 0 where qᵢ(dᵢ) = 0 (never a draw). ``drafts`` [B, γ], q as in
  ``accept``, p [B, ≥ γ, V]; NaN, ±inf and negative entries count as 0."""
  gamma = drafts.shape[1]
  # (gathered first: one value per draft, not a pass over the vocabulary)
  p_d = finite_probs(jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0])
  q_d = probs_at(q, drafts)
  return jnp.where(q_d > 0, jnp.minimum(1.0, p_d / jnp.where(q_d > 0, q_d, 1.0)), 0.0)


def scoring_chances(keep: jax.Array) -> jax.Array:
  """[B, γ] the chance that token-wise verification scores each draft position (reaches it:
  every earlier draft kept), Πⱼ<ᵢ keepⱼ, from ``keep_probabilities``' [B, γ]."""
  reached = jnp.cumprod(keep, axis=1)
  return jnp.concatenate([jnp.ones_like(keep[:, :1]), reached[:, :-1]], axis=1)


def accept(key: jax.Array, drafts: jax.Array, q: jax.Array | SubsetProbs,
           p: jax.Array) -> Acceptance:
  """Runs the acceptance rule for a batch.

  Args:
    key: PRNG key.
    drafts: [B, γ] draft tokens.
    q: [B, γ, V] draft distributions the drafts were sampled from, or ``SubsetProbs``
      [B, γ, K] (a reduced-vocabulary draft: every pass over q and p is K wide but the
      final draw's, which places the residual's K entries in p's row).
    p: [B, γ+1, V] target distributions at the same prefixes plus the bonus one.
  """
  b, gamma = drafts.shape
  u_key, s_key = jax.random.split(key)
  p = finite_probs(p)
  q_k, p_k, ids = support_view(q, p)  # [B, γ, K], [B, γ + 1, K] (K = V without a subset)
  p_d = jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0]  # [B, γ]
  q_d = probs_at(q, drafts)
  u = jax.random.uniform(u_key, (b, gamma))
  # u < p/q without dividing: q_d > 0 for a token the draft actually sampled.
  ok = u * q_d < p_d
  accepted = jnp.cumprod(ok.astype(jnp.int32), axis=1).astype(bool)
  n = jnp.sum(accepted, axis=1)

  # Residual at position n; a zero row of q at index γ turns it into p_{γ+1}.
  q_pad = jnp.concatenate([q_k, jnp.zeros_like(q_k[:, :1])], axis=1)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(jnp.take_along_axis(p_k, n[:, None, None], axis=1)[:, 0] - q_n, 0.0)
  if ids is not None:  # outside the subset q is 0: the residual is p there
    residual = p_n.at[:, ids].set(residual)
  # empty only if p_n == q_n, where rejection has probability 0; fall back to p.
  residual = normalized(residual, p_n)
  next_token = sample_from(s_key, residual)
  beta = jnp.sum(jnp.minimum(p_k[:, :gamma], q_k), axis=-1)
  return Acceptance(num_accepted=n, next_token=next_token, accepted=accepted, beta=beta)
