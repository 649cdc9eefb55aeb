"""Tiny configs and random models shared by tests, notebooks and benchmarks."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax.config import ModelConfig
from specjax.model import Params, compute_dtype, forward, init_params


def tiny_config(vocab_size: int = 64, num_layers: int = 2, dim: int = 32, num_heads: int = 4,
                num_kv_heads: int = 2, ffn_dim: int = 64, **kw) -> ModelConfig:
  return ModelConfig(vocab_size=vocab_size, dim=dim, num_layers=num_layers,
                     num_heads=num_heads, num_kv_heads=num_kv_heads, ffn_dim=ffn_dim, **kw)


def tiny_model(seed: int = 0, scale: float = 0.5, **kw) -> tuple[ModelConfig, Params]:
  """A random tiny model with peaked (non-uniform) next-token distributions."""
  cfg = tiny_config(**kw)
  return cfg, init_params(cfg, jax.random.PRNGKey(seed), scale=scale)


DRAFTER_KINDS = ("prompt_lookup", "unigram", "bigram", "early_exit", "trained_exit",
                 "adapter_exit", "eagle", "medusa", "hybrid")


def make_drafter(kind: str, cfg: ModelConfig, params: Params, corpus: Sequence[Sequence[int]]):
  """(drafter, draft_params) for each non-model drafter kind, for tests over all drafters."""
  from specjax import drafters  # local: drafters import this package's models

  if kind == "prompt_lookup":
    return drafters.PromptLookupDrafter(cfg.vocab_size, max_ngram=3), ()
  if kind in ("unigram", "bigram"):
    order = 1 if kind == "unigram" else 2
    return drafters.NgramDrafter(cfg.vocab_size, order=order), drafters.fit_ngram(
        corpus, cfg.vocab_size, top_k=4)
  if kind == "early_exit":
    return drafters.early_exit_drafter(cfg, params, 1)
  if kind in ("trained_exit", "adapter_exit"):  # random exit head, half the target vocabulary
    # (q = 0 elsewhere); the adapter exit puts the target's layer 1, perturbed, before it
    from specjax.drafters.early_exit import adapter_layer
    from specjax.drafters.medusa import random_medusa_weights
    weights = random_medusa_weights(cfg, 1, 1, jax.random.PRNGKey(7), own_head=False)
    if kind == "adapter_exit":
      keys = iter(jax.random.split(jax.random.PRNGKey(8), 16))
      weights["adapter"] = jax.tree.map(
          lambda w: w + 0.3 * jnp.std(w) * jax.random.normal(next(keys), w.shape),
          adapter_layer(cfg, params, 1))
    return drafters.trained_exit_drafter(cfg, params, 1, weights,
                                         np.arange(0, cfg.vocab_size, 2))
  if kind == "eagle":  # random weights, half the target vocabulary (q = 0 elsewhere)
    from specjax.drafters.eagle import random_eagle_weights
    weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(7))
    vocab_map = np.arange(0, cfg.vocab_size, 2)
    return drafters.eagle_drafter(cfg, params, weights, vocab_map)
  if kind == "medusa":  # random heads, each its own rows, top-4 per head
    from specjax.drafters.medusa import random_medusa_weights
    weights = random_medusa_weights(cfg, 3, 1, jax.random.PRNGKey(7))
    return drafters.medusa_drafter(cfg, params, weights, top_k=4)
  if kind == "hybrid":  # the random EAGLE drafter, copying after a 2-token match
    eagle, dp = make_drafter("eagle", cfg, params, corpus)
    return drafters.hybrid_drafter(eagle, min_match=2, max_ngram=3), dp
  raise ValueError(f"unknown drafter kind {kind!r}")


# --- exact-distribution harness (tests of lossless sampling) -----------------------


def chi_square_pvalue(counts: np.ndarray, exact: np.ndarray) -> float:
  """Chi-square p-value of ``counts`` against the law ``exact`` (same shape).

  Fails if a cell of probability zero was drawn; cells expected fewer than 5
  times are pooled so the chi-square approximation holds. Refuses a law that is one
  cell after pooling: it has no degree of freedom, and a test against it has no power
  (choose a model or prompt whose law is spread).
  """
  from scipy import stats

  expected = exact.ravel() * counts.sum()
  observed = counts.ravel()
  assert observed[expected == 0].sum() == 0, "sampled a token of probability zero"
  keep = expected > 0
  small = keep & (expected < 5)
  obs = np.append(observed[keep & ~small], observed[small].sum())
  exp = np.append(expected[keep & ~small], expected[small].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  assert len(exp) >= 2, (f"degenerate law (largest cell {exact.max():.4f}): one cell after "
                         "pooling, so the chi-square test has no power")
  exp = exp * obs.sum() / exp.sum()  # float round-off only
  return float(stats.chisquare(obs, exp).pvalue)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _argmax_after_each_prefix(params: Params, cfg: ModelConfig, ids: jax.Array) -> jax.Array:
  size = ids.shape[0]
  out = forward(params, cfg, ids[None], jnp.arange(size)[None], kvc.init_cache(cfg, 1, size))
  return jnp.argmax(out.logits[0], -1)


def greedy_predictions(cfg: ModelConfig, params: Params, size: int):
  """``ids -> [len(ids)]`` the target's argmax after every prefix of ``ids`` (a full forward,
  no cache), for hand-written reference loops. The ids are zero-padded to ``size`` (later
  positions do not reach earlier ones' logits), so every length runs one compiled program
  (one per model config and size, shared by every caller) instead of eager ops compiled
  anew per length."""
  def predictions(ids: Sequence[int]) -> list[int]:
    if len(ids) > size:
      raise ValueError(f"{len(ids)} ids do not fit the padded size {size}")
    out = _argmax_after_each_prefix(params, cfg, jnp.asarray(list(ids) + [0] * (size - len(ids))))
    return np.asarray(out)[:len(ids)].tolist()
  return predictions


def exact_joint(cfg: ModelConfig, params: Params, sampler, prompt: Sequence[int]) -> np.ndarray:
  """[V, V] the warped target's exact law of the first two tokens after ``prompt``."""
  def next_probs(seqs):
    seqs = jnp.asarray(seqs)
    b, t = seqs.shape
    out = forward(params, cfg, seqs, jnp.broadcast_to(jnp.arange(t), (b, t)),
                  kvc.init_cache(cfg, b, t, compute_dtype(params)))
    return np.asarray(sampler.probs(out.logits[:, -1]), np.float64)

  p1 = next_probs([list(prompt)])[0]
  p2 = next_probs([list(prompt) + [x] for x in range(cfg.vocab_size)])
  return p1[:, None] * p2


def empirical_joint(dec, target: tuple[ModelConfig, Params], draft_params, prompt: Sequence[int],
                    rows: int, seed: int = 0) -> np.ndarray:
  """[V, V] counts of the first two tokens of ``rows`` independent speculative runs."""
  cfg, params = target
  v = cfg.vocab_size
  out = dec.generate(params, draft_params, [list(prompt)] * rows, 2, seed=seed,
                     cache_size=len(prompt) + 2 + dec.cache_headroom)
  gen = out.tokens[:, len(prompt):len(prompt) + 2]
  assert np.all(out.num_generated == 2)
  return np.bincount(gen[:, 0] * v + gen[:, 1], minlength=v * v).reshape(v, v)


VARIED_BATCHES = ([[5, 6, 7, 8], [9]], [[1] * 30, [2] * 11], [[3, 4], [5]])


def new_compiles_across_batches(dec, target_params, draft_params) -> int:
  """Compiles of the speculative loop and prefill (``SpeculativeDecoder.run``,
  ``prefill_models``) that prompts, budgets and seeds different from a warm-up call still
  cause (0 when shapes stay static): two-row batches, cache size 64."""
  from specjax.speculative.decoder import SpeculativeDecoder, prefill_models
  count = lambda: SpeculativeDecoder.run._cache_size() + prefill_models._cache_size()
  dec.generate(target_params, draft_params, [[1], [2, 3]], 8, cache_size=64)
  before = count()
  for seed, prompts in enumerate(VARIED_BATCHES):
    dec.generate(target_params, draft_params, prompts, 8 + seed, cache_size=64, seed=seed)
  return count() - before
