"""Any specjax model as a draft, optionally over a reduced vocabulary.

The draft keeps its own KV cache. After a step in which all γ drafts were
accepted, the draft has not yet seen its own last draft token, so its cache
can lag the committed sequence by up to two tokens; each ``propose`` therefore
starts with one forward over two tokens (``num_valid`` 1 or 2), which keeps
the shapes static. Plain decoding steps of an adaptive policy skip the draft;
the next ``propose`` first feeds that backlog in chunks (``over_backlog``).

Reduced vocabulary (FR-Spec / EAGLE-3 style): a draft with V_d < V outputs
logits over V_d ids and carries ``vocab_map`` [V_d] of target ids. It samples
over its V_d rows and hands q over as ``SubsetProbs`` on the map, zero elsewhere
(``sampling.sample_subset``; the same as warping logits lifted with -inf), so
tokens outside the map have q = 0 — verification remains exact.

Trees: a static topology is grown by ``tree_draft.grow`` and a sampled dynamic tree
by ``tree_draft.grow_sampled`` (node i at draft slot root + 1 + i, the target's layout);
an EAGLE-2 ``DynamicTree`` by
``tree_draft.grow_dynamic``, whose propose returns a ``DynamicDraftState``
(the cache plus where each node was written) that ``rollback`` compacts
back into a plain cache, so the state between steps is always a KVCache.
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
from specjax.drafters.reduced_vocab import full_input
from specjax.drafters.tree_draft import check_tree_draw, grow_tree, vocab_maps
from specjax.generate import over_backlog, prefill
from specjax.model import Params, compute_dtype, forward
from specjax.sampling import Sampler, as_subset, sample_subset
from specjax.speculative.drafter import Drafter
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology
from specjax.speculative.tree_acceptance import AcceptedPath

BACKLOG_CHUNK = 4  # tokens per forward when catching up after skipped steps


@flax.struct.dataclass(kw_only=True)
class DynamicDraftState:
  """What ``ModelDrafter.propose`` returns for a ``DynamicTree`` (``rollback`` undoes it).

  Attributes:
    cache: the draft cache, the fed tree nodes written past the root.
    slots: [B, N] each node's draft-cache slot offset from the root (-1: never fed).
  """

  cache: kvc.KVCache
  slots: jax.Array


@dataclasses.dataclass(frozen=True)
class ModelDrafter(Drafter):
  """A draft model.

  Attributes:
    cfg: the draft's config.
    target_vocab_size: when set (reduced vocabulary), the size of the target
      vocabulary; draft_params must then come from ``make_params`` with a map.
    tree_draw: how a tree's children are chosen: "point_mass" (the top-c
      draft tokens) or "without_replacement" (c draws from the warped draft,
      verified with the real q); see ``tree_draft``. EAGLE-2 dynamic trees
      always take the top-k (point mass), sampled dynamic trees draw whenever the
      sampler does.
  """

  cfg: ModelConfig
  target_vocab_size: Optional[int] = None
  tree_draw: str = "point_mass"

  def __post_init__(self):
    check_tree_draw(self.tree_draw)

  def supports(self, topology: TreeTopology | DynamicTree | SampledDynamicTree) -> bool:
    # any static tree (``tree_draft.grow``), EAGLE-2 tree (``grow_dynamic``) or sampled
    # dynamic tree (``grow_sampled``)
    return True

  @property
  def vocab_size(self) -> int:
    return self.target_vocab_size or self.cfg.vocab_size

  def make_params(self, params: Params, vocab_map: Optional[np.ndarray] = None,
                  input_map: Optional[np.ndarray] = None, unknown_row: int = 0,
                  input_embed: Optional[Any] = None) -> dict[str, Any]:
    """Packs draft weights (and the reduced-vocabulary maps) as ``draft_params``.

    Args:
      params: the draft model's weights.
      vocab_map: [V_d] target id of each draft row (reduced vocabulary only).
      input_map: [V] draft row read for each target id; default: its own row
        for ids in the map and ``unknown_row`` for the rest.
      unknown_row: see ``input_map``.
      input_embed: [V, D] the target's embedding table (same width as the draft):
        full-vocabulary input. Ids in the map read the draft's own (trained)
        rows, every other id the target's row instead of a substitute row, so
        prompt tokens outside the draft's vocabulary keep their meaning
        (``input_map`` is then unused). The draft keeps its own rows as its
        output head. The target's table is shared, not copied
        (``model.embed_inputs``).

    Example: with vocab_map [0, 7, 3] and input_embed E, target id 7 reads the
    draft's row 1 and target id 5 reads E[5].
    """
    if vocab_map is None:
      if self.target_vocab_size is not None:
        raise ValueError("a reduced-vocabulary drafter needs a vocab_map")
      if input_embed is not None:
        raise ValueError("input_embed is for a reduced-vocabulary draft; this one reads "
                         "every id through its own embedding already")
      return {"model": params}
    vocab_map = np.asarray(vocab_map, np.int32)
    if self.target_vocab_size is None or vocab_map.shape != (self.cfg.vocab_size,):
      raise ValueError(f"vocab_map must have shape ({self.cfg.vocab_size},) and the drafter "
                       "a target_vocab_size")
    if vocab_map.min() < 0 or vocab_map.max() >= self.target_vocab_size:
      raise ValueError("vocab_map has ids outside the target vocabulary")
    if input_embed is not None:
      reads = full_input(vocab_map, input_embed, self.target_vocab_size, self.cfg.dim)
      return {"model": dict(params, **reads), "vocab_map": jnp.asarray(vocab_map)}
    if input_map is None:
      inverse = np.full((self.target_vocab_size,), unknown_row, np.int32)
      inverse[vocab_map] = np.arange(len(vocab_map), dtype=np.int32)
    else:
      inverse = np.asarray(input_map, np.int32)
      if inverse.shape != (self.target_vocab_size,) or inverse.min() < 0 or (
          inverse.max() >= self.cfg.vocab_size):
        raise ValueError(f"input_map must map {self.target_vocab_size} target ids to draft rows")
    return {"model": params, "vocab_map": jnp.asarray(vocab_map),
            "inverse_map": jnp.asarray(inverse)}

  def check_params(self, draft_params: Any) -> None:
    """Raises ValueError unless ``draft_params`` came from ``make_params`` for this config."""
    if not isinstance(draft_params, dict) or "model" not in draft_params:
      raise ValueError("draft_params must come from ModelDrafter.make_params (a dict with "
                       f"'model'), got {type(draft_params).__name__}")
    if (self.target_vocab_size is not None) != ("vocab_map" in draft_params):
      raise ValueError("draft_params and the drafter disagree on a reduced vocabulary: build "
                       "them with this drafter's make_params")
    validation.check_params(draft_params["model"], self.cfg, "draft_params['model']")

  @staticmethod
  def _draft_ids(dp, tokens):
    """Target ids -> rows of the input table (identity for a full-vocabulary draft or one
    that reads the target's table, ``make_params(input_embed=...)``)."""
    return tokens if "inverse_map" not in dp else dp["inverse_map"][tokens]

  def _forward(self, dp, tokens, positions, cache, num_valid=None, mask=None):
    """Logits over the draft's own rows (Vd) and the new cache."""
    out = forward(dp["model"], self.cfg, self._draft_ids(dp, tokens), positions, cache, mask,
                  num_valid=num_valid)
    return out.logits, out.cache

  def tolerates_skipped_steps(self) -> bool:
    return True  # ``_catch_up`` feeds any backlog

  def _catch_up(self, dp, state: kvc.KVCache, tokens, seq_lens):
    """Feeds the committed tokens the cache lacks: (logits after the last [B, Vd], cache).

    After a speculative step these are 1–2 tokens, fed in one forward. After plain
    decoding steps that skipped the drafter (an adaptive policy's γ = 0) the backlog
    before the last two goes first, ``BACKLOG_CHUNK`` tokens per forward.
    """
    s = tokens.shape[1]

    def feed(pos, valid, cache):
      chunk = jnp.take_along_axis(tokens, jnp.clip(pos, 0, s - 1), axis=1)
      return self._forward(dp, chunk, pos, cache, valid)[1]

    state = over_backlog(feed, state, state.lengths, seq_lens - 2, BACKLOG_CHUNK)
    start = state.lengths  # seq_lens - 2 <= start <= seq_lens - 1
    idx = start[:, None] + jnp.arange(2)[None, :]
    pair = jnp.take_along_axis(tokens, jnp.clip(idx, 0, tokens.shape[1] - 1), axis=1)
    num_valid = seq_lens - start
    logits, cache = self._forward(dp, pair, idx, state, num_valid)
    return jnp.take_along_axis(logits, (num_valid - 1)[:, None, None], axis=1)[:, 0], cache

  def _sample(self, dp, sampler: Sampler, key, logits):
    """(target ids, q over the draft's rows) from draft-row logits."""
    if "vocab_map" in dp:
      return sample_subset(sampler, key, logits, dp["vocab_map"])
    return sampler.sample(key, logits)

  def init(self, draft_params, tokens, prompt_lens, features=None) -> kvc.KVCache:
    b, s = tokens.shape
    return prefill(draft_params["model"], self.cfg, self._draft_ids(draft_params, tokens),
                   prompt_lens - 1,
                   kvc.init_cache(self.cfg, b, s, compute_dtype(draft_params["model"])))

  def propose_chain(self, draft_params, state: kvc.KVCache, tokens, seq_lens, key,
                    sampler: Sampler, gamma: int):
    b = tokens.shape[0]
    last_logits, cache = self._catch_up(draft_params, state, tokens, seq_lens)
    keys = jax.random.split(key, gamma)
    d1, q1 = self._sample(draft_params, sampler, keys[0], last_logits)

    def step(carry, k):
      cache, tok, pos = carry
      logits, cache = self._forward(draft_params, tok[:, None], pos[:, None], cache)
      nxt, q = self._sample(draft_params, sampler, k, logits[:, 0])
      return (cache, nxt, pos + 1), (nxt, q)

    (cache, _, _), (rest, qs) = jax.lax.scan(step, (cache, d1, seq_lens), keys[1:])
    drafts = jnp.concatenate([d1[:, None], rest.T.reshape(b, gamma - 1)], axis=1)
    q = jnp.concatenate([q1[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return drafts, as_subset(q, draft_params.get("vocab_map"), self.target_vocab_size), cache

  def propose(self, draft_params, state: kvc.KVCache, tokens, seq_lens, key, sampler: Sampler,
              topology: TreeTopology | DynamicTree | SampledDynamicTree):
    if topology.is_chain:
      return super().propose(draft_params, state, tokens, seq_lens, key, sampler, topology)
    dp = draft_params
    root_logits, cache = self._catch_up(dp, state, tokens, seq_lens)  # lengths = seq_lens
    b = tokens.shape[0]

    def expand(level_tokens, _, depth, mask):
      nonlocal cache
      t, w = mask.shape[-2:]  # [T, W] (static trees) or [B, T, W] (dynamic)
      positions = jnp.broadcast_to((seq_lens - 1 + depth)[:, None], (b, t))
      logits, cache = self._forward(dp, level_tokens, positions, cache,
                                    num_valid=jnp.zeros((b,), jnp.int32),
                                    mask=jnp.broadcast_to(jnp.asarray(mask), (b, t, w)))
      return logits, None

    to_target, wrap_q = vocab_maps(dp.get("vocab_map"), self.vocab_size)
    proposal, slots = grow_tree(topology, sampler, key, root_logits, None, expand, to_target,
                                wrap_q, self.tree_draw)
    if slots is not None:  # an EAGLE-2 tree; others write node i at slot root + 1 + i
      return proposal, DynamicDraftState(cache=cache, slots=slots)
    return proposal, cache

  def rollback(self, state: kvc.KVCache | DynamicDraftState, seq_lens,
               accepted: AcceptedPath) -> kvc.KVCache:
    if isinstance(state, DynamicDraftState):
      # Node j was written at slot root + slots[j]; every accepted node but
      # possibly the last has children, so was fed (a frontier node).
      node = jnp.maximum(accepted.path[:, 1:] - 1, 0)
      src = jnp.where(accepted.path[:, 1:] >= 0,
                      jnp.take_along_axis(state.slots, node, axis=1), -1)
      fed = jnp.sum(src >= 0, axis=1)
      src = jnp.concatenate([jnp.zeros_like(src[:, :1]), src], axis=1)  # the root stays put
      return kvc.compact(state.cache, accepted.start, src).with_lengths(
          jnp.minimum(seq_lens - 1, accepted.start + 1 + fed))
    # The draft wrote node i at slot root + 1 + i (``tree_draft``), the target's
    # layout: the same compaction applies. It fed every depth but the last, and
    # never the newest committed token (the next propose feeds it).
    depth = accepted.path.shape[1] - 1
    fed = accepted.start + 1 + jnp.minimum(accepted.num_accepted, depth - 1)
    return kvc.compact(state, accepted.start, accepted.path).with_lengths(
        jnp.minimum(seq_lens - 1, fed))
