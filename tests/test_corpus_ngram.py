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
  # min_count counts the suffix, not its top continuation: (1 2) seen twice, → 3 and → 4
  # once each, is kept (the tie goes to the smaller id) while every other suffix is dropped
  keys, nexts, count, total = m.ngram_table([np.array([1, 2, 3, 1, 2, 4])], 2, 2)
  assert list(keys) == [m.suffix_hashes(np.array([1, 2]), 2)[0]]
  assert (int(nexts[0]), int(count[0]), int(total[0])) == (3, 1, 2)
  keys, nexts, *_ = m.ngram_table([np.array([1, 2, 4, 1, 2, 3])], 2, 2)  # order does not matter
  assert int(nexts[0]) == 3


def test_predictions_read_only_the_tokens_before_each_position(benchmark_module):
  m = benchmark_module("corpus_ngram")
  store = [np.array([5, 6, 7, 8, 9])]
  tables = {n: m.ngram_table(store, n, 1) for n in (1, 2)}
  pred, conf = m.predict(tables, np.array([5, 6, 7, 8, 9]))
  # position 0 has no context; every later token is its predecessor's only continuation
  assert list(pred) == [-1, 6, 7, 8, 9] and list(conf) == [0, 1, 1, 1, 1]
  # an unseen context predicts nothing (a lookup that skipped the key comparison would)
  pred, _ = m.predict(tables, np.array([1, 2, 3, 4]))
  assert list(pred) == [-1] * 4
  # a prediction reads the tokens before its position, never the token itself: at 9 the
  # suffix is (7 8) → 1; a variant that read the position's own token would look up (8 9)
  # or 9, which the store lacks, and predict nothing
  store = [np.array([7, 8, 1])] * 3
  tables = {n: m.ngram_table(store, n, 1) for n in (1, 2)}
  assert m.predict(tables, np.array([7, 8, 9]))[0][2] == 1
  # the longest suffix wins: (5 6) → 7 once, but 6 alone → 1 (3 of its 4 continuations)
  store = [np.array([5, 6, 7]), np.array([9, 6, 1]), np.array([9, 6, 1]), np.array([3, 6, 1])]
  tables = {n: m.ngram_table(store, n, 1) for n in (1, 2)}
  assert m.predict(tables, np.array([5, 6, 0]))[0][2] == 7  # bigram (5 6) → 7
  assert m.predict(tables, np.array([4, 6, 0]))[0][2] == 1  # no bigram (4 6): unigram 6 → 1


def test_accepted_runs_count_consecutive_hits_capped_at_gamma(benchmark_module):
  m = benchmark_module("corpus_ngram")
  runs = m.accepted_runs(np.array([True, True, True, False, True, False]), 2)
  assert list(runs) == [2, 2, 1, 0, 1, 0]
  # decoding verifies at 0 (2 accepted + 1), at 3 (0 + 1), at 4 (1 + 1): 3 calls, not the
  # 6 positions' mean run of 1 + 1
  assert m.calls_per_answer(runs) == 3
  assert m.calls_per_answer(np.zeros(5, np.int64)) == 5


def _archive(path, answers, target=None):
  """An archive-shaped file (``specjax.distill.archive``'s layout) with prompts 0 0."""
  from specjax.distill import archive
  arrays = {"header": np.array(json.dumps({
      "format": archive.FORMAT, "version": archive.VERSION,
      "target": target or {"name": "tiny"}, "tokenizer_sha256": "t"}))}
  for split, resp in answers.items():
    arrays[f"{split}_prompt"] = np.concatenate([np.array([0, 0], np.uint16)] * len(resp))
    arrays[f"{split}_prompt_len"] = np.full(len(resp), 2, np.int32)
    arrays[f"{split}_response"] = np.concatenate(resp).astype(np.uint16)
    arrays[f"{split}_response_len"] = np.array([len(r) for r in resp], np.int32)
    arrays[f"{split}_shard"] = np.zeros(len(resp), np.int32)
    modes = ["greedy", "T=1.0"] if split == "heldout" else ["greedy"] * len(resp)
    arrays[f"{split}_meta"] = np.array(json.dumps(
        [{"category": "chat", "mode": mode} for mode in modes]))
  np.savez(path, **arrays)


def _run(*args):
  return subprocess.run([sys.executable, "-m", "benchmarks.corpus_ngram", *args], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)


def test_the_benchmark_reports_each_mode_from_an_archive(tmp_path):
  # the held-out greedy answer repeats a train answer after its first token
  answers = {"train": [np.array([1, 2, 3, 4, 5, 6])] * 3,
             "heldout": [np.array([9, 2, 3, 4, 5, 6]), np.array([7, 7, 7, 7])]}
  path = tmp_path / "tiny.npz"
  _archive(path, answers)
  out = tmp_path / "out.md"
  proc = _run(f"--archives={path}", "--orders=1,2", "--gamma=2", f"--out={out}")
  assert proc.returncode == 0, proc.stderr
  table = [line for line in out.read_text().splitlines() if line.startswith("|")]
  assert len({line.count("|") for line in table}) == 1  # every row as wide as the header
  rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in table}
  greedy = [c.strip() for c in rows[("greedy", "**all**")].split("|")[1:-1]]
  # 6 positions: 9 and 2 follow contexts the store lacks (0 0, 0 9 and 9; the store's
  # answers start at 1), 3 4 5 6 hit: runs 0 0 2 2 2 1, decoded in 4 calls (at 0, 1, 2, 5)
  assert greedy[2:6] == ["6", "0.667", "1.167", "1.50"]
  sampled = [c.strip() for c in rows[("sampled", "**all**")].split("|")[1:-1]]
  assert sampled[2:6] == ["4", "0.000", "0.000", "1.00"]


def test_the_benchmark_refuses_bad_input_before_scoring(tmp_path, refused):
  answers = {"train": [np.array([1, 2, 3])], "heldout": [np.array([1, 2]), np.array([3])]}
  good, other = tmp_path / "a.npz", tmp_path / "b.npz"
  _archive(good, answers)
  _archive(other, answers, target={"name": "another"})
  out = f"--out={tmp_path / 'out.md'}"
  refused("benchmarks.corpus_ngram",
          ([f"--archives={good}", "--orders=0", out], "--orders"),
          ([f"--archives={good}", "--orders=2,2", out], "--orders must not repeat"),
          ([f"--archives={good}", "--gamma=0", out], "--gamma"),
          ([f"--archives={tmp_path / 'missing.npz'}", out], "is not a corpus archive"),
          ([f"--archives={good},{other}", out], "another target or tokenizer"))
