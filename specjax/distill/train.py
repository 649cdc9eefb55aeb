"""Token-level distillation of a draft from the target's top-k distributions: stored in
the corpus, or recomputed teacher-forced on every batch by a ``Teacher`` (id-only corpora).

One training example is a prompt + target response (target token ids); the
draft reads it teacher-forced and at every response position its distribution
is pulled towards the target's with the chosen divergence (``losses.py``).
The loop is deterministic for a seed: the batch of step s depends only on
(seed, s), so a run resumed from step s reproduces the uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import kv_cache as kvc
from specjax import sharding
from specjax.config import ModelConfig
from specjax.distill import checkpoint as ckpt
from specjax.distill import losses
from specjax.drafters import reduced_vocab
from specjax.model import Params, compute_dtype, forward, lm_head, target_features


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation hyper-parameters (static)."""

  loss: str = "fkl"
  steps: int = 300
  batch_size: int = 8
  seq_len: int = 288
  lr: float = 5e-4
  warmup_steps: int = 20
  end_lr_fraction: float = 0.1
  weight_decay: float = 0.01
  clip_norm: float = 1.0
  seed: int = 0
  eval_every: int = 50
  checkpoint_every: int = 25
  on_policy_every: int = 0  # every n-th step trains on draft samples scored by the target
  keep_fraction: float = 1.0  # AdaSPEC: train on this fraction of positions (``selected``)
  length_group: int = 0  # > 0: batches of similar lengths, trimmed (``batch_indices``)

  def __post_init__(self):
    if self.loss not in losses.LOSSES:
      raise ValueError(f"loss must be one of {losses.LOSSES}, got {self.loss!r}")
    if not 0.0 < self.keep_fraction <= 1.0:
      raise ValueError(f"keep_fraction must be in (0, 1], got {self.keep_fraction}")
    if self.length_group < 0:
      raise ValueError(f"length_group must be >= 0 (0: off), got {self.length_group}")

  @property
  def pad_to(self) -> Optional[int]:
    """``make_batch``'s ``pad_to``: grouped batches are trimmed to their longest row."""
    return LENGTH_PAD if self.length_group else None


@dataclasses.dataclass(frozen=True)
class Draft:
  """A draft model with its (optional) reduced vocabulary.

  Attributes:
    cfg: the draft's ModelConfig (vocab_size = Vd).
    target_vocab_size: V of the target.
    vocab_map: [Vd] int32 target ids of the draft rows, or None (full vocabulary).
    input_map: [V] int32 draft row read for each target id (default: the
      fallback-row map derived from vocab_map).
  """

  cfg: ModelConfig
  target_vocab_size: int
  vocab_map: Optional[np.ndarray] = None
  input_map: Optional[np.ndarray] = None

  def maps(self) -> tuple[jax.Array, jax.Array]:
    """(vocab_map [Vd], input_map [V]); the identity for a full-vocabulary draft."""
    if self.vocab_map is None:
      ident = jnp.arange(self.target_vocab_size, dtype=jnp.int32)
      return ident, ident
    vm = jnp.asarray(self.vocab_map, jnp.int32)
    if self.input_map is not None:
      return vm, jnp.asarray(self.input_map, jnp.int32)
    return vm, reduced_vocab.input_map(vm, self.target_vocab_size)


# ------------------------------------------------------------------ batches


LENGTH_PAD = 64  # trimmed batches' lengths are multiples of this (few programs)


def record_length(rec: dict, seq_len: int) -> int:
  """Prompt + response tokens of ``rec`` that ``make_batch`` keeps in a row of ``seq_len``."""
  return min(len(rec["prompt"]) + len(rec["response"]), seq_len)


