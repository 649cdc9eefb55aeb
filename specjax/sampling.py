"""Sampling strategies as small frozen dataclasses that expose their distributions.

Speculative sampling needs the *full warped distribution* of both models, not
only a sample, so every strategy has ``probs(logits) -> [..., V]`` and
``sample(key, logits) -> (tokens, probs)``. Warping order follows Hugging Face:
temperature, then top-k, then top-p.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Argmax decoding; its distribution is the one-hot of the argmax (the T -> 0 limit)."""

  def probs(self, logits: jax.Array) -> jax.Array:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

  def sample(self, key: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    del key
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), self.probs(logits)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Random sampling with optional temperature, top-k and top-p (nucleus) warping.

  Attributes:
    temperature: > 0; divides the logits.
    top_k: keep the k most likely tokens (ties at the k-th value are all kept).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p
      (ties at the cut-off are all kept).
  """

  temperature: float = 1.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f"temperature must be > 0 for Sampling (use Greedy for 0), "
                       f"got {self.temperature}")
    if self.top_k is not None and self.top_k < 1:
      raise ValueError(f"top_k must be >= 1, got {self.top_k}")
    if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  def probs(self, logits: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32) / self.temperature
    if self.top_k is not None and self.top_k < logits.shape[-1]:
      kth = jax.lax.top_k(logits, self.top_k)[0][..., -1:]
      logits = jnp.where(logits >= kth, logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    if self.top_p is not None and self.top_p < 1.0:
      # The cut-off is the smallest probability in the nucleus: sorted
      # descending, token i is kept while the mass before it is < top_p.
      sorted_p = -jnp.sort(-p, axis=-1)
      mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
      cutoff = jnp.min(jnp.where(mass_before < self.top_p, sorted_p, jnp.inf), axis=-1,
                       keepdims=True)
      p = jnp.where(p >= cutoff, p, 0.0)
      p = p / jnp.sum(p, axis=-1, keepdims=True)
    return p

  def sample(self, key: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    p = self.probs(logits)
    return sample_from(key, p), p


Sampler = Union[Greedy, Sampling]


def sample_from(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Draws one index per row of ``probs`` [..., V] (zeros are never drawn)."""
  logp = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
  return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)


def make_sampler(temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None) -> Sampler:
  """Greedy at temperature 0, else Sampling. Validates every parameter."""
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if top_k is not None and top_k < 1:
    raise ValueError(f"top_k must be >= 1, got {top_k}")
  if top_p is not None and not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if temperature == 0:
    return Greedy()
  return Sampling(temperature=temperature, top_k=top_k, top_p=top_p)


def sample_subset(sampler: Sampler, key: jax.Array, logits: jax.Array, ids: jax.Array,
                  vocab_size: int) -> tuple[jax.Array, jax.Array]:
  """Samples from logits [..., Vd] over the vocabulary subset ``ids`` [Vd].

  Returns (target ids, q [..., vocab_size] zero outside ``ids``): the same
  distribution as sampling the logits lifted to the full vocabulary with -inf
  outside the subset (every warp only rescales or cuts finite logits), with
  the random draw over Vd instead of V ids. Reduced-vocabulary drafters use it.
  """
  tok, q = sampler.sample(key, logits)
  full = jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., ids].set(q)
  return ids[tok], full

