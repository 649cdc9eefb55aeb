"""The drafter interface: anything that proposes a tree (or chain) of draft tokens.

It belongs to the speculative step, which calls it; the drafters in
``specjax.drafters`` implement it, one floor up.

A drafter is a small frozen (hashable) dataclass holding only static
configuration; its arrays (weights, index maps) travel separately as
``draft_params`` and its per-sequence state (a KV cache, nothing, ...) as
``draft_state``, so the speculative loop stays one jitted program.

Contract, for rows whose committed sequence is ``tokens[b, :seq_lens[b]]``:
  * ``init`` builds the state after the prompt is known;
  * ``propose`` returns a ``Proposal`` of the topology's N nodes: their
    tokens and how they were drawn (``speculative.proposal``); for a chain,
    token i must be a sample of qᵢ given the committed sequence and the
    earlier drafts (chain drafters implement ``propose_chain`` only);
  * ``rollback`` is told the new committed lengths and the accepted path and
    must forget anything it derived from rejected nodes.

Capabilities are explicit methods with conservative defaults, so the decoder
never probes attributes:
  * ``supports(topology)``: which trees the drafter can build (default:
    chains only), and ``buildable()`` says so in words. The decoder refuses a
    topology the drafter does not support.
  * ``default_tree()``: the topology the decoder uses when given neither
    ``gamma`` nor ``tree`` (default None: a chain of γ = 4). A drafter whose
    shape follows from its own configuration (lookahead decoding's window and
    guess set) returns it, so users need not rebuild it.
  * ``tolerates_skipped_steps()``: the decoder may take plain decoding steps
    without calling the drafter (an adaptive policy's γ = 0, ``adaptive``):
    the next ``propose`` then finds any number of tokens committed since its
    state last saw the sequence and must catch up on them. A feature drafter
    still receives ``observe`` with each plain step's single feature (the
    root's, at position ``start``). Default False: the decoder refuses γ = 0.
  * ``shares_target_cache()`` (early exit): ``propose`` gets as ``state`` a
    ``SharedCache``: the target's KV cache, holding the committed length − 1,
    beside the drafter's own state (from ``init``; ``()`` when it keeps
    none). It may write only target slots at or past that length
    (verification overwrites them) and returns its own state alone.
  * ``reads_target_features()`` (EAGLE, Medusa): ``init`` receives ``features``
    [B, S, D] of the prompt's committed positions, and after every
    verification ``observe(state, hidden, start)`` receives the accepted
    path's [B, D + 1, F] features, of positions ``start[b] + t``. The
    features are the target's last hidden state (F = D), or, when
    ``target_feature_layers()`` names layers, their outputs concatenated
    (F = len(layers)·D; EAGLE-3's fusion of low, mid and high layers).
  * ``reads_target_predictions()`` (Jacobi): after every verification
    ``observe_block(state, predictions, num_accepted)`` receives the target's
    argmax at *every* entry of the verified block, [B, N + 1] (entry 0 after
    the root, entry i + 1 after node i), accepted or not, and the accepted
    length n [B]. Such a drafter cannot be replayed from a greedy
    continuation (``speculative.replay``): off the accepted path the target's
    predictions are not the continuation's tokens.

Adding a drafter: subclass ``Drafter`` as a frozen dataclass, implement
``vocab_size``, ``init``, ``propose_chain`` (or ``propose`` for trees, and
``supports``) and, if it keeps state, ``rollback``. Example::

    @dataclasses.dataclass(frozen=True)
    class RepeatDrafter(Drafter):        # proposes the last token γ times
      vocab_size: int
      def init(self, draft_params, tokens, prompt_lens, features=None):
        return ()
      def propose_chain(self, draft_params, state, tokens, seq_lens, key, sampler, gamma):
        last = jnp.take_along_axis(tokens, (seq_lens - 1)[:, None], axis=1)
        drafts = jnp.repeat(last, gamma, axis=1)
        return drafts, jax.nn.one_hot(drafts, self.vocab_size), state
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax

from specjax import kv_cache as kvc
from specjax.kernels.packed import PackedWeight, unpacked
from specjax.sampling import Sampler
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree_acceptance import AcceptedPath
from specjax.speculative.tree import TreeTopology


class SharedCache(NamedTuple):
  """The ``state`` a drafter that ``shares_target_cache`` gets in ``propose``."""

  target: kvc.KVCache  # the target's cache, holding the committed length − 1
  own: Any  # the drafter's own state (its ``init``'s, after ``observe``/``rollback``)


class Drafter:
  """Base class of all drafters (see the module docstring for the contract).

  Subclasses provide ``vocab_size`` (a field or a property): the size of the
  target vocabulary their proposals range over.
  """

  # --- capabilities ------------------------------------------------------------

  def supports(self, topology: TreeTopology) -> bool:
    """Whether ``propose`` can build this topology (default: chains only)."""
    return topology.is_chain

  def buildable(self) -> str:
    """Which trees ``supports`` accepts, in words (for error messages)."""
    return "chains only (pass gamma or TreeTopology.chain(γ))"

  def default_tree(self) -> Optional[TreeTopology]:
    """The topology to verify when the decoder is given neither gamma nor tree (None: a chain)."""
    return None

  def tolerates_skipped_steps(self) -> bool:
    return False

  def shares_target_cache(self) -> bool:
    return False

  def reads_target_features(self) -> bool:
    return False

  def reads_target_predictions(self) -> bool:
    return False

  def target_feature_layers(self) -> tuple[int, ...]:
    """Sorted target layers whose outputs make the features (default (): the last hidden
    state), for drafters that read them."""
    return ()

  def check_params(self, draft_params: Any) -> None:
    """Raises ValueError for draft params this drafter cannot use (default: accepts any)."""

  def plain_params(self, draft_params: Any) -> Any:
    """``draft_params`` with the CPU streaming kernel's packed weights as plain arrays
    (for sharding, ``sharding.shard_params(..., drafter=)``; default: every packed leaf
    unpacked in place; drafters that pack a weight transposed override it)."""
    return jax.tree.map(lambda w: unpacked(w) if isinstance(w, PackedWeight) else w,
                        draft_params, is_leaf=lambda w: isinstance(w, PackedWeight))

  # --- the step ----------------------------------------------------------------

  def init(self, draft_params: Any, tokens: jax.Array, prompt_lens: jax.Array,
           features: Optional[jax.Array] = None) -> Any:
    """State for rows with prompts ``tokens[b, :prompt_lens[b]]`` ([B, S] buffer)."""
    raise NotImplementedError

  def propose(self, draft_params: Any, state: Any, tokens: jax.Array, seq_lens: jax.Array,
              key: jax.Array, sampler: Sampler,
              topology: TreeTopology) -> tuple[Proposal, Any]:
    """Returns (the proposal of ``topology``'s nodes, new state)."""
    if not topology.is_chain:
      raise ValueError(f"{type(self).__name__} builds chains only, not {topology}")
    drafts, q, state = self.propose_chain(draft_params, state, tokens, seq_lens, key, sampler,
                                          topology.num_nodes)
    return Proposal.chain(drafts, q), state

  def propose_chain(self, draft_params: Any, state: Any, tokens: jax.Array, seq_lens: jax.Array,
                    key: jax.Array, sampler: Sampler,
                    gamma: int) -> tuple[jax.Array, jax.Array, Any]:
    """Returns (drafts [B, γ] int32, q [B, γ, V] float32 or ``SubsetProbs``, new state)."""
    raise NotImplementedError

  def observe(self, state: Any, hidden: jax.Array, start: jax.Array) -> Any:
    """Receives the target's features of the accepted path (feature drafters only)."""
    return state

  def observe_block(self, state: Any, predictions: jax.Array, num_accepted: jax.Array) -> Any:
    """Receives the target's argmax at every block entry (``reads_target_predictions``)."""
    return state

  def rollback(self, state: Any, seq_lens: jax.Array, accepted: AcceptedPath) -> Any:
    """Forgets everything past the committed ``seq_lens`` (default: stateless)."""
    return state
