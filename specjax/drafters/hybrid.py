"""Hybrid drafting: copy from the context where it repeats, a model drafter elsewhere.

Each step, each row's committed context is searched for its own suffix (prompt lookup,
``PromptLookupDrafter``). A row whose suffix of at least ``lookup.min_ngram`` tokens occurred
before proposes what followed that occurrence, a point mass that costs no draft forward;
every other row takes the model drafter's proposal (an EAGLE feature drafter, Medusa heads,
an independent draft). Retrieval beside a model draft, as in REST (He et al. 2023) and
SAM-Decoding (Hu et al. 2024): copying pays on summaries, quotations, code edits and
answers that reuse the question, where a small drafter's guesses are weakest on long spans.

Lossless: the choice reads only the committed tokens, so each row's proposal is a valid
chain (or tree) of its own, with the law it was drawn from (a chain's copied tokens carry
one-hot q); verification then keeps the target's distribution, and greedy output is plain
greedy decoding. When every row of the batch copies, the model drafter's forward is skipped
(``lax.cond``) if it tolerates skipped steps (``Drafter.tolerates_skipped_steps``: it
catches up on the next step it drafts) and its state keeps its type through ``propose``;
otherwise it drafts every step and its proposal is dropped where a row copies. Its
``rollback`` is told what it drafted: none of its nodes were verified in a copying row (the
step counts as all rejected, so a drafter that keeps its accepted drafts' cache, an
independent draft, refeeds the copied tokens instead), and after a skipped step it keeps the
state it had (its next catch-up feeds the backlog).

Shapes: chains, and EAGLE-2 dynamic trees (``DynamicTree``) when the model drafter builds
them. A copying row fills the tree's N nodes with the continuations of its best matches,
one chain of up to D nodes per match (the j-th chain holds the j-th best match), in
breadth-first order with per-row parents, a point-mass proposal like the model's own dynamic
tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.sampling import Sampler, dense_probs
from specjax.speculative.drafter import Drafter, SharedCache
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.speculative.tree_acceptance import AcceptedPath


def match_layout(num_nodes: int, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(branch [N], offset [N], parents [N]) of N copied nodes laid out as chains of up to
  ``depth`` nodes from the root, match j's chain being the j-th (all full but the last),
  in breadth-first order (a dynamic tree's per-row order): node i continues match
  branch[i] at its offset[i]-th token."""
  lengths = [min(depth, num_nodes - j) for j in range(0, num_nodes, depth)]
  nodes = [(d, j) for d in range(depth) for j, n in enumerate(lengths) if d < n]
  index = {node: i for i, node in enumerate(nodes)}
  parents = [index[(d - 1, j)] if d else -1 for d, j in nodes]
  return (np.asarray([j for _, j in nodes], np.int32), np.asarray([d for d, _ in nodes], np.int32),
          np.asarray(parents, np.int32))


@flax.struct.dataclass(kw_only=True)
class HybridState:
  """The model drafter's state, and what its last ``propose`` did.

  Attributes:
    model: the model drafter's state (after ``propose``: its new state, or its old one where
      the step skipped it).
    copied: [B] bool, the rows that copied in the last step.
    skipped: bool scalar, whether the last step skipped the model's forward.
  """

  model: Any
  copied: jax.Array
  skipped: jax.Array


