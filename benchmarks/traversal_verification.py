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

Nothing here is timed: both rules read the same target forward.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import (held_out_setup, provenance, realised_tokens_per_call,
                               write_markdown)
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
  propose, verify, finish = jax.jit(dec.propose), jax.jit(dec.verify), jax.jit(dec.finish)
  state, prompt_lens = dec.prepare(target.params, draft.params, prompts, new, seed=seed)
  topology = dec.tree  # a static topology, or a dynamic tree's N and depth

  @jax.jit
  def expect(proposal, scores, done, key):
    trav = expected_tokens(proposal, scores.p, topology)
    n = jax.vmap(lambda k: accept_tree(k, proposal, scores.p, topology).num_accepted)(
        jax.random.split(key, draws)).astype(jnp.float32)  # [draws, B]
    live = (~done).astype(jnp.float32)
    rr = jnp.mean(n, axis=0) + 1.0
    return (jnp.sum(rr * live), jnp.sum(jnp.var(n, axis=0) / draws * live),
            jnp.sum(trav * live), jnp.sum(live))

  sums = np.zeros(4)
  key = jax.random.PRNGKey(seed + 1)
  while not bool(jnp.all(state.done)):
    rng, k_draft, k_accept = jax.random.split(state.rng, 3)
    key, k_coins = jax.random.split(key)
    proposal, draft_state = propose(draft.params, state, k_draft)
    scores = verify(target.params, state, proposal)
    sums += np.asarray(expect(proposal, scores, state.done, k_coins))
    state = finish(state, proposal, scores, k_accept, draft_state, rng)
  c = jax.device_get(state.counters)
  assert np.all(np.asarray(state.seq_lens) - np.asarray(prompt_lens) == new)
  realised = float(np.sum(c.emitted) / np.sum(c.target_calls))
  return realised, sums[0] / sums[3], float(np.sqrt(sums[1])) / sums[3], sums[2] / sums[3]


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
      rows.append((t, spec, rr_real, tv_real, rr_pair, rr_err, tv_pair))
      print(f"T={t:g} {spec}: realised {rr_real:.3f} -> {tv_real:.3f}; paired "
            f"{rr_pair:.3f} ± {rr_err:.3f} -> {tv_pair:.3f} ({time.perf_counter() - start:.0f} s)",
            flush=True)

  lines = ["# Traversal verification vs recursive rejection on trees: tokens per target call",
           "", f"{provenance()}; draft `{draft.name}` ({draft.note}); {len(prompts)} prompts "
           f"({', '.join(sorted({p.category for p in evals}))}), batch {len(prompts)}, "
           f"{NEW.value} new tokens per prompt, no EOS stop, seed {SEED.value}, "
           f"{DRAWS.value} acceptance draws per tree for recursive rejection's paired mean; "
           f"{time.perf_counter() - start:.0f} s.", "",
           "| T | tree | recursive rejection (realised) | traversal (realised) | "
           "recursive rejection (paired) | traversal (paired) | traversal / recursive "
           "(paired) |", "|---|---|---|---|---|---|---|"]
  for t, spec, rrr, tvr, rrp, rre, tvp in rows:
    lines.append(f"| {t:g} | {spec} | {rrr:.3f} | {tvr:.3f} | {rrp:.3f} ± {rre:.3f} | "
                 f"{tvp:.3f} | {tvp / rrp:.3f} |")
  lines += ["", "Trees: `sampled:w1:w2:…` sampled dynamic trees (w nodes per depth, children "
            "drawn without replacement, verified with the real q); `k:D:N` EAGLE-2 trees "
            "(top-k children: point masses). *Realised*: each rule's own run (its acceptance "
            "draws add noise of a few percent). *Paired*: the expected tokens per step of both "
            "rules on every tree the traversal run verified (traversal exactly, "
            "`specjax.speculative.traversal_verification.expected_tokens`; recursive rejection "
            "by its acceptance draws, ± one standard error)."]
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
