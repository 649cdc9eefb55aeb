"""Plain autoregressive decoding: chunked prefill + a jit-compiled ``lax.while_loop``.

Invariant shared with speculative decoding: a row with ``seq_lens[b]`` tokens
in its buffer has ``seq_lens[b] - 1`` of them in the KV cache; the last token
is fed by the next step. So prefill commits ``prompt_len - 1`` tokens and the
first decode step feeds the last prompt token, which makes every prompt length
one program.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax import sharding, validation
from specjax.config import ModelConfig
from specjax.model import Params, compute_dtype, forward, target_features
from specjax.prompts import pack_prompts
from specjax.sampling import Greedy, Sampler, Sampling
from specjax.sequences import append

PREFILL_CHUNK = 64


def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, num_tokens: jax.Array,
            cache: kvc.KVCache, chunk: int = PREFILL_CHUNK, return_hidden: bool = False,
            feature_layers: tuple[int, ...] = ()):
  """Commits ``tokens[b, :num_tokens[b]]`` to an empty cache, ``chunk`` tokens at a time.

  The chunks run in ``over_chunks`` (one program for every prompt length), each one
  ``prefill_chunk``. Returns the cache, or ``(cache, hidden)`` with ``return_hidden=True``:
  [B, S, D] last hidden states (before the final norm) of the committed
  positions, what feature drafters (EAGLE) read; other slots are undefined.
  With ``feature_layers``, the hidden states are those layers' outputs
  concatenated ([B, S, len(feature_layers)·D], ``model.target_features``).
  """
  b, s = tokens.shape
  layers = feature_layers if return_hidden else None
  step = lambda idx, valid, carry: prefill_chunk(params, cfg, tokens, idx, valid, *carry,
                                                 feature_layers=layers)
  cache, hidden = over_chunks(step, (cache, feature_buffer(params, cfg, b, s, layers)),
                              num_tokens, s, chunk)
  return (cache, hidden) if return_hidden else cache


def feature_buffer(params: Params, cfg: ModelConfig, batch: int, length: int,
                   feature_layers: Optional[tuple[int, ...]]) -> jax.Array:
  """Zeros for ``prefill_chunk``'s features: [B, S, F], or an empty placeholder when
  ``feature_layers`` is None (no features wanted)."""
  if feature_layers is None:
    return jnp.zeros((0,), compute_dtype(params))
  width = cfg.dim * max(1, len(feature_layers))
  return jnp.zeros((batch, length, width), compute_dtype(params))


def prefill_chunk(params: Params, cfg: ModelConfig, tokens: jax.Array, idx: jax.Array,
                  valid: jax.Array, cache: kvc.KVCache, hidden: jax.Array,
                  feature_layers: Optional[tuple[int, ...]] = None
                  ) -> tuple[kvc.KVCache, jax.Array]:
  """Commits one chunk: positions ``idx`` [C] of ``tokens`` [B, S], the first ``valid[b]``
  of them per row, to a cache whose rows hold the positions before ``idx[0]``.

  With ``feature_layers`` (a tuple, () for the last hidden state) the chunk's features
  go to ``hidden`` [B, S, F] at those positions; with None, ``hidden`` passes through.
  Positions past S are dropped (a last chunk may run past the buffer).
  """
  b, s = tokens.shape
  chunk_tokens = jnp.take(tokens, jnp.clip(idx, 0, s - 1), axis=1)
  out = forward(params, cfg, chunk_tokens, jnp.broadcast_to(idx, (b, idx.shape[0])), cache,
                num_valid=valid, compute_logits=False,
                return_layers=() if feature_layers is None else feature_layers)
  if feature_layers is not None:
    feats = target_features(out, feature_layers)
    hidden = hidden.at[:, idx].set(feats.astype(hidden.dtype), mode="drop")
  return out.cache, hidden


def over_chunks(step, carry, num_tokens: jax.Array, length: int, chunk: int = PREFILL_CHUNK):
  """Feeds positions 0 … max(num_tokens) − 1 in chunks: ``carry = step(idx, valid, carry)``
  with idx [C] the chunk's positions (C = min(chunk, length); the last chunk may run past
  ``length``) and valid [B] how many of them each row commits (its first ``valid[b]``).

  The number of chunks is dynamic (a ``while_loop``), so one program serves every prompt
  length and its cost follows the longest prompt of the batch, not the buffer's length.
  """
  chunk = min(chunk, length)

  def body(c):
    i, carry = c
    idx = i * chunk + jnp.arange(chunk)
    return i + 1, step(idx, jnp.clip(num_tokens - i * chunk, 0, chunk), carry)

  _, carry = jax.lax.while_loop(lambda c: c[0] * chunk < jnp.max(num_tokens), body, (0, carry))
  return carry


def over_backlog(step, carry, lengths: jax.Array, target: jax.Array, chunk: int):
  """Feeds each row's positions ``lengths[b]`` … ``target[b] − 1`` in chunks: ``carry =
  step(pos, valid, carry)`` with pos [B, C] the chunk's positions per row (C = ``chunk``;
  those past ``valid[b]`` are padding) and valid [B] how many of them the row commits.

  How a drafter catches up on tokens committed while it was skipped (an adaptive
  policy's plain decoding steps). The number of chunks is dynamic (a ``while_loop``):
  none when no row lags, so the common case costs one comparison.
  """

  def body(c):
    fed, carry = c
    valid = jnp.clip(target - fed, 0, chunk)
    return fed + valid, step(fed[:, None] + jnp.arange(chunk)[None, :], valid, carry)

  _, carry = jax.lax.while_loop(lambda c: jnp.any(c[0] < target), body, (lengths, carry))
  return carry


def last_tokens(tokens: jax.Array, seq_lens: jax.Array) -> jax.Array:
  """[B, 1] the last token of each row, the one the next forward feeds."""
  return jnp.take_along_axis(tokens, (seq_lens - 1)[:, None], axis=1)


@flax.struct.dataclass(kw_only=True)
class DecodeState:
  """State of the autoregressive loop.

  Attributes:
    tokens: [B, S] prompt followed by generated tokens (right-padded).
    seq_lens: [B] valid tokens per row; the cache holds seq_lens - 1.
    max_lens: [B] prompt length + max_new_tokens.
    done: [B] row finished (EOS or budget).
    cache: target KV cache.
    rng: PRNG key.
    steps: scalar, decode steps taken.
  """

  tokens: jax.Array
  seq_lens: jax.Array
  max_lens: jax.Array
  done: jax.Array
  cache: kvc.KVCache
  rng: jax.Array
  steps: jax.Array


def decode_step(params: Params, cfg: ModelConfig, sampler: Sampler, eos_ids: tuple[int, ...],
                state: DecodeState) -> DecodeState:
  """Feeds each row's last token, samples the next one and appends it."""
  active = ~state.done
  pos = state.seq_lens - 1
  out = forward(params, cfg, last_tokens(state.tokens, state.seq_lens), pos[:, None],
                state.cache, num_valid=active.astype(jnp.int32))
  rng, key = jax.random.split(state.rng)
  nxt, _ = sampler.sample(key, out.logits[:, 0])
  state, _ = append(state, nxt[:, None], jnp.ones_like(state.seq_lens), eos_ids)
  return sharding.constrain(state.replace(cache=out.cache, rng=rng, steps=state.steps + 1),
                            state.seq_lens.shape[0])


def init_decode_state(params: Params, cfg: ModelConfig, tokens: jax.Array,
                      prompt_lens: jax.Array, max_new_tokens: jax.Array,
                      rng: jax.Array) -> DecodeState:
  b, s = tokens.shape
  cache = prefill(params, cfg, tokens, prompt_lens - 1,
                  kvc.init_cache(cfg, b, s, compute_dtype(params)))
  max_lens = prompt_lens + max_new_tokens
  return sharding.constrain(DecodeState(tokens=tokens, seq_lens=prompt_lens, max_lens=max_lens,
                                       done=prompt_lens >= max_lens, cache=cache, rng=rng,
                                       steps=jnp.zeros((), jnp.int32)), b)


# ``generate`` runs two programs, so a call's time splits into prefill and decode loop.
_prefill = jax.jit(init_decode_state, static_argnames=("cfg",), donate_argnums=(2,))


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "eos_ids"), donate_argnums=(2,))
def _decode(params, cfg, state: DecodeState, sampler, eos_ids) -> DecodeState:
  """Decode steps until every row is done (the whole state comes back, so every donated
  buffer, the cache included, is reused in place)."""
  step = functools.partial(decode_step, params, cfg, sampler, eos_ids)
  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), step, state)


