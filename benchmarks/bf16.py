"""bfloat16 against float32 on the embedded SmolLM2-135M target: agreement, speed, speedup.

Usage:
  python -m benchmarks.bf16 [--prompts 5] [--new_tokens 64] [--gammas 2,3]
      [--out benchmarks/results/bf16.md]

Both dtypes run the same prompts in one process (batch 1):

  agreement   float32 greedy generates ``new_tokens`` per prompt; both dtypes then
              score that text teacher-forced (one forward each), and at every
              generated position the table gives float32's top-two logit gap, the
              largest |logit_bf16 − logit_f32| and whether the argmaxes agree, binned
              by the gap (the near-tie rule of ``tests/test_bf16.py``). Free-running,
              the bfloat16 greedy text is compared with float32's up to the first
              difference, and float32's gap there is reported.
  speed       one plain decode step t₁ of each dtype (decode-loop time per step), and
              speculative decoding with the EAGLE drafter (chains of ``gammas``) in
              each dtype against plain decoding in the same dtype: tokens per target
              call, decode-only speedup, and greedy equality with that dtype's plain
              decoding, and where a speculative text parts from plain decoding's, the
              target's top-two logit gap there (a forward over γ + 1 tokens rounds
              differently from one over a single token; in bfloat16 that flips near-ties).

On CPU float32 runs the streaming matmul and attention kernels (``specjax.kernels``),
bfloat16 XLA's dot and the reference attention (the kernels take float32 only), so
the speed columns compare two code paths as well as two dtypes.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

import jax
import jax.numpy as jnp

import specjax
from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.measure import load_average
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax import kv_cache as kvc
from specjax.model import compute_dtype, forward
from specjax.sampling import Greedy
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.calibration import loop_step_seconds

PROMPTS = flags.DEFINE_integer("prompts", 5, "held-out prompts (round-robin over categories)")
NEW = flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt")
GAMMAS = flags.DEFINE_list("gammas", ["2", "3"], "chain lengths of the speculative rows")
OUT = flags.DEFINE_string("out", "benchmarks/results/bf16.md", "markdown output")

CACHE = 512
GAP_BINS = (0.0, 0.1, 0.25, 0.5, 1.0, np.inf)


def teacher_forced_logits(target, tokens: list[int]) -> np.ndarray:
  """[L, V] float32 logits of ``tokens`` scored in one forward by ``target``'s dtype."""
  ids = jnp.asarray([tokens])
  n = ids.shape[1]
  out = forward(target.params, target.cfg, ids, jnp.arange(n)[None],
                kvc.init_cache(target.cfg, 1, n, compute_dtype(target.params)))
  return np.asarray(out.logits[0], np.float32)


def agreement(t32, t16, prompts: list[list[int]], new: int) -> tuple[list[str], list[str]]:
  """Markdown lines: the teacher-forced table by gap, and the free-running comparison."""
  gaps, diffs, agree, free = [], [], [], []
  for p in prompts:
    ref = specjax.generate(t32.params, t32.cfg, [p], new, Greedy(), cache_size=CACHE,
                           eos_ids=()).generated(0)
    l32 = teacher_forced_logits(t32, p + ref)[len(p) - 1:-1]
    l16 = teacher_forced_logits(t16, p + ref)[len(p) - 1:-1]
    top2 = np.sort(l32, axis=-1)[:, -2:]
    gaps.append(top2[:, 1] - top2[:, 0])
    diffs.append(np.abs(l16 - l32).max(axis=-1))
    agree.append(l16.argmax(-1) == l32.argmax(-1))
    out16 = specjax.generate(t16.params, t16.cfg, [p], new, Greedy(), cache_size=CACHE,
                             eos_ids=()).generated(0)
    differs = [i for i, (a, b) in enumerate(zip(ref, out16)) if a != b]
    free.append((differs[0], float(gaps[-1][differs[0]])) if differs else None)
  gaps, diffs, agree = map(np.concatenate, (gaps, diffs, agree))
  table = ["| float32 top-2 gap | positions | argmax agrees | max abs(Δ logit), median / max |",
           "|---|---|---|---|"]
  for lo, hi in zip(GAP_BINS[:-1], GAP_BINS[1:]):
    sel = (gaps >= lo) & (gaps < hi)
    if sel.any():
      table.append(f"| [{lo:g}, {hi:g}) | {sel.sum()} | {agree[sel].mean():.1%} | "
                   f"{np.median(diffs[sel]):.3f} / {diffs[sel].max():.3f} |")
  same = sum(f is None for f in free)
  lines = [f"Free-running greedy: bfloat16 reproduces float32's {new} tokens on {same} of "
           f"{len(free)} prompts."]
  for i, f in enumerate(free):
    if f is not None:
      lines.append(f"- prompt {i}: first difference at token {f[0]}, where float32's top-2 gap "
                   f"is {f[1]:.3f}")
  return table, lines


