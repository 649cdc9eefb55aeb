"""Batch-1 greedy decode speed of SmolLM2-135M (f32): specjax vs HF transformers, plus the floor.

Usage:
  python -m benchmarks.decode_speed [--new_tokens 128] [--out benchmarks/results/decode_speed.md]

Prints and writes (markdown):
  * ms/token of specjax.generate and of HF ``generate`` (torch CPU) on the same
    prompts in the same run, and their ratio;
  * the bandwidth floor: f32 weight bytes / memory bandwidth measured here by
    a jitted reduction over a 512 MB array;
  * the verify-cost curve: one forward over T = 1, 2, 4, 8, 16 new tokens on
    a warm cache, relative to T = 1 (what speculative verification costs).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from benchmarks.common import forward_time, provenance, write_markdown
from specjax.loaders import chat_prompt, load_model, load_model_tokenizer, smollm2_gguf_path

FLAGS = flags.DEFINE_integer("new_tokens", 128, "tokens generated per prompt")
OUT = flags.DEFINE_string("out", "benchmarks/results/decode_speed.md", "markdown output")
REPEATS = flags.DEFINE_integer("repeats", 2, "timed repetitions per prompt (best is kept)")

PROMPTS = ["Explain what a hash table is.", "Write a haiku about the sea.",
           "List three uses of Python decorators.", "What causes the seasons on Earth?",
           "Describe how to make a cup of tea."]


def _best(fn, repeats):
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return min(times)


def measure_bandwidth_gbps() -> float:
  """Read bandwidth of a jitted f32 reduction over 512 MB (best of 10)."""
  x = jnp.ones((128 * 1024 * 1024,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(x).block_until_ready()
  best = _best(lambda: f(x).block_until_ready(), 10)
  return x.nbytes / best / 1e9


def verify_cost_curve(cfg, params, ts=(1, 2, 4, 8, 16)):
  """Median seconds of one forward over T new tokens after 200 cached tokens."""
  return {t: forward_time(cfg, params, t, repeats=20) for t in ts}


def specjax_ms_per_token(cfg, params, prompts, new_tokens, repeats):
  per = []
  for p in prompts:
    specjax.generate(params, cfg, [p], new_tokens, eos_ids=(), cache_size=256)  # compile/warm
    best = _best(lambda: specjax.generate(params, cfg, [p], new_tokens, eos_ids=(),
                                          cache_size=256), repeats)
    per.append(best / new_tokens * 1e3)
  return per


def hf_ms_per_token(prompts, new_tokens, repeats):
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(os.cpu_count() or 1)
  path = smollm2_gguf_path()
  model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                               gguf_file=os.path.basename(path),
                                               dtype=torch.float32).eval()
  per = []
  with torch.inference_mode():
    for p in prompts:
      ids = torch.tensor([p])
      run = lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)
      run()
      per.append(_best(run, repeats) / new_tokens * 1e3)
  return per


def main(_):
  cfg, params = load_model()
  tok = load_model_tokenizer()
  prompts = [chat_prompt(tok, t) for t in PROMPTS]
  n = FLAGS.value
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  bw = measure_bandwidth_gbps()
  floor_ms = weight_bytes / (bw * 1e9) * 1e3
  ours = specjax_ms_per_token(cfg, params, prompts, n, REPEATS.value)
  curve = verify_cost_curve(cfg, params)
  theirs = hf_ms_per_token(prompts, n, REPEATS.value)
  s_ms, h_ms = float(np.mean(ours)), float(np.mean(theirs))
  write_markdown(OUT.value, [
      "# Decode speed: SmolLM2-135M-Instruct, f32, batch 1, greedy",
      "",
      f"Command: `python -m benchmarks.decode_speed --new_tokens {n}` ({provenance()}).",
      "",
      f"{len(prompts)} chat prompts, {n} new tokens each (EOS ignored), best of "
      f"{REPEATS.value} warm runs; ms/token includes the prefill.",
      "",
      "| | ms/token | vs HF |",
      "|---|---|---|",
      f"| specjax `generate` | {s_ms:.1f} | {s_ms / h_ms:.2f}x |",
      f"| HF transformers `generate` (torch CPU) | {h_ms:.1f} | 1.00x |",
      f"| floor: {weight_bytes / 1e6:.0f} MB weights / {bw:.1f} GB/s measured | {floor_ms:.1f} | |",
      "",
      f"specjax is {s_ms / floor_ms:.2f}x the bandwidth floor.",
      "",
      "## Verify-cost curve (one forward over T new tokens, 200 cached, median of 20)",
      "",
      "| T | ms | relative to T=1 |",
      "|---|---|---|",
  ] + [f"| {t} | {v * 1e3:.1f} | {v / curve[1]:.2f} |" for t, v in curve.items()])


if __name__ == "__main__":
  app.run(main)
