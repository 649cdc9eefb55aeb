"""The draft–verify loop: propose → verify → accept → commit/rollback, one jitted while loop.

γ, the sampler, the drafter and the model configs are static (fields of the
frozen ``SpeculativeDecoder``); prompt lengths, acceptance counts and budgets
are arrays, so nothing recompiles across prompts or acceptance patterns.

Step, for a row with committed length s (the target cache holds s − 1):
  propose: the drafter samples d₁…d_γ with distributions q₁…q_γ;
  verify:  the target runs [x_{s−1}, d₁…d_γ] at positions s−1…s−1+γ in one
           forward, giving p₁…p_{γ+1};
  accept:  modified rejection sampling keeps n drafts and draws one more
           token (``acceptance.accept``);
  observe: a feature drafter (EAGLE) receives the target's hidden states of
           the verified block;
  commit:  d₁…dₙ and the extra token are appended (trimmed at EOS/budget);
  rollback: both caches are cut back to the new committed length − 1.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax import validation
from specjax.config import ModelConfig
from specjax.drafters.base import Drafter
from specjax.generate import check_sampler, is_eos, last_tokens, prefill
from specjax.model import Params, forward
from specjax.prompts import pack_prompts
from specjax.sampling import Greedy, Sampler
from specjax.speculative.acceptance import Acceptance, accept
from specjax.speculative.metrics import SpecResult, summarize
from specjax.speculative.state import SpecCounters, SpecState


@dataclasses.dataclass(frozen=True)
class SpeculativeDecoder:
  """Lossless speculative decoding of a target with any drafter.

  Attributes:
    target_cfg: the target's config.
    drafter: proposes γ tokens (see ``specjax.drafters``).
    gamma: draft length γ >= 1 (static).
    sampler: Greedy() or Sampling(...), applied identically to target and draft.
    eos_ids: stop tokens (any sequence of ints, stored as a tuple); default the target's.
  """

  target_cfg: ModelConfig
  drafter: Drafter
  gamma: int = 4
  sampler: Sampler = Greedy()
  eos_ids: Optional[tuple[int, ...]] = None

  def __post_init__(self):
    object.__setattr__(self, "gamma", validation.as_int(self.gamma, "gamma", 1))
    check_sampler(self.sampler)
    if self.drafter.vocab_size != self.target_cfg.vocab_size:
      raise ValueError(
          f"vocabulary mismatch: the drafter proposes over {self.drafter.vocab_size} tokens but "
          f"the target has {self.target_cfg.vocab_size}; speculative decoding needs one vocabulary")
    eos = self.target_cfg.eos_token_ids if self.eos_ids is None else self.eos_ids
    object.__setattr__(self, "eos_ids", validation.token_ids(eos, "eos_ids"))

  # --- the algorithm's steps -------------------------------------------------

  def propose(self, draft_params: Any, state: SpecState, key: jax.Array):
    """Draft γ tokens: (drafts [B, γ], q [B, γ, V], new draft state)."""
    # A drafter that shares the target's KV cache (early exit) reads it as its
    # state; it only writes scratch slots, which verify overwrites.
    draft_state = (state.target_cache if getattr(self.drafter, "shares_target_cache", False)
                   else state.draft_state)
    return self.drafter.propose(draft_params, draft_state, state.tokens, state.seq_lens,
                                key, self.sampler, self.gamma)

  def verify(self, target_params: Params, state: SpecState, drafts: jax.Array):
    """One target forward over the last committed token and the drafts.

    Returns (p [B, γ+1, V], the new target cache, hidden [B, γ+1, D]: the
    target's features of the block, for feature drafters).
    """
    b = drafts.shape[0]
    block = jnp.concatenate([last_tokens(state.tokens, state.seq_lens), drafts], axis=1)
    positions = (state.seq_lens - 1)[:, None] + jnp.arange(self.gamma + 1)[None, :]
    out = forward(target_params, self.target_cfg, block, positions, state.target_cache,
                  num_valid=jnp.full((b,), self.gamma + 1, jnp.int32))
    return self.sampler.probs(out.logits), out.cache, out.hidden

  def observe(self, state: SpecState, draft_state: Any, hidden: jax.Array) -> Any:
    """Hands a feature drafter the target's features of the verified block (positions s−1…)."""
    if not getattr(self.drafter, "reads_target_features", False):
      return draft_state
    return self.drafter.observe(draft_state, hidden, state.seq_lens - 1)

  def accept(self, key: jax.Array, drafts: jax.Array, q: jax.Array, p: jax.Array) -> Acceptance:
    return accept(key, drafts, q, p)

  def commit(self, state: SpecState, drafts: jax.Array, acc: Acceptance) -> SpecState:
    """Appends accepted drafts + the extra token, trimmed at EOS and at the budget."""
    b, s = state.tokens.shape
    g = self.gamma
    active = ~state.done
    j = jnp.arange(g + 1)[None, :]
    emitted = jnp.where(j < acc.num_accepted[:, None],
                        jnp.concatenate([drafts, drafts[:, :1]], axis=1),
                        acc.next_token[:, None])  # [B, γ+1]; valid for j <= n
    n_emit = acc.num_accepted + 1
    eos_at = jnp.where(is_eos(emitted, self.eos_ids) & (j < n_emit[:, None]), j, g + 1)
    first_eos = jnp.min(eos_at, axis=1)
    n_emit = jnp.minimum(jnp.minimum(n_emit, first_eos + 1), state.max_lens - state.seq_lens)
    n_emit = jnp.where(active, n_emit, 0)
    slots = jnp.where(j < n_emit[:, None], state.seq_lens[:, None] + j, s)  # s: dropped
    tokens = state.tokens.at[jnp.arange(b)[:, None], slots].set(emitted, mode="drop")
    seq_lens = state.seq_lens + n_emit
    done = state.done | (active & ((first_eos < n_emit) | (seq_lens >= state.max_lens)))
    return state.replace(tokens=tokens, seq_lens=seq_lens, done=done)

  def rollback(self, state: SpecState, target_cache: kvc.KVCache, draft_state: Any) -> SpecState:
    """Both models forget everything past the new committed length (a length update)."""
    return state.replace(target_cache=target_cache.with_lengths(state.seq_lens - 1),
                         draft_state=self.drafter.rollback(draft_state, state.seq_lens))

  def count(self, counters: SpecCounters, active: jax.Array, acc: Acceptance,
            n_emit: jax.Array) -> SpecCounters:
    g = self.gamma
    a = active.astype(jnp.int32)
    scored = (jnp.arange(g)[None, :] <= acc.num_accepted[:, None]) & active[:, None]
    return counters.replace(
        target_calls=counters.target_calls + a, drafted=counters.drafted + g * a,
        accepted=counters.accepted + acc.num_accepted * a, emitted=counters.emitted + n_emit,
        accepted_at=counters.accepted_at + (acc.accepted & active[:, None]),
        accept_len_hist=counters.accept_len_hist
        + jax.nn.one_hot(acc.num_accepted, g + 1, dtype=jnp.int32) * a[:, None],
        beta_sum=counters.beta_sum + jnp.sum(jnp.where(scored, acc.beta, 0.0), axis=1),
        beta_count=counters.beta_count + jnp.sum(scored, axis=1))

  # --- composition -----------------------------------------------------------

  def step(self, target_params: Params, draft_params: Any, state: SpecState) -> SpecState:
    """One full speculative step (pure)."""
    rng, k_draft, k_accept = jax.random.split(state.rng, 3)
    drafts, q, draft_state = self.propose(draft_params, state, k_draft)
    p, target_cache, hidden = self.verify(target_params, state, drafts)
    acc = self.accept(k_accept, drafts, q, p)
    draft_state = self.observe(state, draft_state, hidden)
    return self._finish(state, drafts, acc, target_cache, draft_state, rng)

  def _finish(self, state, drafts, acc, target_cache, draft_state, rng) -> SpecState:
    new = self.commit(state, drafts, acc)
    new = self.rollback(new, target_cache, draft_state)
    counters = self.count(state.counters, ~state.done, acc, new.seq_lens - state.seq_lens)
    return new.replace(rng=rng, steps=state.steps + 1, counters=counters)

  @functools.partial(jax.jit, static_argnames=("self",))
  def init(self, target_params: Params, draft_params: Any, tokens: jax.Array,
           prompt_lens: jax.Array, max_new_tokens: jax.Array, rng: jax.Array) -> SpecState:
    """Prefills both models with each prompt minus its last token."""
    b, s = tokens.shape
    empty = kvc.init_cache(self.target_cfg, b, s)
    if getattr(self.drafter, "reads_target_features", False):
      target_cache, hidden = prefill(target_params, self.target_cfg, tokens, prompt_lens - 1,
                                     empty, return_hidden=True)
      draft_state = self.drafter.init(draft_params, tokens, prompt_lens, features=hidden)
    else:
      target_cache = prefill(target_params, self.target_cfg, tokens, prompt_lens - 1, empty)
      draft_state = self.drafter.init(draft_params, tokens, prompt_lens)
    max_lens = prompt_lens + max_new_tokens
    return SpecState(tokens=tokens, seq_lens=prompt_lens, max_lens=max_lens,
                     done=prompt_lens >= max_lens, target_cache=target_cache,
                     draft_state=draft_state, rng=rng,
                     steps=jnp.zeros((), jnp.int32),
                     counters=SpecCounters.zeros(b, self.gamma))

  @functools.partial(jax.jit, static_argnames=("self",), donate_argnames=("state",))
  def run(self, target_params: Params, draft_params: Any, state: SpecState) -> SpecState:
    """Runs steps in a ``lax.while_loop`` until every row is done."""
    body = functools.partial(self.step, target_params, draft_params)
    return jax.lax.while_loop(lambda st: ~jnp.all(st.done), body, state)

  # --- Python-side API ---------------------------------------------------------

  def prepare(self, target_params: Params, draft_params: Any,
              prompts: Sequence[Sequence[int]], max_new_tokens: int, *, seed: int = 0,
              cache_size: Optional[int] = None) -> tuple[SpecState, np.ndarray]:
    """Validates parameters and prompts and packs them (before any compilation), then prefills."""
    validation.check_params(target_params, self.target_cfg, "target_params")
    if hasattr(self.drafter, "check_params"):
      self.drafter.check_params(draft_params)
    cfg = self.target_cfg
    tokens, lens, _ = pack_prompts(prompts, max_new_tokens, cache_size, headroom=self.gamma,
                                   vocab_size=cfg.vocab_size, max_cache_size=cfg.max_cache_size,
                                   max_positions=cfg.max_position_embeddings,
                                   cache_bytes_per_slot=kvc.bytes_per_slot(cfg))
    state = self.init(target_params, draft_params, jnp.asarray(tokens), jnp.asarray(lens),
                      jnp.full(lens.shape, max_new_tokens, jnp.int32), jax.random.PRNGKey(seed))
    return state, lens

  def generate(self, target_params: Params, draft_params: Any,
               prompts: Sequence[Sequence[int]], max_new_tokens: int, *, seed: int = 0,
               cache_size: Optional[int] = None, profile: bool = False) -> SpecResult:
    """Speculative generation for a batch; returns tokens and metrics.

    With ``profile=True`` the Python-loop twin runs instead of the fused loop
    (same tokens, slower), and the result's ``timing`` splits the wall time
    into draft, verify and other (acceptance, commit, rollback, dispatch).
    """
    start = time.perf_counter()
    timing = {"draft": 0.0, "verify": 0.0, "other": 0.0}
    if profile:
      state = None
      for state, t in self.stream(target_params, draft_params, prompts, max_new_tokens,
                                  seed=seed, cache_size=cache_size):
        timing = {k: timing[k] + t[k] for k in timing}
      lens = np.array([len(p) for p in prompts], np.int32)
      if state is None:  # nothing to generate
        state, lens = self.prepare(target_params, draft_params, prompts, max_new_tokens,
                                   seed=seed, cache_size=cache_size)
    else:
      state, lens = self.prepare(target_params, draft_params, prompts, max_new_tokens, seed=seed,
                                 cache_size=cache_size)
      state = self.run(target_params, draft_params, state)
    jax.block_until_ready(state.tokens)
    result = summarize(state, lens, self.gamma, time.perf_counter() - start)
    if profile:
      result.timing = timing
    return result

  def stream(self, target_params: Params, draft_params: Any,
             prompts: Sequence[Sequence[int]], max_new_tokens: int, *, seed: int = 0,
             cache_size: Optional[int] = None) -> Iterator[tuple[SpecState, dict[str, float]]]:
    """Python-loop twin of ``run``: yields the state after every step with phase timings.

    Runs the same step functions, each jitted on its own, so draft, verify and
    the rest (accept, commit, rollback, bookkeeping) can be timed separately.
    """
    state, _ = self.prepare(target_params, draft_params, prompts, max_new_tokens, seed=seed,
                            cache_size=cache_size)
    propose, verify, finish = _phase_fns(self)
    while not bool(jnp.all(state.done)):
      t0 = time.perf_counter()
      rng, k_draft, k_accept = jax.random.split(state.rng, 3)
      drafts, q, draft_state = jax.block_until_ready(propose(draft_params, state, k_draft))
      t1 = time.perf_counter()
      p, target_cache, hidden = jax.block_until_ready(verify(target_params, state, drafts))
      t2 = time.perf_counter()
      state = jax.block_until_ready(
          finish(state, drafts, q, p, k_accept, target_cache, hidden, draft_state, rng))
      t3 = time.perf_counter()
      yield state, {"draft": t1 - t0, "verify": t2 - t1, "other": t3 - t2}


@functools.lru_cache(maxsize=32)
def _phase_fns(dec: SpeculativeDecoder):
  """Separately jitted phases of one step (for ``stream``)."""

  def finish(state, drafts, q, p, key, target_cache, hidden, draft_state, rng):
    draft_state = dec.observe(state, draft_state, hidden)
    return dec._finish(state, drafts, dec.accept(key, drafts, q, p), target_cache, draft_state,
                       rng)

  return jax.jit(dec.propose), jax.jit(dec.verify), jax.jit(finish)