def first_difference(target, prompt: list[int], plain: list[int], spec: list[int]):
  """None when ``spec`` is ``plain``; else (index of the first difference, the target's
  top-two logit gap there, teacher-forced on the plain text)."""
  differs = [i for i, (a, b) in enumerate(zip(plain, spec)) if a != b]
  if not differs and len(plain) == len(spec):
    return None
  i = differs[0] if differs else min(len(plain), len(spec))
  top2 = np.sort(teacher_forced_logits(target, prompt + plain)[len(prompt) - 1 + i])[-2:]
  return i, float(top2[1] - top2[0])


def speed(target, draft, prompts: list[list[int]], new: int, gammas: list[int]):
  """(t₁ seconds, rows [(γ, tokens per call, step / t₁, decode-only speedup, per prompt
  None if the speculative text is the plain one, else (first difference, top-2 gap))])."""
  plain = lambda p: specjax.generate(target.params, target.cfg, [p], new, Greedy(),
                                     cache_size=CACHE, eos_ids=())
  plain(prompts[0])  # compile
  refs = [plain(p) for p in prompts]
  t1 = loop_step_seconds(refs)
  rows = []
  for g in gammas:
    dec = SpeculativeDecoder(target.cfg, draft.drafter, gamma=g, sampler=Greedy(), eos_ids=())
    dec.generate(target.params, draft.params, [prompts[0]], 4, cache_size=CACHE)  # compile
    outs = [dec.generate(target.params, draft.params, [p], new, cache_size=CACHE)
            for p in prompts]
    calls = sum(int(o.per_row["target_calls"][0]) for o in outs)
    tpc = sum(int(o.per_row["emitted"][0]) for o in outs) / calls
    step = loop_step_seconds(outs)
    rows.append((g, tpc, step / t1, tpc * t1 / step,
                 [first_difference(target, p, r.generated(0), o.generated(0))
                  for p, o, r in zip(prompts, outs, refs)]))
  return t1, rows


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  load_start = load_average()
  gammas = [int(g) for g in GAMMAS.value]
  t32, t16 = load_target("smollm2", "float32"), load_target("smollm2", "bfloat16")
  evals = default_prompts(PROMPTS.value)
  prompts = [t32.encode(p.text) for p in evals]
  new = NEW.value
  table, free = agreement(t32, t16, prompts, new)
  lines = ["# bfloat16 against float32 (SmolLM2-135M-Instruct target, batch 1)", "",
           f"{provenance()} ({jax.default_backend()}); {len(prompts)} "
           f"prompts ({', '.join(sorted({p.category for p in evals}))}), {new} new tokens.", "",
           "Command: `python -m benchmarks.bf16 " + " ".join(
               f"--{f.name}={','.join(f.value) if isinstance(f.value, list) else f.value}"
               for f in (PROMPTS, NEW, GAMMAS)) + "`", "",
           "## Agreement (teacher-forced on float32's greedy text)", "", *table, "", *free, "",
           "## Speed and speculative decoding (EAGLE drafter, each dtype against its own "
           "plain decoding)", "",
           "| dtype | t₁ (ms) | γ | tokens / call | step / t₁ | decode-only speedup | "
           "prompts whose text = plain greedy's |", "|---|---|---|---|---|---|---|"]
  for name, target in (("float32", t32), ("bfloat16", t16)):
    draft = load_draft("eagle", target, lambda: [])
    t1, rows = speed(target, draft, prompts, new, gammas)
    for g, tpc, cost, sp, diffs in rows:
      parted = [d for d in diffs if d is not None]
      same = f"{len(diffs) - len(parted)} of {len(diffs)}" + "".join(
          f"; parts at token {i} (top-2 gap {gap:.3f})" for i, gap in parted)
      lines.append(f"| {name} | {t1 * 1e3:.2f} | {g} | {tpc:.2f} | {cost:.2f} | **{sp:.2f}×** | "
                   f"{same} |")
  lines.insert(3, f"Load average at the start {load_start}, at the end {load_average()} (the "
               "speed columns are ratios within one dtype, each measured back to back).")
  write_markdown(OUT.value, lines + [""])


if __name__ == "__main__":
  app.run(main)
