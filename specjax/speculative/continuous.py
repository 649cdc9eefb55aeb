"""Continuous batching: a fixed number of slots serves a queue of requests in one jitted loop.

With fixed batches a batch runs until its slowest row is done, and a row that stops early
(EOS, a smaller budget) leaves its slot idle. Here ``slots`` rows decode together and a
row that finishes hands its slot to the next waiting request inside the same jitted
program; shapes stay static (slots × cache slots), requests and their lengths live in
arrays, so one program serves any queue up to the padded queue size.

One pass of the loop:
  steps:  the decoder's speculative steps (``SpeculativeDecoder.steps_while``, the same
          loop ``run`` uses, an adaptive policy's included) until an occupied slot is done;
  retire: every occupied slot that is done copies its tokens, length and counters to its
          request's output row (one scatter for all slots) and becomes empty;
  admit:  while a slot is empty and requests wait, the next request is prefilled into the
          first empty slot: the target and the drafter are prefilled for that one prompt
          (``prefill_models`` at batch 1, in chunks of ``generate.PREFILL_CHUNK`` tokens)
          and the slot's row of every state leaf is overwritten with the result.
Empty and finished slots are done rows, which every step skips (they emit nothing and
their scratch writes are never read).

What this does not do: the admitted prompt's prefill runs to the end before the next step
(the other slots wait for it), rather than being cut into chunks interleaved with the
others' steps. The drafter interface initialises a drafter from a whole prompt
(``Drafter.init``); interleaving would need every drafter to extend its state chunk by
chunk.

Requirements: every leaf of the drafter's state is per row, batch-major (what ``init``
returns at batch 1 has the shape of its batch-B state with 1 rows); otherwise ``serve``
refuses the drafter at trace time, naming the leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax import sharding, validation
from specjax.model import Params
from specjax.prompts import pack_prompts
from specjax.speculative.decoder import SpeculativeDecoder, prefill_models
from specjax.speculative.metrics import SpecResult, counters_to_host
from specjax.speculative.state import SpecCounters, SpecState

QUEUE_ROUND = 16  # queues are padded to a multiple of this: one program for nearby sizes


@flax.struct.dataclass(kw_only=True)
class Queue:
  """The requests, padded to Q rows (the first ``size`` are real).

  Attributes:
    tokens: [Q, S] prompts, right-padded into the cache's slot count.
    prompt_lens: [Q].
    budgets: [Q] new tokens each request may take.
    size: scalar, the number of real requests.
  """

  tokens: jax.Array
  prompt_lens: jax.Array
  budgets: jax.Array
  size: jax.Array


@flax.struct.dataclass(kw_only=True)
class ServeState:
  """The slots' decoding state, the queue's position and the finished requests' outputs.

  Attributes:
    spec: the decoder's state of the B slots.
    slot_request: [B] the request each slot serves (-1: empty).
    next_request: scalar, the first request not yet admitted.
    out_tokens: [Q, S] each finished request's prompt and output.
    out_lens: [Q] its committed length.
    out_counters: its acceptance counters (``SpecCounters`` with Q rows).
    admitted_at, finished_at: [Q] the loop's step count when the request took a slot
      and when it was found done (latency in steps).
  """

  spec: SpecState
  slot_request: jax.Array
  next_request: jax.Array
  out_tokens: jax.Array
  out_lens: jax.Array
  out_counters: SpecCounters
  admitted_at: jax.Array
  finished_at: jax.Array


@dataclasses.dataclass
class ServeResult(SpecResult):
  """``SpecResult`` with one row per request (in the order given), plus:

  Attributes:
    slots: how many requests decoded at once.
    admitted_at, finished_at: [R] the step count when each request took a slot and
      when it was done; their difference is its latency in steps.
  """

  slots: int = 0
  admitted_at: Optional[np.ndarray] = None
  finished_at: Optional[np.ndarray] = None


def _put_row(tree: Any, row: Any, b: jax.Array, what: str) -> Any:
  """``tree`` (batch-major leaves of B rows) with row ``b`` replaced by ``row`` (1 row)."""

  def put(path, old, new):
    if old.shape[1:] != new.shape[1:] or new.shape[:1] != (1,):
      raise ValueError(
          f"{what} leaf {jax.tree_util.keystr(path)} has shape {old.shape} for the slots but "
          f"{new.shape} for one request: continuous batching needs every leaf per row "
          "(batch-major)")
    return jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), b, axis=0)

  return jax.tree_util.tree_map_with_path(put, tree, row)


def _admit(dec: SpeculativeDecoder, target_params: Params, draft_params: Any, queue: Queue,
           st: ServeState) -> ServeState:
  """Prefills the next request into the first empty slot."""
  b = jnp.argmax(st.slot_request < 0)
  r = st.next_request
  tokens = jax.lax.dynamic_slice_in_dim(queue.tokens, r, 1)
  lens = jax.lax.dynamic_slice_in_dim(queue.prompt_lens, r, 1)
  max_lens = lens + jax.lax.dynamic_slice_in_dim(queue.budgets, r, 1)
  target_cache, draft_state = prefill_models(dec.target_cfg, dec.drafter, target_params,
                                             draft_params, tokens, lens)
  spec = st.spec
  rows = dict(tokens=tokens, seq_lens=lens, max_lens=max_lens, done=lens >= max_lens,
              target_cache=target_cache, draft_state=draft_state,
              counters=SpecCounters.zeros(1, dec.tree.max_depth, dec.tree.max_children),
              policy=() if dec.policy is None else dec.policy.init(1))
  spec = spec.replace(**{k: _put_row(getattr(spec, k), v, b,
                                     f"{type(dec.drafter).__name__}'s state" if k == "draft_state"
                                     else k)
                         for k, v in rows.items()})
  return st.replace(spec=spec, slot_request=st.slot_request.at[b].set(r), next_request=r + 1,
                    admitted_at=st.admitted_at.at[r].set(spec.steps))


def _retire(st: ServeState) -> ServeState:
  """Every occupied slot that is done hands its row to its request's outputs and empties."""
  q = st.out_lens.shape[0]
  retiring = st.spec.done & (st.slot_request >= 0)
  req = jnp.where(retiring, st.slot_request, q)  # q: dropped
  put = lambda out, rows: out.at[req].set(rows, mode="drop")
  return st.replace(out_tokens=put(st.out_tokens, st.spec.tokens),
                    out_lens=put(st.out_lens, st.spec.seq_lens),
                    out_counters=jax.tree.map(put, st.out_counters, st.spec.counters),
                    finished_at=put(st.finished_at, jnp.broadcast_to(st.spec.steps, req.shape)),
                    slot_request=jnp.where(retiring, -1, st.slot_request))


