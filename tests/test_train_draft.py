"""experiments.train_draft end to end on the embedded target: the data stage, a trained
exit, its resume, and a warm start (``--init_from``) on the grown corpus, from the run's
workdir and from its draft directory alone; a corpus exported as token ids, imported into
another cache and trained on beside a second seed's (``--also_data_seeds``).

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


def _steps(workdir):
  return [json.loads(l) for l in (workdir / "steps.jsonl").read_text().splitlines()]


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

  steps = _steps(first)
  assert "invocation" in steps[0] and steps[0]["cores"] == os.cpu_count()
  assert [m["step"] for m in steps[1:]] == [1, 2]

  # The same command again resumes at the last checkpoint: nothing more to train.
  _train_draft(tmp_path, "--stage=train", "--train_batches=1", f"--workdir={first}")
  assert _metrics(first)[len(done):] == []
  assert _steps(first)[len(steps):][0]["invocation"] and len(_steps(first)) == len(steps) + 1

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


@pytest.mark.heavy
def test_an_eagle_drafter_continues_from_its_draft_directory(tmp_path):
  """What continuing the shipped EAGLE-3 drafter does (--init_from=specjax/assets/
  smollm2_eagle3): a draft directory's weights and vocabulary, another EAGLE refused, one
  of fewer layers grown."""
  eagle = ["--draft_kind=eagle", "--eagle_feature_layers=0,1", "--eagle_ttt_steps=2"]
  first, warm = tmp_path / "first", tmp_path / "warm"
  _train_draft(tmp_path, "--stage=all", "--train_batches=1", f"--workdir={first}", *eagle)
  done = _metrics(first)
  _train_draft(tmp_path, "--stage=train", "--train_batches=1", f"--workdir={warm}",
               f"--init_from={first / 'draft'}", *eagle)
  start = _metrics(warm)[0]
  assert start["step"] == 0
  for key in ("alpha_T0", "alpha_T1"):  # the stored float16 weights score as the run's last
    assert start[key] == pytest.approx(done[-1][key], abs=0.02), key
  np.testing.assert_array_equal(_vocab_map(warm), _vocab_map(first))
  err = _refused(tmp_path, *TINY, "--stage=train", "--train_batches=1", *eagle,
                 "--eagle_ttt_steps=3", f"--workdir={tmp_path / 'third'}",
                 f"--init_from={first / 'draft'}")
  assert "trained another draft" in err and "ttt_steps 2 there, 3 here" in err

  # grown by a layer that starts as the identity: step 0 scores as the run it grew from
  grown = tmp_path / "grown"
  _train_draft(tmp_path, "--stage=train", "--train_batches=1", f"--workdir={grown}",
               f"--init_from={first / 'draft'}", *eagle, "--eagle_layers=2")
  assert json.loads((grown / "setup.json").read_text())["draft_layers"] == 2
  start = _metrics(grown)[0]
  for key in ("alpha_T0", "alpha_T1"):
    assert start[key] == pytest.approx(done[-1][key], abs=0.02), key
  err = _refused(tmp_path, *TINY, "--stage=train", "--train_batches=1", *eagle,
                 f"--workdir={tmp_path / 'shrunk'}", f"--init_from={grown}")
  assert "trained another draft" in err and "draft_layers 2 there, 1 here" in err


def _refused(tmp_path, *flags):
  proc = subprocess.run([sys.executable, "-m", "experiments.train_draft", *flags], cwd=ROOT,
                        env=dict(os.environ, SPECJAX_CACHE=str(tmp_path / "cache")),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  return proc.stderr


def test_corpus_flags_are_refused_before_the_model_loads(tmp_path):
  from specjax.distill import archive, teacher
  from specjax.loaders.embedded import smollm2_config
  corpus = tmp_path / "corpus"
  teacher.save_shard(teacher.shard_path(str(corpus), "train", 0),
                     [dict(prompt=np.array([1, 2], np.int32), response=np.array([3], np.int32),
                           topk_ids=np.zeros((1, 4), np.int32),
                           topk_logp=np.zeros((1, 4), np.float32))], [dict(source="s")])
  spec = dict(data_seed=3, gen_batch=2, max_new=8, max_prompt=96, topk=4, version=1)
  path = str(tmp_path / "a.npz")
  archive.pack(str(corpus), path, cfg=smollm2_config(), tokenizer_sha256="ab" * 32, spec=spec)
  err = _refused(tmp_path, *TINY, "--stage=import", f"--archive={path}")
  assert "import it with --data_seed=3 (here 0)" in err
  assert "specjax matmul" not in err  # (what loading the target logs)
  assert "no finished corpus for these flags" in _refused(
      tmp_path, *TINY, "--stage=export", f"--archive={tmp_path / 'b.npz'}")
  err = _refused(tmp_path, *TINY, "--stage=train", "--also_data_seeds=4")
  assert "no finished corpus for --data_seed=4" in err and "specjax matmul" not in err


@pytest.mark.heavy
def test_a_corpus_exported_and_imported_elsewhere_trains_on_the_same_records(tmp_path):
  from specjax.distill import teacher
  path = tmp_path / "answers.npz"
  _train_draft(tmp_path, "--stage=data", "--train_batches=2", f"--workdir={tmp_path / 'w'}")
  _train_draft(tmp_path, "--stage=export", "--train_batches=2", f"--archive={path}")
  # another machine: an empty cache, the same flags
  elsewhere = tmp_path / "elsewhere"
  _train_draft(elsewhere, "--stage=import", f"--archive={path}")
  [src] = (tmp_path / "cache" / "distill").iterdir()
  [out] = (elsewhere / "cache" / "distill").iterdir()
  assert src.name == out.name  # the directory the train stage reads for these flags
  for split in ("train", "heldout"):
    a, b = teacher.load_corpus(str(src), split), teacher.load_corpus(str(out), split)
    assert len(a) == len(b) == {"train": 4, "heldout": 2}[split]
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x["response"], y["response"])
      np.testing.assert_array_equal(x["topk_ids"], y["topk_ids"])  # (stored: --topk=4)
      np.testing.assert_allclose(x["topk_logp"], y["topk_logp"], rtol=1e-3)  # (float16)

  # corpora accumulate: a second seed's answers train beside the first's
  _train_draft(elsewhere, "--stage=data", "--train_batches=1", "--data_seed=1",
               f"--workdir={tmp_path / 'w'}")
  workdir = tmp_path / "both"
  _train_draft(elsewhere, "--stage=train", "--train_batches=2", "--also_data_seeds=1",
               f"--workdir={workdir}")
  setup = json.loads((workdir / "setup.json").read_text())
  assert setup["train_responses"] == 4 + 2 and setup["corpus"] == str(out)
  assert len(setup["also_corpora"]) == 1 and setup["also_corpora"][0] != str(out)
  # each corpus caches its own records' features, so a later run on either reuses them
  for corpus, records in ((out, 4), (pathlib.Path(setup["also_corpora"][0]), 2)):
    cached = json.loads((corpus / "features-train-layers0.json").read_text())
    assert len(cached["lengths"]) == records, corpus

  # --max_train_tokens: the leading records of both corpora, each cut to the same share;
  # the features stay cached for whole corpora (a cut never rewrites them)
  corpora = [teacher.load_corpus(str(out), "train"),
             teacher.load_corpus(setup["also_corpora"][0], "train")]
  total = sum(len(r["response"]) for recs in corpora for r in recs)
  want = teacher.leading_records(corpora, total // 2)
  cut = tmp_path / "cut"
  _train_draft(elsewhere, "--stage=train", "--train_batches=2", "--also_data_seeds=1",
               f"--max_train_tokens={total // 2}", f"--workdir={cut}")
  cut_setup = json.loads((cut / "setup.json").read_text())
  assert cut_setup["train_responses"] == sum(map(len, want)) < 6
  assert cut_setup["train_tokens"] == sum(len(r["response"]) for w in want for r in w)
  for corpus, records in ((out, 4), (pathlib.Path(setup["also_corpora"][0]), 2)):
    cached = json.loads((corpus / "features-train-layers0.json").read_text())
    assert len(cached["lengths"]) == records, corpus
  err = _refused(elsewhere, *TINY, "--stage=train", "--train_batches=2",
                 f"--max_train_tokens={total + 1}", f"--workdir={tmp_path / 'too_many'}")
  assert f"--max_train_tokens: asked for {total + 1:,} response tokens" in err
