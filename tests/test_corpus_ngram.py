"""benchmarks.corpus_ngram: the datastore's most frequent continuation per suffix, predictions
from the longest matching suffix before each position (never the position itself), and the
chain's accepted runs; then the whole benchmark on a small archive-shaped file."""

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_the_table_keeps_each_suffixes_most_frequent_continuation(benchmark_module):
  m = benchmark_module("corpus_ngram")
  keys, nexts, count, total = m.ngram_table([np.array([1, 2, 3, 1, 2, 4, 1, 2, 3])], 2, 1)
  table = {int(k): (int(v), int(c), int(t)) for k, v, c, t in zip(keys, nexts, count, total)}
  assert table[int(m.suffix_hashes(np.array([1, 2]), 2)[0])] == (3, 2, 3)  # 1 2 → 3, 4, 3
  assert table[int(m.suffix_hashes(np.array([2, 3]), 2)[0])] == (1, 1, 1)
  assert len(table) == 5  # (1 2), (2 3), (3 1), (2 4), (4 1); the last (2 3) has no next
  # a suffix seen fewer than min_count times predicts nothing
  keys, *_ = m.ngram_table([np.array([1, 2, 3, 1, 2, 4, 1, 2, 3])], 2, 2)
  assert list(keys) == [m.suffix_hashes(np.array([1, 2]), 2)[0]]


def test_predictions_read_only_the_tokens_before_each_position(benchmark_module):
  m = benchmark_module("corpus_ngram")
  store = [np.array([5, 6, 7, 8, 9])]
  tables = {n: m.ngram_table(store, n, 1) for n in (1, 2)}
  pred, conf = m.predict(tables, np.array([5, 6, 7, 8, 9]))
  # position 0 has no context; every later token is its predecessor's only continuation
  assert list(pred) == [-1, 6, 7, 8, 9] and list(conf) == [0, 1, 1, 1, 1]
  # an unseen context predicts nothing; a peeking variant (the token itself) would hit
  pred, _ = m.predict(tables, np.array([1, 2, 3, 4]))
  assert list(pred) == [-1] * 4
  # the longest suffix wins: after 5 6 the bigram says 7, the unigram 6 alone says 7 too,
  # but after 9 6 only the unigram matches
  store = [np.array([5, 6, 7]), np.array([9, 6, 1]), np.array([9, 6, 1]), np.array([3, 6, 1])]
  tables = {n: m.ngram_table(store, n, 1) for n in (1, 2)}
  assert m.predict(tables, np.array([5, 6, 0]))[0][2] == 7  # bigram (5 6) → 7
  assert m.predict(tables, np.array([4, 6, 0]))[0][2] == 1  # unigram 6 → 1 (3 of 4)


def test_accepted_runs_count_consecutive_hits_capped_at_gamma(benchmark_module):
  m = benchmark_module("corpus_ngram")
  runs = m.accepted_runs(np.array([True, True, True, False, True, False]), 2)
  assert list(runs) == [2, 2, 1, 0, 1, 0]


def test_the_benchmark_reports_each_mode_from_an_archive(tmp_path):
  # an archive-shaped file: the held-out answer repeats a train answer after its first token
  answers = {"train": [np.array([1, 2, 3, 4, 5, 6])] * 3,
             "heldout": [np.array([9, 2, 3, 4, 5, 6]), np.array([7, 7, 7, 7])]}
  arrays = {}
  for split, resp in answers.items():
    arrays[f"{split}_prompt"] = np.concatenate([np.array([0, 0], np.uint16)] * len(resp))
    arrays[f"{split}_prompt_len"] = np.full(len(resp), 2, np.int32)
    arrays[f"{split}_response"] = np.concatenate(resp).astype(np.uint16)
    arrays[f"{split}_response_len"] = np.array([len(r) for r in resp], np.int32)
    modes = ["greedy", "sampled"] if split == "heldout" else ["greedy"] * len(resp)
    arrays[f"{split}_meta"] = np.array(json.dumps(
        [{"category": "chat", "mode": mode} for mode in modes]))
  path = tmp_path / "tiny.npz"
  np.savez(path, **arrays)
  out = tmp_path / "out.md"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.corpus_ngram", f"--archives={path}",
                         "--orders=1,2", "--gamma=2", f"--out={out}"], cwd=ROOT,
                        capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  rows = {tuple(c.strip() for c in line.split("|")[1:3]): line
          for line in out.read_text().splitlines() if line.startswith("| greedy")
          or line.startswith("| sampled")}
  greedy = [c.strip() for c in rows[("greedy", "**all**")].split("|")[1:-1]]
  # 6 positions: 9 and 2 follow contexts the store lacks (0 0, 0 9 and 9; the store's
  # answers start at 1), 3 4 5 6 hit: runs 0 0 2 2 2 1
  assert greedy[2:5] == ["6", "0.667", "1.167"]
  sampled = [c.strip() for c in rows[("sampled", "**all**")].split("|")[1:-1]]
  assert sampled[2:4] == ["4", "0.000"]
  bad = subprocess.run([sys.executable, "-m", "benchmarks.corpus_ngram", f"--archives={path}",
                        "--orders=0", f"--out={out}"], cwd=ROOT, capture_output=True, text=True)
  assert bad.returncode != 0 and "--orders" in bad.stderr
