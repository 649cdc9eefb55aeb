"""Self-distillation data: the target answers prompts and we keep its top-k distributions.

Decoding reuses ``specjax.generate`` (chunked prefill, ``DecodeState``) with a
step that also records, for every generated position, the target's k most
likely tokens and their log-probabilities at temperature 1. Storing top-k
instead of [V] distributions keeps a 100k-token corpus at a few MB; the losses
treat the remaining mass as one "other" bucket (see ``losses.py``).

Responses are cached on disk in shards (``$SPECJAX_CACHE/distill/<key>/``), so
an interrupted generation run continues where it stopped.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
from typing import Callable, Iterator, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax import files
from specjax import kv_cache as kvc
from specjax.config import ModelConfig
from specjax.generate import DecodeState, init_decode_state, last_tokens
from specjax.model import Params, compute_dtype, forward
from specjax.prompts import pack_prompts
from specjax.sampling import Greedy, Sampler
from specjax.sequences import append


@flax.struct.dataclass(kw_only=True)
class TeacherState:
  """DecodeState plus the recorded top-k per generated position.

  Attributes:
    decode: the plain decoding state.
    topk_ids: [B, N, k] int32 target ids of the k most likely next tokens.
    topk_logp: [B, N, k] float32 their log-probabilities at temperature 1.
    prompt_lens: [B] where generation started.
  """

  decode: DecodeState
  topk_ids: jax.Array
  topk_logp: jax.Array
  prompt_lens: jax.Array


def _teacher_step(params, cfg, sampler, eos_ids, logits_fn, st: TeacherState) -> TeacherState:
  state = st.decode
  b = state.tokens.shape[0]
  active = ~state.done
  pos = state.seq_lens - 1
  logits, cache = logits_fn(params, cfg, last_tokens(state.tokens, state.seq_lens),
                            pos[:, None], state.cache, active.astype(jnp.int32))
  logits = logits[:, 0]
  k = st.topk_ids.shape[-1]
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  top_logp, top_ids = jax.lax.top_k(logp, k)
  step = state.seq_lens - st.prompt_lens  # index of the token being generated
  n = st.topk_ids.shape[1]
  write = jnp.where(active, step, n)
  rows = jnp.arange(b)
  topk_ids = st.topk_ids.at[rows, write].set(top_ids.astype(jnp.int32), mode="drop")
  topk_logp = st.topk_logp.at[rows, write].set(top_logp, mode="drop")
  rng, key = jax.random.split(state.rng)
  nxt, _ = sampler.sample(key, logits)
  state, _ = append(state, nxt[:, None], jnp.ones_like(state.seq_lens), eos_ids)
  decode = state.replace(cache=cache, rng=rng, steps=state.steps + 1)
  return st.replace(decode=decode, topk_ids=topk_ids, topk_logp=topk_logp)


def target_logits_fn(params, cfg, tokens, positions, cache, num_valid):
  out = forward(params, cfg, tokens, positions, cache, num_valid=num_valid)
  return out.logits, out.cache


@functools.partial(jax.jit, static_argnames=("cfg", "sampler", "eos_ids", "k", "max_new",
                                             "logits_fn"))
def _generate_topk(params, cfg, tokens, prompt_lens, rng, sampler, eos_ids, k, max_new,
                   logits_fn):
  b = tokens.shape[0]
  state = init_decode_state(params, cfg, tokens, prompt_lens,
                            jnp.full((b,), max_new, jnp.int32), rng)
  st = TeacherState(decode=state, topk_ids=jnp.zeros((b, max_new, k), jnp.int32),
                    topk_logp=jnp.full((b, max_new, k), -jnp.inf, jnp.float32),
                    prompt_lens=prompt_lens)
  step = functools.partial(_teacher_step, params, cfg, sampler, eos_ids, logits_fn)
  st = jax.lax.while_loop(lambda s: ~jnp.all(s.decode.done), step, st)
  return st.decode.tokens, st.decode.seq_lens, st.topk_ids, st.topk_logp


def generate_with_topk(params: Params, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int, sampler: Sampler = Greedy(), *, k: int = 32,
                       seed: int = 0, eos_ids: Optional[Sequence[int]] = None,
                       cache_size: Optional[int] = None) -> list[dict[str, np.ndarray]]:
  """Generates responses and records the target's top-k log-probs at each new position.

  Returns one record per prompt: ``prompt`` [P], ``response`` [R] (EOS
  included when produced), ``topk_ids`` / ``topk_logp`` [R, k] (the target's
  distribution that produced ``response[i]``).
  """
  tokens, lens, _ = pack_prompts(prompts, max_new_tokens, cache_size, vocab_size=cfg.vocab_size)
  eos = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
  out_tokens, seq_lens, ids, logp = _generate_topk(
      params, cfg, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(seed), sampler,
      eos, k, max_new_tokens, target_logits_fn)
  out_tokens, seq_lens, ids, logp = map(np.asarray, (out_tokens, seq_lens, ids, logp))
  records = []
  for i, p in enumerate(prompts):
    r = int(seq_lens[i] - lens[i])
    records.append(dict(prompt=np.asarray(p, np.int32),
                        response=out_tokens[i, lens[i]:seq_lens[i]].astype(np.int32),
                        topk_ids=ids[i, :r], topk_logp=logp[i, :r].astype(np.float32)))
  return records


# ---------------------------------------------------------------- on-disk corpus


def target_shape(cfg: ModelConfig) -> dict:
  """The target fields a corpus depends on (not repr(cfg), which grows new fields)."""
  return {f: getattr(cfg, f) for f in ("name", "vocab_size", "dim", "num_layers", "num_heads",
                                       "num_kv_heads", "ffn_dim", "rope_theta")}


def corpus_key(cfg: ModelConfig, spec: dict) -> str:
  """Cache key of a corpus: the target's shape (``target_shape``) + spec."""
  blob = json.dumps({"target": target_shape(cfg), **spec}, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def save_shard(path: str, records: Sequence[dict], meta: Sequence[dict]) -> None:
  """One shard: ragged records flattened with offsets (np.savez, atomic rename)."""
  arrays = {}
  for field in ("prompt", "response", "topk_ids", "topk_logp"):
    arrays[field] = np.concatenate([r[field] for r in records], axis=0)
    arrays[field + "_len"] = np.array([len(r[field]) for r in records], np.int64)
  arrays["meta"] = np.array(json.dumps(list(meta)))
  with files.atomic_path(path, ".npz") as tmp:
    np.savez(tmp, **arrays)


def load_shard(path: str) -> list[dict]:
  with np.load(path) as z:
    meta = json.loads(str(z["meta"]))
    out = [dict(m) for m in meta]
    for field in ("prompt", "response", "topk_ids", "topk_logp"):
      offs = np.concatenate([[0], np.cumsum(z[field + "_len"])])
      data = z[field]
      for i, rec in enumerate(out):
        rec[field] = data[offs[i]:offs[i + 1]]
  return out


def ids_only(records: Sequence[dict]) -> list[dict]:
  """The records without their stored top-k: what an online ``train.Teacher`` trains on."""
  keep = ("prompt", "response", "mode", "category", "source")
  return [{f: r[f] for f in keep if f in r} for r in records]


def leading_records(corpora: Sequence[Sequence[dict]], max_tokens: int
                    ) -> list[list[dict]]:
  """The leading records of each corpus, together at most ``max_tokens`` response tokens,
  each corpus cut to the same share of its own tokens (the corpus-size axis of an ablation:
  a corpus and the answers beside it shrink alike). Records stay in corpus order: a
  corpus's generation batches interleave its prompt categories, so its head is a sample
  of all of them, not of one. Raises ValueError when the corpora hold fewer tokens."""
  sizes = [sum(len(r["response"]) for r in recs) for recs in corpora]
  if max_tokens < 1 or max_tokens > sum(sizes):
    raise ValueError(f"asked for {max_tokens:,} response tokens; the corpus holds "
                     f"{sum(sizes):,}")
  out = []
  for recs, size in zip(corpora, sizes):
    budget, kept, used = size * max_tokens // sum(sizes), [], 0
    for r in recs:
      if used + len(r["response"]) > budget:
        break
      kept.append(r)
      used += len(r["response"])
    out.append(kept)
  return out


def load_corpus(directory: str, split: str) -> list[dict]:
  """All records of ``split`` ('train' or 'heldout') in shard order."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no distillation corpus at {directory}; run "
                            "`python -m experiments.train_draft --stage=data` first")
  recs = []
  for n in shard_names(directory, split):
    recs += load_shard(os.path.join(directory, n))
  return recs


def shard_names(directory: str, split: str) -> list[str]:
  """The file names of ``split``'s whole shards in ``directory``, in order."""
  return sorted(f for f in os.listdir(directory) if f.startswith(split + "-")
                and f.endswith(".npz") and ".tmp" not in f)


def shard_path(directory: str, split: str, i: int) -> str:
  """Shard ``i`` of ``split``: ``{directory}/{split}-{i:05d}.npz``."""
  return os.path.join(directory, f"{split}-{i:05d}.npz")


class CorpusDiskFull(OSError):
  """The disk filled while a corpus was written; every shard already written is kept."""


def write_shards(directory: str, split: str, batches: Sequence,
                 make_records: Callable[[int, object], tuple[list[dict], list[dict]]],
                 progress: Optional[Callable[[int, int], None]] = None,
                 deadline: Optional[float] = None) -> int:
  """Writes the missing shards ``{split}-{i:05d}.npz``, one per batch; returns how many exist.

  ``make_records(i, batch)`` gives shard i's (records, meta). Shards are written whole
  (``files.atomic_path``) and only where missing, so a run that stops (``deadline``, a
  crash, a full disk) resumes where it stopped and writes exactly what an uninterrupted
  one would. A full disk raises ``CorpusDiskFull`` naming the shards kept.
  """
  import time
  os.makedirs(directory, exist_ok=True)
  done = 0
  for i, batch in enumerate(batches):
    path = shard_path(directory, split, i)
    if not os.path.exists(path):
      if deadline is not None and time.time() > deadline:
        break
      records, meta = make_records(i, batch)
      try:
        save_shard(path, records, meta)
      except OSError as e:
        if e.errno != errno.ENOSPC:
          raise
        raise CorpusDiskFull(errno.ENOSPC, f"the disk filled while writing {path}; the {done} "
                             f"{split} shards before it are kept: free space and rerun the same "
                             "command to continue") from e
    done += 1
    if progress:
      progress(i, len(batches))
  return done


def build_corpus(directory: str, params: Params, cfg: ModelConfig, split: str,
                 batches: Sequence[tuple[list[list[int]], list[dict]]], samplers: Sequence[Sampler],
                 max_new_tokens: int, k: int, seed: int,
                 progress: Optional[Callable[[int, int], None]] = None,
                 deadline: Optional[float] = None, cache_size: Optional[int] = None) -> int:
  """The target's answers: generates the missing shards ``{split}-{i:05d}.npz``; returns how
  many exist (``write_shards``).

  Batch i uses ``samplers[i % len(samplers)]`` and seed ``seed + i``, so a
  resumed run writes exactly the shards an uninterrupted one would. A fixed
  ``cache_size`` (>= longest prompt + ``max_new_tokens``) makes every batch
  one compiled program.
  """

  def make(i, batch):
    prompts, meta = batch
    sampler = samplers[i % len(samplers)]
    recs = generate_with_topk(params, cfg, prompts, max_new_tokens, sampler, k=k, seed=seed + i,
                              cache_size=cache_size)
    mode = "greedy" if isinstance(sampler, Greedy) else f"T={sampler.temperature}"
    return recs, [dict(m, mode=mode) for m in meta]

  return write_shards(directory, split, batches, make, progress, deadline)


def build_text_corpus(directory: str, params: Params, cfg: ModelConfig, split: str,
                      batches: Sequence[tuple[list[tuple[np.ndarray, np.ndarray]], list[dict]]],
                      k: int, length: int, progress: Optional[Callable[[int, int], None]] = None,
                      deadline: Optional[float] = None) -> int:
  """Fixed text scored by teacher forcing (EAGLE-1's recipe): each batch's (prompt,
  response) pairs get the target's top-k at every response position, one prefill of
  ``length`` positions per batch (one compiled program); shards as ``build_corpus``'s."""

  def make(i, batch):
    seqs, meta = batch
    return score_with_target(params, cfg, seqs, k, length=length), \
        [dict(m, mode="text") for m in meta]

  return write_shards(directory, split, batches, make, progress, deadline)


def length_batches(lengths: Sequence[int], batch_size: int, pad_to: int
                   ) -> Iterator[tuple[np.ndarray, int]]:
  """Teacher-forced batching: (indices, padded length) of ``batch_size`` sequences at a
  time, shortest first, the length rounded up to ``pad_to``; a caller that pads every
  batch to ``batch_size`` rows compiles one program per padded length."""
  order = np.argsort(np.asarray(lengths), kind="stable")
  for i in range(0, len(order), batch_size):
    idx = order[i:i + batch_size]
    yield idx, -(-max(lengths[j] for j in idx) // pad_to) * pad_to


def score_with_target(params: Params, cfg: ModelConfig,
                      seqs: Sequence[tuple[np.ndarray, np.ndarray]], k: int,
                      length: Optional[int] = None) -> list[dict]:
  """Records (prompt, response, the target's top-k at each response position), teacher-forced
  in one forward over ``length`` positions (default: the longest, rounded up to 32)."""
  l = max(len(p) + len(r) for p, r in seqs)
  if length is not None and l > length:
    raise ValueError(f"a sequence of {l} tokens does not fit length={length}")
  l = length or -(-l // 32) * 32
  tokens = np.zeros((len(seqs), l), np.int32)
  for i, (p, r) in enumerate(seqs):
    tokens[i, :len(p) + len(r)] = np.concatenate([p, r])
  logp_top, ids_top = _score(params, cfg, jnp.asarray(tokens), k)
  logp_top, ids_top = np.asarray(logp_top), np.asarray(ids_top)
  out = []
  for i, (p, r) in enumerate(seqs):
    sl = slice(len(p) - 1, len(p) - 1 + len(r))
    out.append(dict(prompt=np.asarray(p, np.int32), response=np.asarray(r, np.int32),
                    topk_ids=ids_top[i, sl], topk_logp=logp_top[i, sl]))
  return out


@functools.partial(jax.jit, static_argnames=("cfg", "k"))
def _score(params, cfg, tokens, k):
  b, l = tokens.shape
  out = forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(l), (b, l)),
                kvc.init_cache(cfg, b, l, compute_dtype(params)))
  return jax.lax.top_k(jax.nn.log_softmax(out.logits, axis=-1), k)
