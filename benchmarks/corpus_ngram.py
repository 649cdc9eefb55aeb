"""How much of the target's held-out answers an n-gram over its archived answers predicts.

Usage:
  python -m benchmarks.corpus_ngram [--archives A.npz,B.npz,...] [--orders 1,2,3,4,6]
      [--min_count 2] [--gamma 4] [--out benchmarks/results/corpus_ngram.md]

A retrieval draft (REST, He et al. 2023; suffix decoding) proposes what followed the current
suffix in a datastore of text. Its best datastore here is the target's own answers: the
archived corpora (``experiments/corpora/``, ``specjax.distill.archive``). This measures that
draft without decoding: the train answers of every archive form the datastore (for each
suffix of n tokens, n in ``--orders``, the continuation seen most often, kept where the
suffix was seen at least ``--min_count`` times); each held-out answer (its sources are never
a train prompt's) is read left to right, its prompt included as context, and at every
position the longest matching suffix predicts the next token (a point mass). The datastore
holds answers only, so an answer's first token, which follows the prompt's template, is
rarely predicted. Archives of different targets or tokenizers are refused.

Reported per sampling mode of the answers (greedy: the target's T = 0 continuation; T = 1:
one sample), pooled over answers:

  top-1      the share of positions whose token is the prediction. For greedy answers it is
             what a greedy verify accepts; for sampled ones it estimates the target's
             probability of the prediction, what recursive rejection accepts a point mass
             with (the answer's token is a draw from that distribution).
  accepted   the mean number of a ``--gamma``-chain's drafts accepted from each position:
             the run of consecutive correct predictions (each read from the true context,
             which is the chain's own while it is accepted), capped at γ; its distribution.
  tokens/call  what decoding with that chain would make per target call: a walk over each
             answer that verifies at a position, takes its accepted run plus the target's
             own token, and verifies again after them (greedy answers: exactly the greedy
             chain's count; sampled: one draw of it). Unlike ``accepted`` it skips the
             positions inside accepted runs, so clustered runs count once.
  by confidence  the share of positions whose prediction had at least that share of its
             suffix's continuations, and the top-1 there (what a draft that copies only when
             sure would see).
"""

from __future__ import annotations

import glob
import os
from typing import Sequence

import numpy as np
from absl import app, flags

from benchmarks.common import int_list, provenance, write_markdown
from experiments.machine import probe_output_dir
from specjax.distill import archive

ARCHIVES = flags.DEFINE_list("archives", None, "corpus archives (.npz); default: every "
                             "archive in experiments/corpora/")
ORDERS = flags.DEFINE_list("orders", ["1", "2", "3", "4", "6"], "suffix lengths n, longest "
                           "matched first")
MIN_COUNT = flags.DEFINE_integer("min_count", 2, "times a suffix must occur in the datastore "
                                 "to predict")
GAMMA = flags.DEFINE_integer("gamma", 4, "chain length the accepted runs are capped at")
OUT = flags.DEFINE_string("out", "benchmarks/results/corpus_ngram.md", "markdown output")

CONFIDENCES = (0.5, 0.8, 0.95)
_BASE = 1_000_003  # > any vocabulary here; products wrap modulo 2^64, so two suffixes may
# share a hash, with odds of about (suffixes)² / 2^65 (~1e-7 for a few million)


def suffix_hashes(seq: np.ndarray, n: int) -> np.ndarray:
  """[len(seq) − n + 1] a hash of each window seq[i:i + n] (int64, wrapping)."""
  seq = np.asarray(seq, np.int64)
  h = np.zeros(len(seq) - n + 1, np.int64)
  for j in range(n):
    h = h * _BASE + seq[j:len(seq) - n + 1 + j]
  return h


def ngram_table(seqs: Sequence[np.ndarray], n: int, min_count: int):
  """(keys sorted, the most frequent next token, its count, the suffix's count) over every
  window of n tokens in ``seqs`` that has a next token; suffixes seen fewer than
  ``min_count`` times are dropped. Ties go to the smaller token id."""
  keys, nexts = [], []
  for s in seqs:
    if len(s) > n:
      keys.append(suffix_hashes(s, n)[:-1])
      nexts.append(np.asarray(s[n:], np.int64))
  if not keys:
    empty = np.zeros(0, np.int64)
    return empty, empty, empty, empty
  k, v = np.concatenate(keys), np.concatenate(nexts)
  order = np.lexsort((v, k))
  k, v = k[order], v[order]
  starts = np.flatnonzero(np.r_[True, (k[1:] != k[:-1]) | (v[1:] != v[:-1])])
  count = np.diff(np.r_[starts, len(k)])
  k, v = k[starts], v[starts]
  order = np.lexsort((v, -count, k))  # per key: the most frequent first, then the smaller id
  k, v, count = k[order], v[order], count[order]
  first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
  total = np.add.reduceat(count, first)
  keep = total >= min_count
  return k[first][keep], v[first][keep], count[first][keep], total[keep]


