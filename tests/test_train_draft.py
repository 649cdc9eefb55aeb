"""experiments.train_draft end to end on the embedded target: the data stage, a trained
exit, its resume, and a warm start (``--init_from``) on the grown corpus, from the run's
workdir and from its draft directory alone.

Each command runs in a subprocess (the script's absl flags would collide with other entry
points' in this process) with a tiny budget: a few 8-token answers, two optimizer steps.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# One corpus key for both invocations (only --train_batches and --workdir differ): the
# second data stage resumes the first's shards and appends one more batch.
TINY = ["--gen_batch=2", "--max_new_tokens=8", "--max_prompt_tokens=96", "--topk=4",
        "--heldout_batches=1", "--heldout_mix_batches=0", "--draft_kind=exit",
        "--exit_layer=1", "--draft_vocab=256", "--batch_size=2", "--seq_len=112",
        "--steps=2", "--eval_every=2", "--checkpoint_every=1", "--loss=top1"]


def _train_draft(tmp_path, *flags):
  proc = subprocess.run([sys.executable, "-m", "experiments.train_draft", *TINY, *flags],
                        cwd=ROOT, env=dict(os.environ, SPECJAX_CACHE=str(tmp_path / "cache")),
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc


def _metrics(workdir):
  return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]


def _vocab_map(workdir):
  from specjax.drafts import shards
  return np.asarray(shards.read_tensors(str(workdir / "draft"))["vocab_map"])


@pytest.mark.heavy
def test_train_resume_and_warm_start_on_a_grown_corpus(tmp_path):
  first, second = tmp_path / "first", tmp_path / "second"
  _train_draft(tmp_path, "--stage=all", "--train_batches=1", f"--workdir={first}")
  setup = json.loads((first / "setup.json").read_text())
  assert setup["train_responses"] == 2 and setup["draft_kind"] == "exit"
  done = _metrics(first)
  assert [m["step"] for m in done] == [0, 2] and 0.0 <= done[-1]["alpha_T0"] <= 1.0
  assert done[-1]["alpha_T1"] != done[0]["alpha_T1"]  # two steps moved the draft
  card = json.loads((first / "draft" / "draft.json").read_text())
  assert card["info"]["final"]["step"] == 2

  # The same command again resumes at the last checkpoint: nothing more to train.
  _train_draft(tmp_path, "--stage=train", "--train_batches=1", f"--workdir={first}")
  assert _metrics(first)[len(done):] == []

  # One more answer batch, then a warm start from the first run on the grown corpus.
  _train_draft(tmp_path, "--stage=all", "--train_batches=2", f"--workdir={second}",
               f"--init_from={first}")
  grown = json.loads((second / "setup.json").read_text())
  assert grown["corpus"] == setup["corpus"] and grown["train_responses"] == 4
  assert grown["init_from"] == str(first)
  warm = _metrics(second)
  # its step 0 is the first run's last checkpoint, scored on the same held-out answers
  assert warm[0]["step"] == 0
  for key in ("alpha_T0", "alpha_T1"):
    assert warm[0][key] == pytest.approx(done[-1][key], abs=1e-6), key
  np.testing.assert_array_equal(_vocab_map(second), _vocab_map(first))

  # A warm start from the draft directory alone (as from a shipped draft): its weights as
  # stored (float16) and its vocabulary; the setup its draft.json records.
  from_dir = tmp_path / "from_dir"
  _train_draft(tmp_path, "--stage=train", "--train_batches=2", f"--workdir={from_dir}",
               f"--init_from={first / 'draft'}")
  assert json.loads((from_dir / "setup.json").read_text())["init_from"] == str(first / "draft")
  start = _metrics(from_dir)[0]
  assert start["step"] == 0
  for key in ("alpha_T0", "alpha_T1"):
    assert start[key] == pytest.approx(done[-1][key], abs=0.02), key
  np.testing.assert_array_equal(_vocab_map(from_dir), _vocab_map(first))

  # A warm start of another draft is refused before any compute, from either source.
  for source in (first, first / "draft"):
    proc = subprocess.run([sys.executable, "-m", "experiments.train_draft", *TINY,
                           "--stage=train", "--train_batches=2", "--exit_layer=2",
                           f"--workdir={tmp_path / 'third'}", f"--init_from={source}"],
                          cwd=ROOT, env=dict(os.environ, SPECJAX_CACHE=str(tmp_path / "cache")),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode != 0 and "trained another draft" in proc.stderr, source
    assert "exit_layer 1 there, 2 here" in proc.stderr
