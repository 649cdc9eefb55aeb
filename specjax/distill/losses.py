"""Token-level distillation losses (DistillSpec) and the acceptance rate β.

All divergences act on log-probabilities over the last axis. The target's
distribution is stored as its top-k tokens; ``coarsen`` turns target top-k +
draft logits into two distributions over k + 1 outcomes (the top-k tokens the
draft can emit, plus one "other" bucket). A divergence between coarsened
distributions is a lower bound of the full one and is zero iff the draft
matches the target on every kept token and on the remaining mass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DIVERGENCES = ("fkl", "rkl", "tv")
LOSSES = DIVERGENCES + ("top1",)
_LOG_FLOOR = -69.0  # log(1e-30)


def _xlogy_diff(a_logp: jax.Array, b_logp: jax.Array) -> jax.Array:
  """Σ a (log a - log b), with 0 log 0 = 0 (and no NaN gradient there)."""
  a = jnp.exp(a_logp)
  safe = jnp.where(a > 0, a_logp - b_logp, 0.0)
  return jnp.sum(jnp.where(a > 0, a * safe, 0.0), axis=-1)


def divergence(kind: str, p_logp: jax.Array, q_logp: jax.Array) -> jax.Array:
  """D(p, q) over the last axis: p the target, q the draft.

  Args:
    kind: 'fkl' = KL(p || q) (mass-covering), 'rkl' = KL(q || p) (mode-seeking),
      'tv' = ½ Σ |p - q| (the quantity 1 - β that speculative decoding loses), or
      'top1' = −log q(argmax p): hard-label distillation, the cross-entropy to the
      target's most probable outcome (Medusa-1's and LayerSkip's loss with the target's
      own argmax as the label). 'top1' is not a divergence (it is > 0 when p = q) but
      rewards exactly what greedy acceptance checks, and unlike a divergence between
      coarsened top-1 distributions it makes the draft rank that token first.
    p_logp, q_logp: [..., V] log-probabilities (-inf for impossible outcomes).
  """
  if kind == "fkl":
    return _xlogy_diff(p_logp, q_logp)
  if kind == "rkl":
    return _xlogy_diff(q_logp, p_logp)
  if kind == "tv":
    return 0.5 * jnp.sum(jnp.abs(jnp.exp(p_logp) - jnp.exp(q_logp)), axis=-1)
  if kind == "top1":
    top = jnp.argmax(p_logp, axis=-1)[..., None]
    return -jnp.take_along_axis(q_logp, top, axis=-1)[..., 0]
  raise ValueError(f"unknown distillation loss {kind!r}; choose one of {LOSSES}")


def _log1mexp_sum(logp: jax.Array) -> jax.Array:
  """log(1 - Σ exp(logp)) over the last axis, clamped at the smallest normal float."""
  rest = 1.0 - jnp.sum(jnp.exp(logp), axis=-1)
  return jnp.maximum(jnp.log(jnp.maximum(rest, 1e-30)), _LOG_FLOOR)


def coarsen(topk_draft_ids: jax.Array, topk_logp: jax.Array, in_map: jax.Array,
            draft_logp: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Target top-k and draft log-probs -> two distributions over k + 1 outcomes.

  Args:
    topk_draft_ids: [N, k] draft-vocabulary ids of the target's top-k tokens
      (any value where ``in_map`` is False).
    topk_logp: [N, k] the target's log-probs of those tokens.
    in_map: [N, k] whether the token exists in the draft vocabulary; tokens
      outside it move to the "other" bucket on both sides.
    draft_logp: [N, Vd] the draft's log-softmax.

  Returns:
    (p_logp, q_logp), each [N, k + 1]; the last column is "other".
  """
  n, vd = draft_logp.shape
  ids = jnp.where(in_map, topk_draft_ids, 0)
  p_k = jnp.where(in_map, topk_logp, -jnp.inf)
  q_k = jnp.where(in_map, jnp.take_along_axis(draft_logp, ids, axis=-1), -jnp.inf)
  chosen = jnp.zeros((n, vd), bool).at[jnp.arange(n)[:, None], ids].max(in_map)
  # Both "other" masses are floored at 1e-30: when the top-k holds (nearly)
  # all the mass on one side, rounding must not turn the KL into inf.
  q_other = jnp.maximum(jax.nn.logsumexp(jnp.where(chosen, -jnp.inf, draft_logp), axis=-1),
                        _LOG_FLOOR)
  p_other = _log1mexp_sum(p_k)
  return (jnp.concatenate([p_k, p_other[:, None]], -1),
          jnp.concatenate([q_k, q_other[:, None]], -1))


def beta(p: jax.Array, q: jax.Array) -> jax.Array:
  """β = Σ_x min(p(x), q(x)): the probability that a draft token is accepted."""
  return jnp.sum(jnp.minimum(p, q), axis=-1)