def _admit_all(dec, target_params, draft_params, queue: Queue, st: ServeState) -> ServeState:
  waiting = lambda s: jnp.any(s.slot_request < 0) & (s.next_request < queue.size)
  return jax.lax.while_loop(
      waiting, functools.partial(_admit, dec, target_params, draft_params, queue), st)


@functools.partial(jax.jit, static_argnames=("dec",), donate_argnames=("st",))
def serve_loop(dec: SpeculativeDecoder, target_params: Params, draft_params: Any, queue: Queue,
               st: ServeState) -> ServeState:
  """Admits, steps, retires and admits again until the queue is empty and every slot too."""

  def one_pass(s: ServeState) -> ServeState:
    occupied = s.slot_request >= 0
    spec = dec.steps_while(target_params, draft_params, s.spec,
                           lambda sp: ~jnp.any(sp.done & occupied))
    s = _retire(s.replace(spec=spec))
    return _admit_all(dec, target_params, draft_params, queue, s)

  st = _admit_all(dec, target_params, draft_params, queue, st)
  return jax.lax.while_loop(lambda s: jnp.any(s.slot_request >= 0), one_pass, st)


def _budgets(max_new_tokens: int | Sequence[int], n: int) -> np.ndarray:
  if isinstance(max_new_tokens, (int, np.integer)) and not isinstance(max_new_tokens, bool):
    return np.full((n,), validation.as_int(max_new_tokens, "max_new_tokens", 0), np.int32)
  budgets = list(max_new_tokens)
  if len(budgets) != n:
    raise ValueError(f"max_new_tokens gives {len(budgets)} budgets for {n} prompts")
  return np.array([validation.as_int(v, f"max_new_tokens[{i}]", 0)
                   for i, v in enumerate(budgets)], np.int32)


