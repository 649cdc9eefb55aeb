"""Corpus archives (specjax.distill.archive): a corpus of the target's answers packed as token
ids and rebuilt shard by shard, its top-k scored teacher-forced; and what is refused."""

import dataclasses
import json
import os

import numpy as np
import pytest

from specjax.distill import archive, teacher
from specjax.sampling import Greedy, Sampling
from specjax.testing import tiny_model

SPEC = dict(data_seed=3, gen_batch=4, max_new=12, max_prompt=16, topk=4, version=1)
SHA = "ab" * 32


def _spec(k):
  return dict(SPEC, topk=k)


@pytest.fixture(scope="module", params=[archive.STORED_TOPK, archive.STORED_TOPK + 2],
                ids=["topk_stored", "topk_rescored"])
def corpus(request, tmp_path_factory):
  """A tiny target and a corpus it wrote, keeping the top-k an archive stores or one more
  than it does: three train shards (greedy, T = 1, greedy) and one held-out shard, answers
  of up to 12 tokens, eight ids ending one, so lengths differ."""
  k = request.param
  cfg, params = tiny_model(seed=7, vocab_size=64, num_layers=1)
  cfg = dataclasses.replace(cfg, eos_token_ids=tuple(range(40, 48)))
  rng = np.random.default_rng(0)

  def batches(n, split):
    return [([rng.integers(6, 64, int(rng.integers(3, 9))).tolist() for _ in range(4)],
             [dict(category="code", source=f"{split}:{i}:{j}") for j in range(4)])
            for i in range(n)]

  root = tmp_path_factory.mktemp("corpus")
  for split, n in (("train", 3), ("heldout", 1)):
    assert teacher.build_corpus(str(root), params, cfg, split, batches(n, split),
                                (Greedy(), Sampling(1.0)), SPEC["max_new"], k, seed=11) == n
  return cfg, params, str(root), k


def test_an_archive_keeps_the_ids_and_rebuilds_the_corpus_resumably(corpus, tmp_path):
  cfg, params, src, k = corpus
  stored = k <= archive.STORED_TOPK
  path = str(tmp_path / "a.npz")
  header = archive.pack(src, path, cfg=cfg, tokenizer_sha256=SHA, spec=_spec(k),
                        info=dict(command="test"))
  assert header["splits"]["train"]["records"] == 12 and header["splits"]["train"]["shards"] == 3
  assert header["stored_topk"] == stored and archive.read_header(path) == header
  with np.load(path) as z:
    assert z["train_response"].dtype == np.uint16
    assert ("train_topk_logp" in z.files) == stored  # else ids only
    if stored:  # the argmax coded as its difference from the emitted token
      greedy = np.concatenate([[r["mode"] == "greedy"] * len(r["response"])
                               for r in teacher.load_corpus(src, "train")])
      assert not z["train_topk_ids"][greedy, 0].any() and z["train_topk_ids"][~greedy, 0].any()

  out = str(tmp_path / "rebuilt")
  if not stored:
    with pytest.raises(ValueError, match="keeps token ids only"):
      archive.restore(path, out, cfg, tokenizer_sha256=SHA)
  archive.restore(path, out, cfg, tokenizer_sha256=SHA, params=params, batch=3)
  assert json.load(open(os.path.join(out, "spec.json")))["restored_from"] == path
  for split in archive.SPLITS:
    a, b = teacher.load_corpus(src, split), teacher.load_corpus(out, split)
    assert len(a) == len(b) and len({len(r["response"]) for r in a}) > 1
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x["prompt"], y["prompt"])
      np.testing.assert_array_equal(x["response"], y["response"])
      assert {k: x[k] for k in ("category", "source", "mode")} == \
          {k: y[k] for k in ("category", "source", "mode")}
      # stored: as generated (log-probs to float16); rescored: teacher-forced, the same
      np.testing.assert_array_equal(x["topk_ids"][:, 0], y["topk_ids"][:, 0])
      if stored:
        np.testing.assert_array_equal(x["topk_ids"], y["topk_ids"])
      np.testing.assert_allclose(x["topk_logp"], y["topk_logp"], rtol=1e-3, atol=1e-4)
      if x["mode"] == "greedy":  # the top-1 at position i predicts response[i]
        np.testing.assert_array_equal(y["topk_ids"][:, 0], y["response"])

  # an interrupted restore resumes: only the missing shard is made again
  os.remove(os.path.join(out, "train-00001.npz"))
  kept = os.path.getmtime(os.path.join(out, "train-00000.npz"))
  seen = []
  archive.restore(path, out, cfg, tokenizer_sha256=SHA, params=params,
                  progress=lambda split, i, n: seen.append((split, i, n)))
  assert os.path.getmtime(os.path.join(out, "train-00000.npz")) == kept
  assert seen == [("train", 0, 3), ("train", 1, 3), ("train", 2, 3), ("heldout", 0, 1)]
  np.testing.assert_array_equal(teacher.load_corpus(out, "train")[5]["topk_ids"],
                                teacher.load_corpus(src, "train")[5]["topk_ids"])


