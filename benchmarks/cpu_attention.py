"""The CPU attention kernel against the jnp reference, per layer and end to end.

Usage:
  python -m benchmarks.cpu_attention [--prompts 3] [--new_tokens 32] [--rounds 3]
      [--out benchmarks/results/cpu_attention.md]

Part 1: one layer's attention (SmolLM2 shapes: 3 kv heads, 3 query heads each,
head dim 64, float32) through ``specjax.attention`` with impl "cpu" and
"reference", for decode, verify, tree, batched-generation and prefill-sized
blocks; medians of interleaved rounds of 20-call medians.

Part 2, in the same process: decoding on the embedded SmolLM2-135M target
with the attention "auto" picks on CPU (the kernel) and with the reference
(the kernel switched off, compilation caches cleared). For each: a plain decode
step t₁ at batch 1 and 4 (prefill excluded), speculative steps (the shipped
EAGLE drafter, T = 0) and their decode-only speedup = tokens per call × t₁ /
step, and batched generation throughput (64 rows, the corpus path). The two
attentions are timed in alternating rounds; every speculative output is
checked against plain greedy decoding with the same attention.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

import specjax
from benchmarks.common import median_time, provenance, write_markdown
from experiments.machine import probe_output_dir
from specjax import attention
from specjax.kernels import cpu_attention as ca
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder

PROMPTS = flags.DEFINE_integer("prompts", 3, "held-out prompts for part 2")
NEW = flags.DEFINE_integer("new_tokens", 32, "tokens generated per prompt in part 2")
ROUNDS = flags.DEFINE_integer("rounds", 3, "alternating rounds of the two attentions")
OUT = flags.DEFINE_string("out", "benchmarks/results/cpu_attention.md", "markdown output")

K, G, H = 3, 3, 64
# (label, B, cache slots S, committed length L, new tokens T)
LAYER_SHAPES = [("decode", 1, 512, 200, 1), ("verify γ=1", 1, 512, 200, 2),
                ("verify γ=4", 1, 512, 200, 5), ("tree N=8", 1, 512, 200, 9),
                ("tree N=16", 1, 512, 200, 17), ("decode, batch 4", 4, 320, 100, 1),
                ("verify γ=3, batch 4", 4, 320, 100, 4),
                ("generation, batch 64", 64, 256, 150, 1),
                ("generation, batch 256", 256, 320, 200, 1),
                ("prefill 32", 1, 512, 0, 32), ("prefill 64", 1, 512, 0, 64),
                ("prefill 256", 1, 512, 0, 256), ("prefill 512", 1, 512, 0, 512),
                ("prefill 160, batch 16", 16, 256, 0, 160)]
CACHE = 512


def _layer_table(rounds: int) -> list[str]:
  rng = np.random.default_rng(0)
  lines = ["## One layer", "",
           "| block | B | S | L | T | reference (ms) | kernel (ms) | kernel speedup |",
           "|---|---|---|---|---|---|---|---|"]
  for label, b, s, length, t in LAYER_SHAPES:
    q = jnp.asarray(rng.normal(size=(b, t, K * G, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, K, s, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, K, s, H)), jnp.float32)
    lengths = jnp.full((b,), length, jnp.int32)
    mask = jnp.tril(jnp.ones((t, t), bool))
    fns = {impl: jax.jit(lambda q, k, v, impl=impl: attention.attention(
        q, k, v, lengths, mask, impl=impl)) for impl in ("reference", "cpu")}
    outs = {impl: f(q, k, v) for impl, f in fns.items()}
    np.testing.assert_allclose(np.asarray(outs["cpu"]), np.asarray(outs["reference"]),
                               atol=1e-5, rtol=1e-4)
    times = {impl: [] for impl in fns}
    for _ in range(rounds):
      for impl, f in fns.items():
        times[impl].append(median_time(lambda f=f: f(q, k, v).block_until_ready(), 20))
    ref, ker = (float(np.median(times[i])) * 1e3 for i in ("reference", "cpu"))
    lines.append(f"| {label} | {b} | {s} | {length} | {t} | {ref:.3f} | {ker:.3f} | "
                 f"**{ref / ker:.2f}×** |")
    print(lines[-1], flush=True)
  return lines + [""]


def _timed(fn):
  t = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - t


class _Decoding:
  """Part 2's measurements for one attention, accumulated over rounds."""

  def __init__(self, target, draft, prompts, gen_ids, methods, new):
    self.target, self.draft, self.prompts, self.new = target, draft, prompts, new
    self.gen_ids, self.methods = gen_ids, methods
    self.t1 = {1: [], 4: []}
    self.steps = {name: [] for name, _ in methods}
    self.calls = {name: [0, 0] for name, _ in methods}
    self.gen = []
    self.equal = True
    # One decoder per method for the whole run: a new instance would compile again.
    self.decoders = {name: SpeculativeDecoder(target.cfg, draft.drafter, tree=tree,
                                              sampler=make_sampler(0.0), eos_ids=())
                     for name, tree in methods}

  def _plain(self, prompts, n):
    return specjax.generate(self.target.params, self.target.cfg, prompts, n, make_sampler(0.0),
                            seed=0, cache_size=CACHE, eos_ids=())

  def round(self, prompts=None):
    """Times every measurement once over ``prompts`` (default: all) and records it; with
    ``prompts`` given (a warm-up after compilation caches were cleared) nothing is recorded."""
    from specjax.distill import teacher
    from specjax.sampling import Greedy
    from specjax.speculative.calibration import loop_step_seconds
    record = prompts is None
    prompts = self.prompts if record else prompts
    keep = lambda xs, x: xs.append(x) if record else None
    refs = {}
    for b in (1, 4):
      for batch in ([[p] for p in prompts] if b == 1 else [(prompts * 4)[:4]]):
        full = self._plain(batch, self.new)
        keep(self.t1[b], loop_step_seconds([full]))
        if b == 1:
          refs[tuple(batch[0])] = full.generated(0)
    for name, dec in self.decoders.items():
      for i, p in enumerate(prompts):
        out = dec.generate(self.target.params, self.draft.params, [p], self.new, seed=i,
                           cache_size=CACHE)
        keep(self.steps[name], loop_step_seconds([out]))
        if record:
          self.calls[name][0] += int(out.per_row["emitted"][0])
          self.calls[name][1] += int(out.per_row["target_calls"][0])
        self.equal &= out.generated(0) == refs[tuple(p)]
    recs, dt = _timed(lambda: teacher.generate_with_topk(
        self.target.params, self.target.cfg, self.gen_ids, self.new, Greedy(),
        k=1, seed=0, cache_size=256))
    keep(self.gen, sum(len(x["response"]) for x in recs) / dt)


