"""Does an XLA flag shorten compiling without changing a bit of what decoding computes?

Usage:
  python -m benchmarks.xla_flags [--flag_sets ';--xla_cpu_use_fusion_emitters=false;...']
      [--out benchmarks/results/xla_flags.md]

Most of the test suite's time, and a cold default run's first minutes, is XLA:CPU compiling
(docs/testing.md). A flag that compiles faster is only worth having if every program still
computes the same bits, since the tests pin what users run. Each flag set (one
``XLA_FLAGS`` value; the empty one is the reference) runs the same workload in a fresh
process:

* **tiny loops**: speculative decoding on the tiny random target (chains γ = 2, 3 and a
  5-node tree, greedy and sampled with top-p; EAGLE, adapter-exit and Medusa drafts sampled
  at T = 0.8), 4 prompts × 24 tokens: the kind of program the tests compile by the hundred;
* **teacher loops**: the distillation teacher's decode loop with its top-k log-probabilities
  on three tiny targets (float32 and bfloat16, greedy and T = 1) and on SmolLM2 (2 prompts ×
  24 tokens, greedy and T = 1);
* **SmolLM2 generate**: the first and a warm ``specjax.generate`` of 64 tokens (their
  difference is that program's compile).

It reports XLA's backend compile seconds of each part (``jax.monitoring``'s compile-duration
events) and, against the reference, how many output arrays (tokens, top-k ids and
log-probabilities) differ and by how much. Seconds are one process each on a possibly noisy
machine: compare within one report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from absl import app, flags

from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir

DEFAULT_SETS = ("", "--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=1",
                "--xla_backend_optimization_level=0")
FLAG_SETS = flags.DEFINE_string(
    "flag_sets", ";".join(DEFAULT_SETS),
    "';'-separated XLA_FLAGS values, each a set of --xla_... flags; the first is the "
    "reference the others are compared with (the default's first is empty: no flags)")
OUT = flags.DEFINE_string("out", "benchmarks/results/xla_flags.md", "markdown output")
CHILD = flags.DEFINE_string("child", "", "internal: run the workload and write its arrays "
                            "and timings to this .npz path")

PARTS = ("tiny loops", "teacher loops", "SmolLM2 generate")


def parse_flag_sets(value: str) -> list[str]:
  """The flag sets, stripped; every flag of a set must be an ``--xla_...`` flag, and no set
  may repeat (SystemExit naming the bad one, before any process starts)."""
  sets = [s.strip() for s in value.split(";")]
  if len(sets) < 2:
    raise SystemExit("--flag_sets needs a reference and at least one set to compare, "
                     f"separated by ';', got {value!r}")
  for s in sets:
    bad = [f for f in s.split() if not f.startswith("--xla_")]
    if bad:
      raise SystemExit(f"--flag_sets: {bad[0]!r} is not an --xla_... flag (in {s!r})")
  if len(set(sets)) < len(sets):
    raise SystemExit(f"--flag_sets repeats a set: {sets}")
  return sets


def compare(reference: dict, other: dict) -> dict:
  """How ``other``'s arrays differ from ``reference``'s (same keys): the number that are not
  bit for bit equal, and the largest absolute difference among float arrays (-inf, the
  teacher's padding, compared as equal where both have it)."""
  if sorted(reference) != sorted(other):
    raise ValueError(f"the workloads wrote different arrays: {sorted(set(reference) ^ set(other))}")
  differ, max_diff = 0, 0.0
  for key, a in reference.items():
    b = other[key]
    if a.shape != b.shape or not np.array_equal(a, b):
      differ += 1
      if a.shape == b.shape and np.issubdtype(a.dtype, np.floating):
        both = np.isneginf(a) & np.isneginf(b)
        max_diff = max(max_diff, float(np.max(np.where(both, 0.0, np.abs(
            a.astype(np.float64) - b.astype(np.float64))))))
  return dict(arrays=len(reference), differ=differ, max_diff=max_diff)


def _workload(path: str) -> None:
  """The child: runs the three parts, writes their arrays and compile seconds to ``path``."""
  import time

  import jax
  import jax.numpy as jnp
  from jax import monitoring

  import specjax
  from specjax.distill import teacher
  from specjax.drafters import ModelDrafter
  from specjax.model import cast_params
  from specjax.sampling import Greedy, Sampling
  from specjax.speculative import SpeculativeDecoder
  from specjax.speculative.tree import TreeTopology
  from specjax.testing import make_drafter, tiny_model

  compiles = []  # seconds of each backend compile, in order

  def listen(event, secs, **_):
    if event.endswith("backend_compile_duration"):
      compiles.append(secs)

  monitoring.register_event_duration_secs_listener(listen)
  arrays, seconds = {}, {}

  def part(name, fn):
    before = len(compiles)
    fn()
    seconds[name] = sum(compiles[before:])

  prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11, 12, 13], [3]]

  def tiny_loops():
    cfg, params = tiny_model(seed=0)
    dcfg, dparams = tiny_model(seed=1, num_layers=1)
    settings = [(2, None), (3, None), (None, TreeTopology((-1, -1, 0, 0, 1)))]
    for gamma, tree in settings:
      for s, sampler in enumerate((Greedy(), Sampling(temperature=1.0, top_p=0.9))):
        dec = SpeculativeDecoder(cfg, ModelDrafter(dcfg), gamma=gamma, tree=tree,
                                 sampler=sampler)
        out = dec.generate(params, dec.drafter.make_params(dparams), prompts, 24, seed=1)
        arrays[f"tiny_{gamma}_{tree is not None}_{s}"] = np.asarray(out.tokens)
    for kind in ("eagle", "adapter_exit", "medusa"):
      drafter, dp = make_drafter(kind, cfg, params, [[1, 2, 3, 4] * 4])
      dec = SpeculativeDecoder(cfg, drafter, gamma=3, sampler=Sampling(temperature=0.8))
      arrays[f"tiny_{kind}"] = np.asarray(dec.generate(params, dp, prompts, 24, seed=2).tokens)

  def teacher_loops():
    models = [(f"tiny{seed}", *tiny_model(seed=seed, **kw)) for seed, kw in
              ((0, {}), (1, dict(num_layers=1)), (5, dict(vocab_size=64, num_layers=3)))]
    cfg, params = specjax.load_model()
    runs = [(name, c, p, dt) for name, c, p in models for dt in ("f32", "bf16")]
    runs.append(("smollm2", cfg, params, "f32"))
    for name, c, p, dt in runs:
      p = p if dt == "f32" else cast_params(p, jnp.bfloat16)
      ids = (prompts if name != "smollm2" else
             [[1, 504, 3300, 28, 253, 1345, 30, 9, 77, 1200], [5, 6, 7]])
      for s, sampler in enumerate((Greedy(), Sampling(1.0))):
        for i, r in enumerate(teacher.generate_with_topk(p, c, ids, 24, sampler, k=4, seed=s,
                                                         eos_ids=())):
          arrays[f"{name}_{dt}_{s}_{i}_ids"] = r["topk_ids"]
          arrays[f"{name}_{dt}_{s}_{i}_logp"] = r["topk_logp"]

  calls = []

  def smollm2_generate():
    cfg, params = specjax.load_model()
    for _ in range(2):
      start = time.perf_counter()
      out = specjax.generate(params, cfg, [[1, 504, 3300, 28, 253, 1345, 30]], 64, Greedy(),
                             eos_ids=())
      jax.block_until_ready(out.tokens)
      calls.append(time.perf_counter() - start)
    arrays["smollm2_generate"] = np.asarray(out.tokens)

  for name, fn in zip(PARTS, (tiny_loops, teacher_loops, smollm2_generate)):
    part(name, fn)
  np.savez(path, **arrays, __meta__=np.asarray(json.dumps(dict(
      compile=seconds, first_call=calls[0], warm_call=calls[1]))))


