"""Cost of the sampled acceptance rules with a reduced-vocabulary q: over the vocabulary
(q lifted to V) against ``SubsetProbs`` (q kept on the draft's K ids).

Usage:
  python -m benchmarks.acceptance_width [--vocab 49152] [--subset 8192] [--rows 1,8,32]
      [--out benchmarks/results/acceptance_width.md]

An EAGLE-3 drafter of the embedded target draws from 8,192 of its 49,152 ids. Its q
used to be lifted to the vocabulary, so every pass of the acceptance rules (β, the
residual max(p − q, 0) and its mass, recursive rejection's running residual) read
[B, N, V] arrays in which only K columns can be non-zero. With ``SubsetProbs`` they
read K columns, and only the final draw reads a [B, V] row. Each timed function
computes what a step computes at T = 1 (the target's warped p over [B, N + 1, V] and
the draft's q over [B, N, K], from random logits), then the rule: the chain of
γ = 3 token-wise and block-wise, and a 3-node tree (two children of the root, one
grandchild) drawn without replacement. Medians of interleaved jitted calls. The "lifted"
column is today's rules on a dense q (the code before ``SubsetProbs`` also lifted q inside
the drafter, a scatter of about 0.03 ms at B = 1 not timed here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import command_line, interleaved_times, provenance, write_markdown
from experiments.machine import probe_output_dir
from specjax.sampling import Sampling, SubsetProbs, lift_probs
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import TreeTopology
from specjax.speculative.tree_acceptance import accept_tree

VOCAB = flags.DEFINE_integer("vocab", 49152, "target vocabulary V (SmolLM2: 49152)")
SUBSET = flags.DEFINE_integer("subset", 8192, "draft vocabulary K (the EAGLE-3 drafter: 8192)")
ROWS = flags.DEFINE_list("rows", ["1", "8", "32"], "batch sizes B")
REPEATS = flags.DEFINE_integer("repeats", 60, "timed rounds per B")
OUT = flags.DEFINE_string("out", "benchmarks/results/acceptance_width.md", "markdown output")

RULES = {  # name: (topology, block verification)
    "chain γ = 3, token-wise": (TreeTopology.chain(3), False),
    "chain γ = 3, block": (TreeTopology.chain(3), True),
    "tree of 3 nodes, without replacement": (TreeTopology((-1, -1, 0)), False),
}


def step_fn(topology: TreeTopology, block: bool, ids: jax.Array, v: int, lifted: bool):
  """jit: (key, draft logits [B, N, K], target logits [B, N + 1, V], tokens) -> acceptance."""
  sampler = Sampling(1.0)
  draw = "sampled" if topology.is_chain else "without_replacement"

  @jax.jit
  def run(key, draft_logits, target_logits, tokens):
    q, p = sampler.probs(draft_logits), sampler.probs(target_logits)
    q = lift_probs(q, ids, v) if lifted else SubsetProbs(q, ids, v)
    return accept_tree(key, Proposal(tokens=tokens, q=q, draw=draw), p, topology, block=block)

  return run


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  v, k = VOCAB.value, SUBSET.value
  if not 0 < k <= v:
    raise ValueError(f"--subset must be in [1, --vocab = {v}], got {k}")
  rows = [int(r) for r in ROWS.value]
  if min(rows) < 1:
    raise ValueError(f"--rows must be positive, got {ROWS.value}")
  ids = jnp.asarray(np.sort(np.random.default_rng(0).choice(v, k, replace=False)), jnp.int32)
  lines = ["# Sampled acceptance with a reduced-vocabulary q: over the vocabulary or as "
           "`SubsetProbs`", "",
           f"{provenance()}; V = {v}, K = {k}; median ms per call (p and q warped from logits, "
           f"then the rule) of {REPEATS.value} interleaved rounds.", "",
           f"Command: `{command_line('acceptance_width', [VOCAB, SUBSET, ROWS, REPEATS])}`", "",
           "| B | rule | q lifted to V | `SubsetProbs` | saved | ratio |",
           "|---|---|---|---|---|---|"]
  for b in rows:
    for name, (topology, block) in RULES.items():
      n = topology.num_nodes
      draft_logits = 3 * jax.random.normal(jax.random.PRNGKey(b), (b, n, k))
      target_logits = 3 * jax.random.normal(jax.random.PRNGKey(b + 1), (b, n + 1, v))
      tokens = ids[jnp.argmax(draft_logits, axis=-1)].astype(jnp.int32)
      args = (jax.random.PRNGKey(2), draft_logits, target_logits, tokens)
      fns = {lifted: step_fn(topology, block, ids, v, lifted) for lifted in (True, False)}
      times = interleaved_times(
          {lifted: (lambda f=f: jax.block_until_ready(f(*args))) for lifted, f in fns.items()},
          REPEATS.value)
      old, new = (1e3 * float(np.median(times[lifted])) for lifted in (True, False))
      lines.append(f"| {b} | {name} | {old:.3f} | {new:.3f} | {old - new:.3f} | "
                   f"{old / new:.2f}x |")
      write_markdown(OUT.value, lines + [""], quiet=True)
  write_markdown(OUT.value, lines + [""])


if __name__ == "__main__":
  app.run(main)
