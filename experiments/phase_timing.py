"""Draft and verify phase costs timed inside one jitted loop: device time, not dispatch.

``SpeculativeDecoder.stream`` runs each phase of a step as its own synchronised call. On a
CPU that is close to the phases' cost inside the fused decode loop; on a GPU every call
also pays a dispatch of the order of a one-layer draft's whole work (an H200 measured the
EAGLE drafter's c = 0.42 that way, where the fused loop's γ = 4 step, 1.2 plain steps,
leaves about 0.05 if the verify costs one plain step: ``experiments/results/gpu_h200/``).

Here a phase runs ``n`` and then ``2n`` times in one jitted ``lax.fori_loop`` (one
program: the trip count is an argument) and its cost is the slope, (t(2n) − t(n)) / n,
so whatever one call costs on top of its repeats cancels; ``n`` grows (×4) until ``n``
repeats take ``min_seconds``, so the difference stands clear of timer noise. Each repeat
adds to every integer leaf of the state a zero computed from the previous repeat's output
(a token id or a probability compared with a negative number), which XLA cannot prove
zero, so no repeat is hoisted out of the loop or merged with another (tests read the
compiled loop: the phase's matrix products stay in its body, and leave it without the
zero). What the loop leaves out: the draft's and the target's cache writes are discarded
(the phases' outputs are reduced to one number), a few kilobytes per step.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax.speculative.decoder import SpeculativeDecoder
from specjax.speculative.state import SpecState


REPEAT_SCOPE = "phase_repeat"  # names the repeated phase in the compiled program (tests read it)


def _depend(state: SpecState, zero: jax.Array) -> SpecState:
  """``state`` with ``zero`` (0 at run time, unknown to XLA) added to its integer leaves."""
  def add(x):
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.integer):
      return x + zero.astype(x.dtype)
    return x
  return jax.tree.map(add, state)


@functools.lru_cache(maxsize=32)
def _loops(dec: SpeculativeDecoder) -> tuple[Callable, Callable]:
  """(draft loop, verify loop) of ``dec``, jitted; each takes the trip count as an argument."""

  def draft_loop(draft_params, state, key, n):
    @jax.named_scope(REPEAT_SCOPE)
    def body(i, zero):
      proposal, _ = dec.propose(draft_params, _depend(state, zero), jax.random.fold_in(key, i))
      return (jnp.min(proposal.tokens) < 0).astype(jnp.int32)  # token ids are >= 0
    return jax.lax.fori_loop(0, n, body, jnp.int32(0))

  def verify_loop(target_params, draft_params, state, key, n):
    proposal, _ = dec.propose(draft_params, state, key)

    @jax.named_scope(REPEAT_SCOPE)
    def body(_, zero):
      scores = dec.verify(target_params, _depend(state, zero), proposal)
      return (scores.p[0, 0, 0] < 0).astype(jnp.int32)  # probabilities are >= 0
    return jax.lax.fori_loop(0, n, body, jnp.int32(0))

  return jax.jit(draft_loop), jax.jit(verify_loop)


def _timed(run: Callable[[int], Any], n: int) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(run(n))
  return time.perf_counter() - t0


def _slope(run: Callable[[int], Any], n: int, repeats: int, min_seconds: float,
           max_n: int = 4096) -> list[float]:
  """Seconds per repeat, (t(2n) − t(n)) / n, ``repeats`` times (t(n) and t(2n) interleaved),
  with ``n`` raised until n repeats take ``min_seconds``."""
  jax.block_until_ready(run(n))  # one program for every trip count: compiles once
  while n < max_n and _timed(run, n) < min_seconds:
    n *= 4
  jax.block_until_ready(run(2 * n))
  out = []
  for _ in range(repeats):
    t_n, t_2n = _timed(run, n), _timed(run, 2 * n)
    out.append((t_2n - t_n) / n)
  return out


def fused_phase_seconds(dec: SpeculativeDecoder, target_params, draft_params, state: SpecState,
                        n: int = 8, repeats: int = 7,
                        min_seconds: float = 0.1) -> dict[str, Any]:
  """Median seconds of one draft phase and one verify phase of ``dec`` from ``state``.

  Returns ``draft`` and ``verify`` (medians over ``repeats`` slopes) and ``draft_samples``
  (the draft slopes, for a spread check). A slope is a difference of two timings, so on a
  noisy machine one can come out small or negative; the median of several is reported.
  """
  if n < 1 or repeats < 1 or min_seconds < 0:
    raise ValueError(f"n and repeats must be >= 1 and min_seconds >= 0, got {n}, {repeats} "
                     f"and {min_seconds}")
  draft_loop, verify_loop = _loops(dec)
  key = jax.random.key(0)
  draft = _slope(lambda k: draft_loop(draft_params, state, key, jnp.int32(k)), n, repeats,
                 min_seconds)
  verify = _slope(lambda k: verify_loop(target_params, draft_params, state, key, jnp.int32(k)),
                  n, repeats, min_seconds)
  return dict(draft=float(np.median(draft)), verify=float(np.median(verify)),
              draft_samples=draft)