def make_batch(records: Sequence[dict], seq_len: int, k: int,
               pad_to: Optional[int] = None) -> dict[str, np.ndarray]:
  """Pads records into fixed shapes.

  Response token i of a record with prompt length P is predicted at sequence
  position P - 1 + i (e.g. P = 3: tokens [p0 p1 p2 r0 r1], r0 predicted at 2).
  With ``pad_to``, L is the longest row rounded up to a multiple of it (at most
  ``seq_len``) instead of ``seq_len``: the same loss, since no trained position
  attends to the trailing padding (with EAGLE's feature noise, a draw of the same
  distribution: the noise is drawn at the batch's shape), at the cost of one program
  per (L, R) pair.

  Returns:
    tokens [B, L] target ids; pred_pos [B, R] positions whose next-token
    distribution is trained; topk_ids / topk_logp [B, R, k]; weight [B, R].
  """
  b, r_max = len(records), seq_len
  out = dict(tokens=np.zeros((b, seq_len), np.int32), pred_pos=np.zeros((b, r_max), np.int32),
             topk_ids=np.zeros((b, r_max, k), np.int32),
             topk_logp=np.full((b, r_max, k), -np.inf, np.float32),
             weight=np.zeros((b, r_max), np.float32))
  for i, rec in enumerate(records):
    p = rec["prompt"][-(seq_len - 1):]
    r = rec["response"][:seq_len - len(p)]
    n = len(r)
    out["tokens"][i, :len(p)] = p
    out["tokens"][i, len(p):len(p) + n] = r
    out["pred_pos"][i, :n] = len(p) - 1 + np.arange(n)
    if "topk_ids" in rec:  # (absent from id-only corpora: a ``Teacher`` fills them in)
      out["topk_ids"][i, :n] = rec["topk_ids"][:n, :k]
      out["topk_logp"][i, :n] = rec["topk_logp"][:n, :k]
    out["weight"][i, :n] = 1.0
    if "features" in rec:  # EAGLE: the target's features, aligned with the tokens
      if "features" not in out:
        out["features"] = np.zeros((b, seq_len, rec["features"].shape[-1]), np.float16)
      cut = len(rec["prompt"]) - len(p)
      out["features"][i, :len(p) + n] = rec["features"][cut:cut + len(p) + n]
  if pad_to:
    longest = max(record_length(rec, seq_len) for rec in records)
    l_used = min(seq_len, -(-longest // pad_to) * pad_to)
    for key in ("tokens", "features"):
      if key in out:
        out[key] = out[key][:, :l_used]
  # trim R to the longest response, rounded to 32 (fewer LM-head rows, few shapes)
  r_used = max(1, int(out["weight"].sum(1).max()))
  r_used = min(r_max, -(-r_used // 32) * 32)
  for key in ("pred_pos", "topk_ids", "topk_logp", "weight"):
    out[key] = out[key][:, :r_used]
  return out


def batch_indices(step: int, batch_size: int, n: int, seed: int,
                  lengths: Optional[Sequence[int]] = None, group: int = 0) -> np.ndarray:
  """Indices of step ``step``: consecutive slices of per-epoch permutations of range(n).

  With ``group`` > 0 (and ``lengths``, one per record), batches of similar lengths: each
  epoch's permutation is cut into windows of ``group`` batches, a window's records are
  sorted by length and cut into batches, and those batches are taken in a random order
  (HF's ``group_by_length``, fairseq's buckets). An epoch is then ``n // batch_size``
  batches (the ``n % batch_size`` records its permutation puts last sit it out). Still a
  function of (seed, step) alone, so a resumed run draws the same batches.
  """
  if group:
    if lengths is None or len(lengths) != n:
      raise ValueError(f"group={group} needs one length per record ({n})")
    per_epoch = n // batch_size
    if per_epoch == 0:
      raise ValueError(f"{n} records make no batch of {batch_size}")
    epoch, j = divmod(step, per_epoch)
    window, slot = divmod(j, group)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    first = window * group
    count = min(group, per_epoch - first)
    members = perm[first * batch_size:(first + count) * batch_size]
    ordered = members[np.argsort(np.asarray(lengths)[members], kind="stable")]
    order = np.random.default_rng([seed, epoch, window, 1]).permutation(count)
    b = order[slot]
    return ordered[b * batch_size:(b + 1) * batch_size]
  idx = []
  start = step * batch_size
  for g in range(start, start + batch_size):
    epoch, j = divmod(g, n)
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    idx.append(perm[j])
  return np.asarray(idx)


# ------------------------------------------------------------------ online teacher


@dataclasses.dataclass(frozen=True)
class Teacher:
  """The target run teacher-forced on each batch, so a corpus need only hold token ids.

  ``fill`` recomputes what ``make_batch`` would copy from a stored corpus: the
  target's top-k log-probs at the trained positions and, for feature drafters,
  its features. On an accelerator this costs little next to the draft's own
  step; on CPU it is one target forward per batch.

  Attributes:
    cfg: the target's config.
    k: top-k kept per position (the losses' coarsening, as for stored corpora).
    feature_layers: None (no features), () for the last hidden state, or the
      layers whose outputs are concatenated (``model.target_features``).
  """

  cfg: ModelConfig
  k: int = 64
  feature_layers: Optional[tuple[int, ...]] = None

  @functools.partial(jax.jit, static_argnames=("self",))
  def fill(self, target_params: Params, batch: dict) -> dict:
    tokens = batch["tokens"]
    b, l = tokens.shape
    layers = self.feature_layers or ()
    out = forward(target_params, self.cfg, tokens, jnp.broadcast_to(jnp.arange(l), (b, l)),
                  kvc.init_cache(self.cfg, b, l, compute_dtype(target_params)),
                  compute_logits=False, return_layers=layers)
    hidden = jnp.take_along_axis(out.hidden, batch["pred_pos"][:, :, None], axis=1)
    logp = jax.nn.log_softmax(lm_head(self.cfg, target_params, hidden), axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp, self.k)
    valid = (batch["weight"] > 0)[:, :, None]
    batch = dict(batch, topk_ids=jnp.where(valid, top_ids, 0).astype(jnp.int32),
                 topk_logp=jnp.where(valid, top_logp, -jnp.inf))
    if self.feature_layers is not None:
      batch["features"] = target_features(out, layers).astype(jnp.float32)
    return batch


# ------------------------------------------------------------------ model pieces


def draft_logp_at(params: Params, cfg: ModelConfig, input_ids: jax.Array,
                  pred_pos: jax.Array) -> jax.Array:
  """[B, R, Vd] the draft's log-probs at ``pred_pos`` given its input ids [B, L] (draft
  rows, or target ids when ``params`` hold a full-vocabulary ``input_embed``)."""
  b, l = input_ids.shape
  pos = jnp.broadcast_to(jnp.arange(l), (b, l))
  out = forward(params, cfg, input_ids, pos, kvc.init_cache(cfg, b, l, compute_dtype(params)),
                compute_logits=False)
  hidden = jnp.take_along_axis(out.hidden, pred_pos[:, :, None], axis=1)
  return jax.nn.log_softmax(lm_head(cfg, params, hidden), axis=-1)


@dataclasses.dataclass(frozen=True)
class TokenObjective:
  """What a token draft is trained on: its log-probs at the trained positions.

  An objective maps (trainable params, frozen arrays, input map, batch, key)
  to ([B, R, Vd] log-probs at ``batch["pred_pos"]``, or [K, B, R, Vd] for K
  draft steps or heads, auxiliary loss) and says from which trained position
  each step has an input (``min_position``); the divergence to the target is
  added by ``loss_fn``. Feature drafters have their own
  (``specjax.distill.eagle.EagleObjective``, ``specjax.distill.heads.HeadObjective``).

  Attributes:
    cfg: the draft's config.
    full_input: a reduced-vocabulary draft reads every target id as it does at
      inference with ``ModelDrafter.make_params(input_embed=target_embed)``:
      the target's row (frozen: ``frozen["input_embed"]``), or its own trainable
      row for ids in its vocabulary (``frozen["input_rows"]``; both from
      ``reduced_vocab.full_input``). Otherwise ids go through ``in_map`` (ids outside
      the vocabulary read a substitute row). Example: vocab_map [0, 7, 3]: id 7
      reads draft row 1, id 5 the target's row 5.
  """

  cfg: ModelConfig
  full_input: bool = False

  def min_position(self, step: int) -> int:
    """The first trained position step ``step`` has an input for (one step: every one)."""
    del step
    return 0

  def logp_and_aux(self, params, frozen, in_map, batch, key):
    del key
    if not self.full_input:
      return draft_logp_at(params, self.cfg, in_map[batch["tokens"]], batch["pred_pos"]), 0.0
    if "input_embed" not in frozen or "input_rows" not in frozen:
      raise ValueError("TokenObjective(full_input=True) reads frozen['input_embed'] and "
                       "frozen['input_rows'] (specjax.drafters.reduced_vocab.full_input)")
    reads = dict(params, input_embed=frozen["input_embed"], input_rows=frozen["input_rows"])
    return draft_logp_at(reads, self.cfg, batch["tokens"], batch["pred_pos"]), 0.0


def _coarsened(draft_logp, topk_ids, topk_logp, vocab_map, in_map):
  b, r, vd = draft_logp.shape
  k = topk_ids.shape[-1]
  d_ids = in_map[topk_ids]
  present = (vocab_map[d_ids] == topk_ids) & jnp.isfinite(topk_logp)
  p, q = losses.coarsen(d_ids.reshape(b * r, k), topk_logp.reshape(b * r, k),
                        present.reshape(b * r, k), draft_logp.reshape(b * r, vd))
  return p, q, d_ids, present


def selected(gap: jax.Array, weight: jax.Array, keep_fraction: float) -> jax.Array:
  """AdaSPEC's token selection (Hu et al. 2025): 1.0 at the ``keep_fraction`` of weighted
  positions where ``gap`` (the draft's divergence minus a reference draft's) is largest,
  0.0 elsewhere and at unweighted positions; ties at the threshold are kept.

  The positions the reference learned no better than the draft (small or negative gap)
  are taken as ones the draft cannot learn, and leave the loss.
  """
  valid = weight > 0
  n = jnp.sum(valid)
  ranked = jnp.sort(jnp.where(valid, gap, -jnp.inf).ravel())[::-1]
  kth = jnp.clip(jnp.ceil(keep_fraction * n).astype(jnp.int32) - 1, 0, ranked.size - 1)
  return (valid & (gap >= ranked[kth])).astype(weight.dtype)


def loss_fn(params, objective, kind, vocab_map, in_map, frozen, batch, key=None,
            keep_fraction: float = 1.0):
  """Weighted divergence to the target at ``pred_pos`` plus the objective's auxiliary loss.

  An objective that unrolls K draft steps (EAGLE-3's training-time test)
  returns [K, B, R, Vd] log-probs; the loss is the mean over steps, step k
  (from 0) weighing only positions ``pred_pos >= k`` (ones with a committed
  prefix at that draft step). With ``keep_fraction`` < 1 (AdaSPEC) each step keeps the
  positions ``selected`` by its divergence minus that of the reference draft whose
  parameters are ``frozen["reference"]`` (same objective, not trained).
  """
  logp, aux = objective.logp_and_aux(params, frozen, in_map, batch, key)
  steps = logp if logp.ndim == 4 else logp[None]
  ref_steps = None
  if keep_fraction < 1.0:
    if "reference" not in frozen:
      raise ValueError("keep_fraction < 1 (AdaSPEC) needs the reference draft's parameters "
                       "in frozen['reference']")
    ref, _ = objective.logp_and_aux(frozen["reference"], frozen, in_map, batch, key)
    ref_steps = jax.lax.stop_gradient(ref if ref.ndim == 4 else ref[None])
  total = 0.0
  for k in range(steps.shape[0]):
    p, q, _, _ = _coarsened(steps[k], batch["topk_ids"], batch["topk_logp"], vocab_map, in_map)
    d = losses.divergence(kind, p, q).reshape(batch["weight"].shape)
    w = step_weight(objective, batch, k)
    if ref_steps is not None:
      p_r, q_r, _, _ = _coarsened(ref_steps[k], batch["topk_ids"], batch["topk_logp"],
                                  vocab_map, in_map)
      d_ref = losses.divergence(kind, p_r, q_r).reshape(d.shape)
      w = w * selected(jax.lax.stop_gradient(d) - d_ref, w, keep_fraction)
    total += jnp.sum(d * w) / jnp.maximum(jnp.sum(w), 1.0)
  return total / steps.shape[0] + aux


def step_weight(objective, batch: dict, step: int) -> jax.Array:
  """[B, R] the weight of step ``step``'s log-probs: the batch's, zero at trained positions
  before ``objective.min_position(step)`` (ones the step has no input for)."""
  return batch["weight"] * (batch["pred_pos"] >= objective.min_position(step))


@functools.partial(jax.jit, static_argnames=("objective",))
def alpha_stats(params, objective, vocab_map, in_map, frozen, batch) -> dict[str, jax.Array]:
  """Per-position β sums from stored target top-k (teacher-forced).

  T=0: p and q are one-hots of the argmaxes, β = [argmax q == argmax p]
  (exact: the target's argmax is its top-1). T=1: β ≥ Σ_{top-k} min(p, q)
  (lower bound) and β ≤ that + min(p_rest, q_rest) (upper bound).
  """
  logp, _ = objective.logp_and_aux(params, frozen, in_map, batch, None)
  if logp.ndim == 4:  # several steps: α is the first draft step's (teacher-forced) agreement
    logp = logp[0]
  w = step_weight(objective, batch, 0)
  draft_top = vocab_map[jnp.argmax(logp, axis=-1)]
  beta0 = (draft_top == batch["topk_ids"][..., 0]).astype(jnp.float32)
  p, q, _, _ = _coarsened(logp, batch["topk_ids"], batch["topk_logp"], vocab_map, in_map)
  pk, qk = jnp.exp(p), jnp.exp(q)
  lower = losses.beta(pk[:, :-1], qk[:, :-1]).reshape(w.shape)
  upper = lower + jnp.minimum(pk[:, -1], qk[:, -1]).reshape(w.shape)
  return dict(n=jnp.sum(w), beta0=jnp.sum(beta0 * w), beta1_lo=jnp.sum(lower * w),
              beta1_hi=jnp.sum(upper * w))


def heldout_alpha(params: Params, draft: Draft, records: Sequence[dict], seq_len: int,
                  k: int, batch_size: int = 16, objective=None, frozen=None,
                  teacher: Optional[tuple[Teacher, Params]] = None,
                  pad_to: Optional[int] = None) -> dict[str, float]:
  """α on held-out generations: T=0 on greedy responses, T=1 on sampled ones
  (``teacher``: (Teacher, target params) for id-only records). With ``pad_to`` the records
  are taken in length order, in batches trimmed as ``make_batch`` trims them: the same sums
  over positions in less time."""
  objective = objective or TokenObjective(draft.cfg)
  vm, im = draft.maps()
  out = {}
  for mode, key in (("greedy", "T0"), ("sampled", "T1")):
    recs = [r for r in records if (r.get("mode", "greedy") == "greedy") == (mode == "greedy")]
    if not recs:
      recs = list(records)
    if pad_to:
      recs.sort(key=lambda r: record_length(r, seq_len))
    tot = dict(n=0.0, beta0=0.0, beta1_lo=0.0, beta1_hi=0.0)
    for i in range(0, len(recs), batch_size):
      s = alpha_stats(params, objective, vm, im, frozen or {},
                      device_batch(recs[i:i + batch_size], seq_len, k, teacher,
                                   pad_to=pad_to))
      for name in tot:
        tot[name] += float(s[name])
    n = max(tot["n"], 1.0)
    if key == "T0":
      out["alpha_T0"] = tot["beta0"] / n
    else:
      out["alpha_T1"] = tot["beta1_lo"] / n
      out["alpha_T1_upper"] = tot["beta1_hi"] / n
    out[f"positions_{key}"] = int(tot["n"])
  return out


def device_batch(records, seq_len: int, k: int,
                 teacher: Optional[tuple[Teacher, Params]],
                 place: Optional[Callable[[dict], dict]] = None,
                 pad_to: Optional[int] = None) -> dict:
  """``make_batch`` as device arrays (laid out by ``place``, e.g. rows over a mesh's data
  axis), filled in by ``teacher`` (when given) for id-only records."""
  batch = make_batch(records, seq_len, k, pad_to)
  batch = place(batch) if place else {key: jnp.asarray(v) for key, v in batch.items()}
  return batch if teacher is None else teacher[0].fill(teacher[1], batch)


# ------------------------------------------------------------------ optimisation


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=tc.lr, warmup_steps=tc.warmup_steps,
      decay_steps=max(tc.steps, tc.warmup_steps + 1), end_value=tc.lr * tc.end_lr_fraction)
  return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                     optax.adamw(schedule, weight_decay=tc.weight_decay))


def init_state(params: Params, tc: TrainConfig) -> dict:
  return dict(params=params, opt_state=make_optimizer(tc).init(params),
              step=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("objective", "tc"), donate_argnums=(0,))
def train_step(state, objective, tc, vocab_map, in_map, frozen, batch):
  key = jax.random.fold_in(jax.random.PRNGKey(tc.seed), state["step"])
  loss, grads = jax.value_and_grad(loss_fn)(state["params"], objective, tc.loss, vocab_map,
                                            in_map, frozen, batch, key, tc.keep_fraction)
  updates, opt_state = make_optimizer(tc).update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  return dict(params=params, opt_state=opt_state, step=state["step"] + 1), loss


# ------------------------------------------------------------------ on-policy data


def on_policy_records(draft_params: Params, draft: Draft, target_params: Params,
                      target_cfg: ModelConfig, prompts: Sequence[np.ndarray], max_new: int,
                      k: int, seed: int) -> list[dict]:
  """Draft samples (T=1) continuations; the target scores them teacher-forced.

  The draft runs in its own id space (prompts mapped through ``input_map``;
  sampling over Vd equals sampling its lifted distribution), then samples are
  mapped back to target ids.
  """
  from specjax.distill.teacher import generate_with_topk, score_with_target
  from specjax.sampling import Sampling

  vm, im = map(np.asarray, draft.maps())
  eos = tuple(int(im[e]) for e in target_cfg.eos_token_ids if vm[im[e]] == e)
  recs = generate_with_topk(draft_params, draft.cfg, [im[p] for p in prompts], max_new,
                            Sampling(1.0), k=1, seed=seed, eos_ids=eos)
  seqs = [(np.asarray(p), vm[r["response"]]) for p, r in zip(prompts, recs)]
  return [dict(r, mode="on-policy") for r in score_with_target(target_params, target_cfg, seqs, k)]


# ------------------------------------------------------------------ the loop


def train(draft: Draft, params: Params, train_records: Sequence[dict],
          heldout_records: Sequence[dict], tc: TrainConfig, workdir: str, *, k: int,
          target: Optional[tuple[ModelConfig, Params]] = None,
          stop_after: Optional[int] = None, deadline: Optional[float] = None,
          log: Callable[[dict], None] = print, progress: bool = True,
          objective=None, frozen: Optional[Params] = None,
          teacher: Optional[tuple[Teacher, Params]] = None,
          mesh=None, rules: Optional[sharding.ShardingRules] = None
          ) -> tuple[Params, list[dict]]:
  """Runs (or resumes) training; checkpoints to ``workdir/checkpoints``.

  With ``mesh`` (``sharding.make_mesh``) the same steps run on it under ``rules`` (default
  ``ShardingRules(indivisible="replicate")``: a small draft's heads may not split): batch
  rows over "data"; the trained and frozen parameters, the teacher and the target by the
  rules' parameter axes ("model"). The result is the single-device one up to rounding.

  Args:
    draft, params: the draft to train and its initial parameters.
    train_records, heldout_records: corpus records (see teacher.py).
    tc: hyper-parameters.
    workdir: resumes from its latest checkpoint when there is one.
    k: target top-k used by the losses.
    target: (cfg, params) of the target, needed only for on-policy steps.
    stop_after: stop (after checkpointing) at this step (for tests of resumption).
    deadline: wall-clock time (time.time()) after which to checkpoint and stop; one already
      past takes no step (the latest checkpoint's parameters are returned).
    log: receives one metrics dict per log event (also appended to metrics.jsonl; each
      step's seconds, batch length and trained positions go to steps.jsonl).
    objective: what is trained (default ``TokenObjective(draft.cfg)``).
    frozen: arrays the objective reads but does not train (e.g. the target's
      embedding and LM-head rows for EAGLE).
    teacher: (Teacher, target params): every batch's target top-k (and features)
      are recomputed teacher-forced, so records need only ``prompt`` and
      ``response``; ``k`` must equal the teacher's.

  Returns:
    (final params, metric history of this invocation).
  """
  if mesh is None:
    return _train(draft, params, train_records, heldout_records, tc, workdir, k, target,
                  stop_after, deadline, log, progress, objective, frozen, teacher, None)
  rules = rules or sharding.ShardingRules(indivisible="replicate")
  sharding.check_batch(tc.batch_size, mesh, rules)  # before anything compiles
  on = lambda p, cfg: sharding.shard_params(p, cfg, mesh, rules)
  with sharding.use_mesh(mesh, rules):
    return _train(draft, on(params, draft.cfg), train_records, heldout_records, tc, workdir, k,
                  target and (target[0], on(target[1], target[0])), stop_after, deadline, log,
                  progress, objective, frozen and on(frozen, None),
                  teacher and (teacher[0], on(teacher[1], teacher[0].cfg)),
                  lambda batch: sharding.shard_batch(batch, mesh, rules))


def _train(draft, params, train_records, heldout_records, tc, workdir, k, target, stop_after,
           deadline, log, progress, objective, frozen, teacher, place):
  import tqdm

  if tc.on_policy_every and target is None:
    raise ValueError("on-policy steps need the target: pass target=(cfg, params)")
  if tc.length_group and len(train_records) < tc.batch_size:  # before the step-0 evaluation
    raise ValueError(f"length_group={tc.length_group}: {len(train_records)} training records "
                     f"make no batch of {tc.batch_size}")
  objective = objective or TokenObjective(draft.cfg)
  if teacher is not None and teacher[0].k != k:
    raise ValueError(f"k={k} but the teacher keeps its top {teacher[0].k}")
  if tc.on_policy_every and not isinstance(objective, TokenObjective):
    raise ValueError("on-policy steps are implemented for token drafts only")
  if isinstance(objective, TokenObjective) and objective.full_input:
    if draft.vocab_map is None:
      raise ValueError("full_input is for a reduced-vocabulary draft; this one reads every "
                       "id through its own table")
    if tc.on_policy_every:
      raise ValueError("on-policy steps sample the draft in its own id space; they are not "
                       "implemented for a full-vocabulary-input draft")
  frozen = frozen or {}
  os.makedirs(workdir, exist_ok=True)
  mngr = ckpt.manager(os.path.join(workdir, "checkpoints"))
  state = init_state(jax.tree.map(jnp.copy, params), tc)  # the step donates its state
  if mngr.latest_step() is not None:
    state = ckpt.restore(mngr, state)
  start = int(state["step"])
  vm, im = draft.maps()
  history = []
  metrics_file = open(os.path.join(workdir, "metrics.jsonl"), "a")
  steps_file = open(os.path.join(workdir, "steps.jsonl"), "a")  # (each step's time and shape)

  def emit(m):
    history.append(m)
    metrics_file.write(json.dumps(m) + "\n")
    metrics_file.flush()
    log(m)

  if start == 0 and heldout_records:
    emit(dict(step=0, **heldout_alpha(state["params"], draft, heldout_records, tc.seq_len, k,
                                      objective=objective, frozen=frozen, teacher=teacher,
                                      pad_to=tc.pad_to)))
  end = tc.steps if stop_after is None else min(tc.steps, stop_after)
  if deadline is not None and time.time() > deadline:
    end = start  # out of time before the first step: the checkpoint stands as it is
  bar = tqdm.tqdm(range(start, end), initial=start, total=tc.steps, desc="distill",
                  disable=not progress)
  lengths = ([record_length(r, tc.seq_len) for r in train_records] if tc.length_group
             else None)
  t0, losses_acc = time.time(), []
  for step in bar:
    t_step = time.time()
    if tc.on_policy_every and step % tc.on_policy_every == tc.on_policy_every - 1:
      idx = batch_indices(step, tc.batch_size, len(train_records), tc.seed + 1)
      prompts = [train_records[i]["prompt"] for i in idx]
      recs = on_policy_records(state["params"], draft, target[1], target[0], prompts,
                               max_new=max(1, tc.seq_len - max(map(len, prompts))), k=k,
                               seed=tc.seed * 100_003 + step)
    else:
      idx = batch_indices(step, tc.batch_size, len(train_records), tc.seed, lengths,
                          tc.length_group)
      recs = [train_records[i] for i in idx]
    batch = device_batch(recs, tc.seq_len, k, teacher, place, tc.pad_to)
    state, loss = train_step(state, objective, tc, vm, im, frozen, batch)
    losses_acc.append(float(loss))
    steps_file.write(json.dumps(dict(
        step=step + 1, seconds=round(time.time() - t_step, 3), length=batch["tokens"].shape[1],
        rows=batch["tokens"].shape[0], trained=int(jnp.sum(batch["weight"] > 0)))) + "\n")
    steps_file.flush()
    bar.set_postfix(loss=f"{losses_acc[-1]:.4f}")
    s = step + 1
    out_of_time = deadline is not None and time.time() > deadline
    if s % tc.checkpoint_every == 0 or s == end or out_of_time:
      ckpt.save(mngr, s, state)
    if s % tc.eval_every == 0 or s == tc.steps or out_of_time:
      m = dict(step=s, loss=float(np.mean(losses_acc)), seconds=round(time.time() - t0, 1))
      if heldout_records:
        m.update(heldout_alpha(state["params"], draft, heldout_records, tc.seq_len, k,
                               objective=objective, frozen=frozen, teacher=teacher,
                               pad_to=tc.pad_to))
      emit(m)
      losses_acc = []
    if out_of_time:
      break
  bar.close()
  metrics_file.close()
  steps_file.close()
  return state["params"], history