class GenerateOutput(NamedTuple):
  """Result of ``generate``.

  Attributes:
    tokens: [B, S] prompt + generated tokens (numpy).
    prompt_lens: [B].
    seq_lens: [B] prompt + generated.
    steps: target forward calls in the decode loop.
    seconds: wall time of the call (after compilation when warm).
    prefill_seconds: the part of ``seconds`` until the prompts were prefilled
      (validation and packing included); the rest is the decode loop,
      (seconds − prefill_seconds) / steps per step.
  """

  tokens: np.ndarray
  prompt_lens: np.ndarray
  seq_lens: np.ndarray
  steps: int
  seconds: float
  prefill_seconds: float

  def generated(self, row: int) -> list[int]:
    return self.tokens[row, self.prompt_lens[row]:self.seq_lens[row]].tolist()

  @property
  def num_generated(self) -> np.ndarray:
    return self.seq_lens - self.prompt_lens


def check_sampler(sampler: Sampler) -> None:
  if not isinstance(sampler, (Greedy, Sampling)):
    raise TypeError(f"sampler must be Greedy() or Sampling(...), got {type(sampler).__name__} "
                    f"{sampler!r} (make_sampler builds one from a temperature)")


def generate(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
             max_new_tokens: int, sampler: Sampler = Greedy(), *, seed: int = 0,
             cache_size: Optional[int] = None,
             eos_ids: Optional[Sequence[int]] = None) -> GenerateOutput:
  """Autoregressive generation for a batch of prompts of different lengths.

  Args:
    params, cfg: the model.
    prompts: B token-id lists.
    max_new_tokens: per-row budget; a row also stops at its first EOS.
    sampler: Greedy() or Sampling(...).
    seed: PRNG seed.
    cache_size: slots per row (default: fits the longest prompt + budget,
      rounded up to 64). Every prompt length up to it shares one compile.
    eos_ids: stop tokens (default ``cfg.eos_token_ids``); () never stops early.
  """
  check_sampler(sampler)
  start = time.perf_counter()  # validation and packing count, as in SpeculativeDecoder
  validation.check_params(params, cfg, "params")
  tokens, lens, _ = pack_prompts(prompts, max_new_tokens, cache_size, vocab_size=cfg.vocab_size,
                                 max_cache_size=cfg.max_cache_size,
                                 max_positions=cfg.max_position_embeddings,
                                 cache_bytes_per_slot=kvc.bytes_per_slot(cfg))
  sharding.check_batch(len(lens))
  return generate_packed(params, cfg, tokens, lens, max_new_tokens, sampler, seed=seed,
                         eos_ids=eos_ids, start=start)


