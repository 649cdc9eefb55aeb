"""Block verification against token-wise verification: tokens per target call on SmolLM2.

Usage:
  python -m benchmarks.block_verification [--prompts 10] [--new_tokens 128]
      [--gammas 2,3,4,5,6,7,8] [--temperatures 0.5,1] [--draft eagle]
      [--out benchmarks/results/block_verification.md]

For each temperature and γ, both rules decode the same held-out prompts (one batch,
every row to exactly ``new_tokens`` tokens, no EOS stop), and the table gives:

  realised   emitted tokens / target calls of each rule's own run;
  paired     on every block the *block* run verified, the expected tokens of one step
             under each rule for that very block (``block_verification.expected_tokens``),
             averaged over the blocks: the same drafts and target scores, without the
             acceptance draws' noise. This is the comparison Sun et al.'s Theorem 2
             speaks of (block ≥ token-wise in expectation, for any draft).

Nothing here is timed: the rules cost the same target forward, and the extra work of the
block rule is O(γ V) arithmetic per step. The draft is the experiments' default (the
shipped EAGLE-3 drafter, which samples its chain with a real q).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import (held_out_setup, paired_step_sums, provenance,
                               realised_tokens_per_call, write_markdown)
from experiments.machine import probe_output_dir
from specjax.sampling import dense_probs, make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.block_verification import expected_tokens

PROMPTS = flags.DEFINE_integer("prompts", 10, "held-out prompts (round-robin over categories)")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens generated per prompt")
GAMMAS = flags.DEFINE_list("gammas", [str(g) for g in range(2, 9)], "draft lengths")
TEMPS = flags.DEFINE_list("temperatures", ["0.5", "1"], "temperatures (> 0)")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
SEED = flags.DEFINE_integer("seed", 0, "PRNG seed")
OUT = flags.DEFINE_string("out", "benchmarks/results/block_verification.md", "markdown output")


def paired_run(dec, target, draft, prompts, new, seed) -> tuple[float, float, float]:
  """(realised tokens per call, paired token-wise, paired block) of a block-rule run."""

  @jax.jit
  def expect(proposal, scores, done, _):
    tw, blk = expected_tokens(proposal.tokens, dense_probs(proposal.q), scores.p)
    live = (~done).astype(jnp.float32)
    return jnp.stack([jnp.sum(tw * live), jnp.sum(blk * live), jnp.sum(live)])

  realised, sums = paired_step_sums(dec, target, draft, prompts, new, seed, expect, 3)
  return realised, sums[0] / sums[2], sums[1] / sums[2]


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  gammas = [int(g) for g in GAMMAS.value]
  temps = [float(t) for t in TEMPS.value]
  if not gammas or min(gammas) < 1 or not temps or min(temps) <= 0 or NEW.value < 1:
    raise ValueError("--gammas must be >= 1, --temperatures > 0 and --new_tokens >= 1")
  target, draft, evals, prompts = held_out_setup(DRAFT.value, PROMPTS.value)
  start = time.perf_counter()
  rows = []
  for t in temps:
    sampler = make_sampler(t)
    for g in gammas:
      decs = {rule: SpeculativeDecoder(target.cfg, draft.drafter, gamma=g, sampler=sampler,
                                       eos_ids=(), verification=rule)
              for rule in ("tokenwise", "block")}
      tw_real = realised_tokens_per_call(decs["tokenwise"], target, draft, prompts, NEW.value,
                                         SEED.value)
      blk_real, tw_pair, blk_pair = paired_run(decs["block"], target, draft, prompts, NEW.value,
                                               SEED.value)
      rows.append((t, g, tw_real, blk_real, tw_pair, blk_pair))
      print(f"T={t:g} γ={g}: realised {tw_real:.3f} -> {blk_real:.3f}; paired "
            f"{tw_pair:.3f} -> {blk_pair:.3f} ({time.perf_counter() - start:.0f} s)", flush=True)

  lines = ["# Block verification vs token-wise verification: tokens per target call", "",
           f"{provenance()}; draft `{draft.name}` ({draft.note}); {len(prompts)} prompts "
           f"({', '.join(sorted({p.category for p in evals}))}), batch {len(prompts)}, "
           f"{NEW.value} new tokens per prompt, no EOS stop, seed {SEED.value}; "
           f"{time.perf_counter() - start:.0f} s.", "",
           "| T | γ | token-wise (realised) | block (realised) | token-wise (paired) | "
           "block (paired) | block / token-wise (paired) |",
           "|---|---|---|---|---|---|---|"]
  for t, g, twr, bkr, twp, bkp in rows:
    lines.append(f"| {t:g} | {g} | {twr:.3f} | {bkr:.3f} | {twp:.3f} | {bkp:.3f} | "
                 f"{bkp / twp:.3f} |")
  gain = [r[5] / r[4] for r in rows]
  lines += ["", f"Paired gain of block over token-wise: mean {np.mean(gain):.3f}×, "
                f"min {np.min(gain):.3f}×, max {np.max(gain):.3f}× over {len(rows)} settings.",
            "", "*Realised*: each rule's own run (its acceptance draws add noise of a few "
            "percent). *Paired*: the expected tokens per step of both rules on every block the "
            "block run verified (`specjax.speculative.block_verification.expected_tokens`)."]
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
