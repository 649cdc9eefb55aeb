"""How far Medusa-2's typical acceptance (lossy) moves the output law, and what it buys.

Usage:
  python -m benchmarks.typical_acceptance [--draft=medusa] [--prompts=10] [--new_tokens=64]
      [--temperatures=0.7,1] [--out=benchmarks/results/typical_acceptance.md]

For every step of real decoding with typical acceptance, the law of the step's first
emitted token is known exactly given the context: the drafts are deterministic (Medusa's
heads), so when the deepest typically-acceptable path has depth >= 1 the first token is
its depth-1 node x (a point mass), otherwise a draw from p with every token below τ
removed. Its total-variation distance from the target's own next-token law p is therefore

  TV = 1 − p(x)            (a draft was accepted),
  TV = Σ_{p(y) < τ} p(y)   (none was: the truncated mass).

The table reports its mean over every step of every prompt: a lower bound on the TV of
each step's whole emitted block (a marginal's TV never exceeds the joint's), and 0 for
the lossless rule by construction. Tokens per target call of both rules are measured on
the same prompts and tree (the drafter's own), so the speed bought is beside the law lost.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.typical_acceptance import TypicalAcceptance

DRAFT = flags.DEFINE_string("draft", "medusa", "a drafter with its own static tree "
                            "(experiments.models.load_draft spec)")
PROMPTS = flags.DEFINE_integer("prompts", 10, "held-out prompts (round-robin over categories)")
NEW = flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt")
TEMPS = flags.DEFINE_list("temperatures", ["0.7", "1"], "temperatures (> 0)")
OUT = flags.DEFINE_string("out", "benchmarks/results/typical_acceptance.md", "markdown output")


def first_token_tv(p0: np.ndarray, num_accepted: np.ndarray, first: np.ndarray,
                   tau0: np.ndarray) -> np.ndarray:
  """[B] TV between each step's first-emitted-token law and p0 [B, V] (module docstring):
  1 − p0[first] where a draft was accepted, else the mass of p0 below tau0.

  Example: p0 = (0.5, 0.3, 0.2), τ = 0.25: an accepted draft 1 gives 0.7; none gives 0.2.
  """
  accepted = 1.0 - np.take_along_axis(p0, first[:, None], axis=1)[:, 0]
  truncated = np.sum(np.where(p0 < tau0[:, None], p0, 0.0), axis=1)
  return np.where(num_accepted >= 1, accepted, truncated)


@functools.lru_cache(maxsize=8)
def _steps(dec: SpeculativeDecoder):
  """``dec``'s step phases, jitted once per decoder (not once per prompt)."""
  return jax.jit(dec.propose), jax.jit(dec.verify), jax.jit(dec.accept), jax.jit(dec.finish)


def measure(dec: SpeculativeDecoder, target, draft, prompt, seed: int) -> tuple[list, int, int]:
  """(per-step TVs, tokens, target calls) of one prompt decoded by ``dec``, step by step.
  ``finish`` draws the acceptance again with the same key, so it commits exactly the
  outcome whose TV was recorded."""
  propose, verify, accept, finish = _steps(dec)
  rule = dec.verification
  state, _ = dec.prepare(target.params, draft.params, [prompt], NEW.value, seed=seed)
  start = int(state.seq_lens[0])
  tvs, calls = [], 0
  while not bool(jnp.all(state.done)):
    rng, k_draft, k_accept = jax.random.split(state.rng, 3)
    proposal, draft_state = propose(draft.params, state, k_draft)
    scores = verify(target.params, state, proposal)
    if isinstance(rule, TypicalAcceptance):
      acc = accept(k_accept, proposal, scores)
      p0 = np.asarray(scores.p[:, 0], np.float64)
      node = np.maximum(np.asarray(acc.path[:, 1]) - 1, 0)
      first = np.asarray(proposal.tokens)[np.arange(len(node)), node]
      tvs += first_token_tv(p0, np.asarray(acc.num_accepted), first,
                            np.asarray(rule.tau(scores.p[:, 0]))).tolist()
    state = finish(state, proposal, scores, k_accept, draft_state, rng)
    calls += 1
  return tvs, int(state.seq_lens[0]) - start, calls


def main(argv):
  del argv
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  begin = time.perf_counter()
  target = load_target("smollm2")
  draft = load_draft(DRAFT.value, target, lambda: [])
  tree = draft.drafter.default_tree()
  if tree is None:
    raise ValueError(f"--draft={DRAFT.value} brings no tree of its own")
  prompts = [target.encode(p.text) for p in default_prompts(PROMPTS.value)]
  lines = ["# Typical acceptance (Medusa-2, lossy) against the lossless rule", "",
           f"{provenance()}; draft `{draft.name}` ({draft.note}); its own tree of "
           f"{tree.num_nodes} nodes, depth {tree.max_depth}; {len(prompts)} held-out prompts, "
           f"{NEW.value} new tokens each, batch 1; typical acceptance with FasterDecoding's "
           f"defaults (ε = {TypicalAcceptance().threshold}, δ = {TypicalAcceptance().alpha}).",
           "", "Command: `python -m benchmarks.typical_acceptance --draft=" + DRAFT.value
           + f" --prompts={PROMPTS.value} --new_tokens={NEW.value} --temperatures="
           + ",".join(TEMPS.value) + "`", "",
           "TV: mean over steps of the total-variation distance between the law of the step's "
           "first emitted token and the target's (exact per step; see the module docstring). "
           "It is 0 for the lossless rule by construction.", "",
           "| T | rule | tokens / call | mean first-token TV | steps with TV > 0.5 | steps |",
           "|---|---|---|---|---|---|"]
  for temp in [float(t) for t in TEMPS.value]:
    if temp <= 0:
      raise ValueError("typical acceptance is for sampling: give temperatures > 0")
    for name, verification in (("lossless (recursive rejection)", "tokenwise"),
                               ("typical (lossy)", TypicalAcceptance())):
      dec = SpeculativeDecoder(target.cfg, draft.drafter, tree=tree,
                               sampler=make_sampler(temp), eos_ids=(),
                               verification=verification)
      tvs, tokens, calls = [], 0, 0
      for i, p in enumerate(prompts):
        t, n, c = measure(dec, target, draft, p, seed=i)
        tvs, tokens, calls = tvs + t, tokens + n, calls + c
      tv = f"{np.mean(tvs):.3f}" if tvs else "0 (exact)"
      big = f"{np.mean(np.asarray(tvs) > 0.5):.0%}" if tvs else "–"
      lines.append(f"| {temp:g} | {name} | {tokens / calls:.2f} | {tv} | {big} | {calls} |")
      print(lines[-1], f"({time.perf_counter() - begin:.0f} s)", flush=True)
  lines += ["", f"Total benchmark time {time.perf_counter() - begin:.0f} s."]
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
