"""The verify cost in a host's fast and slow spells (SmolLM2-135M forwards, batch 1).

Usage:
  python -m benchmarks.bandwidth_spells [--tokens 1,2,4,8] [--seconds 100]
      [--out benchmarks/results/bandwidth_spells.md]

Some hosts (the Zen 5 EPYCs of these sessions) switch for seconds to minutes between two
speeds of reading memory: a plain decoding step of ~9.5 ms and one of ~13-14 ms. A ratio of
two timings taken in different spells is wrong, and even within one spell the verify cost
T(t)/T(1) differs if the forwards over several tokens gain less from the fast spell than
the one-token step does. This benchmark runs warm forwards over each of ``--tokens`` new
tokens in turn (one round: every T once, ~50 ms) for ``--seconds``, splits the rounds by
their T = 1 time into the fast and the slow spell (below / above the midpoint of its 10th
and 90th percentiles), and reports each spell's median times and median per-round costs.
"""

from __future__ import annotations

import os
import numpy as np
from absl import app, flags

from benchmarks.common import (command_line, forward_fn, int_list, interleaved_times,
                               provenance, split_spells, write_markdown)
from experiments.machine import probe_output_dir
from experiments.models import load_target

TOKENS = flags.DEFINE_list("tokens", ["1", "2", "4", "8"], "new tokens per forward (T)")
SECONDS = flags.DEFINE_float("seconds", 100.0, "how long to run rounds", lower_bound=1.0)
OUT = flags.DEFINE_string("out", "benchmarks/results/bandwidth_spells.md", "markdown output")


def main(_):
  tokens = sorted(set(int_list(TOKENS)) | {1})
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target("smollm2")
  fns = {t: forward_fn(target.cfg, target.params, t) for t in tokens}
  times = interleaved_times(fns, 0, seconds=SECONDS.value)
  rounds = [{t: times[t][i] for t in tokens} for i in range(len(times[1]))]
  t1 = np.array([r[1] for r in rounds])
  fast, threshold = split_spells(t1)
  lines = ["# The verify cost in a host's fast and slow spells (SmolLM2-135M, batch 1)", "",
           f"{provenance()}; {len(rounds)} rounds in {SECONDS.value:g} s, each a warm forward "
           f"over T = {', '.join(map(str, tokens))} new tokens in turn (200 cached); a round is "
           f"in the fast spell when its T = 1 forward took under {threshold * 1e3:.2f} ms (the "
           "midpoint of the 10th and 90th percentiles).", "",
           "Command: `" + command_line("bandwidth_spells", (TOKENS, SECONDS)) + "`", "",
           "| spell | rounds | " + " | ".join(f"T = {t} (ms)" for t in tokens) + " | " +
           " | ".join(f"cost T({t})/T(1)" for t in tokens if t > 1) + " |",
           "|---|---|" + "---|" * (2 * len(tokens) - 1)]
  for name, sel in (("fast", fast), ("slow", ~fast)):
    sub = [r for r, s in zip(rounds, sel) if s]
    if not sub:
      lines.append(f"| {name} | 0 |" + " – |" * (2 * len(tokens) - 1))
      continue
    medians = " | ".join(f"{np.median([r[t] for r in sub]) * 1e3:.2f}" for t in tokens)
    costs = " | ".join(f"{np.median([r[t] / r[1] for r in sub]):.3f}" for t in tokens if t > 1)
    lines.append(f"| {name} | {len(sub)} | {medians} | {costs} |")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
