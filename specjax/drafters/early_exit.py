"""Self-speculative early exit: the target's first k layers + its final norm and LM head.

Training-free, or with a trained exit head (LayerSkip-style self-speculation on
a frozen target): ``trained_exit_drafter`` puts residual SiLU blocks between the
final norm and the LM head rows (``drafters.residual_head``, trained by
``specjax.distill.heads.exit_objective``); zero blocks are the training-free exit.
Either way the draft shares the target's weights (the draft params are the
target's own arrays, no copy) and the target's KV cache: for every committed
token, the key/value of layer l < k computed by the truncated model is exactly
the target's (same weights, same inputs, same position), so the drafter
attends over the target cache's first k layers instead of keeping and
prefilling a cache of its own.

Per step, on a target cache holding the committed length s − 1 (see
``speculative/decoder.py``): the drafter feeds the last committed token at
slot s − 1 and then its own drafts at s, s + 1, …, writing their layer-l < k
entries into those scratch slots. Verification feeds the same slots again
(the last committed token and the drafts through all L layers) and overwrites
them, so the drafter never leaves anything behind (without an adapter, below, it
keeps no state). Trees work the same way, one forward per depth under the tree
mask (``tree_draft``): node i at slot s + i, verification's layout; an EAGLE-2
dynamic tree's frontier slots may reach past the verified block, into slots past
the committed length that nothing reads before they are written again.

A trained exit may read layer k's output through an **attention adapter** first:
one trained decoder layer (initialised from the target's layer k, ``adapter_layer``)
whose keys and values of committed positions need a cache of its own, one layer
deep (``AdapterState``: 1/L of the target cache). It is built from the target's
true layer-k outputs: the prefill's and every verification's (``observe``, the
feature-drafter interface with ``target_feature_layers`` = (k − 1,)); ``propose``
feeds the ones not yet fed, then the drafts as scratch. Because the draft computes
layer k itself over the shared cache, its input is exact at every draft depth (not
a predicted feature, as EAGLE's is), so teacher-forced α is the real one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax.config import ModelConfig
from specjax.drafters.residual_head import head_logits, target_head
from specjax.drafters.tree_draft import check_tree_draw, grow_tree, vocab_maps
from specjax.generate import last_tokens, over_backlog, over_chunks
from specjax.kernels.packed import PackedWeight, unpacked
from specjax.model import Params, compute_dtype, forward, run_layers
from specjax.sampling import Sampler, as_subset, sample_subset
from specjax.speculative.drafter import Drafter, SharedCache
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology
from specjax.speculative.tree_acceptance import AcceptedPath


@flax.struct.dataclass(kw_only=True)
class AdapterState:
  """A trained exit's attention adapter's own state.

  Attributes:
    cache: the adapter layer's one-layer KV cache; slots below ``cache.lengths`` were
      built from true features (the target's layer-k outputs).
    features: [B, S, D] the target's layer-k outputs by position, written by the
      prefill and by every verification (``observe``).
  """

  cache: kvc.KVCache
  features: jax.Array


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(Drafter):
  """Drafts with the first ``cfg.num_layers`` layers of the target.

  Attributes:
    cfg: the target's config truncated to k layers.
    trained: the logits come from the trained exit head ``draft_params["exit"]``
      (``residual_head`` params, optionally with a ``vocab_map`` of its rows) instead of
      the target's final norm and LM head.
    adapter: the trained exit reads layer k's output through its own decoder layer
      ``draft_params["exit"]["adapter"]`` first (``adapter_sequence``), which keeps a
      one-layer KV cache of its own (filled from the target's layer-k features).
    tree_draw: how a static tree's children are chosen: "point_mass" (the top-c tokens)
      or "without_replacement" (c draws, verified with the real q); see ``tree_draft``.
      Dynamic trees always take the top-k.
  """

  cfg: ModelConfig
  trained: bool = False
  adapter: bool = False
  tree_draw: str = "point_mass"

  def __post_init__(self):
    if self.adapter and not self.trained:
      raise ValueError("an attention adapter belongs to a trained exit (trained=True)")
    check_tree_draw(self.tree_draw)

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def check_params(self, draft_params) -> None:
    if len(draft_params["layers"]) != self.cfg.num_layers:
      raise ValueError(f"early exit after {self.cfg.num_layers} layers got draft params with "
                       f"{len(draft_params['layers'])}")
    if not self.trained:
      return
    ep = draft_params.get("exit")
    if not isinstance(ep, dict) or not {"final_norm", "res_w", "res_b", "head"} <= set(ep):
      raise ValueError("a trained exit needs draft_params['exit'] with final_norm, res_w, res_b "
                       "and head (trained_exit_drafter builds them)")
    d = self.cfg.dim
    if np.shape(ep["res_w"])[0] != 1 or np.shape(ep["res_w"])[2:] != (d, d) or (
        np.shape(ep["head"])[-1] != d):
      raise ValueError(f"exit head of res_w {np.shape(ep['res_w'])} and head "
                       f"{np.shape(ep['head'])} does not fit width {d} (one head)")
    if self.adapter != ("adapter" in ep):
      raise ValueError("the exit head has an attention adapter but the drafter was built "
                       "without one, or the other way round (trained_exit_drafter decides)")
    if self.adapter:
      got = {k: np.shape(v) for k, v in ep["adapter"].items()}
      want = {k: np.shape(v) for k, v in draft_params["layers"][0].items()}
      if got != want:
        raise ValueError(f"the exit's adapter layer {got} is not shaped like the target's "
                         f"layers {want}")

  def supports(self, topology: TreeTopology | DynamicTree | SampledDynamicTree) -> bool:
    # any static tree (``tree_draft.grow``), EAGLE-2 tree (``grow_dynamic``) or sampled
    # dynamic tree (``grow_sampled``)
    return True

  def _draft_logits(self, draft_params: Params, tokens: jax.Array, positions: jax.Array,
                    cache: kvc.KVCache, own_cache: Optional[kvc.KVCache], num_valid=None,
                    mask=None) -> tuple[jax.Array, kvc.KVCache, Optional[kvc.KVCache]]:
    """One draft forward of [B, T] tokens at ``positions`` over the target cache's first k
    layers (and the adapter's cache; ``mask``/``num_valid`` as in ``model.forward``):
    (float32 logits [B, T, Vd] over the exit's rows, the two caches)."""
    out = forward(draft_params, self.cfg, tokens, positions, cache, mask, num_valid=num_valid,
                  compute_logits=not self.trained)
    if not self.trained:
      return out.logits, out.cache, own_cache
    hidden = out.hidden
    if self.adapter:
      hidden, own_cache = self._adapter(draft_params, hidden, positions, own_cache, num_valid,
                                        mask)
    logits = head_logits(draft_params["exit"], hidden[:, :, None], self.cfg.norm_eps)[:, :, 0]
    return logits, out.cache, own_cache

  @staticmethod
  def _rows(draft_params: Params) -> Optional[jax.Array]:
    """[Vd] the target ids of the trained exit head's rows; None: all V (or untrained)."""
    return draft_params.get("exit", {}).get("vocab_map")

  def tolerates_skipped_steps(self) -> bool:
    return True  # the target's cache is current after plain steps; the adapter observes them

  def shares_target_cache(self) -> bool:
    return True  # ``propose`` gets the target's KV cache beside its own state

  def reads_target_features(self) -> bool:
    return self.adapter  # the adapter's cache is filled from layer k's verified outputs

  def target_feature_layers(self) -> tuple[int, ...]:
    return (self.cfg.num_layers - 1,) if self.adapter else ()

  def _adapter(self, draft_params: Params, x: jax.Array, positions: jax.Array,
               cache: kvc.KVCache, num_valid=None, mask=None) -> tuple[jax.Array, kvc.KVCache]:
    return run_adapter(draft_params["exit"]["adapter"], self.cfg, x.astype(cache.k[0].dtype),
                       positions, cache, num_valid, mask)

  def _feed(self, draft_params: Params, features: jax.Array, pos: jax.Array, valid: jax.Array,
            cache: kvc.KVCache) -> kvc.KVCache:
    """Writes the adapter's entries of positions ``pos`` [B, C] from the stored true
    features, committing the first ``valid`` [B] of them."""
    s = features.shape[1]
    x = jnp.take_along_axis(features, jnp.clip(pos, 0, s - 1)[:, :, None], axis=1)
    return self._adapter(draft_params, x, pos, cache, valid)[1]

  def init(self, draft_params, tokens, prompt_lens, features=None) -> Any:
    """No state; with an adapter, an ``AdapterState`` whose cache holds the prompt's
    positions 0 … P − 2 (``features``: layer k's outputs there), fed in chunks."""
    if not self.adapter:
      return ()
    b, s = tokens.shape
    features = features[:, :s]
    cache = kvc.init_cache(dataclasses.replace(self.cfg, num_layers=1), b, s,
                           compute_dtype(draft_params))
    feed = lambda idx, valid, cache: self._feed(
        draft_params, features, jnp.broadcast_to(idx, (b, idx.shape[0])), valid, cache)
    return AdapterState(cache=over_chunks(feed, cache, prompt_lens - 1, s), features=features)

  def observe(self, state: Any, hidden: jax.Array, start: jax.Array) -> Any:
    """Stores the target's layer-k outputs ``hidden`` [B, T, D] of positions start[b] + t
    (the root and the accepted path, or a plain step's root); ``propose`` feeds them."""
    b, t = hidden.shape[:2]
    pos = start[:, None] + jnp.arange(t)[None, :]
    feats = state.features.at[jnp.arange(b)[:, None], pos].set(
        hidden.astype(state.features.dtype), mode="drop")
    return state.replace(features=feats)

  def _catch_up(self, draft_params: Params, state: SharedCache, seq_lens: jax.Array,
                chunk: int) -> tuple[kvc.KVCache, Any]:
    """(the target cache's first k layers, holding seq_lens − 1; the own state, whose adapter
    cache, if any, has been fed the committed positions it lacked, ``chunk`` per forward)."""
    target, own = state
    cache = kvc.KVCache(k=target.k[:self.cfg.num_layers], v=target.v[:self.cfg.num_layers],
                        lengths=target.lengths)
    if self.adapter:  # the entries of committed positions not yet fed (up to the last
      # step's depth + 1 after a speculative step, more after plain steps), from true features
      feed = lambda pos, valid, c: self._feed(draft_params, own.features, pos, valid, c)
      own = own.replace(cache=over_backlog(feed, own.cache, own.cache.lengths, seq_lens - 1,
                                           chunk))
    return cache, own

  def _scratch(self, own: Any, own_cache: Optional[kvc.KVCache], seq_lens: jax.Array) -> Any:
    """The own state after drafting: the drafts' adapter entries are scratch (only positions
    below seq_lens − 1 are true)."""
    return own.replace(cache=own_cache.with_lengths(seq_lens - 1)) if self.adapter else own

  def propose_chain(self, draft_params: Params, state: SharedCache, tokens: jax.Array,
                    seq_lens: jax.Array, key: jax.Array, sampler: Sampler, gamma: int):
    """Drafts over the target cache's first k layers (and the adapter's own cache)."""
    cache, own = self._catch_up(draft_params, state, seq_lens, gamma + 1)
    rows = self._rows(draft_params)

    def step(carry, key):
      cache, own_cache, tok, pos = carry
      logits, cache, own_cache = self._draft_logits(draft_params, tok[:, None], pos[:, None],
                                                    cache, own_cache)
      nxt, q = (sampler.sample(key, logits[:, 0]) if rows is None
                else sample_subset(sampler, key, logits[:, 0], rows))
      return (cache, own_cache, nxt, pos + 1), (nxt, q)

    first = last_tokens(tokens, seq_lens)[:, 0]
    own_cache = own.cache if self.adapter else None
    (_, own_cache, _, _), (drafts, qs) = jax.lax.scan(
        step, (cache, own_cache, first, seq_lens - 1), jax.random.split(key, gamma))
    return (drafts.T, as_subset(jnp.moveaxis(qs, 0, 1), rows, self.vocab_size),
            self._scratch(own, own_cache, seq_lens))

  def propose(self, draft_params: Params, state: SharedCache, tokens: jax.Array,
              seq_lens: jax.Array, key: jax.Array, sampler: Sampler,
              topology: TreeTopology | DynamicTree | SampledDynamicTree):
    """Chains as ``propose_chain``; a tree one draft forward per depth over the target
    cache's scratch slots, node i at slot root + 1 + i (verification's layout, which
    overwrites them; ``tree_draft``)."""
    if topology.is_chain:
      return super().propose(draft_params, state, tokens, seq_lens, key, sampler, topology)
    b = tokens.shape[0]
    cache, own = self._catch_up(draft_params, state, seq_lens, topology.max_depth + 1)
    own_cache = own.cache if self.adapter else None
    root_logits, cache, own_cache = self._draft_logits(  # the root: the last committed token
        draft_params, last_tokens(tokens, seq_lens), (seq_lens - 1)[:, None], cache, own_cache)

    def expand(level_tokens, _, depth, mask):
      nonlocal cache, own_cache
      t, w = mask.shape[-2:]  # [T, W] (static trees) or [B, T, W] (dynamic)
      logits, cache, own_cache = self._draft_logits(
          draft_params, level_tokens, jnp.broadcast_to((seq_lens - 1 + depth)[:, None], (b, t)),
          cache, own_cache, num_valid=jnp.zeros((b,), jnp.int32),
          mask=jnp.broadcast_to(jnp.asarray(mask), (b, t, w)))
      return logits, None

    to_target, wrap_q = vocab_maps(self._rows(draft_params), self.vocab_size)
    proposal, _ = grow_tree(topology, sampler, key, root_logits[:, 0], None, expand, to_target,
                            wrap_q, self.tree_draw)
    return proposal, self._scratch(own, own_cache, seq_lens)

  def rollback(self, state: Any, seq_lens: jax.Array, accepted: AcceptedPath) -> Any:
    return state  # the adapter's cache already stops at the last true feature


def adapter_layer(cfg: ModelConfig, params: Params, num_layers: int) -> Params:
  """A float32 copy of the target's layer ``num_layers`` (the one after the exit): the
  attention adapter's initial weights, so that untrained it is the target's next layer."""
  return jax.tree.map(lambda w: jnp.asarray(unpacked(w), jnp.float32),
                      params["layers"][num_layers], is_leaf=lambda w: isinstance(w, PackedWeight))


def run_adapter(adapter: Params, cfg: ModelConfig, x: jax.Array, positions: jax.Array,
                cache: kvc.KVCache, num_valid=None, mask=None) -> tuple[jax.Array, kvc.KVCache]:
  """The adapter layer over [B, T, D] layer-k outputs at ``positions`` [B, T], against its
  one-layer ``cache`` (``mask``/``num_valid`` as in ``model.forward``): (outputs [B, T, D],
  the cache with their entries)."""
  y, _, cache = run_layers({"layers": [adapter]}, dataclasses.replace(cfg, num_layers=1), x,
                           positions, cache, mask, num_valid=num_valid)
  return y, cache


def adapter_sequence(adapter: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
  """The adapter over whole sequences: [B, L, D] layer-k outputs at positions 0..L-1 ->
  [B, L, D] (causal; what training reads, teacher-forced)."""
  b, l, _ = x.shape
  cache = kvc.init_cache(dataclasses.replace(cfg, num_layers=1), b, l, x.dtype)
  return run_adapter(adapter, cfg, x, jnp.broadcast_to(jnp.arange(l), (b, l)), cache)[0]


def early_exit_drafter(cfg: ModelConfig, params: Params,
                       num_layers: int) -> tuple[EarlyExitDrafter, Params]:
  """Returns (drafter, draft_params) exiting after ``num_layers`` of the target."""
  if not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
  drafter = EarlyExitDrafter(dataclasses.replace(cfg, num_layers=num_layers,
                                                 name=f"{cfg.name}-exit{num_layers}"))
  return drafter, dict(params, layers=params["layers"][:num_layers])


def trained_exit_drafter(cfg: ModelConfig, params: Params, num_layers: int, weights: Params,
                         vocab_map: Optional[np.ndarray] = None) -> tuple[EarlyExitDrafter, Params]:
  """(drafter, draft_params) exiting after ``num_layers`` through a trained exit head.

  Args:
    cfg, params: the target.
    num_layers: k, the layers the draft runs (its exit is layer k − 1's output).
    weights: ``res_w`` [1, L, D, D] and ``res_b`` [1, L, D] (``distill.heads``), and
      optionally the head's own trained rows ``head`` [1, Vd, D] (``--own_head``) and an
      attention adapter ``adapter`` (a decoder layer's params, ``--exit_adapter``).
    vocab_map: [Vd] target ids of the head's rows (without an own head: the target's
      LM head rows there); None: all V rows.
  """
  drafter, dp = early_exit_drafter(cfg, params, num_layers)
  drafter = dataclasses.replace(drafter, trained=True, adapter="adapter" in weights)
  dtype = compute_dtype(params)
  ep = {"final_norm": params["final_norm"], "res_w": jnp.asarray(weights["res_w"], dtype),
        "res_b": jnp.asarray(weights["res_b"], dtype)}
  if "adapter" in weights:
    ep["adapter"] = {k: jnp.asarray(v, dtype) for k, v in weights["adapter"].items()}
  if vocab_map is not None:
    ep["vocab_map"] = jnp.asarray(np.asarray(vocab_map), jnp.int32)
  if "head" in weights:
    head = jnp.asarray(weights["head"], dtype)
    rows = cfg.vocab_size if vocab_map is None else len(vocab_map)
    if head.shape != (1, rows, cfg.dim):
      raise ValueError(f"the exit's own head must be [1, {rows}, {cfg.dim}] (its vocabulary's "
                       f"rows), got {head.shape}")
  else:
    head = target_head(cfg, params)
    head = head if vocab_map is None else head[ep["vocab_map"]]
  dp = dict(dp, exit=dict(ep, head=head))
  drafter.check_params(dp)
  return drafter, dp
