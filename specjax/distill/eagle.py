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

Training-time test (EAGLE-3), ``ttt_steps`` = K > 1: the drafter is unrolled
on its own predictions. Step k's pair at position i reads the drafter's
step-(k−1) output ĥ at i − 1 instead of the target's feature, and attends to
exactly what it would see at the k-th draft step of decoding: the true-feature
pairs of positions ≤ i − k + 1 (the committed prefix), the pairs of steps
2 … k−1 along its own path (position i − (k − m) at step m) and itself
(``ttt_mask``). Every step's output at i predicts the target's next token
after position i, so each step is scored against the same stored target
distribution; positions with no committed prefix at step k (i < k − 1) are
left out. The feature regression applies to step 1 only (EAGLE-3 drops it).

With feature fusion (``EagleDrafter.feature_layers``) batches carry the k
layers' outputs concatenated ([B, L, k·D]); the pairs read their fusion and
the regression target is the highest fused layer's output (the last hidden
state when it is fused, as in the default layers).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import kv_cache as kvc
from specjax.drafters.eagle import EagleDrafter, eagle_params
from specjax.drafters.eagle_arch import SPECJAX


def _unit_rms(x: jax.Array) -> jax.Array:
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def ttt_mask(length: int, step: int) -> np.ndarray:
  """[L, step·L] which cache slots step ``step`` (>= 2) of the unroll sees.

  Slots ``(m − 1)·L + j`` hold step m's pair at position j. Position i sees
  the step-1 pairs j <= i − step + 1 and, for m = 2 … step, step m's pair at
  position i − (step − m) (the last is itself).
  """
  mask = np.zeros((length, step * length), bool)
  for i in range(length):
    mask[i, :max(0, i - step + 2)] = True
    for m in range(2, step + 1):
      j = i - (step - m)
      if j >= 0:
        mask[i, (m - 1) * length + j] = True
  return mask


@dataclasses.dataclass(frozen=True)
class EagleObjective:
  """The objective of ``specjax.distill.train.train`` for an EAGLE drafter.

  Trainable params: the norms, ``fc``, ``fc_bias``, ``layers`` and the fusion; frozen: the target's
  ``embed``, ``final_norm`` and ``head`` rows of the draft vocabulary (no
  ``vocab_map``: training works over the Vd rows). Batches need ``features``.

  Attributes:
    drafter: the drafter being trained (its config).
    feature_weight: weight of the feature regression.
    noise: input features get U(−noise, noise) × their RMS during training.
    ttt_steps: K, draft steps unrolled on the drafter's own predictions (1 = EAGLE-1's
      teacher forcing only).
  """

  drafter: EagleDrafter
  feature_weight: float = 0.1
  noise: float = 0.0
  ttt_steps: int = 1

  def __post_init__(self):
    if self.ttt_steps < 1:
      raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")
    if self.drafter.arch != SPECJAX:  # the unroll below feeds pair zero and specjax's norms
      raise ValueError(f"EAGLE training covers specjax's own wiring only, not {self.drafter.arch} "
                       "(published EAGLE drafters load for inference)")

  def min_position(self, step: int) -> int:
    """Unrolled step k (from 0) has a committed prefix at trained positions >= k."""
    return step

  def unroll(self, params, frozen, batch, key=None) -> jax.Array:
    """[K, B, L, D]: ĥ of every position at each of the K unrolled draft steps."""
    dp = dict(frozen, **params)
    tokens = batch["tokens"]
    b, l = tokens.shape
    feats = self.drafter.fuse(dp, batch["features"].astype(jnp.float32))
    shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    inputs = shift(feats)
    if key is not None and self.noise:
      # The noise's scale is data augmentation, not trained through: sqrt's gradient at a
      # zero input (the padding of stored features, fused) would be NaN.
      rms = jax.lax.stop_gradient(jnp.sqrt(jnp.mean(inputs * inputs, axis=-1, keepdims=True)))
      inputs = inputs + self.noise * rms * jax.random.uniform(key, inputs.shape, minval=-1.0,
                                                              maxval=1.0)
    positions = jnp.broadcast_to(jnp.arange(l), (b, l))
    cache = kvc.init_cache(self.drafter.cfg, b, self.ttt_steps * l)
    h, cache = self.drafter.hidden(dp, inputs, tokens, positions, cache)
    steps = [h]
    for k in range(2, self.ttt_steps + 1):  # the window starts at slot 0; step k writes slot (k−1)L
      mask = jnp.broadcast_to(jnp.asarray(ttt_mask(l, k)), (b, l, k * l))
      h, cache = self.drafter.hidden(dp, shift(h), tokens, positions,
                                     cache.with_lengths(jnp.zeros((b,), jnp.int32)), mask=mask)
      steps.append(h)
    return jnp.stack(steps)

  def logp_and_aux(self, params, frozen, in_map, batch, key):
    """Log-probs at ``pred_pos`` ([B, R, Vd], or [K, B, R, Vd] with ``ttt_steps`` > 1) and
    the weighted feature regression of step 1."""
    del in_map  # EAGLE reads the target's own embedding of every id
    dp = dict(frozen, **params)
    hs = self.unroll(params, frozen, batch, key)
    h_at = jnp.take_along_axis(hs, batch["pred_pos"][None, :, :, None], axis=2)  # [K, B, R, D]
    logp = jax.nn.log_softmax(self.drafter.logits(dp, h_at), axis=-1)
    w = batch["weight"]
    d = self.drafter.cfg.dim  # regression target: the highest layer's output (h_l_k)
    feats = jnp.take_along_axis(batch["features"][..., -d:].astype(jnp.float32),
                                batch["pred_pos"][:, :, None], axis=1)
    err = optax.huber_loss(_unit_rms(h_at[0]), _unit_rms(feats), delta=1.0)
    reg = jnp.sum(jnp.mean(err, axis=-1) * w) / jnp.maximum(jnp.sum(w), 1.0)
    return (logp[0] if self.ttt_steps == 1 else logp), self.feature_weight * reg


def frozen_arrays(target_cfg, target_params, vocab_map=None) -> dict:
  """The target arrays an EAGLE objective reads: embedding, final norm, head rows."""
  dp = eagle_params(target_cfg, target_params, {}, vocab_map)
  return {k: v for k, v in dp.items() if k != "vocab_map"}


def grown(weights: dict, init: dict) -> dict:
  """``weights`` (trained EAGLE weights) with ``init``'s layers beyond theirs appended, each
  starting as the identity: its two residual branches' output projections (``wo``,
  ``w_down``) zero, the rest as ``init`` has it. The grown drafter proposes exactly what
  ``weights`` did until training moves the new layers (depth growth with zero-initialised
  residual branches): the capacity axis of an ablation, continued from a trained drafter."""
  have, want = len(weights["layers"]), len(init["layers"])
  if have > want:
    raise ValueError(f"cannot grow {have} EAGLE layers to {want}")
  new = [dict(l, wo=jnp.zeros_like(l["wo"]), w_down=jnp.zeros_like(l["w_down"]))
         for l in init["layers"][have:]]
  return dict(weights, layers=list(weights["layers"]) + new)
