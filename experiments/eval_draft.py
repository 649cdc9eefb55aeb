"""Held-out α (T=0, T=1) and cost ratio c of a draft for the embedded target.

  python -m experiments.eval_draft [--eval_draft DIR] [--results results.json]

α: mean over held-out target generations (teacher-forced) of
β = Σ_x min(p(x), q(x)), p / q the target's / draft's warped distributions:
greedy (one-hot argmax) on greedy generations, Sampling(temperature=1) on
T=1 generations. T=0 is exact from the stored top-1; for T=1 the stored
top-k gives bounds and ``--exact_records`` responses are re-scored with the
full target distribution. c: median draft / target decode-step time
(B=1, one token, 256 cached tokens), measured interleaved on this machine.
An EAGLE directory (``--draft_kind=eagle``) is evaluated the same way, with
the target's features of the held-out set (cached beside the corpus): its
teacher-forced α is that of the first draft of each step, which reads true
features; later drafts read predicted ones (see experiments.run for α in
real speculative decoding).
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("eval_draft", None, "Draft directory (default: the shipped SmolLM2 draft).")
flags.DEFINE_string("corpus", None, "Corpus directory (default: from draft.json).")
flags.DEFINE_integer("exact_records", 16, "T=1 held-out responses scored with the full target.")
flags.DEFINE_integer("timing_reps", 40, "Interleaved timing repetitions for c.")
flags.DEFINE_string("results", None, "Write the results as JSON here.")


def exact_alpha_t1(tparams, tcfg, records, draft_logits, layers=()) -> float:
  """Mean β at T=1 over the response positions of ``records``, with the full target
  distribution. ``draft_logits(tokens [1, n], positions, target_output)`` returns the
  draft's [n, V] logits over the target vocabulary (−inf outside its own); the target's
  output holds the outputs of ``layers`` (feature fusion)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from specjax.distill import losses
  from specjax.kv_cache import init_cache
  from specjax.model import forward
  from specjax.sampling import Sampling

  sampler = Sampling(temperature=1.0)
  fwd = jax.jit(forward, static_argnames=("cfg", "return_layers"))
  betas = []
  for r in records:
    seq = np.concatenate([r["prompt"], r["response"]])
    n = -(-len(seq) // 64) * 64
    toks = jnp.zeros((1, n), jnp.int32).at[0, :len(seq)].set(jnp.asarray(seq))
    pos = jnp.arange(n)[None]
    out = fwd(tparams, tcfg, toks, pos, init_cache(tcfg, 1, n), return_layers=tuple(layers))
    p = sampler.probs(out.logits[0])
    q = sampler.probs(draft_logits(toks, pos, out))
    betas.append(np.asarray(losses.beta(p, q))[len(r["prompt"]) - 1:len(seq) - 1])
  return float(np.mean(np.concatenate(betas)))


def corpus_path(recorded: str) -> str:
  """A draft's recorded corpus: ``$SPECJAX_CACHE/...`` expanded; a path from another machine
  falls back to the same corpus key under this machine's cache."""
  import os
  from specjax.loaders.embedded import cache_dir
  path = recorded.replace("$SPECJAX_CACHE", cache_dir())
  if not os.path.isdir(path):
    path = os.path.join(cache_dir(), "distill", os.path.basename(path.rstrip("/")))
  return path


def _token_stepper(tcfg, c, p, vm):
  """One decode step (B=1, 256 cached tokens) of a token model, as a timed callable."""
  import jax
  import jax.numpy as jnp
  from specjax.drafters.reduced_vocab import lift_logits
  from specjax.kv_cache import init_cache
  from specjax.model import forward

  @jax.jit
  def f(p, tok, cache):
    out = forward(p, c, tok, cache.lengths[:, None], cache, num_valid=jnp.zeros((1,), jnp.int32))
    lg = out.logits[:, 0]
    if vm is not None:
      lg = lift_logits(lg, vm, tcfg.vocab_size)
    return jnp.argmax(lg, -1)
  cache = init_cache(c, 1, 512).with_lengths(jnp.array([256]))
  return lambda: f(p, jnp.array([[5]]), cache)


def _eagle_stepper(drafter, dp):
  """One EAGLE draft step (a predicted feature + a token in, a token out), timed like above."""
  import jax
  import jax.numpy as jnp
  from specjax.kv_cache import init_cache

  @jax.jit
  def f(dp, feat, tok, cache):
    h, _ = drafter.hidden(dp, feat, tok, cache.lengths[:, None], cache,
                          num_valid=jnp.zeros((1,), jnp.int32))
    return h[:, 0], jnp.argmax(drafter.logits(dp, h[:, 0]), -1)
  cache = init_cache(drafter.cfg, 1, 512).with_lengths(jnp.array([256]))
  feat = jnp.ones((1, 1, drafter.cfg.dim), jnp.float32)
  return lambda: f(dp, feat, jnp.array([[5]]), cache)


def step_times(target_step, draft_step, reps: int) -> dict[str, float]:
  """Median step times of two timed callables, interleaved, and their ratio c."""
  import jax
  import numpy as np

  runs = {"target": target_step, "draft": draft_step}
  times = {k: [] for k in runs}
  for run in runs.values():
    jax.block_until_ready(run())  # compile
  for _ in range(reps):
    for k, run in runs.items():
      t = time.perf_counter()
      jax.block_until_ready(run())
      times[k].append(time.perf_counter() - t)
  med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
  return dict(target_ms=med["target"], draft_ms=med["draft"], c=med["draft"] / med["target"])


def eval_eagle(path: str, meta: dict, tok) -> dict:
  """Held-out α (teacher-forced: every draft reads the target's true features, i.e. the
  first draft of a step) and c of an EAGLE draft directory."""
  import dataclasses
  import jax.numpy as jnp
  import numpy as np
  from specjax import drafts
  from specjax.distill import eagle, features, teacher, train
  from specjax.drafters.eagle import split_params
  from specjax.kv_cache import init_cache
  from specjax.loaders import load_model
  from specjax.model import target_features

  tcfg, tparams = load_model()
  drafter, dp = drafts.load_eagle(path, tcfg, tparams,
                                  tokenizer_sha256=drafts.tokenizer_fingerprint(tok))
  corpus = FLAGS.corpus or corpus_path(meta["info"]["corpus"])
  held = teacher.load_corpus(corpus, "heldout")
  layers = drafter.feature_layers
  k = meta["info"].get("topk", 64)
  online = None
  if meta["info"].get("teacher") == "online":  # an id-only corpus: the target recomputes
    online = (train.Teacher(tcfg, k, layers), tparams)
    held = teacher.ids_only(held)
  else:
    features.corpus_features(corpus, "heldout", held, tparams, tcfg, layers=layers)
  seq_len = _seq_len(meta)
  vm = None if "vocab_map" not in dp else np.asarray(dp["vocab_map"])
  weights, frozen = split_params(dp)
  objective = eagle.EagleObjective(drafter)
  draft = train.Draft(cfg=dataclasses.replace(drafter.cfg, vocab_size=frozen["head"].shape[0]),
                      target_vocab_size=tcfg.vocab_size, vocab_map=vm)
  alpha = lambda recs: train.heldout_alpha(weights, draft, recs, seq_len, k, objective=objective,
                                           frozen=frozen, teacher=online)
  res = dict(kind="eagle", heldout=alpha(held), by_category={
      cat: alpha([r for r in held if r["category"] == cat])
      for cat in sorted({r["category"] for r in held})})

  def draft_logits(toks, pos, out):  # every pair reads the target's true features
    fused = drafter.fuse(dp, target_features(out, layers))
    shifted = jnp.concatenate([jnp.zeros_like(fused[:, :1]), fused[:, :-1]], axis=1)
    h, _ = drafter.hidden(dp, shifted, toks, pos, init_cache(drafter.cfg, *toks.shape))
    return drafter.logits(dp, h)[0]

  res["alpha_T1_exact_subset"] = _exact_subset(tparams, tcfg, held, draft_logits, layers)
  res["timing"] = step_times(_token_stepper(tcfg, tcfg, tparams, None),
                             _eagle_stepper(drafter, dp), FLAGS.timing_reps)
  return res


def main(argv):
  del argv
  from specjax import drafts
  from specjax.loaders import load_model_tokenizer

  tok = load_model_tokenizer()
  path = FLAGS.eval_draft or drafts.DEFAULT_DRAFT_DIR
  meta = drafts.read_draft_metadata(path, (drafts.FORMAT, drafts.EAGLE_FORMAT))
  evaluate = eval_eagle if meta["format"] == drafts.EAGLE_FORMAT else eval_token_draft
  res = dict(draft=path, git=_git(), **evaluate(path, meta, tok))
  a0, a1, c = res["heldout"]["alpha_T0"], res["alpha_T1_exact_subset"]["alpha"], res["timing"]["c"]
  res["expected_walltime_improvement"] = {  # Leviathan et al. Thm 3.8
      f"T{t}_gamma{g}": (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1))
      for t, a in ((0, a0), (1, a1)) if a is not None for g in (1, 2, 3, 4)}
  res["size_bytes"] = {f: os.path.getsize(os.path.join(path, f))
                       for f in drafts.weight_files(path) + ["draft.json"]}
  logging.info("%s", json.dumps(res, indent=2))
  if FLAGS.results:
    with open(FLAGS.results, "w") as f:
      json.dump(res, f, indent=2)
  print(json.dumps(res, indent=2))


