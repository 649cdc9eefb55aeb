"""Self-speculative early exit: the target's first k layers + its final norm and LM head.

Training-free, or with a trained exit head (LayerSkip-style self-speculation on
a frozen target): ``trained_exit_drafter`` puts residual SiLU blocks between the
final norm and the LM head rows (``drafters.residual_head``, trained by
``specjax.distill.heads.exit_objective``); zero blocks are the training-free exit.
Either way the draft shares the target's weights (the draft params are the
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
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache as kvc
from specjax.config import ModelConfig
from specjax.drafters.reduced_vocab import lift_logits
from specjax.drafters.residual_head import head_logits, target_head
from specjax.generate import last_tokens
from specjax.model import Params, compute_dtype, forward
from specjax.sampling import Sampler
from specjax.speculative.drafter import Drafter, SharedCache
from specjax.speculative.tree_acceptance import AcceptedPath


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(Drafter):
  """Drafts with the first ``cfg.num_layers`` layers of the target.

  Attributes:
    cfg: the target's config truncated to k layers.
    trained: the logits come from the trained exit head ``draft_params["exit"]``
      (``residual_head`` params, optionally with a ``vocab_map`` of its rows) instead of
      the target's final norm and LM head.
  """

  cfg: ModelConfig
  trained: bool = False

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  def check_params(self, draft_params) -> None:
    if len(draft_params["layers"]) != self.cfg.num_layers:
      raise ValueError(f"early exit after {self.cfg.num_layers} layers got draft params with "
                       f"{len(draft_params['layers'])}")
    if not self.trained:
      return
    ep = draft_params.get("exit")
    if not isinstance(ep, dict) or not {"final_norm", "res_w", "res_b", "head"} <= set(ep):
      raise ValueError("a trained exit needs draft_params['exit'] with final_norm, res_w, res_b "
                       "and head (trained_exit_drafter builds them)")
    d = self.cfg.dim
    if np.shape(ep["res_w"])[0] != 1 or np.shape(ep["res_w"])[2:] != (d, d) or (
        np.shape(ep["head"])[-1] != d):
      raise ValueError(f"exit head of res_w {np.shape(ep['res_w'])} and head "
                       f"{np.shape(ep['head'])} does not fit width {d} (one head)")

  def exit_logits(self, draft_params: Params, hidden: jax.Array) -> jax.Array:
    """[B, D] layer k's output -> [B, V] float32 logits of the trained exit head."""
    ep = draft_params["exit"]
    logits = head_logits(ep, hidden[:, None], self.cfg.norm_eps)[:, 0]
    return lift_logits(logits, ep["vocab_map"], self.vocab_size) if "vocab_map" in ep else logits

  def tolerates_skipped_steps(self) -> bool:
    return True  # its state is the target's cache, which plain steps keep current

  def shares_target_cache(self) -> bool:
    return True  # ``propose`` gets the target's KV cache beside its own (empty) state

  def init(self, draft_params, tokens, prompt_lens, features=None) -> tuple:
    return ()

  def propose_chain(self, draft_params: Params, state: SharedCache, tokens: jax.Array,
                    seq_lens: jax.Array, key: jax.Array, sampler: Sampler, gamma: int):
    """Drafts over the target cache's first k layers; its own state stays empty."""
    k = self.cfg.num_layers
    target = state.target
    cache = kvc.KVCache(k=target.k[:k], v=target.v[:k], lengths=target.lengths)  # seq_lens - 1

    def step(carry, key):
      cache, tok, pos = carry
      out = forward(draft_params, self.cfg, tok[:, None], pos[:, None], cache,
                    compute_logits=not self.trained)
      logits = (self.exit_logits(draft_params, out.hidden[:, 0]) if self.trained
                else out.logits[:, 0])
      nxt, q = sampler.sample(key, logits)
      return (out.cache, nxt, pos + 1), (nxt, q)

    first = last_tokens(tokens, seq_lens)[:, 0]
    _, (drafts, qs) = jax.lax.scan(step, (cache, first, seq_lens - 1),
                                   jax.random.split(key, gamma))
    return drafts.T, jnp.moveaxis(qs, 0, 1), state.own

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


def trained_exit_drafter(cfg: ModelConfig, params: Params, num_layers: int, weights: Params,
                         vocab_map: Optional[np.ndarray] = None) -> tuple[EarlyExitDrafter, Params]:
  """(drafter, draft_params) exiting after ``num_layers`` through a trained exit head.

  Args:
    cfg, params: the target.
    num_layers: k, the layers the draft runs (its exit is layer k − 1's output).
    weights: ``res_w`` [1, L, D, D] and ``res_b`` [1, L, D] (``distill.heads``), and
      optionally the head's own trained rows ``head`` [1, Vd, D] (``--own_head``).
    vocab_map: [Vd] target ids of the head's rows (without an own head: the target's
      LM head rows there); None: all V rows.
  """
  drafter, dp = early_exit_drafter(cfg, params, num_layers)
  drafter = dataclasses.replace(drafter, trained=True)
  dtype = compute_dtype(params)
  ep = {"final_norm": params["final_norm"], "res_w": jnp.asarray(weights["res_w"], dtype),
        "res_b": jnp.asarray(weights["res_b"], dtype)}
  if vocab_map is not None:
    ep["vocab_map"] = jnp.asarray(np.asarray(vocab_map), jnp.int32)
  if "head" in weights:
    head = jnp.asarray(weights["head"], dtype)
    rows = cfg.vocab_size if vocab_map is None else len(vocab_map)
    if head.shape != (1, rows, cfg.dim):
      raise ValueError(f"the exit's own head must be [1, {rows}, {cfg.dim}] (its vocabulary's "
                       f"rows), got {head.shape}")
  else:
    head = target_head(cfg, params)
    head = head if vocab_map is None else head[ep["vocab_map"]]
  dp = dict(dp, exit=dict(ep, head=head))
  drafter.check_params(dp)
  return drafter, dp