def _decoding_table(rounds: int) -> list[str]:
  from experiments.models import load_draft, load_target
  from experiments.prompts import default_prompts
  from specjax.distill import data
  from specjax.loaders import load_model_tokenizer
  from specjax.speculative.tree import DynamicTree, TreeTopology

  target = load_target("smollm2")
  draft = load_draft("eagle", target, lambda: [])
  prompts = [target.encode(p.text) for p in default_prompts(PROMPTS.value)]
  texts = data.interleave_categories(data.build_prompts(0, extended=True))
  gen_ids, _ = data.prompt_batches(data.chat_encoder(load_model_tokenizer()), texts, 64, 160)[0]
  methods = [("chain γ=1", TreeTopology.chain(1)), ("chain γ=2", TreeTopology.chain(2)),
             ("dynamic k=3 D=3 N=4", DynamicTree(top_k=3, depth=3, num_nodes=4)),
             ("dynamic k=4 D=4 N=8", DynamicTree(top_k=4, depth=4, num_nodes=8))]
  runs = {impl: _Decoding(target, draft, prompts, gen_ids, methods, NEW.value)
          for impl in ("reference", "cpu")}
  real_available = ca.available

  def use(impl):
    ca.available = real_available if impl == "cpu" else (lambda: False)
    jax.clear_caches()  # "auto" is resolved at trace time

  for r in range(rounds):
    for impl, run in runs.items():
      use(impl)
      run.round(prompts[:1])  # compiles again after the caches were cleared; untimed
      run.round()
      print(f"round {r + 1}: {impl} done", flush=True)
  ca.available = real_available

  lines = ["## Decoding on SmolLM2-135M-Instruct", "",
           f"Draft `{draft.name}`; {len(prompts)} held-out prompts, {NEW.value} new tokens, "
           "T = 0, cache 512 slots (generation: 64 prompts of the extended set, cache 256); "
           f"{rounds} alternating rounds, medians over prompts × rounds. Decode-only speedup "
           "= tokens per call × t₁ / step, with t₁ and the step measured with the same "
           "attention.", "",
           "| | reference attention | kernel | kernel speedup |", "|---|---|---|---|"]
  med = lambda xs: float(np.median(xs))
  for b in (1, 4):
    ref, ker = (med(runs[i].t1[b]) * 1e3 for i in ("reference", "cpu"))
    lines.append(f"| plain decode step t₁, batch {b} (ms) | {ref:.1f} | {ker:.1f} | "
                 f"{ref / ker:.2f}× |")
  for name, _ in methods:
    cells = []
    for impl in ("reference", "cpu"):
      run = runs[impl]
      tpc = run.calls[name][0] / run.calls[name][1]
      step = med(run.steps[name])
      cells.append((step, tpc * med(run.t1[1]) / step, tpc))
    lines.append(f"| {name}: step (ms) / decode-only speedup / tokens per call | "
                 f"{cells[0][0] * 1e3:.1f} / **{cells[0][1]:.2f}×** / {cells[0][2]:.2f} | "
                 f"{cells[1][0] * 1e3:.1f} / **{cells[1][1]:.2f}×** / {cells[1][2]:.2f} | "
                 f"{cells[0][0] / cells[1][0]:.2f}× |")
  ref, ker = (med(runs[i].gen) for i in ("reference", "cpu"))
  lines.append(f"| generation, batch 64, greedy (target tokens/s) | {ref:.0f} | {ker:.0f} | "
               f"{ker / ref:.2f}× |")
  lines += ["", "Every speculative output equals plain greedy decoding with the same attention: "
            + ("**yes**" if all(r.equal for r in runs.values()) else "**NO**"), ""]
  return lines


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  if not ca.available():
    raise SystemExit(f"the CPU attention kernel is not available: {ca.unavailable_reason()}")
  lines = ["# CPU attention kernel vs the jnp reference", "",
           f"Command: `python -m benchmarks.cpu_attention --prompts={PROMPTS.value} "
           f"--new_tokens={NEW.value} --rounds={ROUNDS.value}`  ", f"{provenance()}.", ""]
  lines += _layer_table(ROUNDS.value)
  lines += _decoding_table(ROUNDS.value)
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
