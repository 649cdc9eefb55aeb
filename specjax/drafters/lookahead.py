"""Lookahead decoding (Fu et al. 2024) as a draft-free drafter: a 2D Jacobi window harvests
n-grams into a pool, and the pooled n-grams that follow the last token are verified in the
same target forward.

Parameters (static): window W, n-gram size N, guess set G.

One target forward per step runs, as a single static token tree rooted at the last
committed token x (``TreeTopology``; the decoder's tree verification, so its mask, its
positions and, on GPU/TPU, the tree-attention entry point with its Pallas kernels serve
it unchanged; not yet run on an accelerator):

  lookahead branch  N − 1 levels of W columns: cell (ℓ, j) is a guess for position
                    p + j + ℓ (p: x's position; cell (0, 0) is x itself). Level 0 is a
                    chain x → (0, 1) → … → (0, W − 1); cell (ℓ, j) hangs under (ℓ − 1, j).
                    So (ℓ, j) sees level 0 up to column j and column j of the levels above
                    it: exactly the reference's 2D-Jacobi mask (``j_make_causal_mask_multilevel``),
                    and its depth is its position offset j + ℓ.
  verification      the pool's (at most) G continuations of x, N − 1 tokens each, as G
  branch            chains under the root, most recently harvested first.

After the forward (``Drafter.observe_block``), the target's argmax at the last level's
cells, one per column, gives W new tokens. Column j then holds an n-gram: (0, j), (1, j),
…, (N − 2, j), new_j at consecutive positions; it enters the pool keyed by its first
token (``ngram_pool``: G per key, least recently used replaced). The window slides: level
ℓ takes level ℓ + 1 and the last level takes the new tokens (the reference's
``ALWAYS_FWD_ONE``, which also ignores how many tokens the step accepted). The pool is
seeded from the prompt and receives every committed n-gram (the reference's
``POOL_FROM_PROMPT``; ``pool_from_context=False`` turns it off).

Verification is the decoder's, over the whole tree: every node's token is a deterministic
function of the context and of the previous steps, so the proposal is a point mass
(``draw="point_mass"``). Greedy output is plain greedy decoding token for token; sampling
uses recursive rejection with q = 1 (accept child x with probability r(x), else remove x
from the residual r), which keeps the target's distribution exactly.

Departures from the reference implementation, and why:
  * the window's cells are candidates too, not only the pooled n-grams: they are guesses
    fixed before the forward, so accepting along them is just as lossless, and level 0 is
    a Jacobi chain that sometimes matches;
  * every level of the window is seeded at once (random prompt tokens, a fixed seed)
    instead of one level per step; the pool takes the window's n-grams only after N − 2
    steps, when every level below the first came from the target;
  * the pool is per row, so batches > 1 work (the reference decodes one sequence);
  * every committed n-gram enters the pool, not only the last one of each step;
  * empty guess slots repeat the most recent guess, and a key with none verifies token 0
    N − 1 times (a static tree needs G chains; any fixed guess is lossless).

Example::

    drafter = LookaheadDrafter(cfg.vocab_size, window=5, ngram=4, guesses=5)
    dec = SpeculativeDecoder(cfg, drafter)        # verifies drafter.default_tree()
    out = dec.generate(params, (), prompts, max_new_tokens=128)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import validation
from specjax.drafters.ngram_pool import NgramPool
from specjax.sampling import Sampler
from specjax.speculative.drafter import Drafter
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import TreeTopology, breadth_first_order


@flax.struct.dataclass
class LookaheadState:
  """The window and the pool between steps.

  Attributes:
    window: [B, N − 1, W] the 2D Jacobi window ([:, 0, 0] is the last root proposed).
    pool: the n-gram pool (``NgramPool``, continuations of N − 1 tokens).
    pooled: [B] committed positions below this have had their n-grams pooled.
    iterations: [B] Jacobi iterations so far (the window is harvested from N − 2 on).
  """

  window: jax.Array
  pool: NgramPool
  pooled: jax.Array
  iterations: jax.Array


class _Layout(NamedTuple):
  """Where the window and the guesses sit in the verified tree (numpy, static)."""

  topology: TreeTopology
  node_source: np.ndarray   # [nodes] index into concat(guesses [G·(N−1)], window [(N−1)·W])
  window_block: np.ndarray  # [N − 1, W] block entry of each window cell ((0, 0): the root, 0)


@functools.lru_cache(maxsize=64)
def _layout(window: int, ngram: int, guesses: int) -> _Layout:
  levels = ngram - 1  # window levels, and the length of a guess
  parents, source, cell = [], [], {}

  def add(parent: int, src: int) -> int:
    parents.append(parent)
    source.append(src)
    return len(parents) - 1

  for g in range(guesses):  # the verification branch first: siblings are tried in order
    prev = -1
    for k in range(levels):
      prev = add(prev, g * levels + k)
  base = guesses * levels
  cell[(0, 0)] = -1  # the root
  for l in range(levels):
    for j in range(window):
      if (l, j) == (0, 0):
        continue
      parent = cell[(0, j - 1)] if l == 0 else cell[(l - 1, j)]
      cell[(l, j)] = add(parent, base + l * window + j)
  order = breadth_first_order(parents)
  position = {old: k for k, old in enumerate(order)}
  topology = TreeTopology(tuple(-1 if parents[o] < 0 else position[parents[o]] for o in order))
  window_block = np.zeros((levels, window), np.int32)
  for (l, j), node in cell.items():
    window_block[l, j] = 0 if node < 0 else position[node] + 1
  return _Layout(topology, np.asarray([source[o] for o in order], np.int32), window_block)


@dataclasses.dataclass(frozen=True)
class LookaheadDrafter(Drafter):
  """Lookahead decoding: a (N − 1) × W Jacobi window and a pool of n-grams, G per key.

  Attributes:
    vocab_size: the target's vocabulary.
    window: W >= 1, columns of the Jacobi window.
    ngram: N >= 2, the n-gram size (window levels N − 1; guesses of N − 1 tokens).
    guesses: G >= 1, continuations pooled per key and verified per step.
    pool_from_context: seed the pool with the prompt's n-grams and add every committed
      one (else only the window's harvest fills it).
  """

  vocab_size: int
  window: int = 5
  ngram: int = 4
  guesses: int = 5
  pool_from_context: bool = True

  def __post_init__(self):
    object.__setattr__(self, "vocab_size", validation.as_int(self.vocab_size, "vocab_size", 1))
    object.__setattr__(self, "window", validation.as_int(self.window, "window (W)", 1))
    object.__setattr__(self, "ngram", validation.as_int(self.ngram, "ngram (N)", 2))
    object.__setattr__(self, "guesses", validation.as_int(self.guesses, "guesses (G)", 1))
    object.__setattr__(self, "pool_from_context", bool(self.pool_from_context))

  @property
  def layout(self) -> _Layout:
    return _layout(self.window, self.ngram, self.guesses)

  # --- capabilities ------------------------------------------------------------

  def default_tree(self) -> TreeTopology:
    return self.layout.topology

  def supports(self, topology) -> bool:
    return topology == self.layout.topology

  def buildable(self) -> str:
    t = self.layout.topology
    return (f"its own tree only (W={self.window}, N={self.ngram}, G={self.guesses}: "
            f"{t.num_nodes} nodes, depth {t.max_depth}), which the decoder uses when given "
            "neither gamma nor tree")

  def reads_target_predictions(self) -> bool:
    return True

  # --- the step ----------------------------------------------------------------

  def init(self, draft_params, tokens, prompt_lens, features=None) -> LookaheadState:
    b, s = tokens.shape
    levels = self.ngram - 1
    # The reference seeds the window with tokens copied from random prompt positions.
    at = jax.random.randint(jax.random.PRNGKey(0), (b, levels * self.window), 0,
                            jnp.maximum(prompt_lens, 1)[:, None])
    window = jnp.take_along_axis(tokens, at, axis=1).reshape(b, levels, self.window)
    pool = NgramPool.empty(b, self.vocab_size, self.guesses, self.ngram - 1)
    zeros = jnp.zeros((b,), jnp.int32)
    if self.pool_from_context:
      pool = pool.insert_sequence(tokens, zeros, prompt_lens, s)
    return LookaheadState(window=window.astype(jnp.int32), pool=pool,
                          pooled=prompt_lens.astype(jnp.int32), iterations=zeros)

  def propose(self, draft_params, state: LookaheadState, tokens, seq_lens, key,
              sampler: Sampler, topology: TreeTopology) -> tuple[Proposal, LookaheadState]:
    del draft_params, key, sampler  # deterministic: a point mass whatever the sampler
    if not self.supports(topology):
      raise ValueError(f"LookaheadDrafter builds {self.buildable()}, not {topology}")
    pool = state.pool
    if self.pool_from_context:  # the n-grams committed since the last step (<= D + 1)
      pool = pool.insert_sequence(tokens, state.pooled, seq_lens, topology.max_depth + 1)
    root = jnp.take_along_axis(tokens, (seq_lens - 1)[:, None], axis=1)[:, 0]
    grams, valid = pool.lookup(root)
    grams = jnp.where(valid[:, :, None], grams, grams[:, :1])
    window = state.window.at[:, 0, 0].set(root)
    b = tokens.shape[0]
    source = jnp.concatenate([grams.reshape(b, -1), window.reshape(b, -1)], axis=1)
    nodes = source[:, self.layout.node_source]
    new = state.replace(window=window, pool=pool, pooled=seq_lens.astype(jnp.int32))
    return Proposal(tokens=nodes.astype(jnp.int32), q=None, draw="point_mass"), new

  def observe_block(self, state: LookaheadState, predictions: jax.Array,
                    num_accepted: jax.Array) -> LookaheadState:
    """One Jacobi iteration of the window and its harvest (``predictions`` [B, nodes + 1])."""
    del num_accepted  # the window slides by one whatever was accepted (the reference's rule)
    at = jnp.asarray(self.layout.window_block)
    fresh = predictions[:, at[-1]]  # [B, W]: the target's argmax after the last level
    window = state.window
    harvest = state.iterations >= self.ngram - 2
    columns = jnp.concatenate([window, fresh[:, None, :]], axis=1)  # [B, N, W]

    def add_column(j, pool):
      gram = jax.lax.dynamic_index_in_dim(columns, j, axis=2, keepdims=False)  # [B, N]
      return pool.insert(gram[:, 0], gram[:, 1:], harvest)

    pool = jax.lax.fori_loop(0, self.window, add_column, state.pool)
    return state.replace(window=columns[:, 1:], pool=pool, iterations=state.iterations + 1)
