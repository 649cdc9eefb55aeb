"""Greedy replay: a greedy speculative run's exact outcome, at the drafter's cost only.

At T = 0 every accepted token, and the extra token of every step, is the
target's argmax after a prefix of the output, so a greedy speculative run
never leaves the target's greedy continuation of the prompt (that it does not
is what the greedy-equality tests pin). Verification needs the target's
argmax only at block entries on that continuation: an entry off it belongs to
a node whose parent was rejected, and greedy acceptance never reads it. Given
the continuation, "verification" is therefore a lookup: the argmax after
position t is the continuation's token at t + 1. ``replay_greedy`` runs the
decoder's own propose, accept, commit and count around that lookup, so its
output tokens and every counter (accepted lengths, tokens per call,
per-depth and per-rank acceptance, α) equal those of
``SpeculativeDecoder.generate`` with the same drafter and topology — chains,
static and dynamic trees — while the target runs at most one prefill-sized
forward (for a drafter that reads the target's features or shares its cache)
instead of one verification per step.

Example (the γ = 4 chain's tokens per call of a draft, at T = 0)::

    plain = specjax.generate(params, cfg, prompts, 32 + 4, eos_ids=())
    dec = SpeculativeDecoder(cfg, drafter, gamma=4, eos_ids=())
    out = replay_greedy(dec, params, draft_params, prompts,
                        [plain.generated(i) for i in range(len(prompts))], 32)
    out.metrics()["tokens_per_call"]

The continuation must be the target's greedy output generated without stopping
at EOS, at least ``max_new_tokens + D`` tokens long (D: the tree's depth), since
the last step verifies up to D tokens past the budget.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax.generate import prefill
from specjax.model import Params, compute_dtype
from specjax.sampling import Greedy
from specjax.speculative.decoder import SpeculativeDecoder, TargetScores
from specjax.speculative.metrics import SpecResult, summarize
from specjax.speculative.state import SpecState


def replay_greedy(dec: SpeculativeDecoder, target_params: Params, draft_params: Any,
                  prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                  max_new_tokens: int, *, seed: int = 0, cache_size: int | None = None
                  ) -> SpecResult:
  """``dec.generate(target_params, draft_params, prompts, max_new_tokens)`` at T = 0, replayed
  against the target's greedy ``continuations`` of the prompts (module docstring).

  Raises:
    ValueError: ``dec`` does not decode greedily or has an adaptive policy, the
      continuations do not match the prompts, one is shorter than ``max_new_tokens + D``,
      or holds an id outside the vocabulary (plus everything
      ``SpeculativeDecoder.generate`` refuses).
  """
  if not isinstance(dec.sampler, Greedy):
    raise ValueError(f"replay_greedy replays greedy decoding only (sampler {dec.sampler!r}): "
                     "a sampled run leaves any fixed continuation")
  if dec.drafter.reads_target_predictions():
    raise ValueError(f"{type(dec.drafter).__name__} reads the target's predictions over the "
                     "whole block, which a greedy continuation does not give: run it for real")
  if dec.policy is not None:
    raise ValueError("replay_greedy replays one fixed topology; an adaptive policy's plain "
                     "steps feed the target's own features and cache: run it for real")
  if len(continuations) != len(prompts):
    raise ValueError(f"{len(continuations)} continuations for {len(prompts)} prompts")
  need = max_new_tokens + dec.tree.max_depth
  for i, c in enumerate(continuations):
    ids = np.asarray(c, np.int64)
    if ids.ndim != 1 or len(ids) < need:
      raise ValueError(f"continuation {i} has {len(ids)} tokens; the replay needs "
                       f"max_new_tokens + depth = {need} (the last step verifies up to "
                       f"{dec.tree.max_depth} tokens past the budget)")
    if len(ids) and (ids.min() < 0 or ids.max() >= dec.target_cfg.vocab_size):
      raise ValueError(f"continuation {i} holds a token id outside [0, "
                       f"{dec.target_cfg.vocab_size})")
  start = time.perf_counter()
  tokens, lens = dec.pack(target_params, draft_params, prompts, max_new_tokens, cache_size)
  future = tokens.copy()
  for i, (n, c) in enumerate(zip(lens, continuations)):
    future[i, n:n + need] = np.asarray(c[:need], np.int32)  # fits: headroom N >= D
  state = _replay(dec, target_params, draft_params, jnp.asarray(tokens), jnp.asarray(future),
                  jnp.asarray(lens), jnp.full(lens.shape, max_new_tokens, jnp.int32),
                  jax.random.PRNGKey(seed), jnp.int32(need))
  jax.block_until_ready(state.tokens)
  return summarize(state, lens, dec.gamma, time.perf_counter() - start)


@functools.partial(jax.jit, static_argnames=("dec",))
def _replay(dec: SpeculativeDecoder, target_params: Params, draft_params: Any,
            tokens: jax.Array, future: jax.Array, prompt_lens: jax.Array,
            max_new_tokens: jax.Array, rng: jax.Array, length: jax.Array) -> SpecState:
  """The replayed while loop; ``future`` is ``tokens`` with ``length`` continuation tokens
  after each prompt (the state's own buffer holds the prompts only, as in a real run)."""
  drafter, cfg = dec.drafter, dec.target_cfg
  b, s = tokens.shape
  cache = kvc.init_cache(cfg, b, s, compute_dtype(target_params))
  hidden_all = jnp.zeros((b, s, 0), jnp.float32)
  if drafter.reads_target_features() or drafter.shares_target_cache():
    # One forward over prompt + continuation: the target's cache (for a drafter that
    # shares it) and features (for EAGLE) at every position a step can read.
    cache = prefill(target_params, cfg, future, prompt_lens + length - 1, cache,
                    return_hidden=drafter.reads_target_features(),
                    feature_layers=drafter.target_feature_layers())
    if drafter.reads_target_features():
      cache, hidden_all = cache
  features = hidden_all if drafter.reads_target_features() else None
  draft_state = drafter.init(draft_params, tokens, prompt_lens, features=features)
  state = dec.initial_state(tokens, prompt_lens, max_new_tokens, rng,
                            cache.with_lengths(prompt_lens - 1), draft_state)

  def step(st: SpecState) -> SpecState:
    rng, k_draft, k_accept = jax.random.split(st.rng, 3)
    proposal, new_draft_state = dec.propose(draft_params, st, k_draft)
    depth, _ = dec.block_layout(proposal)
    pos = jnp.clip((st.seq_lens - 1)[:, None] + depth, 0, s - 2)  # [B, N + 1] block entries
    argmax = jnp.take_along_axis(future, pos + 1, axis=1)
    scores = TargetScores(p=jax.nn.one_hot(argmax, cfg.vocab_size, dtype=jnp.float32),
                          cache=cache, hidden=jnp.take_along_axis(hidden_all, pos[..., None],
                                                                  axis=1), argmax=argmax)
    new = dec.finish(st, proposal, scores, k_accept, new_draft_state, rng)
    # The shared cache stays the continuation's (commit may have compacted the copy it got).
    return new.replace(target_cache=cache.with_lengths(new.seq_lens - 1))

  return jax.lax.while_loop(lambda st: ~jnp.all(st.done), step, state)
