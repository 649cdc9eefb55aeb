"""The one append routine: new tokens, trimmed at EOS and at the budget, for every decode loop.

Plain decoding (``generate.decode_step``), the distillation teacher and the
speculative decoder all keep the same four fields in their state pytree:
``tokens`` [B, S] (prompt then output, right-padded), ``seq_lens`` [B],
``max_lens`` [B] (prompt length + budget) and ``done`` [B]; they all append
through ``append``.

Example: a row with seq_len 5, max_len 9 and EOS id 2 appending [7, 2, 4]
(n = 3) gets 7 and 2, seq_len 7, and is done.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
  if not eos_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.asarray(eos_ids, tokens.dtype))


def append(state: Any, new: jax.Array, n: jax.Array,
           eos_ids: tuple[int, ...]) -> tuple[Any, jax.Array]:
  """Appends ``new[b, :n[b]]`` to each active row, stopping after EOS and at the budget.

  Args:
    state: a pytree with ``tokens``, ``seq_lens``, ``max_lens`` and ``done``.
    new: [B, T] candidate tokens.
    n: [B] how many of them the row emits before trimming (<= T).
    eos_ids: static stop tokens.

  Returns:
    (state with tokens, seq_lens and done updated, [B] tokens appended).
  """
  b, s = state.tokens.shape
  t = new.shape[1]
  active = ~state.done
  j = jnp.arange(t)[None, :]
  eos_at = jnp.where(is_eos(new, eos_ids) & (j < n[:, None]), j, t)
  first_eos = jnp.min(eos_at, axis=1)
  n_emit = jnp.minimum(jnp.minimum(n, first_eos + 1), state.max_lens - state.seq_lens)
  n_emit = jnp.where(active, n_emit, 0)
  slots = jnp.where(j < n_emit[:, None], state.seq_lens[:, None] + j, s)  # s: dropped
  tokens = state.tokens.at[jnp.arange(b)[:, None], slots].set(new.astype(state.tokens.dtype),
                                                              mode="drop")
  seq_lens = state.seq_lens + n_emit
  done = state.done | (active & ((first_eos < n_emit) | (seq_lens >= state.max_lens)))
  return state.replace(tokens=tokens, seq_lens=seq_lens, done=done), n_emit
