"""Traversal verification against recursive rejection on token trees: tokens per target call.

Usage:
  python -m benchmarks.traversal_verification [--prompts 10] [--new_tokens 128]
      [--trees sampled:2:1,sampled:2:2:1,sampled:4:4:4,4:4:4] [--temperatures 0.5,1]
      [--draft eagle] [--out benchmarks/results/traversal_verification.md]

Trees are ``experiments.config.sweep_tree`` entries: sampled dynamic trees
("sampled:w1:w2:...", children drawn without replacement, verified with the real q) and
EAGLE-2 trees ("top_k:depth:nodes", top-k children, point masses). For each temperature
and tree, both rules decode the same held-out prompts (one batch, every row to exactly
``new_tokens`` tokens, no EOS stop), and the table gives:

  realised   emitted tokens / target calls of each rule's own run;
  paired     on every tree the traversal run verified, the expected tokens of one step
             under each rule for that very tree: traversal verification's exactly
             (``traversal_verification.expected_tokens``), recursive rejection's as the
             mean over ``--coin_draws`` independent acceptance draws. The same drafts and
             target scores, so the two differ by the rule alone (and recursive rejection's
             estimate by its sampling error, stated).

Both rules read the same target forward; only the acceptance itself is timed (batch 1,
the first step of the first prompt, median of 40 interleaved calls), so its extra cost can
be set against its extra tokens.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import (held_out_setup, interleaved_times, paired_step_sums,
                               provenance, realised_tokens_per_call, write_markdown)
from experiments.config import sweep_tree
from experiments.machine import probe_output_dir
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.traversal_verification import expected_tokens
from specjax.speculative.tree_acceptance import accept_tree

PROMPTS = flags.DEFINE_integer("prompts", 10, "held-out prompts (round-robin over categories)")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens generated per prompt")
TREES = flags.DEFINE_list("trees", ["sampled:2:1", "sampled:2:2:1", "sampled:4:4:4", "4:4:4"],
                          "trees (experiments.config.sweep_tree entries, without @T)")
TEMPS = flags.DEFINE_list("temperatures", ["0.5", "1"], "temperatures (> 0)")
DRAWS = flags.DEFINE_integer("coin_draws", 256, "acceptance draws per tree for recursive "
                             "rejection's paired mean")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
SEED = flags.DEFINE_integer("seed", 0, "PRNG seed")
OUT = flags.DEFINE_string("out", "benchmarks/results/traversal_verification.md",
                          "markdown output")


def paired_run(dec, target, draft, prompts, new, seed, draws):
  """(realised tokens per call, paired recursive rejection, its standard error, paired
  traversal) of a traversal-verification run."""
  topology = dec.tree  # a static topology, or a dynamic tree's N and depth

  @jax.jit
  def expect(proposal, scores, done, key):
    trav = expected_tokens(proposal, scores.p, topology)
    n = jax.vmap(lambda k: accept_tree(k, proposal, scores.p, topology).num_accepted)(
        jax.random.split(key, draws)).astype(jnp.float32)  # [draws, B]
    live = (~done).astype(jnp.float32)
    rr = jnp.mean(n, axis=0) + 1.0
    return jnp.stack([jnp.sum(rr * live), jnp.sum(jnp.var(n, axis=0) / draws * live),
                      jnp.sum(trav * live), jnp.sum(live)])

  realised, sums = paired_step_sums(dec, target, draft, prompts, new, seed, expect, 4)
  return realised, sums[0] / sums[3], float(np.sqrt(sums[1])) / sums[3], sums[2] / sums[3]


def acceptance_ms(decs, target, draft, prompt, seed, repeats=40) -> dict[str, float]:
  """{rule: median milliseconds of one jitted acceptance (``SpeculativeDecoder.accept``)}
  on the first step's real tree and target scores for one prompt (batch 1), the rules
  called in turn each round."""
  dec = decs["block"]
  state, _ = dec.prepare(target.params, draft.params, [prompt], 8, seed=seed)
  proposal, _ = jax.jit(dec.propose)(draft.params, state, jax.random.PRNGKey(seed))
  scores = jax.jit(dec.verify)(target.params, state, proposal)
  key = jax.random.PRNGKey(seed + 2)
  fns = {rule: (lambda f=jax.jit(d.accept): jax.block_until_ready(f(key, proposal, scores)))
         for rule, d in decs.items()}
  return {rule: 1e3 * float(np.median(t)) for rule, t in interleaved_times(fns, repeats).items()}


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  temps = [float(t) for t in TEMPS.value]
  trees = [(spec, sweep_tree(spec)[0]) for spec in TREES.value]
  if not trees or not temps or min(temps) <= 0 or NEW.value < 1 or DRAWS.value < 2:
    raise ValueError("--trees must be non-empty, --temperatures > 0, --new_tokens >= 1 and "
                     "--coin_draws >= 2")
  target, draft, evals, prompts = held_out_setup(DRAFT.value, PROMPTS.value)
  start = time.perf_counter()
  rows = []
  for t in temps:
    sampler = make_sampler(t)
    for spec, tree in trees:
      decs = {rule: SpeculativeDecoder(target.cfg, draft.drafter, tree=tree, sampler=sampler,
                                       eos_ids=(), verification=rule)
              for rule in ("tokenwise", "block")}
      rr_real = realised_tokens_per_call(decs["tokenwise"], target, draft, prompts, NEW.value,
                                         SEED.value)
      tv_real, rr_pair, rr_err, tv_pair = paired_run(decs["block"], target, draft, prompts,
                                                     NEW.value, SEED.value, DRAWS.value)
      ms = acceptance_ms(decs, target, draft, prompts[0], SEED.value)
      rows.append((t, spec, rr_real, tv_real, rr_pair, rr_err, tv_pair, ms))
      print(f"T={t:g} {spec}: realised {rr_real:.3f} -> {tv_real:.3f}; paired "
            f"{rr_pair:.3f} ± {rr_err:.3f} -> {tv_pair:.3f}; acceptance {ms['tokenwise']:.2f} "
            f"-> {ms['block']:.2f} ms ({time.perf_counter() - start:.0f} s)", flush=True)

  lines = ["# Traversal verification vs recursive rejection on trees: tokens per target call",
           "", f"{provenance()}; draft `{draft.name}` ({draft.note}); {len(prompts)} prompts "
           f"({', '.join(sorted({p.category for p in evals}))}), batch {len(prompts)}, "
           f"{NEW.value} new tokens per prompt, no EOS stop, seed {SEED.value}, "
           f"{DRAWS.value} acceptance draws per tree for recursive rejection's paired mean; "
           f"{time.perf_counter() - start:.0f} s.", "",
           "| T | tree | recursive rejection (realised) | traversal (realised) | "
           "recursive rejection (paired) | traversal (paired) | traversal / recursive "
           "(paired) | acceptance ms: recursive, traversal |", "|---|---|---|---|---|---|---|---|"]
  for t, spec, rrr, tvr, rrp, rre, tvp, ms in rows:
    lines.append(f"| {t:g} | {spec} | {rrr:.3f} | {tvr:.3f} | {rrp:.3f} ± {rre:.3f} | "
                 f"{tvp:.3f} | {tvp / rrp:.3f} | {ms['tokenwise']:.2f}, {ms['block']:.2f} |")
  lines += ["", "Trees: `sampled:w1:w2:…` sampled dynamic trees (w nodes per depth, children "
            "drawn without replacement, verified with the real q); `k:D:N` EAGLE-2 trees "
            "(top-k children: point masses). *Realised*: each rule's own run (its acceptance "
            "draws add noise of a few percent). *Paired*: the expected tokens per step of both "
            "rules on every tree the traversal run verified (traversal exactly, "
            "`specjax.speculative.traversal_verification.expected_tokens`; recursive rejection "
            "by its acceptance draws, ± one standard error). *Acceptance ms*: the median time "
            "of one jitted acceptance under each rule at batch 1, on the first step's real "
            "tree and target scores of the first prompt, the rules called in turn 40 times "
            "(the target forward it follows is not included)."]
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
