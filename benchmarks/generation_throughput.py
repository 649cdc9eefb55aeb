"""Batched generation throughput of the self-distillation corpus path on this machine.

Usage:
  python -m benchmarks.generation_throughput [--batch_sizes 32,128,256] [--max_new_tokens 64]
      [--out benchmarks/results/generation_throughput.md]

Times ``specjax.distill.teacher.generate_with_topk`` (what ``experiments.train_draft
--stage=data`` runs: jit-compiled, batched, one cache size) on chat-formatted prompts of
the extended prompt set, greedy and T = 1, after one warm-up call with the same shapes.
Throughput = target tokens generated (rows stop at EOS or the budget) / wall time; the
loop runs until every row of the batch is done, so early-stopping rows still cost steps.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
from absl import app, flags

from benchmarks.common import provenance, write_markdown

BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["32", "128", "256"], "rows per generation call")
MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "response budget per row")
TOPK = flags.DEFINE_integer("topk", 1, "target top-k recorded per position (1: id-only corpus)")
REPEATS = flags.DEFINE_integer("repeats", 2, "timed calls per setting (all are reported)")
OUT = flags.DEFINE_string("out", "benchmarks/results/generation_throughput.md", "markdown output")


def main(argv):
  del argv
  from specjax.distill import data, teacher
  from specjax.loaders import load_model, load_model_tokenizer
  from specjax.sampling import Greedy, Sampling

  cfg, params = load_model()
  tok = load_model_tokenizer()
  prompts = data.interleave_categories(data.build_prompts(0, extended=True))
  max_prompt = 160
  cache_size = -(-(max_prompt + MAX_NEW.value) // 64) * 64
  rows = []
  for b in map(int, BATCH_SIZES.value):
    ids, _ = data.prompt_batches(data.chat_encoder(tok), prompts, b, max_prompt)[0]
    for name, sampler in (("greedy", Greedy()), ("T=1", Sampling(1.0))):
      run = lambda seed: teacher.generate_with_topk(params, cfg, ids, MAX_NEW.value, sampler,
                                                    k=TOPK.value, seed=seed,
                                                    cache_size=cache_size)
      run(0)  # compile
      rates = []
      for r in range(REPEATS.value):
        t = time.perf_counter()
        recs = run(1 + r)
        dt = time.perf_counter() - t
        rates.append(sum(len(x["response"]) for x in recs) / dt)
      rows.append((b, name, rates))
      print(b, name, [f"{x:.0f}" for x in rates], flush=True)
  lines = ["# Batched generation throughput (self-distillation corpus path)", "",
           f"Command: `python -m benchmarks.generation_throughput --batch_sizes "
           f"{','.join(BATCH_SIZES.value)} --max_new_tokens {MAX_NEW.value} --topk {TOPK.value}`  ",
           f"{provenance()}; SmolLM2-135M-Instruct (f32), cache {cache_size} slots, prompts of "
           f"the extended set (≤ {max_prompt} tokens, one length-sorted batch), EOS stops rows.",
           "", "| batch | sampler | target tokens/s (each timed call) | best |", "|---|---|---|---|"]
  for b, name, rates in rows:
    lines.append(f"| {b} | {name} | {', '.join(f'{x:.0f}' for x in rates)} | {max(rates):.0f} |")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
