"""What a new process pays before decoding: the tokenizer and the first compile, cold and cached.

Usage:
  python -m benchmarks.cold_start [--pairs 2] [--out benchmarks/results/cold_start.md]

Each trial is a fresh Python process with its own ``$SPECJAX_CACHE`` (the float32 weights
and the CPU kernels linked in from the real cache, so only the two caches measured here
start empty). It times ``load_model_tokenizer()`` (built from the GGUF, or read from the
tokenizer cache) and two calls of the embedded target's speculative decoding with the
EAGLE-3 drafter (γ = 2, greedy, 4 prompts × 8 tokens) under ``specjax.compile_cache``:
the first call compiles (or reads the programs from disk), the second only runs, so
their difference is the compile. A pair is a cold trial, then a warm one on the same
cache directory; outputs of the two must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir

PAIRS = flags.DEFINE_integer("pairs", 2, "cold/warm trial pairs")
OUT = flags.DEFINE_string("out", "benchmarks/results/cold_start.md", "markdown output")

_TRIAL = r"""
import json, time, hashlib
t0 = time.perf_counter()
from specjax import compile_cache
compile_cache.enable()
from specjax.loaders import load_model_tokenizer
start = time.perf_counter()
tok = load_model_tokenizer()
tokenizer_s = time.perf_counter() - start
import numpy as np
from experiments.models import load_draft, load_target
from specjax.sampling import Greedy
from specjax.speculative import SpeculativeDecoder
target = load_target("smollm2")
draft = load_draft("eagle", target, ngram_corpus=lambda: [])
dec = SpeculativeDecoder(target.cfg, draft.drafter, gamma=2, sampler=Greedy(), eos_ids=())
prompts = [target.encode(q) for q in ("Give me three tips about gardening.",
           "Write a Python function that reverses a list.", "What is 17 times 23?",
           "Summarise the plot of Hamlet in two sentences.")]
calls = []
for _ in range(2):
  start = time.perf_counter()
  out = dec.generate(target.params, draft.params, prompts, 8, cache_size=256)
  calls.append(time.perf_counter() - start)
print(json.dumps(dict(tokenizer=tokenizer_s, first=calls[0], second=calls[1],
                      total=time.perf_counter() - t0,
                      tokens=hashlib.md5(np.asarray(out.tokens).tobytes()).hexdigest())))
"""


def _cache_with_weights(tmp: str) -> str:
  """A cache directory holding links to the real cache's weights and kernels only."""
  from specjax.loaders.embedded import cache_dir
  real = cache_dir()
  for name in os.listdir(real):
    if not (name.startswith("tokenizer-") or name == "xla"):
      os.symlink(os.path.join(real, name), os.path.join(tmp, name))
  return tmp


def _trial(cache: str) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(SPECJAX_CACHE=cache, PYTHONPATH=os.getcwd(), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _TRIAL], env=env, capture_output=True,
                        text=True, check=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(_):
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  from specjax.loaders import load_model  # builds the float32 weights cache if missing
  load_model()
  rows = []
  for pair in range(PAIRS.value):
    with tempfile.TemporaryDirectory() as tmp:
      cache = _cache_with_weights(tmp)
      cold, warm = _trial(cache), _trial(cache)
    if cold["tokens"] != warm["tokens"]:
      raise SystemExit(f"pair {pair}: outputs differ between the cold and the warm trial")
    rows += [(pair, "cold", cold), (pair, "warm", warm)]
  lines = ["# Cold start: tokenizer and first compile, without and with the caches", "",
           f"Command: `python -m benchmarks.cold_start --pairs {PAIRS.value}`  ",
           provenance() + ".", "",
           "Seconds in a fresh process. first call = compile (or read from the compilation "
           "cache) + run; second call = run; compile = first − second. Warm trials read the "
           "tokenizer and the programs their cold twin wrote; outputs are equal in every pair.",
           "", "| pair | caches | tokenizer | first call | second call | compile | process |",
           "|---|---|---|---|---|---|---|"]
  for pair, kind, r in rows:
    lines.append(f"| {pair} | {kind} | {r['tokenizer']:.2f} | {r['first']:.2f} | "
                 f"{r['second']:.2f} | {r['first'] - r['second']:.2f} | {r['total']:.1f} |")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