def test_an_archive_for_another_target_tokenizer_or_format_is_refused(corpus, tmp_path):
  cfg, params, src, k = corpus
  path = str(tmp_path / "a.npz")
  archive.pack(src, path, cfg=cfg, tokenizer_sha256=SHA, spec=_spec(k))
  other = dataclasses.replace(cfg, dim=cfg.dim * 2)
  with pytest.raises(ValueError, match=f"another target: dim {cfg.dim} there, {2 * cfg.dim}"):
    archive.restore(path, str(tmp_path / "x"), other, tokenizer_sha256=SHA, params=params)
  with pytest.raises(ValueError, match="another tokenizer"):
    archive.restore(path, str(tmp_path / "x"), cfg, tokenizer_sha256="cd" * 32, params=params)
  assert not os.path.exists(tmp_path / "x")  # refused before anything was written
  np.savez(tmp_path / "other.npz", x=np.zeros(3))
  with pytest.raises(ValueError, match="not a corpus archive"):
    archive.read_header(str(tmp_path / "other.npz"))
  with pytest.raises(ValueError, match="ids outside the target's vocabulary"):
    archive.pack(src, path, cfg=dataclasses.replace(cfg, vocab_size=32), tokenizer_sha256=SHA,
                 spec=_spec(k))
  wrong_k = f"{k}\\), not \\(\\d+, {k + 1}\\) as the spec's topk={k + 1}"
  with pytest.raises(ValueError, match=wrong_k):
    archive.pack(src, path, cfg=cfg, tokenizer_sha256=SHA, spec=_spec(k + 1))


def test_a_corpus_with_a_missing_shard_is_not_packed(corpus, tmp_path):
  cfg, _, src, k = corpus
  holed = tmp_path / "holed"
  holed.mkdir()
  for name in ("train-00000.npz", "train-00002.npz"):
    os.link(os.path.join(src, name), holed / name)
  with pytest.raises(ValueError, match="not numbered 0..1 without gaps"):
    archive.pack(str(holed), str(tmp_path / "a.npz"), cfg=cfg, tokenizer_sha256=SHA,
                 spec=_spec(k))


@pytest.mark.real_model
def test_the_committed_archives_hold_the_embedded_targets_answers():
  """What experiments/corpora/ ships restores for the embedded target: the header names its
  shape and tokenizer, the records are the counts it claims, and the README lists each."""
  from specjax import drafts
  from specjax.loaders import load_model_tokenizer
  from specjax.loaders.embedded import smollm2_config
  root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "experiments", "corpora")
  paths = sorted(f for f in os.listdir(root) if f.endswith(".npz"))
  assert paths, "experiments/corpora/ holds no archive"
  readme = open(os.path.join(root, "README.md")).read()
  sha = drafts.tokenizer_fingerprint(load_model_tokenizer())
  for name in paths:
    header = archive.read_header(os.path.join(root, name))
    archive.check_target(header, smollm2_config(), sha, name)
    assert name in readme and header["info"]["command"], name
    for split in archive.SPLITS:
      shards = archive.records(os.path.join(root, name), split)
      assert len(shards) == header["splits"][split]["shards"], (name, split)
      assert sum(len(r["response"]) for s in shards for r in s) == \
          header["splits"][split]["response_tokens"], (name, split)
