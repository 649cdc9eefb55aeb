"""Unigram and bigram drafts fitted on target generations (the paper's Table 3 baselines).

A full V x V bigram table is 9.7 GB for V = 49152, so the bigram keeps the
``top_k`` most frequent successors of each token and backs off to the unigram:
q(x | prev) = λ · bigram(x | prev) + (1 − λ) · unigram(x), with λ = n/(n + κ)
for a previous token seen n times (Witten-Bell-like). The sampler warps
log q exactly as it warps a model's logits.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.sampling import Sampler
from specjax.speculative.drafter import Drafter


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
  """Order-1 (unigram) or order-2 (bigram) draft; tables live in ``draft_params``."""

  vocab_size: int
  order: int = 2

  def __post_init__(self):
    if self.order not in (1, 2):
      raise ValueError(f"order must be 1 (unigram) or 2 (bigram), got {self.order}")

  def tolerates_skipped_steps(self) -> bool:
    return True  # stateless: every proposal reads the committed tokens afresh

  def init(self, draft_params, tokens, prompt_lens, features=None):
    return ()

  def log_q(self, draft_params, prev: jax.Array) -> jax.Array:
    """[B, V] draft log-probabilities given the previous token [B]."""
    q = jnp.broadcast_to(draft_params["unigram"], prev.shape + (self.vocab_size,))
    if self.order == 2:
      lam = draft_params["weight"][prev][:, None]
      rows = jnp.arange(prev.shape[0])[:, None]
      q = (1 - lam) * q
      q = q.at[rows, draft_params["next_ids"][prev]].add(lam * draft_params["next_probs"][prev])
    return jnp.log(jnp.maximum(q, 1e-30))

  def propose_chain(self, draft_params, state, tokens, seq_lens, key, sampler: Sampler,
                    gamma: int):
    prev = jnp.take_along_axis(tokens, (seq_lens - 1)[:, None], axis=1)[:, 0]

    def step(prev, k):
      tok, q = sampler.sample(k, self.log_q(draft_params, prev))
      return tok, (tok, q)

    _, (drafts, qs) = jax.lax.scan(step, prev, jax.random.split(key, gamma))
    return drafts.T, jnp.moveaxis(qs, 0, 1), state


def fit_ngram(sequences: Iterable[Sequence[int]], vocab_size: int, top_k: int = 16,
              smoothing: float = 1.0, kappa: float = 4.0) -> dict[str, jnp.ndarray]:
  """Fits unigram and truncated-bigram tables (``draft_params`` for NgramDrafter).

  Args:
    sequences: token-id sequences (e.g. target generations).
    vocab_size: V.
    top_k: successors kept per token.
    smoothing: add-``smoothing`` for the unigram, so q > 0 everywhere.
    kappa: back-off strength; a token seen n times gets λ = n / (n + κ).
  """
  uni = np.full(vocab_size, smoothing, np.float64)
  pairs: dict[int, dict[int, int]] = {}
  for seq in sequences:
    seq = np.asarray(seq, np.int64)
    np.add.at(uni, seq, 1)
    for a, b in zip(seq[:-1].tolist(), seq[1:].tolist()):
      row = pairs.setdefault(a, {})
      row[b] = row.get(b, 0) + 1
  next_ids = np.zeros((vocab_size, top_k), np.int32)
  next_probs = np.zeros((vocab_size, top_k), np.float32)
  weight = np.zeros(vocab_size, np.float32)
  for a, row in pairs.items():
    items = sorted(row.items(), key=lambda kv: -kv[1])[:top_k]
    total = sum(row.values())
    kept = sum(c for _, c in items)
    next_ids[a, :len(items)] = [t for t, _ in items]
    next_probs[a, :len(items)] = [c / kept for _, c in items]
    weight[a] = kept / (total + kappa)  # = coverage (kept/total) x λ (total/(total+κ))
  return {"unigram": jnp.asarray(uni / uni.sum(), jnp.float32), "next_ids": jnp.asarray(next_ids),
          "next_probs": jnp.asarray(next_probs), "weight": jnp.asarray(weight)}