def _run(flag_set: str, path: str) -> tuple[dict, dict]:
  env = dict(os.environ, XLA_FLAGS=flag_set, JAX_PLATFORMS="cpu")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every process compiles everything
  proc = subprocess.run([sys.executable, "-m", "benchmarks.xla_flags", f"--child={path}"],
                        env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    raise SystemExit(f"XLA_FLAGS={flag_set!r}: the workload failed:\n{proc.stderr[-3000:]}")
  with np.load(path) as z:
    arrays = {k: z[k] for k in z.files if k != "__meta__"}
    meta = json.loads(str(z["__meta__"]))
  return arrays, meta


def main(_):
  if CHILD.value:
    _workload(CHILD.value)
    return
  sets = parse_flag_sets(FLAG_SETS.value)
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  from specjax.loaders import load_model  # builds the float32 weights cache if missing
  load_model()
  lines = ["# XLA flags: compile time and bit equality", "",
           f"Command: `{' '.join(['python -m benchmarks.xla_flags', *sys.argv[1:]])}`  ",
           provenance() + ".", "",
           "XLA's backend compile seconds of each part of one workload (benchmarks/xla_flags.py"
           "'s docstring), one fresh process per flag set; SmolLM2's first `generate` call "
           "(compile + run) beside a warm one. Arrays: the workload's outputs (tokens, top-k "
           "ids and log-probabilities) that differ from the reference's (the first set), bit "
           "for bit, and the largest difference among float ones.", "",
           "| XLA_FLAGS | " + " | ".join(f"{p} compile (s)" for p in PARTS)
           + " | SmolLM2 first / warm call (s) | arrays differing | max abs diff |",
           "|---" * (len(PARTS) + 4) + "|"]
  with tempfile.TemporaryDirectory() as tmp:
    reference = None
    for i, flag_set in enumerate(sets):
      print(f"[{i + 1}/{len(sets)}] XLA_FLAGS={flag_set!r}", file=sys.stderr, flush=True)
      arrays, meta = _run(flag_set, os.path.join(tmp, f"{i}.npz"))
      if reference is None:
        reference = arrays
        diff_cells = ["reference", "–"]
      else:
        d = compare(reference, arrays)
        diff_cells = [f"{d['differ']} of {d['arrays']}",
                      f"{d['max_diff']:.2g}" if d["differ"] else "0"]
      lines.append(f"| `{flag_set or '(none)'}` | "
                   + " | ".join(f"{meta['compile'][p]:.1f}" for p in PARTS)
                   + f" | {meta['first_call']:.2f} / {meta['warm_call']:.2f} | "
                   + " | ".join(diff_cells) + " |")
      write_markdown(OUT.value, lines, quiet=True)
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