def predict(tables: dict, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """([L] prediction of context[i] from context[:i] (−1: no suffix matched), [L] its share
  of the matched suffix's continuations), the longest order first."""
  context = np.asarray(context, np.int64)
  size = len(context)
  pred, conf = np.full(size, -1, np.int64), np.zeros(size)
  for n in sorted(tables, reverse=True):
    keys, nexts, count, total = tables[n]
    if size <= n or not len(keys):
      continue
    h = suffix_hashes(context, n)[:-1]  # the suffix before positions n … size − 1
    i = np.minimum(np.searchsorted(keys, h), len(keys) - 1)
    pos = np.arange(n, size)
    take = (keys[i] == h) & (pred[pos] < 0)
    pred[pos[take]] = nexts[i[take]]
    conf[pos[take]] = count[i[take]] / total[i[take]]
  return pred, conf


def accepted_runs(correct: np.ndarray, gamma: int) -> np.ndarray:
  """[L] from each position, how many consecutive predictions are correct, capped at γ."""
  out, run = np.zeros(len(correct), np.int64), 0
  for t in range(len(correct) - 1, -1, -1):
    run = run + 1 if correct[t] else 0
    out[t] = min(run, gamma)
  return out


def calls_per_answer(runs: np.ndarray) -> int:
  """Target calls a chain decoding makes over an answer whose accepted runs from each
  position are ``runs``: each call emits its accepted run and one token of the target's."""
  calls, t = 0, 0
  while t < len(runs):
    calls += 1
    t += int(runs[t]) + 1
  return calls


def load(paths: Sequence[str]):
  """(train answers, [(prompt, answer, meta)] held-out) from the archives, all of one target
  and tokenizer (``archive.read_header`` refuses a file that is not an archive)."""
  train, held, first = [], [], None
  for path in paths:
    header = archive.read_header(path)
    key = (header["target"], header["tokenizer_sha256"])
    if first is not None and key != first[1]:
      raise ValueError(f"{path} was generated by another target or tokenizer than {first[0]}")
    first = first or (path, key)
    train += [r["response"] for shard in archive.records(path, "train") for r in shard]
    held += [(r["prompt"], r["response"], r) for shard in archive.records(path, "heldout")
             for r in shard]
  return train, held


def measure(tables: dict, held, gamma: int) -> dict:
  """Per mode ('greedy', 'sampled') and category: positions, top-1, accepted runs, and the
  (confidence, correct) pairs."""
  out = {}
  for prompt, answer, meta in held:
    pred, conf = predict(tables, np.r_[prompt, answer])
    pred, conf = pred[len(prompt):], conf[len(prompt):]
    correct = pred == np.asarray(answer, np.int64)
    mode = "greedy" if meta.get("mode", "greedy") == "greedy" else "sampled"
    runs = accepted_runs(correct, gamma)
    calls = np.array([calls_per_answer(runs)])
    for key in ((mode, "all"), (mode, meta.get("category", "?"))):
      cell = out.setdefault(key, {"correct": [], "runs": [], "conf": [], "calls": []})
      cell["correct"].append(correct)
      cell["runs"].append(runs)
      cell["conf"].append(conf)
      cell["calls"].append(calls)
  return {k: {name: np.concatenate(v) for name, v in cell.items()} for k, cell in out.items()}


def main(argv):
  del argv
  paths = ARCHIVES.value or sorted(glob.glob("experiments/corpora/*.npz"))
  if not paths:
    raise SystemExit("--archives: no corpus archive found")
  orders = int_list(ORDERS)
  if len(set(orders)) != len(orders):
    raise SystemExit(f"--orders must not repeat a length, got {ORDERS.value}")
  if MIN_COUNT.value < 1 or GAMMA.value < 1:
    raise SystemExit("--min_count and --gamma must be >= 1")
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  try:
    train, held = load(paths)
  except (OSError, ValueError) as e:
    raise SystemExit(f"--archives: {e}") from None
  if not held:
    raise SystemExit("--archives: no held-out answers to score")
  tables = {n: ngram_table(train, n, MIN_COUNT.value) for n in orders}
  cells = measure(tables, held, GAMMA.value)
  g = GAMMA.value
  lines = ["# A corpus n-gram draft on the target's held-out answers (no decoding)", "",
           f"`python -m benchmarks.corpus_ngram --archives={','.join(paths)} "
           f"--orders={','.join(map(str, orders))} --min_count={MIN_COUNT.value} "
           f"--gamma={g}`  ",
           f"{provenance()}", "",
           f"Datastore: {len(train):,} train answers, {sum(map(len, train)):,} tokens; "
           + ", ".join(f"n = {n}: {len(tables[n][0]):,} suffixes" for n in orders)
           + f". Held-out: {len(held):,} answers (by source; the module docstring).", "",
           f"| answers | category | positions | top-1 | accepted of γ = {g} | tokens/call | "
           + " | ".join(f"P(accepted = {k})" for k in range(g + 1)) + " | "
           + " | ".join(f"conf ≥ {c}: share / top-1" for c in CONFIDENCES) + " |",
           "|" + "---|" * (6 + g + 1 + len(CONFIDENCES))]
  for (mode, category), c in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1] != "all",
                                                                    kv[0][1])):
    dist = np.bincount(c["runs"], minlength=g + 1) / len(c["runs"])
    conf = []
    for th in CONFIDENCES:
      sel = c["conf"] >= th
      conf.append(f"{sel.mean():.2f} / {c['correct'][sel].mean():.2f}" if sel.any() else "–")
    name = f"**{category}**" if category == "all" else category
    lines.append(f"| {mode} | {name} | {len(c['correct']):,} | {c['correct'].mean():.3f} | "
                 f"{c['runs'].mean():.3f} | {len(c['correct']) / c['calls'].sum():.2f} | "
                 + " | ".join(f"{x:.3f}" for x in dist) + " | "
                 + " | ".join(conf) + " |")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
