"""How steady the calibration's chain rate α_c is when it counts βs instead of coin flips.

Usage:
  python -m benchmarks.alpha_evidence [--temperature 1] [--prompts 8] [--seeds 5]
      [--gamma 4] [--new_tokens 128] [--out benchmarks/results/alpha_evidence.md]

``calibration.measure_chain_alphas`` prices an adaptive policy's prior α_c (and each prompt's
ease) from a few training-side prompts, decoded alone with a chain of ``--gamma``. Under
``evidence="expected"`` a sampled chain's draft positions count their β = Σ min(p, q), each
weighted by its chance of being scored given the drafts (the default since 2026-12-07,
a8f8098); under ``"accepted"`` their accept/reject outcomes; the third row,
"scored βs", is what "expected" counted from d2cc146 until then: the βs of the positions
the flips scored. All three have the same expectation. For each seed one decode of the
prompts gives every count (``calibration.chain_alphas``: the decoding does not depend on the
evidence, only the counting does), and the table gives their mean and their spread over the
seeds (the standard deviation, and the largest minus the smallest), for the shipped EAGLE-3
drafter on the embedded target.
"""

from __future__ import annotations

import time

import numpy as np
from absl import app, flags

from benchmarks.common import provenance, write_markdown
from experiments.models import load_draft, load_target
from experiments.prompts import training_prompts
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import EVIDENCE
from specjax.speculative.calibration import (CHAIN_COUNTERS, chain_alphas, chain_decoder,
                                             decode_each)

TEMP = flags.DEFINE_float("temperature", 1.0, "sampling temperature (> 0: greedy βs are the "
                          "outcomes)")
PROMPTS = flags.DEFINE_integer("prompts", 8, "training-side calibration prompts")
SEEDS = flags.DEFINE_integer("seeds", 5, "seeds (each decodes every prompt once)")
GAMMA = flags.DEFINE_integer("gamma", 4, "the calibration chain's γ")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens per prompt")
OUT = flags.DEFINE_string("out", "benchmarks/results/alpha_evidence.md", "markdown output")
SCORED = "scored βs"  # Σβ over the positions the flips scored, over their number


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if not TEMP.value > 0:
    raise app.UsageError("--temperature must be > 0: at T = 0 a greedy β is its outcome")
  for name, flag in (("prompts", PROMPTS), ("seeds", SEEDS), ("gamma", GAMMA),
                     ("new_tokens", NEW)):
    if flag.value < 1:
      raise app.UsageError(f"--{name} must be >= 1")
  target = load_target("smollm2")
  draft = load_draft("eagle", target, lambda: [])
  template = SpeculativeDecoder(target.cfg, draft.drafter, sampler=make_sampler(TEMP.value),
                                eos_ids=())
  prompts = [target.encode(t) for t in training_prompts(PROMPTS.value)]
  start = time.perf_counter()
  chain = chain_decoder(template, GAMMA.value)
  counts_of = EVIDENCE + (SCORED,)
  alphas = {e: [] for e in counts_of}
  for seed in range(SEEDS.value):
    counts = decode_each(chain, target.params, draft.params, prompts, NEW.value, seed * 1000,
                         None, CHAIN_COUNTERS + ("beta_sum", "beta_count"))
    for e in EVIDENCE:
      alphas[e].append(chain_alphas(counts, e)[0])
    alphas[SCORED].append(float(counts["beta_sum"].sum() / counts["beta_count"].sum()))
    print(f"seed {seed}: " + ", ".join(f"{e} {alphas[e][-1]:.4f}" for e in counts_of)
          + f" ({time.perf_counter() - start:.0f} s)", flush=True)
  lines = ["# α_c counted by βs or by outcomes", "",
           f"Command: `python -m benchmarks.alpha_evidence --temperature {TEMP.value:g} "
           f"--prompts {PROMPTS.value} --seeds {SEEDS.value} --gamma {GAMMA.value} "
           f"--new_tokens {NEW.value}`  ",
           f"{provenance()}; {(time.perf_counter() - start) / 60:.1f} min.", "",
           f"SmolLM2 with the shipped EAGLE-3 drafter, T = {TEMP.value:g}, a chain of "
           f"γ = {GAMMA.value}, {PROMPTS.value} training-side prompts of {NEW.value} tokens "
           "each decoded alone once per seed, both counts read from the same decodes "
           "(`calibration.measure_chain_alphas`' decodes, `calibration.chain_alphas`).", "",
           "| evidence | α_c per seed | mean | std over seeds | max − min |",
           "|---|---|---|---|---|"]
  for e in counts_of:
    a = np.asarray(alphas[e])
    lines.append(f"| {e} | {', '.join(f'{x:.3f}' for x in a)} | {a.mean():.3f} | "
                 f"{a.std(ddof=1) if len(a) > 1 else 0.0:.4f} | {a.max() - a.min():.3f} |")
  write_markdown(OUT.value, lines + [""])


if __name__ == "__main__":
  app.run(main)
