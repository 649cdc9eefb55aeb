"""The streaming kernel's prefetch modes on whole forwards, fast and slow memory spells apart.

Usage:
  python -m benchmarks.prefetch_modes [--tokens 1,2,4,8] [--arms measured,l2,m1_off,off]
      [--seconds 120] [--out benchmarks/results/prefetch_modes.md]

``kernel_ab`` times kernel sources on the matmul chain alone; this times warm SmolLM2
forwards over T new tokens (batch 1, 200 cached) with the policy ``load_model`` measured
here against the same packed weights under an edited policy (static metadata only: the same
panels, the same bits), interleaved round by round, each round's forwards split into the
host's spells by the round's total time (``common.split_spells``). Arms:

- ``measured``: the policy as measured (the baseline);
- ``l2``: every non-temporal prefetch hinted into L2 instead (mode 2 -> 1);
- ``m1_off``: no prefetch at one row (plain decoding's step), the rest as measured;
- ``off``: no prefetch at any row count.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from absl import app, flags

from benchmarks.common import (command_line, forward_fn, int_list, interleaved_times,
                               provenance, split_spells, write_markdown)
from experiments.machine import probe_output_dir
from experiments.models import load_target
from specjax.kernels.packed import PackedWeight

EDITS = {  # arm -> (grid, prefetch modes) -> the edited modes
    "measured": lambda grid, p: p,
    "l2": lambda grid, p: tuple(1 if m == 2 else m for m in p),
    "m1_off": lambda grid, p: tuple(0 if g == 1 else m for g, m in zip(grid, p)),
    "off": lambda grid, p: (),
}
TOKENS = flags.DEFINE_list("tokens", ["1", "2", "4", "8"], "new tokens per forward (T)")
ARMS = flags.DEFINE_list("arms", list(EDITS), f"policies to time, the first the baseline "
                         f"(of {', '.join(EDITS)})")
SECONDS = flags.DEFINE_float("seconds", 120.0, "how long to run rounds", lower_bound=1.0)
OUT = flags.DEFINE_string("out", "benchmarks/results/prefetch_modes.md", "markdown output")


def with_prefetch(params, edit):
  """``params`` with every packed weight's policy's prefetch modes edited by ``edit``."""

  def one(w):
    if not isinstance(w, PackedWeight) or not w.policy.prefetch:
      return w
    policy = dataclasses.replace(w.policy, prefetch=edit(w.policy.grid, w.policy.prefetch))
    return dataclasses.replace(w, policy=policy)

  return jax.tree_util.tree_map(one, params, is_leaf=lambda x: isinstance(x, PackedWeight))


def main(_):
  tokens = int_list(TOKENS)
  unknown = [a for a in ARMS.value if a not in EDITS]
  if unknown or not ARMS.value:
    raise SystemExit(f"--arms: unknown {', '.join(unknown) or '(none given)'}; choose from "
                     f"{', '.join(EDITS)}")
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target("smollm2")
  arms = {a: with_prefetch(target.params, EDITS[a]) for a in ARMS.value}
  fns = {(a, t): forward_fn(target.cfg, p, t) for a, p in arms.items() for t in tokens}
  runs = interleaved_times(fns, 0, seconds=SECONDS.value)
  fast, threshold = split_spells(np.sum(list(runs.values()), axis=0))
  base = ARMS.value[0]
  layer = target.params["layers"][0]["wqkv"]
  policy = layer.policy.describe() if isinstance(layer, PackedWeight) else "XLA's dot"
  lines = ["# The streaming kernel's prefetch modes on whole forwards (SmolLM2-135M, batch 1)",
           "", f"{provenance()}; layers' measured policy: {policy}; {len(fast)} rounds in "
           f"{SECONDS.value:g} s, each a warm forward per arm and T; a round is in the fast "
           f"spell when it took under {threshold * 1e3:.0f} ms in all. Cells: median ms "
           f"(median per-round ratio to `{base}`).", "",
           "Command: `" + command_line("prefetch_modes", (TOKENS, ARMS, SECONDS)) + "`"]
  for name, sel in (("Fast spell", fast), ("Slow spell", ~fast)):
    lines += ["", f"## {name} ({int(sel.sum())} rounds)", ""]
    if not sel.any():
      lines.append("No rounds.")
      continue
    lines += ["| T | " + " | ".join(ARMS.value) + " |", "|---" * (len(ARMS.value) + 1) + "|"]
    for t in tokens:
      ref = np.asarray(runs[base, t])[sel]
      cells = []
      for a in ARMS.value:
        x = np.asarray(runs[a, t])[sel]
        cells.append(f"{np.median(x) * 1e3:.2f}" + ("" if a == base
                                                    else f" ({np.median(x / ref):.3f})"))
      lines.append(f"| {t} | " + " | ".join(cells) + " |")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
