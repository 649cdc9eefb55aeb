"""Per-step overhead of the speculative loop beyond its forward passes (SmolLM2-135M target).

Usage:
  python -m benchmarks.spec_overhead [--gamma 4] [--out benchmarks/results/spec_overhead.md]

For each draft (the target itself, and a random tiny model), measures in one run:
  step      = (fused ``run`` time) / steps, the prefill excluded;
  forwards  = one draft forward over 2 tokens + (γ − 1) over 1 token + one
              target forward over γ + 1 tokens, each timed alone;
  overhead  = step − forwards (sampling, acceptance, commit, rollback, loop);
  other     = the non-forward phase timed directly by the profiled Python-loop twin;
and reports overhead relative to one target decode step (forward over 1 token).
"""

from __future__ import annotations

import time

import jax
from absl import app, flags

from benchmarks.common import forward_time, provenance, write_markdown
from specjax.drafters import ModelDrafter
from specjax.loaders import chat_prompt, load_model, load_model_tokenizer
from specjax.speculative import SpeculativeDecoder
from specjax.testing import tiny_model

GAMMA = flags.DEFINE_integer("gamma", 4, "draft length")
NEW = flags.DEFINE_integer("new_tokens", 96, "tokens per run")
OUT = flags.DEFINE_string("out", "benchmarks/results/spec_overhead.md", "markdown output")


def fused_step_time(dec, params, dparams, prompt, new):
  state, _ = dec.prepare(params, dparams, [prompt], new, cache_size=256)
  jax.block_until_ready(dec.run(params, dparams, state))  # compile
  times, steps = [], 0
  for _ in range(3):
    state, _ = dec.prepare(params, dparams, [prompt], new, cache_size=256)
    jax.block_until_ready(state)
    t = time.perf_counter()
    out = jax.block_until_ready(dec.run(params, dparams, state))
    times.append(time.perf_counter() - t)
    steps = int(out.steps)
  return min(times) / steps, steps


def main(_):
  cfg, params = load_model()
  tok = load_model_tokenizer()
  prompt = chat_prompt(tok, "Write a short story about a robot learning to paint.")
  g = GAMMA.value
  t1 = forward_time(cfg, params, 1)
  verify = forward_time(cfg, params, g + 1)
  drafts = {"target as draft": (cfg, params),
            "random tiny draft (1 layer, d=64)": tiny_model(vocab_size=cfg.vocab_size, dim=64,
                                                            num_layers=1, num_heads=2,
                                                            num_kv_heads=1, ffn_dim=128)}
  rows = []
  for name, (dcfg, dparams) in drafts.items():
    drafter = ModelDrafter(dcfg)
    dec = SpeculativeDecoder(cfg, drafter, gamma=g, eos_ids=())
    dp = drafter.make_params(dparams)
    step, steps = fused_step_time(dec, params, dp, prompt, NEW.value)
    draft = forward_time(dcfg, dparams, 2) + (g - 1) * forward_time(dcfg, dparams, 1)
    overhead = step - draft - verify
    dec.generate(params, dp, [prompt], 16, cache_size=256, profile=True)  # compile the phases
    prof = dec.generate(params, dp, [prompt], NEW.value, cache_size=256, profile=True)
    other = prof.timing["other"] / prof.steps
    rows.append(f"| {name} | {steps} | {step * 1e3:.1f} | {draft * 1e3:.1f} | "
                f"{verify * 1e3:.1f} | {overhead * 1e3:.1f} ({overhead / t1 * 100:.1f}%) | "
                f"{other * 1e3:.2f} ({other / t1 * 100:.1f}%) |")
  write_markdown(OUT.value, [
      "# Speculative-step overhead beyond the forward passes (SmolLM2-135M target, greedy)",
      "",
      f"Command: `python -m benchmarks.spec_overhead --gamma {g} --new_tokens {NEW.value}` "
      f"({provenance()}).",
      "",
      f"One target decode step (forward over 1 token): {t1 * 1e3:.1f} ms. "
      "Goal: overhead <= 10% of it.",
      "",
      "Two measures of the overhead: *step − forwards* (fused step time minus the forwards "
      "timed alone; negative means the fused loop is cheaper than separately dispatched "
      "forwards, i.e. no measurable overhead), and *other phase*: the acceptance, commit, "
      "rollback and counters jitted on their own and timed per step by the profiled "
      "Python-loop twin (`generate(profile=True)`), dispatch included. Percentages are of "
      "one target decode step.",
      "",
      "| draft | steps | step ms | draft forwards ms | verify forward ms | step − forwards ms | "
      "other phase ms |",
      "|---|---|---|---|---|---|---|",
      *rows,
  ])


if __name__ == "__main__":
  app.run(main)
