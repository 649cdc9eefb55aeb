"""EAGLE: a feature drafter that reads the target's last hidden states (Li et al. 2024).

The draft autoregresses on the target's *features* (its last hidden state,
before the final norm) rather than on tokens alone. Its input at position i
is the pair (f_{i−1}, x_i): the feature that predicted token x_i, and x_i's
embedding (the target's own, frozen), each RMS-normalised (as in EAGLE-3:
SmolLM2's features have RMS ≈ 30 against 0.13 for its embeddings, so without
the norms the token is invisible), projected by ``fc`` [2D → D] and run
through a few decoder layers. The output ĥ_i predicts the feature f_i; the
target's final norm and LM head (frozen, optionally restricted to a reduced
vocabulary) turn it into the distribution of x_{i+1}. f_{−1} is zero.

Drafting γ tokens for a row with committed length s: the pairs c…s−1 whose
true features arrived with the last verification are fed in one forward
(``num_valid`` of a static γ+1 window), giving ĥ_{s−1} and d₁; then
(ĥ_{s−1}, d₁), (ĥ_s, d₂), … are fed one at a time, each draft reading its
predecessor's *predicted* feature. Verification hands back the true features
of its block (``observe``), and after acceptance the draft cache keeps only
the pairs built from true features (lengths = the old s); everything past is
scratch. Tokens outside a reduced vocabulary get q = 0 (logits lifted with
−inf; q is handed over as ``SubsetProbs`` on the map), so verification stays exact.

Feature fusion (EAGLE-3), ``feature_layers`` = (l₁ … l_k): the feature of a
position is the fusion g = fuse · [norm₁(h_l₁); …; norm_k(h_l_k)] of k
target layers' outputs (low, mid and high) instead of the last hidden state
alone; later drafts read the drafter's own ĥ in g's place, as in EAGLE-3.
The state keeps the raw concatenated outputs; fusion happens where pairs are
built. ``fuse`` starts as the identity on the highest layer, so an untrained
fusion of (…, last) reads exactly what EAGLE-1 reads.

Draft params: ``embed_norm`` [D], ``feature_norm`` [D], ``fc`` [2D, D],
``fc_bias`` [D], ``layers`` (the draft's own, trained), with fusion
``fuse_norms`` [k, D] and ``fuse`` [kD, D] (trained), and ``embed``,
``final_norm``, ``head`` [Vd, D], ``vocab_map`` [Vd] (the target's arrays,
shared, see ``eagle_params``).

That is specjax's own wiring, the default ``EagleArch``; the published EAGLE-1/2
and EAGLE-3 drafters (``drafts.eagle_published``) run on the same code with
theirs (``eagle_arch``: which norms, where the token enters, which head, whether
the pair (0, x_0) exists). Training (``distill.eagle``) covers the default only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax import validation
from specjax.config import ModelConfig
from specjax.drafters.eagle_arch import SPECJAX, EagleArch
from specjax.drafters.reduced_vocab import lift_logits
from specjax.drafters.residual_head import target_head
from specjax.drafters.tree_draft import check_tree_draw, grow_tree, vocab_maps
from specjax.generate import over_backlog, over_chunks
from specjax.kernels import streaming_matmul as sm
from specjax.kernels.accumulate import einsum_f32
from specjax.kernels.packed import (PROJECTIONS, PackedWeight, head_policy_of, pack_under,
                                    policy_of, unpacked)
from specjax.kernels.policy import MatmulPolicy
from specjax.model import Params, cast_params, compute_dtype, init_params, rms_norm, run_layers
from specjax.sampling import Sampler, as_subset, sample_subset
from specjax.sharding import dense
from specjax.speculative.drafter import Drafter
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology
from specjax.speculative.tree_acceptance import AcceptedPath


@flax.struct.dataclass(kw_only=True)
class EagleState:
  """Per-row drafter state.

  Attributes:
    cache: the draft layers' KV cache; slots below ``cache.lengths`` hold
      pairs built from true target features.
    features: [B, S, F] the target's features by position (f_p at slot p;
      F = k·D raw layer outputs with fusion), written by the prefill and by
      every verification.
  """

  cache: kvc.KVCache
  features: jax.Array


@dataclasses.dataclass(frozen=True)
class EagleDrafter(Drafter):
  """An EAGLE feature drafter for a target of vocabulary ``cfg.vocab_size``.

  Attributes:
    cfg: the draft's layer stack: the target's widths, its own ``num_layers``,
      and the target's ``vocab_size``.
    tree_draw: how a tree's children are chosen (see ``tree_draft``): each
      node is fed as the pair (its parent's predicted feature, its token).
      EAGLE-2 dynamic trees (``DynamicTree``) always take the top-k, sampled dynamic
      trees (``SampledDynamicTree``) draw whenever the sampler does.
    feature_layers: target layers fused into the feature (EAGLE-3), sorted;
      () reads the last hidden state (EAGLE-1).
    arch: the wiring (``eagle_arch``): specjax's own by default, or a published
      drafter's.
  """

  cfg: ModelConfig
  tree_draw: str = "point_mass"
  feature_layers: tuple[int, ...] = ()
  arch: EagleArch = SPECJAX

  def __post_init__(self):
    check_tree_draw(self.tree_draw)
    if not isinstance(self.arch, EagleArch):
      raise TypeError(f"arch must be an EagleArch, got {type(self.arch).__name__}")
    object.__setattr__(self, "feature_layers",
                       validation.layer_indices(self.feature_layers, "feature_layers"))
    if self.feature_layers and self.arch.target_norm_eps is not None:
      raise ValueError("a drafter reads either the target's final-normed last hidden state "
                       f"(arch.target_norm_eps) or fused layers {self.feature_layers}, not both")

  def target_feature_layers(self) -> tuple[int, ...]:
    return self.feature_layers

  def plain_params(self, draft_params):
    return unpack_eagle_params(draft_params)  # the packed head is [D, Vd], the plain [Vd, D]

  def check_params(self, draft_params) -> None:
    k = len(self.feature_layers)
    required, optional = self.arch.param_keys(fused=bool(k))
    have = set(draft_params)
    if (have & required) != required or have - required - optional:
      missing, extra = sorted(required - have), sorted(have - required - optional)
      raise ValueError(f"draft params do not fit the drafter's wiring {self.arch}: missing "
                       f"{missing}, unexpected {extra}")
    if k and draft_params["fuse"].shape != (k * self.cfg.dim, self.cfg.dim):
      raise ValueError(f"fusion weights of shape {draft_params['fuse'].shape} do not fuse "
                       f"{k} layers of width {self.cfg.dim}")

  def fuse(self, dp: Params, features: jax.Array) -> jax.Array:
    """[..., F] raw target features -> [..., D] what a pair reads (identity without fusion)."""
    if self.arch.target_norm_eps is not None:  # EAGLE-1 reads the post-final-norm hidden state
      return rms_norm(features, dp["target_norm"], self.arch.target_norm_eps)
    if not self.feature_layers:
      return features
    k, d = len(self.feature_layers), self.cfg.dim
    parts = features.reshape(features.shape[:-1] + (k, d)).astype(dp["fuse"].dtype)
    if self.arch.fusion_norms:
      parts = rms_norm(parts, dp["fuse_norms"], self.cfg.norm_eps)
    return dense(parts.reshape(features.shape[:-1] + (k * d,)), dp["fuse"])

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def supports(self, topology: TreeTopology | DynamicTree | SampledDynamicTree) -> bool:
    # any static tree (``tree_draft.grow``), EAGLE-2 tree (``grow_dynamic``) or sampled
    # dynamic tree (``grow_sampled``)
    return True

  def hidden(self, dp: Params, features: jax.Array, tokens: jax.Array, positions: jax.Array,
             cache: kvc.KVCache, num_valid: Optional[jax.Array] = None,
             mask: Optional[jax.Array] = None):
    """Pairs (features [B, T, D], tokens [B, T]) -> (ĥ [B, T, D], new cache)."""
    eps, embed = self.cfg.norm_eps, dp["embed"][tokens]
    if self.arch.input == "attention":  # g is the residual; the token joins layer 0's attention
      h, _, cache = run_layers(dp, self.cfg, features.astype(embed.dtype), positions, cache, mask,
                               num_valid=num_valid,
                               attn_prefix=rms_norm(embed, dp["embed_norm"], eps))
      return h, cache
    features = features.astype(dp["fc"].dtype)
    if self.arch.input == "normed_fc":
      embed, features = (rms_norm(embed, dp["embed_norm"], eps),
                         rms_norm(features, dp["feature_norm"], eps))
    x = dense(jnp.concatenate([embed, features], axis=-1), dp["fc"])
    if "fc_bias" in dp:
      x = x + dp["fc_bias"]
    h, _, cache = run_layers(dp, self.cfg, x, positions, cache, mask, num_valid=num_valid)
    return h, cache

  def head_logits(self, dp: Params, h: jax.Array) -> jax.Array:
    """ĥ [..., D] -> float32 logits over the head's rows."""
    x = rms_norm(h, dp["final_norm"], self.cfg.norm_eps) if self.arch.head_norm else h
    if isinstance(dp["head"], PackedWeight):  # [D, Vd] panels (``pack_eagle_params``)
      return dense(x.astype(jnp.float32), dp["head"])
    return einsum_f32("...d,vd->...v", x, dp["head"])

  def logits(self, dp: Params, h: jax.Array) -> jax.Array:
    """Logits over the target vocabulary (−inf outside ``vocab_map`` when there is one)."""
    logits = self.head_logits(dp, h)
    return lift_logits(logits, dp["vocab_map"], self.vocab_size) if "vocab_map" in dp else logits

  def _sample(self, dp: Params, sampler: Sampler, key: jax.Array, h: jax.Array):
    """(target ids, q over the head's rows) drawn from ĥ [B, D]."""
    logits = self.head_logits(dp, h)
    if "vocab_map" in dp:
      return sample_subset(sampler, key, logits, dp["vocab_map"])
    return sampler.sample(key, logits)

  def reads_target_features(self) -> bool:
    return True  # ``init`` gets the prompt's features, ``observe`` each accepted path's

  def init(self, draft_params, tokens, prompt_lens, features=None) -> EagleState:
    """Feeds the prompt's pairs 0…P−2 (1…P−2 without pair zero) in chunks (as the target's
    prefill: the cost follows the longest prompt, not the buffer); pair P−1 is pending for
    the first ``propose``."""
    b, s = tokens.shape
    first = self.arch.first_pair

    def step(idx, valid, cache):  # idx: cache slots; pairs idx + first
      p = idx + first
      prev = jnp.take(features, jnp.clip(p - 1, 0, s - 1), axis=1)  # f_{p−1}, f_{−1} = 0
      fused = jnp.where((p >= 1)[None, :, None], self.fuse(draft_params, prev), 0.0)
      _, cache = self.hidden(draft_params, fused, jnp.take(tokens, jnp.clip(p, 0, s - 1), axis=1),
                             jnp.broadcast_to(p, (b, p.shape[0])), cache, num_valid=valid)
      return cache

    cache = over_chunks(step, kvc.init_cache(self.cfg, b, s, compute_dtype(draft_params)),
                        prompt_lens - 1 - first, s)
    return EagleState(cache=cache, features=features)

  def observe(self, state: EagleState, hidden: jax.Array, start: jax.Array) -> EagleState:
    """Stores the target's features ``hidden`` [B, T, D] of positions start[b] + t."""
    b, t = hidden.shape[:2]
    pos = start[:, None] + jnp.arange(t)[None, :]
    feats = state.features.at[jnp.arange(b)[:, None], pos].set(
        hidden.astype(state.features.dtype), mode="drop")
    return state.replace(features=feats)

  def propose_chain(self, draft_params, state: EagleState, tokens, seq_lens, key,
                    sampler: Sampler, gamma: int):
    b, s = tokens.shape
    h_last, cache = self._catch_up(draft_params, state, tokens, seq_lens, gamma + 1)
    keys = jax.random.split(key, gamma)
    d1, q1 = self._sample(draft_params, sampler, keys[0], h_last)

    def step(carry, k):
      cache, h_prev, tok, p = carry
      h, cache = self.hidden(draft_params, h_prev[:, None], tok[:, None], p[:, None], cache)
      nxt, q = self._sample(draft_params, sampler, k, h[:, 0])
      return (cache, h[:, 0], nxt, p + 1), (nxt, q)

    (cache, _, _, _), (rest, qs) = jax.lax.scan(step, (cache, h_last, d1, seq_lens), keys[1:])
    drafts = jnp.concatenate([d1[:, None], rest.T.reshape(b, gamma - 1)], axis=1)
    q = as_subset(jnp.concatenate([q1[:, None], jnp.moveaxis(qs, 0, 1)], axis=1),
                  draft_params.get("vocab_map"), self.vocab_size)
    # Only pairs < seq_lens were built from true features; the rest is scratch.
    return drafts, q, state.replace(cache=cache.with_lengths(seq_lens - self.arch.first_pair))

  def tolerates_skipped_steps(self) -> bool:
    return True  # a plain step's feature arrives by ``observe``; ``_catch_up`` feeds any backlog

  def _pairs(self, dp, state: EagleState, tokens, pos, num_valid, cache):
    """Feeds the pairs (f_{p−1}, x_p) of positions pos [B, T] (true features), committing the
    first ``num_valid`` [B]: (ĥ [B, T, D], cache)."""
    s = tokens.shape[1]
    pair_tokens = jnp.take_along_axis(tokens, jnp.clip(pos, 0, s - 1), axis=1)
    feats = jnp.take_along_axis(state.features, jnp.clip(pos - 1, 0, s - 1)[:, :, None], axis=1)
    feats = jnp.where((pos >= 1)[:, :, None], self.fuse(dp, feats), 0.0)
    return self.hidden(dp, feats, pair_tokens, pos, cache, num_valid)

  def _catch_up(self, dp, state: EagleState, tokens, seq_lens, window: int):
    """Feeds the pending pairs (true features): (ĥ of the last committed position, cache).

    After a speculative step 1 … ``window`` pairs are pending, fed in one forward. After
    plain decoding steps that skipped the drafter (an adaptive policy's γ = 0) the
    backlog before the last ``window`` goes first, ``window`` pairs per forward.
    """
    first = self.arch.first_pair
    feed = lambda pos, valid, cache: self._pairs(dp, state, tokens, pos, valid, cache)[1]
    cache = over_backlog(feed, state.cache, state.cache.lengths + first, seq_lens - window,
                         window)
    c = cache.lengths + first  # pairs c … seq_lens − 1 are pending (at most window of them)
    # Without pair zero, a row of committed length 1 has no pair yet (the published
    # drafters start after the target's first token): its window starts at the pair
    # (0, x_0), fed as scratch. Otherwise start = c.
    start = jnp.minimum(c, seq_lens - 1)
    h, cache = self._pairs(dp, state, tokens, start[:, None] + jnp.arange(window)[None, :],
                           seq_lens - c, cache)
    last = jnp.clip(seq_lens - 1 - start, 0, window - 1)[:, None, None]
    return jnp.take_along_axis(h, last, axis=1)[:, 0], cache

  def propose(self, draft_params, state: EagleState, tokens, seq_lens, key, sampler: Sampler,
              topology: TreeTopology | DynamicTree | SampledDynamicTree):
    if topology.is_chain:
      return super().propose(draft_params, state, tokens, seq_lens, key, sampler, topology)
    dp = draft_params
    b = tokens.shape[0]
    h_root, cache = self._catch_up(dp, state, tokens, seq_lens, topology.max_depth + 1)

    def expand(level_tokens, parent_h, depth, mask):
      nonlocal cache
      t, w = mask.shape[-2:]  # [T, W] (static trees) or [B, T, W] (dynamic)
      positions = jnp.broadcast_to((seq_lens - 1 + depth)[:, None], (b, t))
      h, cache = self.hidden(dp, parent_h, level_tokens, positions, cache,
                             num_valid=jnp.zeros((b,), jnp.int32),
                             mask=jnp.broadcast_to(jnp.asarray(mask), (b, t, w)))
      return self.head_logits(dp, h), h

    to_target, wrap_q = vocab_maps(dp.get("vocab_map"), self.vocab_size)
    # No slot map needed: tree pairs are dropped below.
    proposal, _ = grow_tree(topology, sampler, key, self.head_logits(dp, h_root), h_root, expand,
                            to_target, wrap_q, self.tree_draw)
    # Tree pairs were built from predicted features: only pairs < seq_lens stay.
    return proposal, state.replace(cache=cache.with_lengths(seq_lens - self.arch.first_pair))

  def rollback(self, state: EagleState, seq_lens, accepted: AcceptedPath) -> EagleState:
    return state  # the cache already stops at the last pair of true features


# The trained entries of the draft params (the fusion pair only with feature_layers);
# the rest are the target's arrays.
TRAINED_KEYS = ("embed_norm", "feature_norm", "fc", "fc_bias", "layers", "fuse_norms", "fuse")
FUSION_KEYS = ("fuse_norms", "fuse")


def split_params(dp: Params) -> tuple[Params, Params]:
  """Draft params (packed or not) -> (trained weights, the target's arrays the head reads
  without ``vocab_map``, i.e. over the head's rows: what training and teacher-forced eval
  use), all plain."""
  dp = unpack_eagle_params(dp)
  weights = {k: dp[k] for k in TRAINED_KEYS if k in dp}
  frozen = {k: v for k, v in dp.items() if k not in TRAINED_KEYS and k != "vocab_map"}
  return weights, frozen


def head_rows(dp: Params) -> int:
  """How many rows the draft head has (the reduced vocabulary's size, or V), packed or not;
  for heads of their own rows ([K, Vd, D], Medusa's), each head's."""
  head = dp["head"]
  return head.shape[1] if isinstance(head, PackedWeight) else head.shape[-2]


def draft_panel_dtype():
  """The default dtype of a packed draft's panels: float16 where the kernel widens halves in
  hardware (``streaming_matmul.widens_halves_in_hardware``: half the bytes a draft step
  streams, 1-11% faster speculative decoding on a Zen 5, ``benchmarks/results/draft_panels.md``),
  else float32."""
  return jnp.float16 if sm.widens_halves_in_hardware() else jnp.float32


def pack_eagle_params(dp: Params, policy: MatmulPolicy,
                      head_policy: Optional[MatmulPolicy] = None,
                      panel_dtype: Any = None) -> Params:
  """Inference draft params with ``fc``, the fusion and the layers' projections packed for the
  streaming matmul under ``policy`` (the target's layers': ``packed.policy_of``), the head
  under ``head_policy`` (the target's head's: ``packed.head_policy_of``; default ``policy``),
  in panels of ``panel_dtype`` (default ``draft_panel_dtype()``; float32 keeps every bit of
  plain params).

  Float16 panels halve the bytes a draft step streams (the kernel widens them to float32 as
  they load; products and sums stay float32). They round the packed weights to float16 once,
  here: a drafter stored in float16 (the shipped ones) keeps its trained weights exactly, and
  the head's rows of the target round (as do a bfloat16 checkpoint's weights). Any fixed
  draft keeps verification exact, so the output law is unchanged; what can change is which
  drafts are made. ``split_params`` of such params gives the rounded values, which decoding
  uses; packed params repacked in float32 keep them rounded (pack the plain params again
  for the original values).

  A one-layer drafter multiplies a few rows (γ + 1 pending pairs, a tree level's
  k nodes) by small matrices at every draft step: the shapes where the kernel
  beats XLA's dot on CPU. The head is stored as [D, Vd] panels. Plain params
  come back unchanged under a policy that never takes the kernel; train on
  ``unpack_eagle_params``.
  """
  head_policy = policy if head_policy is None else head_policy
  if policy.never and head_policy.never:
    return dp
  panel_dtype = draft_panel_dtype() if panel_dtype is None else panel_dtype
  pack = lambda w, p: pack_under(w, p, panel_dtype)
  layer = lambda l: {k: pack(v, policy) if k in PROJECTIONS else v for k, v in l.items()}
  head = dp["head"]  # packed: [D, Vd] panels; plain: [Vd, D]
  if head_policy.never:
    head = unpacked_head(head)
  else:
    head = pack(head if isinstance(head, PackedWeight) else jnp.transpose(head), head_policy)
  out = dict(dp, layers=[layer(l) for l in dp["layers"]], head=head)
  for k in ("fc", "fuse"):
    if k in dp:
      out[k] = pack(dp[k], policy)
  return out


def unpacked_head(head) -> jax.Array:
  """The [Vd, D] head of plain or packed draft params."""
  return jnp.transpose(unpacked(head)) if isinstance(head, PackedWeight) else head


def unpack_eagle_params(dp: Params) -> Params:
  """Inverse of ``pack_eagle_params``: plain arrays everywhere."""
  out = dict(dp, layers=[{k: unpacked(v) for k, v in l.items()} for l in dp["layers"]],
             head=unpacked_head(dp["head"]))
  for k in ("fc", "fuse"):
    if k in dp:
      out[k] = unpacked(dp[k])
  return out


def eagle_config(target_cfg: ModelConfig, num_layers: int = 1) -> ModelConfig:
  return dataclasses.replace(target_cfg, num_layers=num_layers,
                             name=f"{target_cfg.name}-eagle{num_layers}")


def default_feature_layers(target_cfg: ModelConfig) -> tuple[int, ...]:
  """EAGLE-3's low, mid and high layers, with the highest the last (the one the head reads)."""
  n = target_cfg.num_layers
  return tuple(sorted({min(2, n - 1), n // 2, n - 1}))


def _fusion_init(d: int, k: int) -> dict:
  """Unit norms and the identity on the highest layer: an untrained fusion reads h_{l_k}."""
  fuse = jnp.zeros((k * d, d), jnp.float32).at[(k - 1) * d:].set(jnp.eye(d))
  return {"fuse_norms": jnp.ones((k, d), jnp.float32), "fuse": fuse}


def init_eagle_weights(target_cfg: ModelConfig, target_params: Params, num_layers: int = 1,
                       key: Optional[jax.Array] = None,
                       feature_layers: tuple[int, ...] = ()) -> Params:
  """Trainable EAGLE weights: unit norms, a random ``fc`` (variance 1 / 2D), layers
  copied from the target's last ``num_layers`` and, with ``feature_layers``, the fusion."""
  d = target_cfg.dim
  key = jax.random.PRNGKey(0) if key is None else key
  fc = jax.random.normal(key, (2 * d, d), jnp.float32) / np.sqrt(2 * d)
  layers = [{k: jnp.array(unpacked(v), jnp.float32) for k, v in l.items()}  # plain, trainable
            for l in target_params["layers"][-num_layers:]]
  weights = {"embed_norm": jnp.ones((d,), jnp.float32),
             "feature_norm": jnp.ones((d,), jnp.float32),
             "fc": fc, "fc_bias": jnp.zeros((d,), jnp.float32), "layers": layers}
  return dict(weights, **_fusion_init(d, len(feature_layers))) if feature_layers else weights


def random_eagle_weights(target_cfg: ModelConfig, num_layers: int, key: jax.Array,
                         scale: float = 0.5, num_fused: int = 0) -> Params:
  """Random trainable weights (tests); ``num_fused`` > 0 adds a random fusion."""
  k1, k2, k3 = jax.random.split(key, 3)
  d = target_cfg.dim
  layers = init_params(eagle_config(target_cfg, num_layers), k1, scale=scale)["layers"]
  weights = {"embed_norm": jnp.ones((d,)), "feature_norm": jnp.ones((d,)),
             "fc": scale * jax.random.normal(k2, (2 * d, d)), "fc_bias": jnp.zeros((d,)),
             "layers": layers}
  if num_fused:
    weights.update(fuse_norms=jnp.ones((num_fused, d)),
                   fuse=jax.random.normal(k3, (num_fused * d, d)) / np.sqrt(num_fused * d))
  return weights


def eagle_params(target_cfg: ModelConfig, target_params: Params, weights: Params,
                 vocab_map: Optional[np.ndarray] = None) -> Params:
  """Draft params: trained ``weights`` + the target's embedding, final norm and LM-head rows
  (``vocab_map`` selects a reduced output vocabulary; None = all rows)."""
  head = target_head(target_cfg, target_params)
  # The trained weights compute in the target's dtype (bfloat16 beside a bfloat16 target).
  dp = dict(cast_params(weights, compute_dtype(target_params)), embed=target_params["embed"],
            final_norm=target_params["final_norm"])
  if vocab_map is None:
    dp["head"] = head
  else:
    vm = jnp.asarray(vocab_map, jnp.int32)
    dp["head"], dp["vocab_map"] = head[vm], vm
  return dp


def eagle_drafter(target_cfg: ModelConfig, target_params: Params, weights: Params,
                  vocab_map: Optional[np.ndarray] = None,
                  feature_layers: tuple[int, ...] = (), panel_dtype: Any = None
                  ) -> tuple[EagleDrafter, Params]:
  """(drafter, draft_params) for trained EAGLE ``weights`` on this target; the draft's
  matrices are packed like the target's, in panels of ``panel_dtype`` (``pack_eagle_params``),
  plain for plain targets."""
  num_layers = len(weights["layers"])
  if weights["fc"].shape != (2 * target_cfg.dim, target_cfg.dim):
    raise ValueError(f"EAGLE weights of width {weights['fc'].shape[1]} do not fit a target of "
                     f"width {target_cfg.dim}")
  if bool(feature_layers) != ("fuse" in weights):
    raise ValueError(f"feature_layers {tuple(feature_layers)} but the weights "
                     f"{'have' if 'fuse' in weights else 'lack'} a fusion")
  feature_layers = validation.layer_indices(feature_layers, "feature_layers",
                                            target_cfg.num_layers)
  drafter = EagleDrafter(eagle_config(target_cfg, num_layers), feature_layers=feature_layers)
  dp = eagle_params(target_cfg, target_params, weights, vocab_map)
  drafter.check_params(dp)
  dp = pack_eagle_params(dp, policy_of(target_params), head_policy_of(target_params),
                         panel_dtype)
  return drafter, dp