@dataclasses.dataclass(frozen=True)
class HybridDrafter(Drafter):
  """Prompt lookup where a match of ``lookup.min_ngram`` tokens or more exists, else ``model``.

  Attributes:
    model: the drafter for rows without a match; its params, state and capabilities (target
      features, a shared cache, skipped steps) are the hybrid's.
    lookup: the matcher. Its ``min_ngram`` is the shortest suffix match trusted for copying
      (``hybrid_drafter`` sets 3); its ``max_ngram`` ranks longer matches first.
  """

  model: Drafter
  lookup: PromptLookupDrafter

  def __post_init__(self):
    if not isinstance(self.model, Drafter) or isinstance(self.model, HybridDrafter):
      raise TypeError(f"model must be a Drafter other than a HybridDrafter, got "
                      f"{type(self.model).__name__}")
    if not isinstance(self.lookup, PromptLookupDrafter):
      raise TypeError(f"lookup must be a PromptLookupDrafter, got {type(self.lookup).__name__}")
    if self.model.reads_target_predictions():
      raise ValueError(f"{type(self.model).__name__} reads the target's block predictions "
                       "(Jacobi decoding) and fills its own slots by lookup; it cannot be the "
                       "model of a HybridDrafter")
    if self.lookup.vocab_size != self.model.vocab_size:
      raise ValueError(f"lookup vocabulary {self.lookup.vocab_size} != the model drafter's "
                       f"{self.model.vocab_size}")

  @property
  def vocab_size(self) -> int:
    return self.model.vocab_size

  # --- capabilities: the model's, restricted to the shapes a copying row can fill --------

  def supports(self, topology) -> bool:
    if isinstance(topology, DynamicTree):  # a copying row's root has ⌈N / D⌉ <= k children
      shape_ok = -(-topology.num_nodes // topology.max_depth) <= topology.max_children
    else:
      shape_ok = isinstance(topology, TreeTopology) and topology.is_chain
    return shape_ok and self.model.supports(topology)

  def buildable(self) -> str:
    return ("chains, and EAGLE-2 dynamic trees (DynamicTree) of N <= top_k · depth nodes "
            f"where the model drafter builds them; the model builds {self.model.buildable()}")

  def default_tree(self):
    tree = self.model.default_tree()
    return tree if tree is not None and self.supports(tree) else None

  def tolerates_skipped_steps(self) -> bool:
    return self.model.tolerates_skipped_steps()

  def shares_target_cache(self) -> bool:
    return self.model.shares_target_cache()

  def reads_target_features(self) -> bool:
    return self.model.reads_target_features()

  def target_feature_layers(self) -> tuple[int, ...]:
    return self.model.target_feature_layers()

  def check_params(self, draft_params) -> None:
    self.model.check_params(draft_params)

  def plain_params(self, draft_params):
    return self.model.plain_params(draft_params)

  # --- the step ----------------------------------------------------------------------

  def init(self, draft_params, tokens, prompt_lens, features=None) -> HybridState:
    return HybridState(model=self.model.init(draft_params, tokens, prompt_lens, features),
                       copied=jnp.zeros(tokens.shape[:1], bool), skipped=jnp.asarray(False))

  def observe(self, state: HybridState, hidden, start) -> HybridState:
    return state.replace(model=self.model.observe(state.model, hidden, start))

  def rollback(self, state: HybridState, seq_lens, accepted: AcceptedPath) -> HybridState:
    """The model rolls back as if a copying row had rejected all its nodes; after a skipped
    step it keeps its state."""
    copied = state.copied
    none = AcceptedPath(start=accepted.start,
                        path=jnp.where(copied[:, None], accepted.path.at[:, 1:].set(-1),
                                       accepted.path),
                        num_accepted=jnp.where(copied, 0, accepted.num_accepted))
    roll = lambda _: self.model.rollback(state.model, seq_lens, none)
    if jax.tree.structure(jax.eval_shape(roll, None)) != jax.tree.structure(state.model):
      return state.replace(model=roll(None))  # its state changes type in propose: never skipped
    # A branch, not a select: no pass over the model's whole state (its cache) every step.
    return state.replace(model=jax.lax.cond(state.skipped, lambda _: state.model, roll, None))

  def propose(self, draft_params, state, tokens, seq_lens, key, sampler: Sampler, topology):
    if not self.supports(topology):
      raise ValueError(f"HybridDrafter builds {self.buildable()}, not {topology}")
    n = topology.num_nodes
    depth = n if topology.is_chain else topology.max_depth
    branch, offset, parents = match_layout(n, depth)
    starts, lengths = self.lookup.matches(tokens, seq_lens, int(branch.max()) + 1)
    copy = lengths[:, 0] > 0  # [B]
    copied = self.lookup.continuations(tokens, seq_lens, starts[:, branch],
                                       jnp.asarray(offset))  # [B, N]

    shared = isinstance(state, SharedCache)  # the model shares the target's cache
    own = state.own.model if shared else state.model
    model_in = SharedCache(state.target, own) if shared else own

    def draft(_):
      return self.model.propose(draft_params, model_in, tokens, seq_lens, key, sampler,
                                topology)

    shapes = jax.eval_shape(draft, None)
    # Skipping returns the old state, which must have the type ``propose`` returns (an
    # independent draft's dynamic tree returns another).
    can_skip = (self.model.tolerates_skipped_steps() and jax.tree.structure(shapes[1])
                == jax.tree.structure(own))
    if can_skip:
      def skip(_):  # every row copies: the model's forward is not run, its state unchanged
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes[0]), own

      skipped = jnp.all(copy)
      proposal, model_state = jax.lax.cond(skipped, skip, draft, None)
    else:
      skipped = jnp.asarray(False)
      proposal, model_state = draft(None)
    state = HybridState(model=model_state, copied=copy, skipped=skipped)

    tokens_out = jnp.where(copy[:, None], copied, proposal.tokens)
    if topology.is_chain:
      q = dense_probs(proposal.q)  # a copied token may lie outside a reduced vocabulary
      q = jnp.where(copy[:, None, None], jax.nn.one_hot(copied, self.vocab_size, dtype=q.dtype), q)
      return Proposal(tokens=tokens_out, q=q, draw=proposal.draw), state
    if proposal.draw != "point_mass" or proposal.parents is None:
      raise ValueError(f"{type(self.model).__name__}'s dynamic tree is not a point-mass "
                       "proposal with per-row parents; a copying row cannot share its step")
    b = tokens.shape[0]
    parents_out = jnp.where(copy[:, None], jnp.broadcast_to(jnp.asarray(parents), (b, n)),
                            proposal.parents)
    return Proposal(tokens=tokens_out, parents=parents_out.astype(proposal.parents.dtype),
                    draw="point_mass"), state


def hybrid_drafter(model: Drafter, min_match: int = 3, max_ngram: int = 4) -> HybridDrafter:
  """``model`` with prompt lookup on rows whose last ``min_match``…``max_ngram`` tokens
  occurred before."""
  return HybridDrafter(model, PromptLookupDrafter(model.vocab_size, max_ngram=max_ngram,
                                                  min_ngram=min_match))
