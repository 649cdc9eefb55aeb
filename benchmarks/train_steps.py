"""Where a training run's time went: seconds per step by batch length, from its steps.jsonl.

Usage:
  python -m benchmarks.train_steps --workdir=RUN [--out=benchmarks/results/train_steps.md]

``experiments.train_draft`` appends one line per step to ``RUN/steps.jsonl`` (seconds, batch
length, trained positions) and, at each invocation, a line naming the host and the code. This
reads them back (no compute) and prints, per invocation, the median seconds of a step at each
batch length (medians, so the steps that compiled a new length do not count) and what the
run's steps cost on average against steps of the longest length: with ``--length_group`` a
run's batches are trimmed to their rows, and a step at ``--seq_len`` is what every step of
an ungrouped run costs (its shape, whatever its rows), so the ratio is the grouping's saving
measured inside one run on one machine.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np
from absl import app, flags

from benchmarks.common import write_markdown

WORKDIR = flags.DEFINE_string("workdir", None, "a train_draft --workdir", required=True)
OUT = flags.DEFINE_string("out", "benchmarks/results/train_steps.md", "markdown output")
SKIP = flags.DEFINE_integer("skip", 0, "leave out each invocation's first N steps (their "
                            "machine shared with other work, say)", lower_bound=0)


def invocations(path: str) -> list[tuple[dict, list[dict]]]:
  """(header, step lines) per invocation; steps logged before any header get ``{}``."""
  out: list[tuple[dict, list[dict]]] = [({}, [])]
  with open(path) as f:
    for line in f:
      try:
        m = json.loads(line)
      except json.JSONDecodeError:  # (a line cut short by a kill)
        continue
      if "invocation" in m:
        out.append((m, []))
      else:
        out[-1][1].append(m)
  return [(h, steps) for h, steps in out if steps]


def summary(steps: list[dict]) -> dict:
  """Median seconds per length, how often each length came up, the mean step priced at those
  medians (``typical``: compiling steps left out), the ratio of a step at the longest length
  seen to it, the mean step as taken (``mean``) and trained positions per second as taken."""
  by_length = collections.defaultdict(list)
  for m in steps:
    by_length[m["length"]].append(m)
  median = {l: float(np.median([m["seconds"] for m in ms])) for l, ms in by_length.items()}
  count = {l: len(ms) for l, ms in by_length.items()}
  n = len(steps)
  typical = sum(count[l] * median[l] for l in median) / n
  longest = max(median)
  return dict(median=median, count=count, steps=n, typical=typical, longest=longest,
              mean=sum(m["seconds"] for m in steps) / n,
              ratio=median[longest] / typical,
              positions_per_s=sum(m["trained"] for m in steps) / sum(m["seconds"] for m in steps))


def main(argv):
  del argv
  path = os.path.join(WORKDIR.value, "steps.jsonl")
  lines = ["# Training steps by batch length", "",
           f"Command: `python -m benchmarks.train_steps --workdir={WORKDIR.value}"
           f"{f' --skip={SKIP.value}' if SKIP.value else ''}` (reads `steps.jsonl`; no compute)",
           ""]
  for header, steps in invocations(path):
    steps = steps[SKIP.value:]
    if not steps:
      continue
    s = summary(steps)
    host = (f"{header['cpu']}, CPU family {header['cpu_family']} model {header['cpu_model']}, "
            f"{header['cores']} cores, git {(header['git']['commit'] or '?')[:7]}"
            f"{' (dirty)' if header['git']['dirty'] else ''}, started {header['invocation']}"
            if header else "host not logged (a run started before steps.jsonl named it)")
    lines += [f"## Steps {steps[0]['step']}–{steps[-1]['step']}", "", host, "",
              "| batch length | steps | median s/step |", "|---|---|---|"]
    lines += [f"| {l} | {s['count'][l]} | {s['median'][l]:.2f} |" for l in sorted(s["median"])]
    lines += ["", f"Mean step, each priced at its length's median: **{s['typical']:.2f} s**; a step "
              f"at the longest length seen ({s['longest']}; {s['count'][s['longest']]} steps): "
              f"{s['median'][s['longest']]:.2f} s, "
              f"**{s['ratio']:.2f}×** the mean. As taken (compilations and any slow steps "
              f"included, evaluations and checkpoints not): {s['mean']:.2f} s a step, "
              f"{s['positions_per_s']:.0f} trained positions a second.", ""]
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
