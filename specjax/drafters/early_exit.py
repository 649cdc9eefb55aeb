"""Self-speculative early exit: the target's first k layers + its final norm and LM head.

Training-free and sharing the target's weights (the draft params are the
target's own arrays, no copy) and the target's KV cache: for every committed
token, the key/value of layer l < k computed by the truncated model is exactly
the target's (same weights, same inputs, same position), so the drafter
attends over the target cache's first k layers instead of keeping and
prefilling a cache of its own.

Per step, on a target cache holding the committed length s − 1 (see
``speculative/decoder.py``): the drafter feeds the last committed token at
slot s − 1 and then its own drafts at s, s + 1, …, writing their layer-l < k
entries into those scratch slots. Verification feeds the same slots again
(the last committed token and the drafts through all L layers) and overwrites
them, so the drafter never leaves anything behind: its state is empty.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import kv_cache as kvc
from specjax.config import ModelConfig
from specjax.generate import last_tokens
from specjax.model import Params, forward
from specjax.sampling import Sampler
from specjax.speculative.drafter import Drafter
from specjax.speculative.tree_acceptance import AcceptedPath


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(Drafter):
  """Drafts with the first ``cfg.num_layers`` layers of the target.

  Attributes:
    cfg: the target's config truncated to k layers.
  """

  cfg: ModelConfig

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def tolerates_skipped_steps(self) -> bool:
    return True  # its state is the target's cache, which plain steps keep current

  def shares_target_cache(self) -> bool:
    return True  # ``propose`` gets the target's KV cache as its state

  def init(self, draft_params, tokens, prompt_lens, features=None) -> tuple:
    return ()

  def propose_chain(self, draft_params: Params, target_cache: kvc.KVCache, tokens: jax.Array,
                    seq_lens: jax.Array, key: jax.Array, sampler: Sampler, gamma: int):
    """Drafts over the target cache's first k layers; returns that k-layer cache as state."""
    k = self.cfg.num_layers
    cache = kvc.KVCache(k=target_cache.k[:k], v=target_cache.v[:k],
                        lengths=target_cache.lengths)  # = seq_lens - 1

    def step(carry, key):
      cache, tok, pos = carry
      out = forward(draft_params, self.cfg, tok[:, None], pos[:, None], cache)
      nxt, q = sampler.sample(key, out.logits[:, 0])
      return (out.cache, nxt, pos + 1), (nxt, q)

    first = last_tokens(tokens, seq_lens)[:, 0]
    (cache, _, _), (drafts, qs) = jax.lax.scan(step, (cache, first, seq_lens - 1),
                                               jax.random.split(key, gamma))
    return drafts.T, jnp.moveaxis(qs, 0, 1), cache

  def rollback(self, state: Any, seq_lens: jax.Array, accepted: AcceptedPath) -> tuple:
    return ()


def early_exit_drafter(cfg: ModelConfig, params: Params,
                       num_layers: int) -> tuple[EarlyExitDrafter, Params]:
  """Returns (drafter, draft_params) exiting after ``num_layers`` of the target."""
  if not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
  drafter = EarlyExitDrafter(dataclasses.replace(cfg, num_layers=num_layers,
                                                 name=f"{cfg.name}-exit{num_layers}"))
  return drafter, dict(params, layers=params["layers"][:num_layers])
