"""Held-out α (T=0, T=1) and cost ratio c of a draft for the embedded target.

  python -m experiments.eval_draft [--eval_draft DIR] [--results results.json]

α: mean over held-out target generations (teacher-forced) of
β = Σ_x min(p(x), q(x)), p / q the target's / draft's warped distributions:
greedy (one-hot argmax) on greedy generations, Sampling(temperature=1) on
T=1 generations. T=0 is exact from the stored top-1; for T=1 the stored
top-k gives bounds and ``--exact_records`` responses are re-scored with the
full target distribution. c: median draft / target decode-step time
(B=1, one token, 256 cached tokens), measured interleaved on this machine.
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


def exact_alpha_t1(tparams, tcfg, dparams, draft, records) -> float:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from specjax.distill import losses
  from specjax.distill.vocab import lift_logits
  from specjax.kv_cache import init_cache
  from specjax.model import forward
  from specjax.sampling import Sampling

  vm, im = draft.maps()
  sampler = Sampling(temperature=1.0)
  fwd = jax.jit(forward, static_argnames=("cfg",))
  betas = []
  for r in records:
    seq = np.concatenate([r["prompt"], r["response"]])
    n = -(-len(seq) // 64) * 64
    toks = np.zeros((1, n), np.int32)
    toks[0, :len(seq)] = seq
    pos = jnp.arange(n)[None]
    p = sampler.probs(fwd(tparams, tcfg, jnp.asarray(toks), pos, init_cache(tcfg, 1, n)).logits[0])
    dl = fwd(dparams, draft.cfg, im[jnp.asarray(toks)], pos, init_cache(draft.cfg, 1, n)).logits[0]
    q = sampler.probs(lift_logits(dl, vm, tcfg.vocab_size))
    sl = slice(len(r["prompt"]) - 1, len(seq) - 1)
    betas.append(np.asarray(losses.beta(p, q))[sl])
  return float(np.mean(np.concatenate(betas)))


def step_times(tcfg, tparams, dcfg, dparams, vocab_map, reps: int) -> dict[str, float]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from specjax.distill.vocab import lift_logits
  from specjax.kv_cache import init_cache
  from specjax.model import forward

  def stepper(c, p, vm):
    @jax.jit
    def f(p, tok, cache):
      out = forward(p, c, tok, cache.lengths[:, None], cache, num_valid=jnp.zeros((1,), jnp.int32))
      lg = out.logits[:, 0]
      if vm is not None:
        lg = lift_logits(lg, vm, tcfg.vocab_size)
      return jnp.argmax(lg, -1)
    cache = init_cache(c, 1, 512).with_lengths(jnp.array([256]))
    tok = jnp.array([[5]])
    f(p, tok, cache).block_until_ready()

    def run():
      t = time.perf_counter()
      f(p, tok, cache).block_until_ready()
      return time.perf_counter() - t
    return run

  runs = {"target": stepper(tcfg, tparams, None),
          "draft": stepper(dcfg, dparams, None if vocab_map is None else jnp.asarray(vocab_map))}
  times = {k: [] for k in runs}
  for _ in range(reps):
    for k, run in runs.items():
      times[k].append(run())
  med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
  return dict(target_ms=med["target"], draft_ms=med["draft"], c=med["draft"] / med["target"])


def main(argv):
  del argv
  import numpy as np
  from specjax import drafts
  from specjax.distill import teacher, train
  from specjax.loaders import load_model, load_model_tokenizer

  tok = load_model_tokenizer()
  path = FLAGS.eval_draft or drafts.DEFAULT_DRAFT_DIR
  meta = drafts.read_draft_metadata(path)
  dcfg, dparams, vm, im = drafts.load_draft(
      path, target_vocab_size=len(tok), tokenizer_sha256=drafts.tokenizer_fingerprint(tok),
      with_input_map=True)
  tcfg, tparams = load_model()
  draft = train.Draft(cfg=dcfg, target_vocab_size=tcfg.vocab_size, vocab_map=vm, input_map=im)
  corpus = FLAGS.corpus or meta["info"]["corpus"]
  held = teacher.load_corpus(corpus, "heldout")
  k = meta["info"].get("topk", 64)
  res = dict(draft=path, git=subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                            text=True).stdout.strip())
  res["heldout"] = train.heldout_alpha(dparams, draft, held, 288, k)
  res["by_category"] = {}
  for cat in sorted({r["category"] for r in held}):
    res["by_category"][cat] = train.heldout_alpha(
        dparams, draft, [r for r in held if r["category"] == cat], 288, k)
  sampled = [r for r in held if r["mode"] != "greedy"][:FLAGS.exact_records]
  res["alpha_T1_exact_subset"] = dict(records=len(sampled), tokens=int(sum(len(r["response"])
                                                                         for r in sampled)),
                                      alpha=exact_alpha_t1(tparams, tcfg, dparams, draft, sampled))
  res["timing"] = step_times(tcfg, tparams, dcfg, dparams, vm, FLAGS.timing_reps)
  a0, a1, c = res["heldout"]["alpha_T0"], res["alpha_T1_exact_subset"]["alpha"], res["timing"]["c"]
  res["expected_walltime_improvement"] = {  # Leviathan et al. Thm 3.8
      f"T{t}_gamma{g}": (1 - a ** (g + 1)) / ((1 - a) * (g * c + 1))
      for t, a in ((0, a0), (1, a1)) for g in (1, 2, 3, 4)}
  res["size_bytes"] = {f: os.path.getsize(os.path.join(path, f))
                       for f in ("weights.safetensors", "draft.json")}
  logging.info("%s", json.dumps(res, indent=2))
  if FLAGS.results:
    with open(FLAGS.results, "w") as f:
      json.dump(res, f, indent=2)
  print(json.dumps(res, indent=2))
  del np


if __name__ == "__main__":
  app.run(main)
