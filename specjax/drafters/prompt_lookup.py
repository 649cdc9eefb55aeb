"""Prompt-lookup drafting: copy what followed the latest earlier match of the current suffix.

For each row, the last n committed tokens (n from ``max_ngram`` down to
``min_ngram``) are searched for in the whole committed context; the γ tokens
that followed the most recent earlier occurrence are proposed. Its q is the
one-hot of the proposal (a deterministic draft), so verification accepts a
draft token with probability p(d) and otherwise resamples from p with d
removed — still exactly the target's distribution. Without a match it
proposes a repeat of the last token (accepted only when the target agrees).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.drafters.base import Drafter
from specjax.sampling import Sampler


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
  """n-gram lookup over the context (no weights, no state)."""

  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

  def init(self, draft_params, tokens, prompt_lens, features=None):
    return ()

  def lookup(self, tokens: jax.Array, seq_lens: jax.Array, gamma: int) -> jax.Array:
    """[B, γ] proposals from the latest earlier match of the longest matching suffix."""
    b, s = tokens.shape
    i = jnp.arange(s)[None, :]  # candidate start of an earlier occurrence
    best_start = jnp.full((b,), -1)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):  # longest match wins
      suffix_at = seq_lens[:, None] - n + jnp.arange(n)[None, :]  # [B, n]
      suffix = jnp.take_along_axis(tokens, jnp.clip(suffix_at, 0, s - 1), axis=1)
      match = jnp.ones((b, s), bool)
      for k in range(n):
        shifted = jnp.roll(tokens, -k, axis=1)  # shifted[:, i] = tokens[:, i + k]
        match &= shifted == suffix[:, k:k + 1]
      # The occurrence must end before the suffix starts and leave a next token.
      match &= (i + n <= seq_lens[:, None] - 1) & (seq_lens[:, None] >= n + 1)
      start = jnp.max(jnp.where(match, i + n, -1), axis=1)  # continuation start
      best_start = jnp.where(best_start < 0, start, best_start)
    last = jnp.take_along_axis(tokens, (seq_lens - 1)[:, None], axis=1)
    idx = best_start[:, None] + jnp.arange(gamma)[None, :]
    cont = jnp.take_along_axis(tokens, jnp.clip(idx, 0, s - 1), axis=1)
    usable = (best_start[:, None] >= 0) & (idx < seq_lens[:, None])
    return jnp.where(usable, cont, last).astype(jnp.int32)

  def propose_chain(self, draft_params, state, tokens, seq_lens, key, sampler: Sampler,
                    gamma: int):
    del draft_params, key, sampler  # deterministic: q is one-hot whatever the sampler
    drafts = self.lookup(tokens, seq_lens, gamma)
    return drafts, jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32), state
