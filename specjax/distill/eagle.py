"""Training an EAGLE feature drafter on the self-distillation corpus.

Teacher-forced, as in EAGLE-1: pair i = (f_{i−1}, x_i) with the target's
true features (``specjax.distill.features``), optionally perturbed by uniform
noise so the draft tolerates its own predicted features at later draft
steps. Two losses: the token divergence to the target's stored top-k (the
same ``losses.divergence`` as token drafts, which is what α measures) and a
smooth-L1 regression of ĥ_i onto f_i. Features carry a few huge outlier
dimensions (SmolLM2: RMS ≈ 30, max ≈ 4,000), so both the regression and the
noise are taken relative to each position's RMS, the scale the final norm
removes anyway.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from specjax import kv_cache as kvc
from specjax.drafters.eagle import EagleDrafter, eagle_params


def _unit_rms(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


@dataclasses.dataclass(frozen=True)
class EagleObjective:
  """The objective of ``specjax.distill.train.train`` for an EAGLE drafter.

  Trainable params: ``fc``, ``fc_bias``, ``layers``; frozen: the target's
  ``embed``, ``final_norm`` and ``head`` rows of the draft vocabulary (no
  ``vocab_map``: training works over the Vd rows). Batches need ``features``.

  Attributes:
    drafter: the drafter being trained (its config).
    feature_weight: weight of the feature regression.
    noise: input features get U(−noise, noise) × their RMS during training.
  """

  drafter: EagleDrafter
  feature_weight: float = 0.1
  noise: float = 0.0

  def logp_and_aux(self, params, frozen, in_map, batch, key):
    del in_map  # EAGLE reads the target's own embedding of every id
    dp = dict(frozen, **params)
    tokens = batch["tokens"]
    b, l = tokens.shape
    feats = batch["features"].astype(jnp.float32)
    inputs = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)
    if key is not None and self.noise:
      rms = jnp.sqrt(jnp.mean(inputs * inputs, axis=-1, keepdims=True))
      inputs = inputs + self.noise * rms * jax.random.uniform(key, inputs.shape, minval=-1.0,
                                                              maxval=1.0)
    h, _ = self.drafter.hidden(dp, inputs, tokens, jnp.broadcast_to(jnp.arange(l), (b, l)),
                               kvc.init_cache(self.drafter.cfg, b, l))
    take = lambda x: jnp.take_along_axis(x, batch["pred_pos"][:, :, None], axis=1)
    h_at = take(h)
    logp = jax.nn.log_softmax(self.drafter.logits(dp, h_at), axis=-1)
    w = batch["weight"]
    err = optax.huber_loss(_unit_rms(h_at), _unit_rms(take(feats)), delta=1.0)
    reg = jnp.sum(jnp.mean(err, axis=-1) * w) / jnp.maximum(jnp.sum(w), 1.0)
    return logp, self.feature_weight * reg


def frozen_arrays(target_cfg, target_params, vocab_map=None) -> dict:
  """The target arrays an EAGLE objective reads: embedding, final norm, head rows."""
  dp = eagle_params(target_cfg, target_params, {}, vocab_map)
  return {k: v for k, v in dp.items() if k != "vocab_map"}
