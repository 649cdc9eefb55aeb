"""Continuous batching: a fixed number of slots serves a queue of requests in one jitted loop.

With fixed batches a batch runs until its slowest row is done, and a row that stops early
(EOS, a smaller budget) leaves its slot idle. Here ``slots`` rows decode together and a
row that finishes hands its slot to the next waiting request inside the same jitted
program; shapes stay static (slots × cache slots), requests and their lengths live in
arrays, so one program serves any queue up to the padded queue size.

One pass of the loop:
  admit:  if no request is being admitted, a slot is empty and requests wait, the next
          request takes the first empty slot;
  feed:   one chunk of the admitted prompt (``prefill_chunk`` tokens) goes through the
          target into the admission's own one-row cache (``generate.prefill_chunk``, its
          features kept for a feature drafter; a one-token prompt has none to feed, its
          token is the first step's); after the prompt's last chunk the drafter
          is initialised from the whole prompt (``Drafter.init``) and the slot's row of
          every state leaf is overwritten with the result: the request decodes from the
          next step on;
  steps:  the decoder's speculative steps of the decoding slots (``steps_while``, the loop
          ``run`` uses, an adaptive policy's included): one step while an admission's
          prefill is under way, else until a decoding slot is done (none while a slot
          could be taken: the next pass admits first);
  retire: every decoding slot that is done copies its tokens, length and counters to its
          request's output row (one scatter for all slots) and becomes empty.
So a long prompt's prefill is cut into chunks interleaved with the other slots' steps: no
step waits for more than one chunk (and, after the last, the drafter's initialisation):
Sarathi-style chunked prefill as a schedule, the chunk its own forward, not fused into the
verification's. With ``interleave_prefill=False``
a pass instead admits and feeds until every empty slot is filled (or no request waits)
before it steps: the other slots wait for whole prefills, and no step runs beside a slot
still prefilling.

What this does not do: the drafter's own initialisation (a draft model's prefill, EAGLE's
layer over the prompt's features) runs whole in the pass that feeds the last chunk; the
drafter interface initialises a drafter from a whole prompt (``Drafter.init``). Only one
request is admitted at a time, so at the start the slots fill one prefill after another.
Empty slots and the slot being admitted are done rows, which every step skips (they emit
nothing and their scratch writes are never read).

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
from specjax.generate import PREFILL_CHUNK, feature_buffer, prefill_chunk
from specjax.model import Params, compute_dtype
from specjax.prompts import pack_prompts
from specjax.speculative.decoder import (SpeculativeDecoder, drafter_feature_layers,
                                         init_drafter)
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
  """The slots' decoding state, the admission under way, the queue's position and the
  finished requests' outputs.

  Attributes:
    spec: the decoder's state of the B slots.
    slot_request: [B] the request each slot serves (-1: empty).
    next_request: scalar, the first request not yet admitted.
    pending_slot: scalar, the slot whose request's prompt is being prefilled (-1: none).
    pending_cache: the target cache of that prompt (1 row; its length: the tokens fed).
    pending_hidden: [1, S, F] the target's features of its prompt, for a feature drafter
      (else an empty placeholder).
    out_tokens: [Q, S] each finished request's prompt and output.
    out_lens: [Q] its committed length.
    out_counters: its acceptance counters (``SpecCounters`` with Q rows).
    admitted_at, prefilled_at, finished_at: [Q] the loop's step count when the request
      took a slot, when its prefill was over and it began to decode, and when it was
      found done (latencies in steps).
  """

  spec: SpecState
  slot_request: jax.Array
  next_request: jax.Array
  pending_slot: jax.Array
  pending_cache: kvc.KVCache
  pending_hidden: jax.Array
  out_tokens: jax.Array
  out_lens: jax.Array
  out_counters: SpecCounters
  admitted_at: jax.Array
  prefilled_at: jax.Array
  finished_at: jax.Array


@dataclasses.dataclass
class ServeResult(SpecResult):
  """``SpecResult`` with one row per request (in the order given), plus:

  Attributes:
    slots: how many requests decoded at once.
    admitted_at, prefilled_at, finished_at: [R] the step count when each request took a
      slot, when its prefill was over and when it was done; finished − admitted is its
      latency in steps, prefilled − admitted the other slots' steps during its prefill.
  """

  slots: int = 0
  admitted_at: Optional[np.ndarray] = None
  prefilled_at: Optional[np.ndarray] = None
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


def _at_most_once(pred: jax.Array, fn, x: Any) -> Any:
  """``fn(x)`` where ``pred`` holds, else ``x``: a loop of zero or one pass rather than a
  ``lax.cond``, because XLA updates a loop's buffers in place where a conditional's branches
  copied them (the KV caches) in ``SpeculativeDecoder.steps_while``'s case, which
  tests/test_adaptive.py counts; the copies were not counted for this loop's conds."""
  return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.bool_(False), fn(c[1])),
                            (pred, x))[1]


