"""The draft–verify loop: propose → verify → accept → commit → rollback, one jitted while loop.

The step is the same for chains and token trees: a chain of γ drafts is the
topology ``TreeTopology.chain(γ)``. The topology, the sampler, the drafter
and the model configs are static (fields of the frozen
``SpeculativeDecoder``); prompt lengths, acceptance, budgets and the
contents of dynamic trees are arrays, so nothing recompiles across prompts,
acceptance patterns or trees.

Step, for a row with committed length s (the target cache holds s − 1):
  propose: the drafter builds a ``Proposal`` of the topology's N nodes;
  verify:  the target runs the block [x_{s−1}, nodes...] in one forward at
           positions s − 1 + depth under the tree's ancestor mask, giving p at
           every block entry (``TargetScores``);
  accept:  a lossless rule picks the accepted path (n nodes) and draws one
           more token (``tree_acceptance.accept_tree``);
  commit:  the path's tokens and the extra token are appended, trimmed at
           EOS/budget (``sequences.append``); the path's keys and values move
           to contiguous slots (``kv_cache.compact``, skipped for chains,
           where the path already is contiguous); a feature drafter (EAGLE)
           receives the target's features along the path;
  rollback: both models forget everything past the new committed length.

With an adaptive policy (``adaptive.AdaptiveGamma``) each step is first sized:
the policy picks a chain length or a tree from its static set (γ = 0: a plain
decoding step that skips the drafter) from the acceptance seen so far;
``run`` runs each choice's steps in its own inner loop (``steps_while``'s
docstring says why).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax import sharding, validation
from specjax.attention import resolve_impl
from specjax.config import ModelConfig
from specjax.generate import check_sampler, generate_packed, last_tokens, prefill
from specjax.model import Params, compute_dtype, forward, target_features
from specjax.prompts import pack_prompts
from specjax.sampling import Greedy, Sampler, first_argmax
from specjax.sequences import append
from specjax.speculative.acceptance import keep_probabilities, scoring_chances
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.speculative.block_verification import VERIFICATIONS
from specjax.speculative.drafter import SharedCache
from specjax.speculative.metrics import SpecResult, counters_to_host, summarize
from specjax.speculative.proposal import Proposal
from specjax.speculative.state import SpecCounters, SpecState
from specjax.speculative.tree import (DynamicTree, SampledDynamicTree, TreeTopology,
                                      block_mask_from_parents, depth_from_parents)
from specjax.speculative.tree_acceptance import (AcceptedPath, TreeAcceptance, accept_tree,
                                                 accepted_tokens, first_chain_beta,
                                                 node_ranks)
from specjax.speculative.typical_acceptance import (TYPICAL_LOSSY, TypicalAcceptance,
                                                    accept_typical)

if TYPE_CHECKING:
  from specjax.speculative.drafter import Drafter


@functools.partial(jax.jit, static_argnames=("target_cfg", "drafter"))
def prefill_models(target_cfg: ModelConfig, drafter: "Drafter", target_params: Params,
                   draft_params: Any, tokens: jax.Array, prompt_lens: jax.Array
                   ) -> tuple[kvc.KVCache, Any]:
  """Commits ``tokens[b, :prompt_lens[b] − 1]`` to the target's cache and the drafter's state.

  Its own program, keyed by the target's config and the drafter only, so a sweep
  over γ, trees or temperatures compiles the prefill once (the step loop is what
  they change). A feature drafter (EAGLE) starts from the target's features of
  the prompt, read off the same prefill.
  """
  b, s = tokens.shape
  empty = kvc.init_cache(target_cfg, b, s, compute_dtype(target_params))
  layers = drafter_feature_layers(drafter)
  out = prefill(target_params, target_cfg, tokens, prompt_lens - 1, empty,
                return_hidden=layers is not None, feature_layers=layers or ())
  target_cache, hidden = (out, None) if layers is None else out
  return target_cache, init_drafter(drafter, draft_params, tokens, prompt_lens, hidden)


def drafter_feature_layers(drafter: "Drafter") -> Optional[tuple[int, ...]]:
  """The target layers whose features the drafter's ``init`` reads (``generate.prefill_chunk``'s
  ``feature_layers``; () is the last hidden state), or None when it reads none."""
  return drafter.target_feature_layers() if drafter.reads_target_features() else None


def init_drafter(drafter: "Drafter", draft_params: Any, tokens: jax.Array,
                 prompt_lens: jax.Array, hidden: Optional[jax.Array]) -> Any:
  """The drafter's state for these prompts, given the target's features of them (``hidden``,
  of ``drafter_feature_layers``; ignored by drafters that read none)."""
  if drafter.reads_target_features():
    return drafter.init(draft_params, tokens, prompt_lens, features=hidden)
  return drafter.init(draft_params, tokens, prompt_lens)


class TargetScores(NamedTuple):
  """What verification returns.

  Attributes:
    p: [B, N + 1, V] the target's warped distributions at every block entry.
    cache: the target cache with the block written at slots s − 1 … s − 1 + N.
    hidden: [B, N + 1, F] the target's features of the block (for EAGLE; see
      ``Drafter.target_feature_layers``).
    argmax: [B, N + 1] int32, the argmax of ``p`` where the target decodes greedily (``p``
      is its one-hot), else None: greedy acceptance and the drafters that read the
      target's predictions take it instead of searching ``p`` again.
  """

  p: jax.Array
  cache: kvc.KVCache
  hidden: jax.Array
  argmax: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class SpeculativeDecoder:
  """Lossless speculative decoding of a target with any drafter, over chains or trees.

  Attributes:
    target_cfg: the target's config.
    drafter: builds proposals (see ``specjax.drafters``); must support ``tree``.
    gamma: draft length γ >= 1 of a chain (static); with ``tree`` given it
      defaults to, and must equal, the tree's depth D.
    sampler: Greedy() or Sampling(...), the target's: what the output follows.
    eos_ids: stop tokens (any sequence of ints, stored as a tuple); default the target's.
    tree: the static topology (``TreeTopology``), default the chain of γ (or, with
      neither gamma nor tree given, the drafter's ``default_tree()`` where it has one);
      or an EAGLE-2 ``DynamicTree`` (N nodes of depth <= D, per-row parents), or a
      ``SampledDynamicTree`` (static widths per depth, per-row parents; drawn children,
      for sampling).
    attention_impl: the target's attention in verification (``specjax.attention``:
      "auto", "reference", "cpu", "pallas", "pallas_tpu_interpret", ...).
    verification: how sampled drafts are accepted: "tokenwise" (modified rejection
      sampling, token by token; recursive rejection over a tree's siblings) or "block"
      (the drafts judged jointly: a chain by ``block_verification``, never fewer tokens
      per step in expectation, a tree by ``traversal_verification``, its leaves-first
      generalisation). Both are lossless; with a greedy sampler both keep the longest
      path that matches the target's argmax.
      "typical_lossy" or a ``TypicalAcceptance`` selects Medusa-2's typical acceptance
      (``typical_acceptance``), which is NOT lossless: sampled output leaves the
      target's law; under a greedy sampler the exact greedy rule still applies.
    policy: an ``AdaptiveGamma`` that picks each step's chain length or tree from its
      static set inside the jitted loop (γ = 0 is a plain decoding step); give it instead
      of gamma and tree. ``tree`` is then the chain of its deepest choice's depth (the
      state's depth); ``cache_headroom`` and ``max_children`` cover every choice.
    draft_sampler: the law the drafter draws from (None: ``sampler``, the usual rule). Any
      draft law is lossless, since verification reads the q the drafts were drawn from;
      a sharper draft (a lower temperature, or Greedy: point-mass drafts) can raise the
      acceptance Σ min(p, q) of a drafter whose q is broader than the target's p. Only
      with a sampled ``sampler``: a greedy target's drafts are its argmax guesses.

  Example::

      dec = SpeculativeDecoder(cfg, drafter, tree=TreeTopology.from_choices(
          [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))
      out = dec.generate(target_params, draft_params, prompts, max_new_tokens=64)
  """

  target_cfg: ModelConfig
  drafter: "Drafter"
  gamma: Optional[int] = None
  sampler: Sampler = Greedy()
  eos_ids: Optional[tuple[int, ...]] = None
  tree: Optional[TreeTopology | DynamicTree | SampledDynamicTree] = None
  attention_impl: str = "auto"
  verification: str | TypicalAcceptance = "tokenwise"
  policy: Optional[AdaptiveGamma] = None
  draft_sampler: Optional[Sampler] = None

  def __post_init__(self):
    if self.policy is not None:
      self._check_policy()
      object.__setattr__(self, "tree", TreeTopology.chain(self.policy.max_depth))
    if self.tree is None and self.gamma is None:
      object.__setattr__(self, "tree", self.drafter.default_tree())  # None: a chain
    if self.tree is None:
      gamma = validation.as_int(4 if self.gamma is None else self.gamma, "gamma", 1)
      object.__setattr__(self, "tree", TreeTopology.chain(gamma))
    elif not isinstance(self.tree, (TreeTopology, DynamicTree, SampledDynamicTree)):
      raise TypeError(f"tree must be a TreeTopology, DynamicTree or SampledDynamicTree, got "
                      f"{type(self.tree).__name__}")
    elif self.gamma is not None and self.gamma != self.tree.max_depth:
      raise ValueError(f"gamma={self.gamma} disagrees with the tree's depth "
                       f"{self.tree.max_depth}; leave gamma unset with a tree")
    object.__setattr__(self, "gamma", self.tree.max_depth)
    check_sampler(self.sampler)
    if self.draft_sampler is not None:
      check_sampler(self.draft_sampler)
      if isinstance(self.sampler, Greedy) and not isinstance(self.draft_sampler, Greedy):
        raise ValueError(f"draft_sampler={self.draft_sampler!r} under a greedy sampler: "
                         f"greedy decoding drafts the drafter's argmax; give a draft sampler "
                         f"only with a sampled (temperature > 0) sampler")
    if self.verification == TYPICAL_LOSSY:
      object.__setattr__(self, "verification", TypicalAcceptance())
    if not isinstance(self.verification, TypicalAcceptance) and (
        self.verification not in VERIFICATIONS):
      raise ValueError(f"unknown verification {self.verification!r}; expected one of "
                       f"{VERIFICATIONS}, or {TYPICAL_LOSSY!r} / a TypicalAcceptance (lossy)")
    if self.drafter.vocab_size != self.target_cfg.vocab_size:
      raise ValueError(
          f"vocabulary mismatch: the drafter proposes over {self.drafter.vocab_size} tokens but "
          f"the target has {self.target_cfg.vocab_size}; speculative decoding needs one vocabulary")
    for shape in (self.tree,) + (() if self.policy is None else self.policy.trees):
      if not self.drafter.supports(shape):
        raise ValueError(f"{type(self.drafter).__name__} cannot build {shape}: it builds "
                         f"{self.drafter.buildable()}")
    validation.layer_indices(self.drafter.target_feature_layers(),
                             f"the target layers {type(self.drafter).__name__} reads",
                             self.target_cfg.num_layers)
    resolve_impl(self.attention_impl)  # unknown names fail here, not at trace time
    eos = self.target_cfg.eos_token_ids if self.eos_ids is None else self.eos_ids
    object.__setattr__(self, "eos_ids", validation.token_ids(eos, "eos_ids"))

  @property
  def proposal_sampler(self) -> Sampler:
    """The sampler the drafter draws with: ``draft_sampler``, else the target's."""
    return self.sampler if self.draft_sampler is None else self.draft_sampler

  @property
  def cache_headroom(self) -> int:
    """Slots past the committed prefix a step may write (the policy's largest choice)."""
    return (self.tree if self.policy is None else self.policy).cache_headroom

  @property
  def max_children(self) -> int:
    """The most children a step's tree gives a node (the counters' rank axis)."""
    return (self.tree if self.policy is None else self.policy).max_children

  def zero_counters(self, batch_size: int) -> SpecCounters:
    """Counters of ``batch_size`` rows, shaped for every step this decoder may take."""
    return SpecCounters.zeros(batch_size, self.tree.max_depth, self.max_children,
                              0 if self.policy is None else self.policy.num_choices)

  def with_policy(self, policy: Optional[AdaptiveGamma]) -> "SpeculativeDecoder":
    """This decoder with an adaptive policy in place of its gamma and tree (None: back to
    a fixed chain of γ = 4 or the drafter's default tree)."""
    return dataclasses.replace(self, policy=policy, gamma=None, tree=None)

  def _check_policy(self):
    if not isinstance(self.policy, AdaptiveGamma):
      raise TypeError(f"policy must be an AdaptiveGamma, got {type(self.policy).__name__}")
    if self.tree is not None or self.gamma is not None:
      raise ValueError(f"give the draft lengths in the policy {self.policy.gammas}, not "
                       f"gamma={self.gamma} or tree={self.tree}")
    if self.policy.plain and not self.drafter.tolerates_skipped_steps():
      raise ValueError(f"{type(self.drafter).__name__} cannot skip steps, so the policy cannot "
                       f"choose plain decoding: take 0 out of gammas {self.policy.gammas}")

  # --- the algorithm's steps -------------------------------------------------

  def propose(self, draft_params: Any, state: SpecState, key: jax.Array) -> tuple[Proposal, Any]:
    """The drafter's proposal of the tree's nodes, and its new state."""
    # A drafter that shares the target's KV cache (early exit) reads it beside its own
    # state; it only writes scratch slots, which verify overwrites.
    draft_state = (SharedCache(state.target_cache, state.draft_state)
                   if self.drafter.shares_target_cache() else state.draft_state)
    return self.drafter.propose(draft_params, draft_state, state.tokens, state.seq_lens,
                                key, self.proposal_sampler, self.tree)

  def verify(self, target_params: Params, state: SpecState, proposal: Proposal) -> TargetScores:
    """One target forward over the root (the last committed token) and the tree's nodes."""
    b = proposal.tokens.shape[0]
    t = self.tree.num_nodes + 1
    block = jnp.concatenate([last_tokens(state.tokens, state.seq_lens), proposal.tokens], axis=1)
    depth, mask = self.block_layout(proposal)
    positions = (state.seq_lens - 1)[:, None] + depth
    layers = self.drafter.target_feature_layers()
    out = forward(target_params, self.target_cfg, block, positions, state.target_cache, mask,
                  num_valid=jnp.full((b,), t, jnp.int32), attention_impl=self.attention_impl,
                  return_layers=layers)
    hidden = target_features(out, layers)
    if isinstance(self.sampler, Greedy):
      tokens, p = self.sampler.sample(None, out.logits)
      return TargetScores(p=p, cache=out.cache, hidden=hidden, argmax=tokens)
    return TargetScores(p=self.sampler.probs(out.logits), cache=out.cache, hidden=hidden)

  def block_layout(self, proposal: Proposal) -> tuple[jax.Array, jax.Array]:
    """(depth [B or 1, N + 1], ancestor mask [B, N + 1, N + 1]) of the verified block: the
    root (depth 0) and the proposal's nodes, per row for a dynamic tree."""
    if proposal.parents is None:
      b, t = proposal.tokens.shape[0], self.tree.num_nodes + 1
      return (jnp.asarray(self.tree.block_depth)[None, :],
              jnp.broadcast_to(jnp.asarray(self.tree.block_mask), (b, t, t)))
    return (depth_from_parents(proposal.parents, self.tree.max_depth),
            block_mask_from_parents(proposal.parents, self.tree.max_depth))

  def accept(self, key: jax.Array, proposal: Proposal, scores: TargetScores) -> TreeAcceptance:
    if isinstance(self.verification, TypicalAcceptance) and not isinstance(self.sampler, Greedy):
      return accept_typical(key, proposal, scores.p, self.tree, self.verification)
    return accept_tree(key, proposal, scores.p, self.tree,
                       greedy=isinstance(self.sampler, Greedy),
                       block=self.verification == "block", target_argmax=scores.argmax)

  def commit(self, state: SpecState, proposal: Proposal, acc: TreeAcceptance,
             scores: TargetScores, draft_state: Any) -> tuple[SpecState, jax.Array]:
    """Appends the path and the extra token; compacts the cache; hands EAGLE the path's features.

    Returns (the new state, with both caches cut back to the new committed
    length − 1, and [B] tokens appended).
    """
    start = state.seq_lens - 1  # the root's position and slot
    new, n_emit = append(state, accepted_tokens(proposal, acc), acc.num_accepted + 1,
                         self.eos_ids)
    cache = scores.cache
    if not (self.tree.is_chain and proposal.parents is None):  # a chain is already in place
      cache = kvc.compact(cache, start, acc.path)
    if self.drafter.reads_target_features():
      levels = jnp.arange(acc.path.shape[1])[None, :]
      along = jnp.where(acc.path >= 0, acc.path, levels)
      hidden = jnp.take_along_axis(scores.hidden, along[:, :, None], axis=1)
      draft_state = self.drafter.observe(draft_state, hidden, start)
    if self.drafter.reads_target_predictions():
      predictions = first_argmax(scores.p) if scores.argmax is None else scores.argmax
      draft_state = self.drafter.observe_block(draft_state, predictions, acc.num_accepted)
    accepted = AcceptedPath(start=start, path=acc.path, num_accepted=acc.num_accepted)
    new = new.replace(target_cache=cache.with_lengths(new.seq_lens - 1),
                      draft_state=self.drafter.rollback(draft_state, new.seq_lens, accepted))
    return new, n_emit

  def count(self, counters: SpecCounters, active: jax.Array, proposal: Proposal,
            acc: TreeAcceptance, n_emit: jax.Array, p: jax.Array) -> SpecCounters:
    """``counters`` after this step's verification ``acc`` of ``proposal`` against the
    target's warped distributions ``p`` [B, N + 1, V] (rows not ``active`` unchanged)."""
    # The counters' depth is the state's (an adaptive policy's largest γ), at least the tree's.
    d, depth = counters.accepted_at.shape[1], self.tree.max_depth
    a = active.astype(jnp.int32)
    levels = jnp.arange(d)[None, :]
    accepted_at = (levels < acc.num_accepted[:, None]) & active[:, None]  # [B, D]
    rank = node_ranks(proposal, self.tree)  # [B, N]
    path_rank = jnp.take_along_axis(rank, jnp.maximum(acc.path[:, 1:] - 1, 0), axis=1)
    path_rank = jnp.pad(path_rank, ((0, 0), (0, d - depth)))  # [B, D]
    rank_hit = jax.nn.one_hot(path_rank, counters.accepted_rank.shape[-1], dtype=jnp.int32)
    hist = lambda x: jax.nn.one_hot(x, d + 1, dtype=jnp.int32) * a[:, None]
    counters = counters.replace(
        target_calls=counters.target_calls + a,
        drafted=counters.drafted + self.tree.num_nodes * a,
        accepted=counters.accepted + acc.num_accepted * a, emitted=counters.emitted + n_emit,
        accepted_at=counters.accepted_at + accepted_at,
        accept_len_hist=counters.accept_len_hist + hist(acc.num_accepted),
        depth_hist=counters.depth_hist + hist(jnp.full_like(a, depth)),
        accepted_rank=counters.accepted_rank + rank_hit * accepted_at[:, :, None])
    if isinstance(self.verification, TypicalAcceptance):
      return counters  # which computes no β (its zeros would read α 0)
    if not (self.tree.is_chain and proposal.draw == "sampled"):  # trees, point-mass chains
      if isinstance(self.sampler, Greedy) or (self.verification == "block"
                                              and self.tree.is_chain):
        return counters  # a greedy node's β is its outcome; a point-mass block has no β
      # Recursive rejection's first-chain βs, counted under traversal verification too (as
      # far as the accepted path follows that chain): an estimate of the drafts' agreement
      # with the target, not that rule's own acceptance chances.
      beta, length = first_chain_beta(proposal, p, self.tree)  # [B, depth], [B]
      leading = jnp.sum(jnp.cumprod((path_rank[:, :depth] == 0) & accepted_at[:, :depth],
                                    axis=1), axis=1)  # rank-0 nodes accepted from the root
      scored = ((jnp.arange(depth)[None, :] < jnp.minimum(leading + 1, length)[:, None])
                & active[:, None])
      return counters.replace(
          lead_beta_sum=counters.lead_beta_sum + jnp.sum(jnp.where(scored, beta, 0.0), axis=1),
          lead_beta_count=counters.lead_beta_count + jnp.sum(scored, axis=1))
    levels = jnp.arange(acc.beta.shape[1])[None, :]
    scored = (levels <= acc.num_accepted[:, None]) & active[:, None]
    chance = scoring_chances(keep_probabilities(proposal.tokens, proposal.q, p))
    chance = jnp.where(active[:, None], chance, 0.0)  # [B, γ]
    return counters.replace(
        beta_sum=counters.beta_sum + jnp.sum(jnp.where(scored, acc.beta, 0.0), axis=1),
        beta_count=counters.beta_count + jnp.sum(scored, axis=1),
        weighted_beta_sum=counters.weighted_beta_sum + jnp.sum(chance * acc.beta, axis=1),
        weighted_count=counters.weighted_count + jnp.sum(chance, axis=1))

  # --- composition -----------------------------------------------------------

  def step(self, target_params: Params, draft_params: Any, state: SpecState) -> SpecState:
    """One full speculative step (pure); with a policy, of the draft length it chooses."""
    if self.policy is None:
      return self.fixed_step(target_params, draft_params, state)
    index = self.choice(state)
    new = jax.lax.switch(index, [functools.partial(f, target_params, draft_params)
                                 for f in self.branch_steps()], state)
    return self.observed(state, new, index)

  def choice(self, state: SpecState) -> jax.Array:
    """The policy's choice for the next step: an index into its choices (int32 scalar)."""
    return self.policy.choose(state.policy, ~state.done)

  def observed(self, before: SpecState, after: SpecState, index: jax.Array) -> SpecState:
    """``after`` (one step of the policy's choice ``index``) with the policy's estimates
    updated by the drafts that step accepted along its first-ranked chain (for a chain:
    all it accepted), or by the β it scored them with (``AdaptiveGamma.evidence``)."""
    rank0 = after.counters.accepted_rank[:, :, 0] - before.counters.accepted_rank[:, :, 0]
    leading = jnp.sum(jnp.cumprod(rank0, axis=1), axis=1)  # [B] rank-0 drafts from the root
    active = ~before.done
    hit = jax.nn.one_hot(index, self.policy.num_choices, dtype=jnp.int32) * active[:, None]
    counters = after.counters.add_choices(hit, self.policy.estimate(before.policy, index))
    delta = lambda *names: sum(getattr(after.counters, k) - getattr(before.counters, k)
                               for k in names)
    # A step adds to one pair: a sampled chain's weighted βs (under either rule: their
    # weights are token-wise's chances of scoring, given the drafts), or recursive
    # rejection's first chain's βs (``count``; none under block verification).
    weighed = dict(beta_sum=delta("weighted_beta_sum", "lead_beta_sum"),
                   beta_count=delta("weighted_count", "lead_beta_count"))
    return after.replace(counters=counters, policy=self.policy.observe(
        before.policy, index, leading, active, **weighed))

  def branch(self, index: int) -> Optional["SpeculativeDecoder"]:
    """The fixed decoder of the policy's choice ``index`` (None for γ = 0, plain decoding)."""
    shape = self.policy.shape(index)
    return None if shape is None else dataclasses.replace(self, policy=None, gamma=None,
                                                          tree=shape)

  def branch_steps(self) -> list:
    """One step function per policy choice: ``plain_step`` for γ = 0, else its shape's."""
    branches = [self.branch(i) for i in range(self.policy.num_choices)]
    return [self.plain_step if b is None else b.fixed_step for b in branches]

  def plain_step(self, target_params: Params, draft_params: Any, state: SpecState) -> SpecState:
    """A plain decoding step (a policy's γ = 0): the target feeds the last token and samples
    the next; the drafter is skipped, except that a feature drafter observes that feature."""
    rng, key = jax.random.split(state.rng)
    b = state.tokens.shape[0]
    start = state.seq_lens - 1
    layers = self.drafter.target_feature_layers()
    out = forward(target_params, self.target_cfg, last_tokens(state.tokens, state.seq_lens),
                  start[:, None], state.target_cache, num_valid=jnp.ones((b,), jnp.int32),
                  attention_impl=self.attention_impl, return_layers=layers)
    nxt, _ = self.sampler.sample(key, out.logits[:, 0])
    new, n_emit = append(state, nxt[:, None], jnp.ones_like(state.seq_lens), self.eos_ids)
    draft_state = state.draft_state
    if self.drafter.reads_target_features():
      draft_state = self.drafter.observe(draft_state, target_features(out, layers), start)
    counters = state.counters.add_plain_steps((~state.done).astype(jnp.int32), n_emit)
    return sharding.constrain(new.replace(target_cache=out.cache.with_lengths(new.seq_lens - 1),
                                          draft_state=draft_state, rng=rng,
                                          steps=state.steps + 1, counters=counters), b)

  def fixed_step(self, target_params: Params, draft_params: Any, state: SpecState) -> SpecState:
    """One speculative step of the decoder's own topology."""
    rng, k_draft, k_accept = jax.random.split(state.rng, 3)
    proposal, draft_state = self.propose(draft_params, state, k_draft)
    scores = self.verify(target_params, state, proposal)
    return self.finish(state, proposal, scores, k_accept, draft_state, rng)

  def finish(self, state: SpecState, proposal: Proposal, scores: TargetScores, key: jax.Array,
             draft_state: Any, rng: jax.Array) -> SpecState:
    """Accept, commit and count: the rest of a step once the target has scored the block."""
    acc = self.accept(key, proposal, scores)
    new, n_emit = self.commit(state, proposal, acc, scores, draft_state)
    counters = self.count(state.counters, ~state.done, proposal, acc, n_emit, scores.p)
    # Under a mesh (sharding.use_mesh) every step's state, whichever loop runs it, is pinned.
    return sharding.constrain(new.replace(rng=rng, steps=state.steps + 1, counters=counters),
                              state.seq_lens.shape[0])

  def init(self, target_params: Params, draft_params: Any, tokens: jax.Array,
           prompt_lens: jax.Array, max_new_tokens: jax.Array, rng: jax.Array) -> SpecState:
    """Prefills both models with each prompt minus its last token (``prefill_models``: one
    program per target and drafter, shared by every γ, tree and sampler)."""
    target_cache, draft_state = prefill_models(self.target_cfg, self.drafter, target_params,
                                               draft_params, tokens, prompt_lens)
    return self.initial_state(tokens, prompt_lens, max_new_tokens, rng, target_cache,
                              draft_state)

  def initial_state(self, tokens: jax.Array, prompt_lens: jax.Array, max_new_tokens: jax.Array,
                    rng: jax.Array, target_cache: kvc.KVCache, draft_state: Any) -> SpecState:
    """The state before the first step, around prefilled caches (zero counters)."""
    b = tokens.shape[0]
    max_lens = prompt_lens + max_new_tokens
    # Copies: ``run`` donates the state, which must not take the caller's arrays with it.
    state = SpecState(tokens=jnp.array(tokens), seq_lens=jnp.array(prompt_lens),
                      max_lens=max_lens, done=prompt_lens >= max_lens,
                      target_cache=target_cache, draft_state=draft_state, rng=jnp.array(rng),
                      steps=jnp.zeros((), jnp.int32),
                      counters=self.zero_counters(b),
                      policy=() if self.policy is None else self.policy.init(b))
    return sharding.constrain(state, b)

  @functools.partial(jax.jit, static_argnames=("self",), donate_argnames=("state",))
  def run(self, target_params: Params, draft_params: Any, state: SpecState) -> SpecState:
    """Runs steps in a ``lax.while_loop`` until every row is done (``steps_while``)."""
    return self.steps_while(target_params, draft_params, state, lambda st: ~jnp.all(st.done))

  def steps_while(self, target_params: Params, draft_params: Any, state: SpecState,
                  keep_going) -> SpecState:
    """Steps (inside a trace) for as long as ``keep_going(state)`` (a bool scalar) holds.

    With a policy, the loop's body is one inner ``while_loop`` per choice, each running
    its γ's steps for as long as the policy keeps choosing it. That is ``step`` in
    effect, without its ``lax.switch``: XLA copies every buffer a conditional's branches
    update (the KV caches), a loop updates them in place (tests/test_adaptive.py counts the
    copies; docs/methods.md gives what they cost once measured).
    Each pass of the outer loop takes at least one step (the chosen γ's loop runs).
    """
    if self.policy is None:
      return jax.lax.while_loop(keep_going, functools.partial(self.step, target_params,
                                                              draft_params), state)

    def while_chosen(index, step_fn):
      def body(st):
        return self.observed(st, step_fn(target_params, draft_params, st), jnp.int32(index))
      return lambda st: jax.lax.while_loop(
          lambda s: keep_going(s) & (self.choice(s) == index), body, st)

    loops = [while_chosen(i, f) for i, f in enumerate(self.branch_steps())]
    return jax.lax.while_loop(keep_going,
                              lambda st: functools.reduce(lambda s, f: f(s), loops, st), state)

  # --- Python-side API ---------------------------------------------------------

  def pack(self, target_params: Params, draft_params: Any, prompts: Sequence[Sequence[int]],
           max_new_tokens: int, cache_size: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Validates parameters and prompts and packs them (before any compilation): the
    [B, S] token buffer and the [B] prompt lengths."""
    validation.check_params(target_params, self.target_cfg, "target_params")
    self.drafter.check_params(draft_params)
    cfg = self.target_cfg
    # Verification (and tree drafting) writes past the committed prefix.
    tokens, lens, _ = pack_prompts(prompts, max_new_tokens, cache_size,
                                   headroom=self.cache_headroom,
                                   vocab_size=cfg.vocab_size, max_cache_size=cfg.max_cache_size,
                                   max_positions=cfg.max_position_embeddings,
                                   cache_bytes_per_slot=kvc.bytes_per_slot(cfg))
    sharding.check_batch(len(lens))
    return tokens, lens

  def prepare(self, target_params: Params, draft_params: Any,
              prompts: Sequence[Sequence[int]], max_new_tokens: int, *, seed: int = 0,
              cache_size: Optional[int] = None) -> tuple[SpecState, np.ndarray]:
    """``pack``, then prefills both models."""
    tokens, lens = self.pack(target_params, draft_params, prompts, max_new_tokens, cache_size)
    state = self.init(target_params, draft_params, jnp.asarray(tokens), jnp.asarray(lens),
                      jnp.full(lens.shape, max_new_tokens, jnp.int32), jax.random.PRNGKey(seed))
    return state, lens

  def generate(self, target_params: Params, draft_params: Any,
               prompts: Sequence[Sequence[int]], max_new_tokens: int, *, seed: int = 0,
               cache_size: Optional[int] = None, profile: bool = False) -> SpecResult:
    """Speculative generation for a batch; returns tokens and metrics.

    With ``profile=True`` the Python-loop twin runs instead of the fused loop
    (same tokens, slower), and the result's ``timing`` splits the wall time
    into draft, verify and other (acceptance, commit, rollback, dispatch);
    otherwise its ``prefill_seconds`` is the part of the wall time until both
    models were prefilled (validation and packing included), the rest is the loop.
    A policy that never drafts (``plain_only``) runs plain decoding's own loop instead,
    with the same tokens and counters (``stream`` and ``serve`` keep the speculative loop).
    """
    rows = len(prompts) if hasattr(prompts, "__len__") else 0
    if not profile and rows >= 1 and self.plain_only(rows):  # (pack refuses bad prompts)
      return self._generate_plain(target_params, draft_params, prompts, max_new_tokens,
                                  seed=seed, cache_size=cache_size)
    start = time.perf_counter()
    timing = {"draft": 0.0, "verify": 0.0, "other": 0.0}
    if profile:
      state = None
      for state, t in self.stream(target_params, draft_params, prompts, max_new_tokens,
                                  seed=seed, cache_size=cache_size):
        timing = {k: timing[k] + t[k] for k in timing}
      lens = np.array([len(p) for p in prompts], np.int32)
      if state is None:  # nothing to generate
        state, lens = self.prepare(target_params, draft_params, prompts, max_new_tokens,
                                   seed=seed, cache_size=cache_size)
    else:
      state, lens = jax.block_until_ready(self.prepare(
          target_params, draft_params, prompts, max_new_tokens, seed=seed, cache_size=cache_size))
      prefill_seconds = time.perf_counter() - start
      state = self.run(target_params, draft_params, state)
    jax.block_until_ready(state.tokens)
    result = summarize(state, lens, self.gamma, time.perf_counter() - start)
    if profile:
      result.timing = timing
    else:
      result.prefill_seconds = prefill_seconds
    return result

  def plain_only(self, batch_size: int = 1) -> bool:
    """Whether ``generate`` decodes a batch of ``batch_size`` rows plainly: the policy never
    drafts (``AdaptiveGamma.never_drafts``, e.g. at a batch size where every draft step
    costs more than it returns; with EOS, which may end rows early, at one row), and the
    target's attention is the plain decoder's."""
    return (self.policy is not None
            and self.policy.never_drafts(batch_size if not self.eos_ids else 1)
            and resolve_impl(self.attention_impl) == resolve_impl("auto"))

  def _generate_plain(self, target_params: Params, draft_params: Any,
                      prompts: Sequence[Sequence[int]], max_new_tokens: int, *, seed: int,
                      cache_size: Optional[int]) -> SpecResult:
    """``generate`` for a policy that never drafts: ``specjax.generate``'s loop on the buffer
    ``pack`` made (no drafter prefill, no draft-state bookkeeping per step, no second
    validation), with the counters the speculative loop's plain steps keep. Its steps draw
    their keys from the same seed in the same order as ``plain_step``, so the tokens are those
    of the speculative loop, sampled or greedy."""
    start = time.perf_counter()  # validation counts, as in the speculative loop
    tokens, lens = self.pack(target_params, draft_params, prompts, max_new_tokens, cache_size)
    out = generate_packed(target_params, self.target_cfg, tokens, lens, max_new_tokens,
                          self.sampler, seed=seed, eos_ids=self.eos_ids, start=start)
    steps = jnp.asarray(out.seq_lens - out.prompt_lens, jnp.int32)  # one call per token
    plain = jax.nn.one_hot(0, self.policy.num_choices, dtype=jnp.int32)  # choice 0: γ = 0
    counters = self.zero_counters(len(steps)).add_plain_steps(steps, steps).add_choices(
        steps[:, None] * plain, self.policy.prior_alpha)  # its price for plain steps
    return SpecResult(tokens=out.tokens, prompt_lens=out.prompt_lens, seq_lens=out.seq_lens,
                      steps=out.steps, seconds=time.perf_counter() - start, gamma=self.gamma,
                      per_row=counters_to_host(counters), prefill_seconds=out.prefill_seconds)

  def stream(self, target_params: Params, draft_params: Any,
             prompts: Sequence[Sequence[int]], max_new_tokens: int, *, seed: int = 0,
             cache_size: Optional[int] = None) -> Iterator[tuple[SpecState, dict[str, float]]]:
    """Python-loop twin of ``run``: yields the state after every step with phase timings.

    Runs the same step functions, each jitted on its own, so draft, verify and
    the rest (accept, commit, rollback, bookkeeping) can be timed separately.
    """
    state, _ = self.prepare(target_params, draft_params, prompts, max_new_tokens, seed=seed,
                            cache_size=cache_size)
    while not bool(jnp.all(state.done)):
      if self.policy is None:
        state, timing = _timed_step(self, target_params, draft_params, state)
      else:  # the policy's choice comes to the host, then the chosen step runs in phases
        choice, observed, plain = _policy_fns(self)
        t0 = time.perf_counter()
        index = int(choice(state))
        t1 = time.perf_counter()
        branch = self.branch(index)
        if branch is None:
          new = jax.block_until_ready(plain(target_params, draft_params, state))
          timing = {"draft": 0.0, "verify": time.perf_counter() - t1, "other": 0.0}
        else:
          new, timing = _timed_step(branch, target_params, draft_params, state)
        t2 = time.perf_counter()
        state = jax.block_until_ready(observed(state, new, jnp.int32(index)))
        timing["other"] += (t1 - t0) + (time.perf_counter() - t2)
      yield state, timing


@functools.lru_cache(maxsize=32)
def _phase_fns(dec: SpeculativeDecoder):
  """Separately jitted phases of one step (for ``stream``)."""
  return jax.jit(dec.propose), jax.jit(dec.verify), jax.jit(dec.finish)


@functools.lru_cache(maxsize=32)
def _policy_fns(dec: SpeculativeDecoder):
  """The policy's choice and update and the plain step, jitted (for ``stream``)."""
  return jax.jit(dec.choice), jax.jit(dec.observed), jax.jit(dec.plain_step)


def _timed_step(dec: SpeculativeDecoder, target_params: Params, draft_params: Any,
                state: SpecState) -> tuple[SpecState, dict[str, float]]:
  """One step of ``dec``'s own topology in separately jitted phases, each timed."""
  propose, verify, finish = _phase_fns(dec)
  t0 = time.perf_counter()
  rng, k_draft, k_accept = jax.random.split(state.rng, 3)
  proposal, draft_state = jax.block_until_ready(propose(draft_params, state, k_draft))
  t1 = time.perf_counter()
  scores = jax.block_until_ready(verify(target_params, state, proposal))
  t2 = time.perf_counter()
  state = jax.block_until_ready(finish(state, proposal, scores, k_accept, draft_state, rng))
  t3 = time.perf_counter()
  return state, {"draft": t1 - t0, "verify": t2 - t1, "other": t3 - t2}
