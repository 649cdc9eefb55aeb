"""Sampling strategies as small frozen dataclasses that expose their distributions.

Speculative sampling needs the *full warped distribution* of both models, not
only a sample, so every strategy has ``probs(logits) -> [..., V]`` and
``sample(key, logits) -> (tokens, probs)``. Warping order follows Hugging Face:
temperature, then top-k, then top-p.

Every strategy is total: any logits row gives a finite distribution that sums
to 1, by this rule (``sanitize_logits``, applied after the temperature):
  * NaN logits count as -inf (the token is never drawn);
  * if any logit is +inf, the +inf entries share the mass equally (the limit
    of a logit growing without bound) and every other token gets 0;
  * a row with no finite or +inf entry (all -inf / NaN) is uniform over the
    vocabulary; Greedy then picks id 0, the lowest of the tied ids.
Greedy's argmax therefore never picks a NaN. Parameters are validated when a
strategy is constructed: temperature is a finite number in
[MIN_TEMPERATURE, MAX_TEMPERATURE] (0 only through ``make_sampler``, which
returns Greedy), top_k an integer >= 1 (numpy integers accepted, bools not),
top_p a number in (0, 1].
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import flax.struct
import jax
import jax.numpy as jnp

from specjax.validation import as_float, as_int

# Outside this range a temperature is a mistake: logits / T overflows float32
# for ordinary logits below 1e-4, and above 1e4 every row is near uniform.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4


def sanitize_logits(logits: jax.Array) -> jax.Array:
  """float32 logits with the module's rule for NaN, +inf and all -inf rows applied."""
  x = logits.astype(jnp.float32)
  x = jnp.where(jnp.isnan(x), -jnp.inf, x)
  # One row reduction decides both cases (softmax takes the same max).
  top = jnp.max(x, axis=-1, keepdims=True)
  x = jnp.where(top == jnp.inf, jnp.where(x == jnp.inf, 0.0, -jnp.inf), x)
  return jnp.where(top == -jnp.inf, 0.0, x)


