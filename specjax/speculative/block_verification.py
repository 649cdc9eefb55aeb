"""Block verification (Sun et al. 2024, "Block Verification Accelerates Speculative Decoding").

Token-wise verification (``acceptance.accept``) decides each draft token on its
own: token i is kept with probability min(1, pᵢ(dᵢ)/qᵢ(dᵢ)) and the first
rejection ends the block. Block verification decides the block jointly. It
keeps a running weight

    w₀ = 1,   wᵢ = min(1, wᵢ₋₁ · pᵢ(dᵢ) / qᵢ(dᵢ)),

so a token the target likes more than the draft did can make up for an
earlier one it liked less, and keeps the longest prefix of length τ whose
stop test passes, scanning from the end:

    hᵢ = sᵢ / (sᵢ + 1 − wᵢ)  for i < γ,   h_γ = w_γ,
    sᵢ = Σₓ max(0, wᵢ · p_{i+1}(x) − q_{i+1}(x)),
    τ  = the largest i with ηᵢ < hᵢ (ηᵢ ~ U(0, 1) independent), else 0.

The extra token is drawn from norm(max(0, w_τ · p_{τ+1} − q_{τ+1})) (with
q_{γ+1} = 0 that is p_{γ+1}, the bonus). Here p_{i+1} and q_{i+1} are the
target's and the draft's distributions after the first i drafts (index i of
the arrays below). The emitted tokens are distributed exactly as the target's,
and the expected number of tokens per step is never below token-wise
verification's for the same draft (the paper's Theorems 1 and 2); with γ = 1
the two rules coincide. ``tests/test_block_verification.py`` checks both by
exact enumeration and by sampling.

The rule needs the law q that produced each draft token. A deterministic
drafter (prompt lookup, top-1 chains: ``draw="point_mass"``) has q one-hot at
its token, and the rule applies unchanged. It is defined for one block (a
chain); for token trees, ``SpeculativeDecoder(verification="block")`` runs its
generalisation, traversal verification (``traversal_verification``, Weng et al.
2025), which on a chain gives this rule's law.

Worked example (γ = 2, V = 2): q = (½, ½) at both depths, p₁ = (1, 0) and
p₂ = p₃ = (½, ½). For the draft (0, 0): w₁ = min(1, 1/½) = 1, w₂ = min(1, 1 ·
½/½) = 1, so h₂ = 1 and both tokens are kept. For the draft (1, 0): w₁ = 0,
so w₂ = 0, h₂ = 0, s₁ = 0 and h₁ = 0: τ = 0 and the extra token is drawn from
norm(max(0, p₁ − q₁)) = (1, 0). Token-wise verification gives the same here;
the rules differ when a low ratio is followed by a high one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import SubsetProbs, dense_probs, sample_from
from specjax.speculative.acceptance import (Acceptance, finite_probs, keep_probabilities,
                                            mass_outside, overlap, probs_at, support_view)

VERIFICATIONS = ("tokenwise", "block")  # SpeculativeDecoder.verification


def block_weights(drafts: jax.Array, q: jax.Array | SubsetProbs, p: jax.Array) -> jax.Array:
  """[B, γ + 1] the running weights w₀ = 1, wᵢ = min(1, wᵢ₋₁ pᵢ(dᵢ)/qᵢ(dᵢ))."""
  gamma = drafts.shape[1]
  p_d = jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0]  # [B, γ]
  q_d = probs_at(q, drafts)
  # A token with q = 0 was never a draw: its ratio is 0 (nothing past it is kept).
  ratio = jnp.where(q_d > 0, p_d / jnp.where(q_d > 0, q_d, 1.0), 0.0)

  def step(w, r):
    w = jnp.minimum(w * r, 1.0)
    return w, w

  ones = jnp.ones(drafts.shape[:1], p.dtype)
  _, w = jax.lax.scan(step, ones, ratio.T)
  return jnp.concatenate([ones[:, None], w.T], axis=1)


def _stop_terms(drafts: jax.Array, q: jax.Array | SubsetProbs, p: jax.Array):
  """(w [B, γ + 1], h [B, γ], the residuals max(0, w p − q) on q's support [B, γ + 1, K],
  their masses s [B, γ + 1], q's ids or None). Outside a ``SubsetProbs``' ids q is 0, so
  the residual there is w p, counted in s but never materialised."""
  gamma = drafts.shape[1]
  w = block_weights(drafts, q, p)  # [B, γ + 1]
  q_k, p_k, ids = support_view(q, p)
  q_pad = jnp.concatenate([q_k, jnp.zeros_like(q_k[:, :1])], axis=1)  # q_{γ+1} = 0
  residual = jnp.maximum(w[:, :, None] * p_k - q_pad, 0.0)  # [B, γ + 1, K]
  s = jnp.sum(residual, axis=-1)  # [B, γ + 1]
  if ids is not None:
    s = s + w * mass_outside(p, ids)
  denom = s + 1.0 - w
  # 0/0 happens only when w = 1 and p = q at that entry: stopping there is then as
  # good as going on (the residual falls back to p = q below), so h = 1.
  h = jnp.where(denom > 0, s / jnp.where(denom > 0, denom, 1.0), 1.0)
  h = jnp.concatenate([h[:, 1:gamma], w[:, gamma:]], axis=1)  # h₁ … h_γ, with h_γ = w_γ
  return w, h, residual, s, ids


def stop_probabilities(drafts: jax.Array, q: jax.Array, p: jax.Array
                       ) -> tuple[jax.Array, jax.Array]:
  """The rule's two laws: (h [B, γ], residual [B, γ + 1, V]).

  h[:, i − 1] is hᵢ, the chance that a block whose longer prefixes all failed keeps i
  tokens; residual[:, τ] is the normalised law of the extra token after τ kept tokens
  (residual[:, γ] = p_{γ+1}). So P(τ = i) = hᵢ Πⱼ₌ᵢ₊₁..γ (1 − hⱼ), with h₀ = 1.
  Inputs as in ``accept_block`` (already free of NaN and negative entries; a
  ``SubsetProbs`` q is placed in the vocabulary first).
  """
  _, h, residual, s, _ = _stop_terms(drafts, dense_probs(q), p)
  mass = s[..., None]
  residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)
  return h, residual


def accept_block(key: jax.Array, drafts: jax.Array, q: jax.Array | SubsetProbs,
                 p: jax.Array) -> Acceptance:
  """Block verification of a batch of chains (the module docstring gives the rule).

  Args:
    key: PRNG key.
    drafts: [B, γ] draft tokens.
    q: [B, γ, V] the distributions the drafts were drawn from (one-hot for a
      deterministic drafter), or ``SubsetProbs`` [B, γ, K] (a reduced-vocabulary draft:
      only the extra token's draw reads a [B, V] row).
    p: [B, γ + 1, V] the target's distributions at the same prefixes plus the bonus one.

  Returns the same ``Acceptance`` as token-wise ``acceptance.accept`` (β = Σ min(p, q)
  per position, which does not depend on the rule). Like it, the rule is total:
  NaN, ±inf and negative entries count as 0.
  """
  b, gamma = drafts.shape
  u_key, s_key = jax.random.split(key)
  p = finite_probs(p)
  w, h, residual, s, ids = _stop_terms(drafts, q, p)
  eta = jax.random.uniform(u_key, (b, gamma))
  levels = jnp.arange(1, gamma + 1)[None, :]
  tau = jnp.max(jnp.where(eta < h, levels, 0), axis=1).astype(jnp.int32)  # largest passing i
  def at(x):  # x [B, γ + 1, ...] at τ
    return jnp.take_along_axis(x, tau.reshape((b,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]

  r_tau, p_tau = at(residual), at(p)
  if ids is not None:  # outside q's support the residual is w_τ p_τ
    r_tau = (at(w)[:, None] * p_tau).at[:, ids].set(r_tau)
  # An empty residual (w = 1 and p = q there) falls back to p; sample_from normalises.
  r_tau = jnp.where(at(s)[:, None] > 0, r_tau, p_tau)
  return Acceptance(num_accepted=tau, next_token=sample_from(s_key, r_tau),
                    accepted=levels <= tau[:, None], beta=overlap(p[:, :gamma], q))


def expected_tokens(drafts: jax.Array, q: jax.Array, p: jax.Array) -> tuple[jax.Array, jax.Array]:
  """([B] token-wise, [B] block): the expected tokens one step emits for this very block.

  Token-wise verification keeps n ≥ i with probability Πⱼ≤ᵢ min(1, pⱼ(dⱼ)/qⱼ(dⱼ));
  block verification keeps τ = i with probability hᵢ Πⱼ>ᵢ (1 − hⱼ). Both count the extra
  token. Averaged over the blocks a run verifies, they compare the two rules on the same
  drafts without the noise of the acceptance draws (``benchmarks/block_verification.py``).
  """
  p, q = finite_probs(p), finite_probs(dense_probs(q))
  gamma = drafts.shape[1]
  tokenwise = 1.0 + jnp.sum(jnp.cumprod(keep_probabilities(drafts, q, p), axis=1), axis=1)
  h, _ = stop_probabilities(drafts, q, p)
  fail_after = jnp.cumprod((1.0 - h)[:, ::-1], axis=1)[:, ::-1]  # Πⱼ≥ᵢ (1 − hⱼ)
  fail_after = jnp.concatenate([fail_after[:, 1:], jnp.ones_like(h[:, :1])], axis=1)  # j > i
  p_tau = jnp.concatenate([fail_after[:, :1] * (1.0 - h[:, :1]), h * fail_after], axis=1)
  block = jnp.sum(p_tau * jnp.arange(1, gamma + 2, dtype=p_tau.dtype), axis=1)
  return tokenwise, block
