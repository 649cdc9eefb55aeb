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

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specjax.sampling import sample_from


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


def accept(key: jax.Array, drafts: jax.Array, q: jax.Array, p: jax.Array) -> Acceptance:
  """Runs the acceptance rule for a batch.

  Args:
    key: PRNG key.
    drafts: [B, γ] draft tokens.
    q: [B, γ, V] draft distributions the drafts were sampled from.
    p: [B, γ+1, V] target distributions at the same prefixes plus the bonus one.
  """
  b, gamma = drafts.shape
  u_key, s_key = jax.random.split(key)
  p, q = finite_probs(p), finite_probs(q)
  p_d = jnp.take_along_axis(p[:, :gamma], drafts[..., None], axis=-1)[..., 0]  # [B, γ]
  q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(u_key, (b, gamma))
  # u < p/q without dividing: q_d > 0 for a token the draft actually sampled.
  ok = u * q_d < p_d
  accepted = jnp.cumprod(ok.astype(jnp.int32), axis=1).astype(bool)
  n = jnp.sum(accepted, axis=1)

  # Residual at position n; a zero row of q at index γ turns it into p_{γ+1}.
  q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - q_n, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  # mass == 0 only if p_n == q_n, where rejection has probability 0; fall back to p.
  residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
  next_token = sample_from(s_key, residual)
  beta = jnp.sum(jnp.minimum(p[:, :gamma], q), axis=-1)
  return Acceptance(num_accepted=n, next_token=next_token, accepted=accepted, beta=beta)