@dataclasses.dataclass(frozen=True)
class Greedy:
  """Argmax decoding; its distribution is the one-hot of the argmax (the T -> 0 limit)."""

  def probs(self, logits: jax.Array) -> jax.Array:
    return jax.nn.one_hot(self._argmax(logits), logits.shape[-1], dtype=jnp.float32)

  def sample(self, key: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    del key
    tok = self._argmax(logits)
    return tok, jax.nn.one_hot(tok, logits.shape[-1], dtype=jnp.float32)

  @staticmethod
  def _argmax(logits: jax.Array) -> jax.Array:
    # NaN never wins (jnp.argmax would pick it); +inf and all -inf rows need
    # no special case: the first maximal id wins, as the module rule says.
    return first_argmax(jnp.where(jnp.isnan(logits), -jnp.inf, logits))


def first_argmax(x: jax.Array) -> jax.Array:
  """``jnp.argmax(x, axis=-1)`` as int32: each row's first maximal index (its first NaN
  where it has one), in two plain reductions (a max, then the smallest index that
  reaches it) that XLA:CPU vectorises. ``jnp.argmax`` lowers to one reduction over
  (value, index) pairs, which it runs element by element: over a target's 49,152 logits
  it took 3-5x as long on an AMD EPYC (0.24 against 0.07 ms for one row, 1.9 against
  0.4 ms for the 17 rows of a 16-node tree's verify). Float inputs only. Elsewhere than on
  CPU it is ``jnp.argmax`` (the same ids; its one pass is not known to be slow there)."""
  if jax.default_backend() != "cpu":
    return jnp.argmax(x, axis=-1).astype(jnp.int32)
  top = jnp.max(x, axis=-1, keepdims=True)  # NaN where the row has one
  ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.min(jnp.where((x == top) | jnp.isnan(x), ids, x.shape[-1]), axis=-1)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Random sampling with optional temperature, top-k and top-p (nucleus) warping.

  Attributes:
    temperature: in [MIN_TEMPERATURE, MAX_TEMPERATURE]; divides the logits.
    top_k: keep the k most likely tokens (ties at the k-th value are all kept).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p
      (ties at the cut-off are all kept).
  """

  temperature: float = 1.0
  top_k: Optional[int] = None
  top_p: Optional[float] = None

  def __post_init__(self):
    if isinstance(self.temperature, (int, float)) and self.temperature == 0:
      raise ValueError("temperature must be > 0 for Sampling (use Greedy for 0)")
    object.__setattr__(self, "temperature", as_float(self.temperature, "temperature",
                                                     MIN_TEMPERATURE, MAX_TEMPERATURE))
    if self.top_k is not None:
      object.__setattr__(self, "top_k", as_int(self.top_k, "top_k", 1))
    if self.top_p is not None:
      top_p = as_float(self.top_p, "top_p", 0.0, 1.0)
      if top_p == 0.0:
        raise ValueError("top_p must be in (0, 1], got 0.0")
      object.__setattr__(self, "top_p", top_p)

  def probs(self, logits: jax.Array) -> jax.Array:
    logits = sanitize_logits(logits.astype(jnp.float32) / self.temperature)
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
  """Draws one index per row of ``probs`` [..., V] (zeros are never drawn).

  Entries that are not positive and finite (NaN, ±inf, <= 0) count as 0; a row
  with no positive entry is drawn uniformly. The weights need not sum to 1.

  Inverse CDF in two levels, with one uniform per row: the row is cut into
  blocks (a power of two ≥ √V wide); u · (total mass) picks a block by the
  blocks' running sums, then a token by the running sum inside that block.
  Exact up to float32 rounding: u has 2^-23 resolution, so ids whose share of
  the mass is below ~1e-7 are drawn with a rounded probability. 4-13x cheaper
  on CPU at V = 49,152 (1-16 rows) than Gumbel-max (``jax.random.categorical``),
  which draws and takes two logs of V uniforms (``benchmarks/results/sampling.md``).

  Example: probs [0.5, 0, 0.5] gives 0 or 2, each half the time, never 1.
  """
  ok = (probs > 0) & (probs < jnp.inf)
  w = jnp.where(ok, probs, 0.0).astype(jnp.float32)
  w = jnp.where(jnp.any(ok, axis=-1, keepdims=True), w, 1.0)
  # Keep the running sums finite for huge finite weights: an exact power-of-two scale
  # (dividing by the max is not safe: XLA turns it into x * (1 / max), which flushes
  # to zero for a max near float32's limit).
  w = jnp.where(jnp.max(w, axis=-1, keepdims=True) > 1e30, w * 2.0**-100, w)
  *lead, v = w.shape
  width = 1 << math.isqrt(v - 1).bit_length()  # a power of two ≥ √V
  blocks = -(-v // width)
  w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, blocks * width - v)])
  w = w.reshape(*lead, blocks, width)
  mass = jnp.sum(w, axis=-1)  # [..., blocks]
  ends = jnp.cumsum(mass, axis=-1)
  u = jax.random.uniform(key, (*lead, 1), jnp.float32) * ends[..., -1:]
  b = _first_above(mass, ends, u)
  start = jnp.take_along_axis(ends, jnp.maximum(b - 1, 0)[..., None], axis=-1)
  rest = u - jnp.where(b[..., None] > 0, start, 0.0)  # [..., 1] mass to go inside block b
  row = jnp.take_along_axis(w, b[..., None, None], axis=-2)[..., 0, :]  # [..., width]
  return (b * width + _first_above(row, jnp.cumsum(row, axis=-1), rest)).astype(jnp.int32)


def _first_above(w: jax.Array, ends: jax.Array, x: jax.Array) -> jax.Array:
  """The first index of w [..., n] with a positive entry whose running sum ``ends``
  exceeds x [..., 1]; the last positive one where rounding leaves none (x at the total).
  Only positive entries can be picked, whatever the rounding of the sums."""
  hit = (ends > x) & (w > 0)
  last = w.shape[-1] - 1 - jnp.argmax(w[..., ::-1] > 0, axis=-1)
  return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last)


def make_sampler(temperature: float = 0.0, top_k: Optional[int] = None,
                 top_p: Optional[float] = None) -> Sampler:
  """Greedy at temperature 0, else Sampling. Validates every parameter."""
  temperature = as_float(temperature, "temperature", 0.0, MAX_TEMPERATURE)
  # Sampling validates top_k / top_p even when Greedy is returned.
  sampling = Sampling(temperature=temperature or 1.0, top_k=top_k, top_p=top_p)
  return Greedy() if temperature == 0 else sampling


def scale_temperature(sampler: Sampler, ratio: float) -> Sampler:
  """``sampler``'s warping at ``ratio`` × its temperature: a draft law of the same top-k and
  top-p, sharper below 1 (``SpeculativeDecoder.draft_sampler``). Ratio 0 gives Greedy (the
  argmax, the T → 0 limit), as does a Greedy sampler at any ratio.

  Example: scale_temperature(Sampling(1.0, top_k=50), 0.8) == Sampling(0.8, top_k=50).
  """
  ratio = as_float(ratio, "ratio", 0.0, MAX_TEMPERATURE)
  if isinstance(sampler, Greedy) or ratio == 0:
    return Greedy()
  return dataclasses.replace(sampler, temperature=sampler.temperature * ratio)


def sample_subset(sampler: Sampler, key: jax.Array, logits: jax.Array,
                  ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Samples from logits [..., Vd] over the vocabulary subset ``ids`` [Vd].

  Returns (target ids, q [..., Vd] over ``ids``; ``SubsetProbs`` places it in the
  vocabulary, zero elsewhere): the same distribution as sampling the logits lifted to the
  full vocabulary with -inf outside the subset (every warp only rescales or cuts finite
  logits), with the random draw over Vd instead of V ids. Reduced-vocabulary drafters use it.
  """
  tok, q = sampler.sample(key, logits)
  return ids[tok], q


def lift_probs(q: jax.Array, ids: jax.Array, vocab_size: int) -> jax.Array:
  """Probabilities over a subset [..., Vd] -> over the vocabulary [..., V], zero elsewhere."""
  return jnp.zeros(q.shape[:-1] + (vocab_size,), q.dtype).at[..., ids].set(q)


@flax.struct.dataclass
class SubsetProbs:
  """Distributions over a fixed subset of the vocabulary, zero elsewhere, kept at the
  subset's size: a reduced-vocabulary drafter's q (EAGLE-3's 8,192 of the target's 49,152
  ids) is [..., K] here instead of [..., V], so the rules that read it (acceptance, β) pass
  over K entries where only those can be non-zero (``specjax.speculative.acceptance``).

  Attributes:
    probs: [..., K] the probabilities of ``ids``.
    ids: [K] int32 distinct vocabulary ids, the columns of ``probs``.
    vocab_size: static V.

  Example: ``SubsetProbs(jnp.array([[0.25, 0.75]]), jnp.array([4, 1]), 6).dense()`` is
  ``[[0, 0.75, 0, 0, 0.25, 0]]``.
  """

  probs: jax.Array
  ids: jax.Array
  vocab_size: int = flax.struct.field(pytree_node=False)

  def dense(self) -> jax.Array:
    """[..., V] the same distributions over the whole vocabulary."""
    return lift_probs(self.probs, self.ids, self.vocab_size)

  def slots(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(each token's column in ``probs`` (0 where absent), whether it is in the subset)."""
    hit = self.ids == tokens[..., None]
    return jnp.argmax(hit, axis=-1).astype(jnp.int32), jnp.any(hit, axis=-1)


def as_subset(q: jax.Array, ids: Optional[jax.Array], vocab_size: int) -> jax.Array | SubsetProbs:
  """``q`` [..., K] over ``ids`` as ``SubsetProbs``; ``q`` itself (over the vocabulary) when
  ``ids`` is None."""
  return q if ids is None else SubsetProbs(q, ids, vocab_size)


def dense_probs(q: jax.Array | SubsetProbs) -> jax.Array:
  """[..., V] over the whole vocabulary, whichever form ``q`` has."""
  return q.dense() if isinstance(q, SubsetProbs) else q