def _decoding(st: ServeState) -> jax.Array:
  """[B] the slots that hold a request whose prefill is over."""
  return (st.slot_request >= 0) & (jnp.arange(st.slot_request.shape[0]) != st.pending_slot)


def _request_rows(queue: Queue, r: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Request ``r``'s prompt [1, S], prompt length [1] and length limit [1]."""
  row = lambda a: jax.lax.dynamic_slice_in_dim(a, r, 1)
  lens = row(queue.prompt_lens)
  return row(queue.tokens), lens, lens + row(queue.budgets)


def _admit(queue: Queue, st: ServeState) -> ServeState:
  """The next request takes the first empty slot; its prefill starts from an empty cache."""
  b = jnp.argmax(st.slot_request < 0)
  r = st.next_request
  return st.replace(slot_request=st.slot_request.at[b].set(r), next_request=r + 1,
                    pending_slot=b.astype(jnp.int32),
                    pending_cache=st.pending_cache.with_lengths(jnp.zeros((1,), jnp.int32)),
                    admitted_at=st.admitted_at.at[r].set(st.spec.steps))


def _left_to_feed(queue: Queue, st: ServeState) -> jax.Array:
  """Scalar: the prompt tokens the admission has still to feed (all but its last, which the
  first step feeds; 0 for a one-token prompt); -1 when no admission is under way."""
  _, lens, _ = _request_rows(queue, st.slot_request[st.pending_slot])
  return jnp.where(st.pending_slot >= 0, lens[0] - 1 - st.pending_cache.lengths[0], -1)


def _feed(dec: SpeculativeDecoder, target_params: Params, queue: Queue, chunk: int,
          st: ServeState) -> ServeState:
  """The admitted prompt's next chunk through the target, into the admission's own cache."""
  tokens, _, _ = _request_rows(queue, st.slot_request[st.pending_slot])
  fed = st.pending_cache.lengths
  cache, hidden = prefill_chunk(target_params, dec.target_cfg, tokens, fed[0] + jnp.arange(chunk),
                                jnp.clip(_left_to_feed(queue, st), 0, chunk)[None],
                                st.pending_cache, st.pending_hidden,
                                drafter_feature_layers(dec.drafter))
  # one row: on every data shard, kv heads on the model axis as the slots' caches
  cache, hidden = sharding.constrain((cache, hidden), 1, replicate_rows=True)
  return st.replace(pending_cache=cache, pending_hidden=hidden)


def _install(dec: SpeculativeDecoder, draft_params: Any, queue: Queue,
             st: ServeState) -> ServeState:
  """The admitted request's prefill is over: the drafter is initialised from its prompt
  and the slot's row of every state leaf is overwritten."""
  b = st.pending_slot
  r = st.slot_request[b]
  tokens, lens, max_lens = _request_rows(queue, r)
  draft_state = init_drafter(dec.drafter, draft_params, tokens, lens, st.pending_hidden)
  spec = st.spec
  rows = dict(tokens=tokens, seq_lens=lens, max_lens=max_lens, done=lens >= max_lens,
              target_cache=st.pending_cache, draft_state=draft_state,
              counters=dec.zero_counters(1),
              policy=() if dec.policy is None else dec.policy.init(1))
  spec = spec.replace(**{k: _put_row(getattr(spec, k), v, b,
                                     f"{type(dec.drafter).__name__}'s state" if k == "draft_state"
                                     else k)
                         for k, v in rows.items()})
  return st.replace(spec=spec, pending_slot=jnp.int32(-1),
                    prefilled_at=st.prefilled_at.at[r].set(spec.steps))


def _retire(st: ServeState) -> ServeState:
  """Every decoding slot that is done hands its row to its request's outputs and empties."""
  q = st.out_lens.shape[0]
  retiring = st.spec.done & _decoding(st)
  req = jnp.where(retiring, st.slot_request, q)  # q: dropped
  put = lambda out, rows: out.at[req].set(rows, mode="drop")
  return st.replace(out_tokens=put(st.out_tokens, st.spec.tokens),
                    out_lens=put(st.out_lens, st.spec.seq_lens),
                    out_counters=jax.tree.map(put, st.out_counters, st.spec.counters),
                    finished_at=put(st.finished_at, jnp.broadcast_to(st.spec.steps, req.shape)),
                    slot_request=jnp.where(retiring, -1, st.slot_request))


def _can_admit(queue: Queue, st: ServeState) -> jax.Array:
  """No admission under way, a slot empty and a request waiting."""
  return ((st.pending_slot < 0) & jnp.any(st.slot_request < 0)
          & (st.next_request < queue.size))


@functools.partial(jax.jit, static_argnames=("dec", "chunk", "interleave"),
                   donate_argnames=("st",))
def serve_loop(dec: SpeculativeDecoder, target_params: Params, draft_params: Any, queue: Queue,
               st: ServeState, chunk: int = PREFILL_CHUNK, interleave: bool = True
               ) -> ServeState:
  """Admits and feeds, steps and retires until the queue is empty and every slot too.

  With ``interleave``, a pass admits and feeds one chunk, then takes one step while the
  admission is under way; without, a pass admits and prefills until no slot is empty or no
  request waits, then steps until a slot is done.
  """

  def admit_and_feed(s: ServeState) -> ServeState:
    # admit; feed a chunk (none for a one-token prompt); install after the last chunk
    s = _at_most_once(_can_admit(queue, s), functools.partial(_admit, queue), s)
    s = _at_most_once(_left_to_feed(queue, s) > 0,
                      functools.partial(_feed, dec, target_params, queue, chunk), s)
    return _at_most_once(_left_to_feed(queue, s) == 0,
                         functools.partial(_install, dec, draft_params, queue), s)

  def one_pass(s: ServeState) -> ServeState:
    if interleave:
      s = admit_and_feed(s)
    else:
      s = jax.lax.while_loop(lambda s: (s.pending_slot >= 0) | _can_admit(queue, s),
                             admit_and_feed, s)
    decoding, admitting, steps = _decoding(s), s.pending_slot >= 0, s.spec.steps
    # No step while a slot could be taken (the next pass admits first); one per pass while
    # a prompt is being prefilled; else until a decoding slot is done.
    hold = _can_admit(queue, s)
    spec = dec.steps_while(target_params, draft_params, s.spec,
                           lambda sp: ~jnp.any(sp.done & decoding) & ~jnp.all(sp.done) & ~hold
                           & ~(admitting & (sp.steps > steps)))
    return _retire(s.replace(spec=spec))

  busy = lambda s: jnp.any(s.slot_request >= 0) | (s.next_request < queue.size)
  return jax.lax.while_loop(busy, one_pass, st)


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
                                 headroom=dec.cache_headroom, vocab_size=cfg.vocab_size,
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
  cfg = dec.target_cfg
  return ServeState(spec=spec, slot_request=-ones, next_request=jnp.int32(0),
                    pending_slot=jnp.int32(-1),
                    pending_cache=kvc.init_cache(cfg, 1, s, compute_dtype(target_params)),
                    pending_hidden=feature_buffer(target_params, cfg, 1, s,
                                                  drafter_feature_layers(dec.drafter)),
                    out_tokens=jnp.zeros((q, s), jnp.int32), out_lens=zeros(),
                    out_counters=dec.zero_counters(q),
                    admitted_at=zeros(), prefilled_at=zeros(), finished_at=zeros())


def slot_decoder(dec: SpeculativeDecoder) -> SpeculativeDecoder:
  """``dec`` as the slots run it: a policy's steps priced for the rows' mean. A fixed batch
  waits for its slowest row (``AdaptiveGamma.prompt_ease``); a slot whose request is done
  takes the next one, so here no row waits for another."""
  if dec.policy is None or not dec.policy.prompt_ease:
    return dec
  return dec.with_policy(dataclasses.replace(dec.policy, prompt_ease=()))


def serve(dec: SpeculativeDecoder, target_params: Params, draft_params: Any,
          prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], *,
          slots: int, seed: int = 0, cache_size: Optional[int] = None,
          prefill_chunk: int = PREFILL_CHUNK, interleave_prefill: bool = True) -> ServeResult:
  """Speculative generation of every prompt with continuous batching over ``slots`` rows.

  Args:
    dec: the decoder (any drafter whose state is per row, chains, trees, a policy).
    prompts: R token-id lists, served in this order.
    max_new_tokens: one budget for all, or one per prompt; a request also stops at EOS.
    slots: rows decoded at once (the batch size).
    seed: PRNG seed of the sampler.
    cache_size: slots per row of the caches (default: fits the longest prompt and the
      largest budget, rounded up to 64).
    prefill_chunk: prompt tokens per prefill forward of an admitted request (static: one
      program per value; capped at the cache's slots).
    interleave_prefill: True: an admitted prompt prefills one chunk per step of the other
      slots, so no step waits for more than one chunk. False: each prompt prefills whole
      (and every empty slot is filled) before the next step; the other slots wait, and on
      a CPU, where a step with a slot still prefilling costs what a full one does, the
      queue takes fewer steps (``benchmarks/results/continuous_batching.md``).

  Returns:
    a ``ServeResult`` with one row per prompt; its ``steps`` are the speculative steps
    of the whole run (one target verification each, for all slots together).
  """
  start = time.perf_counter()
  validation.check_params(target_params, dec.target_cfg, "target_params")
  dec.drafter.check_params(draft_params)
  chunk = validation.as_int(prefill_chunk, "prefill_chunk", 1)
  queue, lens = pack_queue(dec, prompts, max_new_tokens, slots, cache_size)
  dec = slot_decoder(dec)
  st = initial_serve_state(dec, target_params, draft_params, queue, slots, seed)
  st = serve_loop(dec, target_params, draft_params, queue, st,
                  chunk=min(chunk, queue.tokens.shape[1]), interleave=bool(interleave_prefill))
  jax.block_until_ready(st.out_tokens)
  seconds = time.perf_counter() - start
  r = len(lens)
  host = lambda a: sharding.to_host(a)[:r]
  return ServeResult(tokens=host(st.out_tokens), prompt_lens=np.asarray(lens),
                     seq_lens=host(st.out_lens), steps=int(st.spec.steps), seconds=seconds,
                     gamma=dec.gamma, per_row={k: v[:r] for k, v in
                                               counters_to_host(st.out_counters).items()},
                     slots=slots, admitted_at=host(st.admitted_at),
                     prefilled_at=host(st.prefilled_at), finished_at=host(st.finished_at))
