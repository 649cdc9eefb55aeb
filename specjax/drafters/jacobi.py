"""Jacobi decoding (Santilli et al. 2023) as a draft-free drafter: the window iterates to its
fixed point, one target forward per iteration, verified like any chain.

Greedy decoding is the fixed point of yᵢ = argmax p(· | x, y₍<ᵢ₎) over a window of m
positions. Jacobi decoding guesses the window, runs the target once over [x_{s−1},
y₁ … y_m] (the chain's verify forward), and replaces every guess by the target's
prediction at its position; positions whose prefix was already right are final. Here:

  propose     the window: the guesses carried from the last iteration, and fresh ones
              (``fill``) where none is carried: "random" (uniform ids) or "prompt_lookup"
              (the tokens that followed the latest match of the context's suffix,
              position by position; see ``PromptLookupDrafter``);
  verify      the decoder's chain verification: the accepted prefix is exactly the
              guesses that equal the target's greedy predictions, plus one token;
  observe     the target's argmax at every entry of the verified block
              (``Drafter.observe_block``): after n accepted guesses and the extra token,
              the predictions at entries n + 1 … m become the guesses for the next m − n
              positions (the Jacobi update; their prefix held a wrong guess, so they are
              guesses, not facts), and the last n slots are refilled.

Each guess is a function of the context and of randomness drawn before verification,
so it counts as a point mass (q one-hot): greedy output is token-for-token plain
greedy decoding, and sampled output keeps the target's distribution (recursive
rejection with point-mass q; ``block`` verification applies too). Jacobi's own
termination rule (stop when an iteration changes nothing) is what the verify rule
does per step: a window already at its fixed point is accepted whole.

The window m is the chain's γ, static: ``SpeculativeDecoder(cfg, JacobiDrafter(V),
gamma=m)`` for any m up to ``max_window`` (the state's size). Target calls are the
iterations, so ``tokens_per_call`` is the tokens per Jacobi iteration (1 means no gain
over plain decoding; the lookahead-decoding authors found plain Jacobi decoding gains
little on chat models, about 1.05x — their n-gram pool is what makes the iteration pay).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from specjax import validation
from specjax.speculative.drafter import Drafter
from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.sampling import Sampler
from specjax.speculative.tree import TreeTopology

FILLS = ("random", "prompt_lookup")


@flax.struct.dataclass
class JacobiState:
  """The window between iterations.

  Attributes:
    guesses: [B, max_window] guesses for positions seq_len, seq_len + 1, … (the first m
      are used).
    carried: [B] how many leading guesses the last iteration produced (the rest are
      filled afresh by the next proposal).
  """

  guesses: jax.Array
  carried: jax.Array


@dataclasses.dataclass(frozen=True)
class JacobiDrafter(Drafter):
  """Jacobi fixed-point iteration over a window of m guesses (the decoder's chain of γ = m).

  Attributes:
    vocab_size: the target's vocabulary.
    max_window: the largest window m it serves (the state holds that many guesses).
    fill: how slots without a carried guess start: "random" or "prompt_lookup".
    max_ngram: longest suffix the prompt-lookup fill matches.
  """

  vocab_size: int
  max_window: int = 16
  fill: str = "prompt_lookup"
  max_ngram: int = 3

  def __post_init__(self):
    object.__setattr__(self, "vocab_size", validation.as_int(self.vocab_size, "vocab_size", 1))
    object.__setattr__(self, "max_window", validation.as_int(self.max_window, "max_window", 1))
    if self.fill not in FILLS:
      raise ValueError(f"fill must be one of {FILLS}, got {self.fill!r}")
    PromptLookupDrafter(self.vocab_size, self.max_ngram)  # validates max_ngram

  def supports(self, topology: TreeTopology) -> bool:
    return isinstance(topology, TreeTopology) and topology.is_chain and (
        topology.num_nodes <= self.max_window)

  def buildable(self) -> str:
    return f"chains of γ <= max_window = {self.max_window} (the Jacobi window)"

  def reads_target_predictions(self) -> bool:
    return True

  def init(self, draft_params, tokens, prompt_lens, features=None) -> JacobiState:
    b = tokens.shape[0]
    return JacobiState(guesses=jnp.zeros((b, self.max_window), jnp.int32),
                       carried=jnp.zeros((b,), jnp.int32))

  def propose_chain(self, draft_params, state: JacobiState, tokens, seq_lens, key,
                    sampler: Sampler, gamma: int):
    del draft_params, sampler  # q is a point mass whatever the sampler
    if self.fill == "random":
      fresh = jax.random.randint(key, (tokens.shape[0], gamma), 0, self.vocab_size, jnp.int32)
    else:
      fresh = PromptLookupDrafter(self.vocab_size, self.max_ngram).lookup(tokens, seq_lens, gamma)
    slot = jnp.arange(gamma)[None, :]
    drafts = jnp.where(slot < state.carried[:, None], state.guesses[:, :gamma], fresh)
    drafts = drafts.astype(jnp.int32)
    return drafts, jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32), state

  def observe_block(self, state: JacobiState, predictions: jax.Array,
                    num_accepted: jax.Array) -> JacobiState:
    """The Jacobi update: predictions [B, m + 1] at entries n + 1 … m are the next guesses."""
    m = predictions.shape[1] - 1
    idx = num_accepted[:, None] + 1 + jnp.arange(self.max_window)[None, :]  # entries n + 1 …
    guesses = jnp.take_along_axis(predictions, jnp.minimum(idx, m), axis=1)
    return JacobiState(guesses=guesses.astype(jnp.int32),
                       carried=(m - num_accepted).astype(jnp.int32))
