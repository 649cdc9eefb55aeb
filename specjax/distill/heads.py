"""Training heads on the frozen target's hidden states by self-distillation: Medusa-1
heads on its last hidden state and the trained early exit on layer k's output.

Both are ``drafters.residual_head`` heads: the target's final norm, L residual
SiLU blocks, the target's LM-head rows. Head k (0-based) reads the feature at
``lag`` + k positions before the trained position p (``batch["pred_pos"]``,
where the stored or online teacher holds the target's top-k of token p + 1):

* Medusa (``lag`` = 1): with the target's own head predicting token i + 1 from
  h_i, head k predicts token i + k + 2, so it reads h_{p−k−1} and has an input
  only where p >= k + 1 (``min_position``). Example: p = 9, K = 3 heads read h_8
  (head 0), h_7 (head 1) and h_6 (head 2).
* The trained exit (``lag`` = 0, one head): layer k's output at p predicts token
  p + 1, as the full model's last hidden state does.

Departures from FasterDecoding's Medusa-1 and LayerSkip's recipes, and why:

* The loss is the divergence to the target's own top-k distribution
  (``losses.divergence``, self-distillation as in Medusa-2's §2.3.2 and as the
  other drafts here are trained), not cross-entropy to a dataset's tokens; at
  T = 0 the greedy corpus makes it the target's argmax.
* The heads share the target's frozen LM head (over a frequency-ranked reduced
  vocabulary, as the EAGLE drafter's) instead of each training its own copy:
  the trained weights are then only the residual blocks (K·L·(D² + D)
  parameters, 1.3 M for SmolLM2 with K = 4, L = 1), small enough to ship, and
  every head starts as the target's own next-token prediction (zero blocks).
  ``own_heads`` (``train_draft --own_head``) gives each head a trainable copy of
  those rows instead, as FasterDecoding's heads have: better held-out accuracy
  (head 0's top-1 0.34 against 0.30 on SmolLM2), 15× the bytes to ship.
  Each head's loss weighs all heads equally (Medusa's λ_k = 0.8^k decay
  is not used: the tree, not the loss, trades the heads off).
* The exit trains an adapter on the frozen target (LayerSkip fine-tunes the
  whole model with layer dropout and an early-exit loss, which would change the
  target): the first k layers, their KV cache and the LM head stay the target's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.distill.train import device_batch, step_weight
from specjax.drafters.early_exit import adapter_sequence
from specjax.drafters.residual_head import head_logits, target_head
from specjax.model import Params

@dataclasses.dataclass(frozen=True)
class HeadObjective:
  """The objective of ``specjax.distill.train.train`` for residual heads.

  Trainable params: ``res_w`` [K, L, D, D] and ``res_b`` [K, L, D]
  (``drafters.residual_head.zero_blocks``); frozen: the target's ``final_norm``
  and its LM-head rows of the draft vocabulary (``frozen_arrays``). Batches need
  ``features``: the target's last hidden state (Medusa) or layer k's output (the
  exit) at every position.

  Attributes:
    cfg: the target's config (norm epsilon).
    num_heads: K.
    lag: head k reads the feature ``lag`` + k positions before the trained position
      (1: Medusa; 0: the trained exit).
  """

  cfg: ModelConfig
  num_heads: int
  lag: int

  def __post_init__(self):
    if self.num_heads < 1 or self.lag < 0:
      raise ValueError(f"need num_heads >= 1 and lag >= 0, got {self.num_heads}, {self.lag}")

  def min_position(self, step: int) -> int:
    """Head ``step`` has an input from position ``lag`` + ``step`` on."""
    return self.lag + step

  def logp_and_aux(self, params, frozen, in_map, batch, key):
    """[K, B, R, Vd] (K > 1) or [B, R, Vd] each head's log-probs for the token after
    ``pred_pos``; no aux loss."""
    del in_map, key  # the heads read features, not ids; no noise
    dp = dict(frozen, **params)
    pred = batch["pred_pos"]
    b, r = pred.shape
    k = self.num_heads
    seq = self.head_inputs(dp, batch["features"])
    src = jnp.maximum(pred[:, :, None] - self.lag - jnp.arange(k), 0)  # [B, R, K]
    feats = jnp.take_along_axis(seq, src.reshape(b, r * k, 1), axis=1)
    logits = head_logits(dp, feats.reshape(b, r, k, -1), self.cfg.norm_eps)
    logp = jnp.moveaxis(jax.nn.log_softmax(logits, axis=-1), 2, 0)
    return (logp if k > 1 else logp[0]), 0.0

  def head_inputs(self, dp, features: jax.Array) -> jax.Array:
    """[B, S, D] what the heads read at every position: the stored features themselves."""
    del dp
    return features


@dataclasses.dataclass(frozen=True)
class AdapterExitObjective(HeadObjective):
  """The adapter exit's objective: one head (lag 0) on the output of a trained decoder
  layer (``params["adapter"]``, ``early_exit.adapter_sequence``) run over the whole
  sequence of layer-k outputs."""

  num_heads: int = 1
  lag: int = 0

  def __post_init__(self):
    if self.num_heads != 1 or self.lag != 0:
      raise ValueError("the adapter exit has one head at lag 0, got "
                       f"num_heads={self.num_heads}, lag={self.lag}")

  def head_inputs(self, dp, features: jax.Array) -> jax.Array:
    return adapter_sequence(dp["adapter"], self.cfg, features.astype(jnp.float32))


def medusa_objective(cfg: ModelConfig, num_heads: int) -> HeadObjective:
  """Medusa-1 heads: head k predicts the token k + 2 after the feature it reads."""
  return HeadObjective(cfg, num_heads, lag=1)


def exit_objective(cfg: ModelConfig, adapter: bool = False) -> HeadObjective:
  """The trained early exit: one head on layer k's output predicting the next token
  (``adapter``: through a trained decoder layer first, ``early_exit.adapter_sequence``)."""
  return AdapterExitObjective(cfg) if adapter else HeadObjective(cfg, 1, lag=0)


def frozen_arrays(target_cfg, target_params: Params, vocab_map=None) -> dict:
  """The target arrays the heads read: its final norm and its LM-head rows (``vocab_map``)."""
  head = target_head(target_cfg, target_params)
  if vocab_map is not None:
    head = head[jnp.asarray(np.asarray(vocab_map), jnp.int32)]
  return {"final_norm": target_params["final_norm"], "head": head}


def own_heads(frozen: dict, num_heads: int) -> jax.Array:
  """[K, Vd, D] float32: each head's own trainable copy of the frozen LM-head rows
  (FasterDecoding's Medusa-1 heads each train their own; as trainable params they
  override ``frozen["head"]``)."""
  return jnp.repeat(jnp.asarray(frozen["head"], jnp.float32)[None], num_heads, axis=0)


@functools.partial(jax.jit, static_argnames=("objective", "ranks"))
def _rank_hits(params, objective: HeadObjective, vocab_map, frozen, batch, ranks: int):
  logp, _ = objective.logp_and_aux(params, frozen, None, batch, None)
  logp = logp if logp.ndim == 4 else logp[None]  # [K, B, R, Vd]
  top = vocab_map[jax.lax.top_k(logp, ranks)[1]]  # [K, B, R, ranks] target ids
  hits = (top == batch["topk_ids"][None, :, :, :1]).astype(jnp.float32)
  w = jnp.stack([step_weight(objective, batch, k) for k in range(logp.shape[0])])  # [K, B, R]
  return jnp.einsum("kbrn,kbr->kn", hits, w), jnp.sum(w, axis=(1, 2))


def head_accuracy(params: Params, objective: HeadObjective, vocab_map, frozen: dict,
                  records: Sequence[dict], seq_len: int, k: int, ranks: int = 10,
                  batch_size: int = 16, teacher=None) -> tuple[np.ndarray, np.ndarray]:
  """Medusa's a_k^(r): how often head k's r-th ranked token is the target's greedy token
  (for the exit's one head, a_0^(0) is its teacher-forced α at T = 0).

  Teacher-forced on held-out greedy responses (all records when there are none):
  the true token after trained position p is the target's argmax there (its
  stored or online top-1), so the table is the T = 0 acceptance of each single
  node, the input of ``drafters.medusa.medusa_tree``.

  Args:
    params: the heads' trained weights; objective, frozen: as trained.
    vocab_map: [Vd] target ids of the head's rows (the identity for a full head).
    records, seq_len, k: held-out records and ``train.make_batch``'s shapes.
    ranks: the ranks measured (the table's columns).
    teacher: (Teacher, target params) for id-only records.

  Returns:
    ([K, ranks] accuracy per head and rank, [K] positions scored per head).
  """
  recs = [r for r in records if r.get("mode", "greedy") == "greedy"] or list(records)
  hits, n = 0.0, 0.0
  vm = jnp.asarray(vocab_map, jnp.int32)
  for i in range(0, len(recs), batch_size):
    batch = device_batch(recs[i:i + batch_size], seq_len, k, teacher)
    h, c = _rank_hits(params, objective, vm, frozen, batch, ranks)
    hits, n = hits + np.asarray(h, np.float64), n + np.asarray(c, np.float64)
  return hits / np.maximum(n, 1.0)[:, None], np.asarray(n)