def _git() -> str:
  return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def _seq_len(meta: dict) -> int:
  """The sequence length the draft trained at (288 for drafts that predate the record)."""
  return meta["info"].get("train_config", {}).get("seq_len", 288)


def _exact_subset(tparams, tcfg, held, draft_logits, layers=()) -> dict:
  """Exact T=1 α on the first sampled held-out responses (α None when the corpus has
  no sampled held-out response)."""
  sampled = [r for r in held if r["mode"] != "greedy"][:FLAGS.exact_records]
  return dict(records=len(sampled), tokens=int(sum(len(r["response"]) for r in sampled)),
              alpha=exact_alpha_t1(tparams, tcfg, sampled, draft_logits, layers)
              if sampled else None)


def eval_token_draft(path: str, meta: dict, tok) -> dict:
  """Held-out α (teacher-forced) and c of a token draft directory."""
  import jax
  import jax.numpy as jnp
  from specjax import drafts
  from specjax.distill import teacher, train
  from specjax.drafters import reduced_vocab
  from specjax.kv_cache import init_cache
  from specjax.loaders import load_model
  from specjax.model import forward

  dcfg, dparams, vm, im = drafts.load_draft(
      path, target_vocab_size=len(tok), tokenizer_sha256=drafts.tokenizer_fingerprint(tok),
      with_input_map=True)
  tcfg, tparams = load_model()
  draft = train.Draft(cfg=dcfg, target_vocab_size=tcfg.vocab_size, vocab_map=vm, input_map=im)
  corpus = FLAGS.corpus or corpus_path(meta["info"]["corpus"])
  held = teacher.load_corpus(corpus, "heldout")
  k = meta["info"].get("topk", 64)
  # Read ids as inference does (specjax.drafts.drafter_from_path).
  full_input = drafts.reads_target_rows(dcfg, vm, tcfg.dim)
  objective = train.TokenObjective(dcfg, full_input=full_input)
  frozen = (reduced_vocab.full_input(vm, tparams["embed"], tcfg.vocab_size, dcfg.dim)
            if full_input else None)
  alpha = lambda recs: train.heldout_alpha(dparams, draft, recs, _seq_len(meta), k,
                                           objective=objective, frozen=frozen)
  res = dict(heldout=alpha(held), by_category={
      cat: alpha([r for r in held if r["category"] == cat])
      for cat in sorted({r["category"] for r in held})})
  d_vm, d_im = draft.maps()
  fwd = jax.jit(forward, static_argnames=("cfg",))
  read_params, read = dparams, lambda toks: d_im[toks]
  if full_input:
    read_params, read = dict(dparams, **frozen), lambda toks: toks

  def draft_logits(toks, pos, out):
    del out
    dl = fwd(read_params, dcfg, read(toks), pos, init_cache(dcfg, *toks.shape)).logits[0]
    return reduced_vocab.lift_logits(dl, d_vm, tcfg.vocab_size)

  res["alpha_T1_exact_subset"] = _exact_subset(tparams, tcfg, held, draft_logits)
  res["timing"] = step_times(
      _token_stepper(tcfg, tcfg, tparams, None),
      _token_stepper(tcfg, dcfg, dparams, None if vm is None else jnp.asarray(vm)),
      FLAGS.timing_reps)
  return res


if __name__ == "__main__":
  app.run(main)