def pack_queue(dec: SpeculativeDecoder, prompts: Sequence[Sequence[int]],
               max_new_tokens: int | Sequence[int], slots: int,
               cache_size: Optional[int] = None) -> tuple[Queue, np.ndarray]:
  """Validates and packs the requests (before any compilation): the padded ``Queue`` and
  the [R] prompt lengths. The cache fits the longest prompt and the largest budget."""
  slots = validation.as_int(slots, "slots", 1)
  cfg = dec.target_cfg
  if len(prompts) == 0:
    raise ValueError("no prompts given")
  budgets = _budgets(max_new_tokens, len(prompts))
  tokens, lens, _ = pack_prompts(prompts, int(budgets.max()), cache_size,
                                 headroom=dec.tree.cache_headroom, vocab_size=cfg.vocab_size,
                                 max_cache_size=cfg.max_cache_size,
                                 max_positions=cfg.max_position_embeddings,
                                 cache_bytes_per_slot=kvc.bytes_per_slot(cfg), cache_rows=slots)
  sharding.check_batch(slots)
  r = len(lens)
  q = -(-r // QUEUE_ROUND) * QUEUE_ROUND
  pad = lambda a: np.concatenate([a, np.zeros((q - r,) + a.shape[1:], a.dtype)])
  queue = Queue(tokens=jnp.asarray(pad(tokens)), prompt_lens=jnp.asarray(pad(lens)),
                budgets=jnp.asarray(pad(budgets)), size=jnp.int32(r))
  return queue, lens


def initial_serve_state(dec: SpeculativeDecoder, target_params: Params, draft_params: Any,
                        queue: Queue, slots: int, seed: int = 0) -> ServeState:
  """Every slot empty (a done row of one dummy token), the outputs zero."""
  q, s = queue.tokens.shape
  ones = jnp.ones((slots,), jnp.int32)
  spec = dec.init(target_params, draft_params, jnp.zeros((slots, s), jnp.int32), ones,
                  jnp.zeros((slots,), jnp.int32), jax.random.PRNGKey(seed))
  zeros = lambda: jnp.zeros((q,), jnp.int32)  # one buffer each: the state is donated
  return ServeState(spec=spec, slot_request=-ones, next_request=jnp.int32(0),
                    out_tokens=jnp.zeros((q, s), jnp.int32), out_lens=zeros(),
                    out_counters=SpecCounters.zeros(q, dec.tree.max_depth,
                                                    dec.tree.max_children),
                    admitted_at=zeros(), finished_at=zeros())


def serve(dec: SpeculativeDecoder, target_params: Params, draft_params: Any,
          prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
          slots: int, seed: int = 0, cache_size: Optional[int] = None) -> ServeResult:
  """Speculative generation of every prompt with continuous batching over ``slots`` rows.

  Args:
    dec: the decoder (any drafter whose state is per row, chains, trees, a policy).
    prompts: R token-id lists, served in this order.
    max_new_tokens: one budget for all, or one per prompt; a request also stops at EOS.
    slots: rows decoded at once (the batch size).
    seed: PRNG seed of the sampler.
    cache_size: slots per row of the caches (default: fits the longest prompt and the
      largest budget, rounded up to 64).

  Returns:
    a ``ServeResult`` with one row per prompt; its ``steps`` are the speculative steps
    of the whole run (one target verification each, for all slots together).
  """
  start = time.perf_counter()
  validation.check_params(target_params, dec.target_cfg, "target_params")
  dec.drafter.check_params(draft_params)
  queue, lens = pack_queue(dec, prompts, max_new_tokens, slots, cache_size)
  st = initial_serve_state(dec, target_params, draft_params, queue, slots, seed)
  st = serve_loop(dec, target_params, draft_params, queue, st)
  jax.block_until_ready(st.out_tokens)
  seconds = time.perf_counter() - start
  r = len(lens)
  host = lambda a: sharding.to_host(a)[:r]
  return ServeResult(tokens=host(st.out_tokens), prompt_lens=np.asarray(lens),
                     seq_lens=host(st.out_lens), steps=int(st.spec.steps), seconds=seconds,
                     gamma=dec.gamma, per_row={k: v[:r] for k, v in
                                               counters_to_host(st.out_counters).items()},
                     slots=slots,
                     admitted_at=host(st.admitted_at), finished_at=host(st.finished_at))
