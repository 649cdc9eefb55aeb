"""Prompt-lookup drafting: copy what followed earlier matches of the current suffix.

For each row, the last n committed tokens (n from ``max_ngram`` down to
``min_ngram``) are searched for in the whole committed context. Candidate
continuations are ranked by the length of the match, then by recency (the
most recent occurrence of the longest matching suffix first). A chain proposes
the γ tokens that followed the best match. A tree whose root has k children,
each the head of a chain (several matches as branches, as in lookahead
decoding's n-gram pool or SpecInfer's multiple candidates), proposes the k best
matches' continuations, one per branch, in rank order. The proposals are
deterministic (point-mass q), so verification accepts a draft token with
probability p(d) and otherwise resamples from p with the rejected tokens
removed — still exactly the target's distribution. Without a match (or past
the end of a short continuation) a node repeats the last committed token,
accepted only when the target agrees. Two branches may start with the same
token (two matches followed by the same word); that wastes a node but stays
lossless.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import Sampler
from specjax.speculative.drafter import Drafter
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import TreeTopology


def branch_layout(topology: TreeTopology) -> tuple[np.ndarray, np.ndarray]:
  """(branch [N], offset [N]): which child of the root each node descends from and its
  index along that chain (0 for the root's child). Needs every node to have <= 1 child."""
  branch, offset = [], []
  for i, p in enumerate(topology.parents):
    if p < 0:  # a child of the root: its rank among the root's children is its branch
      branch.append(topology.ranks[i])
      offset.append(0)
    else:
      branch.append(branch[p])
      offset.append(offset[p] + 1)
  return np.asarray(branch, np.int32), np.asarray(offset, np.int32)


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
  """n-gram lookup over the context (no weights, no state); chains and root-branching trees."""

  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

  def supports(self, topology: TreeTopology) -> bool:
    """Chains, and trees that branch only at the root (every node has at most one child)."""
    return isinstance(topology, TreeTopology) and max(topology.num_children[1:]) <= 1

  def buildable(self) -> str:
    return "chains and trees that branch only at the root (each node has at most one child)"

  def tolerates_skipped_steps(self) -> bool:
    return True  # stateless: every proposal reads the committed tokens afresh

  def init(self, draft_params, tokens, prompt_lens, features=None):
    return ()

  def match_starts(self, tokens: jax.Array, seq_lens: jax.Array, num_matches: int) -> jax.Array:
    """[B, k] where the continuations of the k best earlier matches start (-1: none).

    Best = longest matching suffix, then most recent; each start appears once.
    """
    return self.matches(tokens, seq_lens, num_matches)[0]

  def matches(self, tokens: jax.Array, seq_lens: jax.Array,
              num_matches: int) -> tuple[jax.Array, jax.Array]:
    """(starts, lengths), each [B, k]: where the continuations of the k best earlier matches
    start (-1: none) and how many suffix tokens each matched (0: none)."""
    b, s = tokens.shape
    i = jnp.arange(s)[None, :]  # candidate start of an earlier occurrence
    score = jnp.full((b, s), -1)  # per continuation start c = i + n
    for n in range(min(self.max_ngram, s - 1), self.min_ngram - 1, -1):  # a match needs n + 1
      suffix_at = seq_lens[:, None] - n + jnp.arange(n)[None, :]  # [B, n]
      suffix = jnp.take_along_axis(tokens, jnp.clip(suffix_at, 0, s - 1), axis=1)
      match = jnp.ones((b, s), bool)
      for k in range(n):
        shifted = jnp.roll(tokens, -k, axis=1)  # shifted[:, i] = tokens[:, i + k]
        match &= shifted == suffix[:, k:k + 1]
      # The occurrence must end before the suffix starts and leave a next token.
      match &= (i + n <= seq_lens[:, None] - 1) & (seq_lens[:, None] >= n + 1)
      # Continuation c = i + n scores n * (S + 1) + c: longer n first, then recency.
      cand = jnp.where(match, n * (s + 1) + i + n, -1)
      cand = jnp.concatenate([jnp.full((b, n), -1), cand[:, :s - n]], axis=1)  # index by c
      score = jnp.maximum(score, cand)
    top, starts = jax.lax.top_k(score, num_matches)
    return jnp.where(top >= 0, starts, -1), jnp.where(top >= 0, top // (s + 1), 0)

  def continuations(self, tokens: jax.Array, seq_lens: jax.Array, starts: jax.Array,
                    offsets: jax.Array) -> jax.Array:
    """Tokens at ``starts[b, j] + offsets[j]`` ([B, J]), the last committed token where unusable."""
    s = tokens.shape[1]
    last = jnp.take_along_axis(tokens, (seq_lens - 1)[:, None], axis=1)
    idx = starts + offsets[None, :]
    cont = jnp.take_along_axis(tokens, jnp.clip(idx, 0, s - 1), axis=1)
    usable = (starts >= 0) & (idx < seq_lens[:, None])
    return jnp.where(usable, cont, last).astype(jnp.int32)

  def lookup(self, tokens: jax.Array, seq_lens: jax.Array, gamma: int) -> jax.Array:
    """[B, γ] proposals from the best match (longest matching suffix, latest occurrence)."""
    starts = self.match_starts(tokens, seq_lens, 1)
    return self.continuations(tokens, seq_lens, jnp.repeat(starts, gamma, axis=1),
                              jnp.arange(gamma))

  def propose(self, draft_params, state, tokens, seq_lens, key, sampler: Sampler,
              topology: TreeTopology):
    if topology.is_chain:
      return super().propose(draft_params, state, tokens, seq_lens, key, sampler, topology)
    if not self.supports(topology):
      raise ValueError(f"PromptLookupDrafter builds {self.buildable()}, not {topology}")
    branch, offset = branch_layout(topology)
    starts = self.match_starts(tokens, seq_lens, int(branch.max()) + 1)  # [B, k]
    drafts = self.continuations(tokens, seq_lens, starts[:, branch], jnp.asarray(offset))
    return Proposal(tokens=drafts, q=None, draw="point_mass"), state

  def propose_chain(self, draft_params, state, tokens, seq_lens, key, sampler: Sampler,
                    gamma: int):
    del draft_params, key, sampler  # deterministic: q is one-hot whatever the sampler
    drafts = self.lookup(tokens, seq_lens, gamma)
    return drafts, jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32), state