def generate_packed(params: Params, cfg: ModelConfig, tokens: np.ndarray, lens: np.ndarray,
                    max_new_tokens: int, sampler: Sampler, *, seed: int,
                    eos_ids: Optional[Sequence[int]], start: float) -> GenerateOutput:
  """``generate`` after its validation and packing: ``tokens`` [B, S] and ``lens`` [B] as
  ``pack_prompts`` gives them (a caller that validated and packed them its own way, as
  ``SpeculativeDecoder`` does for a policy that never drafts, reuses them); ``start`` is
  when the call began, so its validation counts in the output's times."""
  eos = validation.token_ids(cfg.eos_token_ids if eos_ids is None else eos_ids, "eos_ids")
  state = jax.block_until_ready(_prefill(
      params, cfg, jnp.asarray(tokens), jnp.asarray(lens),
      jnp.full(lens.shape, max_new_tokens, jnp.int32), jax.random.PRNGKey(seed)))
  prefilled = time.perf_counter()
  state = _decode(params, cfg, state, sampler, eos)
  out_tokens = sharding.to_host(state.tokens)
  end = time.perf_counter()
  return GenerateOutput(tokens=out_tokens, prompt_lens=lens,
                        seq_lens=sharding.to_host(state.seq_lens),
                        steps=int(state.steps), seconds=end - start,
                        prefill_seconds=prefilled - start)
