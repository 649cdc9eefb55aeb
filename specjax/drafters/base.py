"""The drafter interface: anything that proposes γ tokens with their distributions.

A drafter is a small frozen (hashable) dataclass holding only static
configuration; its arrays (weights, index maps) travel separately as
``draft_params`` and its per-sequence state (a KV cache, nothing, ...) as
``draft_state``, so the speculative loop stays one jitted program.

Contract, for rows whose committed sequence is ``tokens[b, :seq_lens[b]]``:
  * ``init`` builds the state after the prompt is known;
  * ``propose`` returns γ tokens and the full warped distributions q₁…q_γ
    (over the target vocabulary) they were sampled from; the i-th token must
    be a sample of qᵢ given the committed sequence and the earlier drafts;
  * ``rollback`` is told the new committed lengths and must forget anything
    it derived from rejected drafts.

A drafter whose class sets ``shares_target_cache = True`` (early exit) gets
the target's KV cache, holding the committed length − 1, as ``state`` in
``propose``; it may write only slots at or past that length (verification
overwrites them) and keeps no state of its own.

A drafter whose class sets ``reads_target_features = True`` (EAGLE) gets
the target's features (last hidden state before the final norm): ``init``
receives ``features`` [B, S, D] of the prompt's committed positions, and
after every verification ``observe(state, hidden, start)`` receives the
block's [B, γ+1, D] features of positions ``start[b] + t``.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from specjax.sampling import Sampler


class Drafter(Protocol):
  """Proposes draft tokens over a vocabulary of ``vocab_size`` target ids."""

  @property
  def vocab_size(self) -> int:
    ...

  def init(self, draft_params: Any, tokens: jax.Array, prompt_lens: jax.Array) -> Any:
    """State for rows with prompts ``tokens[b, :prompt_lens[b]]`` ([B, S] buffer)."""

  def propose(self, draft_params: Any, state: Any, tokens: jax.Array, seq_lens: jax.Array,
              key: jax.Array, sampler: Sampler, gamma: int) -> tuple[jax.Array, jax.Array, Any]:
    """Returns (drafts [B, γ] int32, q [B, γ, V] float32, new state)."""

  def rollback(self, state: Any, seq_lens: jax.Array) -> Any:
    """Forgets everything past the committed ``seq_lens``."""
