"""Fixed text for teacher-forced distillation: documents, deduplication, the split by source,
records, and the shards written (resumed, and kept when the disk fills)."""

import errno
import os
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.distill import data, documents, teacher
from specjax.kv_cache import init_cache
from specjax.model import forward
from specjax.testing import tiny_model

_MODULE = textwrap.dedent('''\
    """The module's docstring, long enough to be kept by itself as a document here.

    Its second paragraph makes it longer than the two hundred characters that a
    document needs to be kept after deduplication.
    """


    def public(x):
      """Doubles x: a function docstring that is long enough to be kept as a document.

      The second paragraph: documents shorter than two hundred characters are dropped, and
      this one has to stay.
      """
      return 2 * x
    ''')


def _tree(root, files):
  for rel, text in files.items():
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
  return str(root)


def test_python_documents_read_code_and_docstrings_and_skip_tests(tmp_path):
  root = _tree(tmp_path, {"pkg/__init__.py": _MODULE, "pkg/sub/mod.py": _MODULE,
                          "pkg/tests/test_x.py": _MODULE, "pkg/test_y.py": _MODULE,
                          "pkg/broken.py": "def (:\n"})
  docs = list(documents.python_documents(root, stdlib=False))
  assert {(d.kind, d.source, d.title) for d in docs} == {
      ("code", "pkg:pkg", "pkg"), ("docstring", "pkg:pkg", "pkg"),
      ("docstring", "pkg:pkg", "pkg.public"),
      ("code", "pkg:pkg.sub.mod", "pkg.sub.mod"), ("docstring", "pkg:pkg.sub.mod", "pkg.sub.mod"),
      ("docstring", "pkg:pkg.sub.mod", "pkg.sub.mod.public")}
  assert next(d for d in docs if d.title == "pkg.public").text.startswith("Doubles x")
  assert [d.source for d in documents.python_documents(root, stdlib=True)][0] == "stdlib:pkg"


def test_deduplicate_drops_repeats_seen_paragraphs_and_short_documents():
  para = "A paragraph of boilerplate that several documents repeat word for word, " * 2
  own = "This document's own text, which nothing else repeats, and long enough to keep. " * 3
  docs = [documents.Document("docs", "pkg:a", "a", f"{para}\n\n{own}"),
          documents.Document("docs", "pkg:b", "b", f"{para}  \n\n\n\n{own}\t"),  # same, normalised
          documents.Document("docs", "pkg:c", "c", f"{para}\n\nA short tail."),
          documents.Document("docs", "pkg:d", "d", f"{own.upper()}\n\n{para}")]
  out = list(documents.deduplicate(docs))
  assert [d.title for d in out] == ["a", "d"]  # b repeats a; c is short without the paragraph
  assert out[0].text == f"{para.strip()}\n\n{own.strip()}"
  assert out[1].text == own.upper().strip()  # the paragraph seen in a is dropped


def test_a_document_is_held_out_with_its_module_or_any_enclosing_package():
  parents = [f"m{i}" for i in range(200) if data.is_heldout(f"pkg:m{i}")]
  kids = [f"m{i}" for i in range(200) if not data.is_heldout(f"pkg:m{i}")]
  assert parents and kids
  doc = lambda source: documents.Document("code", source, "x", "text")
  assert documents.heldout(doc(f"pkg:{parents[0]}.inner.leaf"))
  leaf = next(f"{kids[0]}.c{j}" for j in range(500) if data.is_heldout(f"pkg:{kids[0]}.c{j}"))
  assert documents.heldout(doc(f"pkg:{leaf}")) and not documents.heldout(doc(f"pkg:{kids[0]}"))
  train, held = documents.split([doc(f"pkg:{parents[0]}.a"), doc(f"pkg:{kids[0]}")])
  assert [d.source for d in held] == [f"pkg:{parents[0]}.a"]
  assert [d.source for d in train] == [f"pkg:{kids[0]}"]


def test_collect_interleaves_kinds_caps_packages_and_is_deterministic(tmp_path):
  own = lambda tag: _MODULE.replace(" the ", f" the {tag} ").replace("x", f"x_{tag}")
  files = {f"big/m{i}.py": own(f"big{i}") for i in range(12)}
  files["small/__init__.py"] = own("small")
  site = _tree(tmp_path / "site", files)
  stdlib = _tree(tmp_path / "std", {"json/__init__.py": own("json")})
  docs = documents.collect(seed=1, kinds=("code", "docstring"), roots=(stdlib, [site]),
                           max_per_package=5)
  assert docs == documents.collect(seed=1, kinds=("code", "docstring"), roots=(stdlib, [site]),
                                   max_per_package=5)
  assert [d.kind for d in docs[:4]] == ["code", "docstring", "code", "docstring"]
  for kind in ("code", "docstring"):
    per = [documents.top_package(d) for d in docs if d.kind == kind]
    assert per.count("pkg:big") == 5 and per.count("pkg:small") >= 1
    assert "stdlib:json" in per
  with pytest.raises(ValueError, match="unknown document kinds"):
    documents.collect(kinds=("poems",), roots=(stdlib, [site]))


def test_text_records_chunk_end_the_turn_skip_long_requests_and_stop_at_the_budget():
  docs = [documents.Document("code", "pkg:a", "a", "x" * 10),
          documents.Document("code", "pkg:b", "b" * 50, "y" * 3),
          documents.Document("docs", "pkg:c", "c", "z" * 25)]
  encode_request = lambda text: [1] * (2 if "`a`" in text or "about c" in text else 90)
  encode_text = lambda text: [ord(ch) for ch in text]
  recs = list(documents.text_records(docs, encode_request, encode_text, end_id=0,
                                     max_new_tokens=4, max_prompt_tokens=64, max_tokens=1000,
                                     max_chunks=3))
  # a: 11 ids -> chunks of 4, 4, 3 (the end id last); b: request too long; c: 26 ids -> 3 chunks
  assert [(m["source"], m["chunk"], len(r)) for _, r, m in recs] == [
      ("pkg:a", 0, 4), ("pkg:a", 1, 4), ("pkg:a", 2, 3),
      ("pkg:c", 0, 4), ("pkg:c", 1, 4), ("pkg:c", 2, 4)]
  assert recs[2][1][-1] == 0 and 0 not in recs[5][1]  # c is cut after 3 chunks: no end id
  few = list(documents.text_records(docs, encode_request, encode_text, 0, 4, 64, max_tokens=5))
  assert len(few) == 2  # stops once the responses hold the budget


@pytest.fixture(scope="module")
def tiny():
  return tiny_model(seed=5, vocab_size=64, num_layers=1)


def _text_batches(n, seed=0):
  rng = np.random.default_rng(seed)
  return [([(rng.integers(1, 64, 3).astype(np.int32), rng.integers(1, 64, 9).astype(np.int32))
            for _ in range(2)], [dict(category="code", source=f"pkg:m{i}")] * 2) for i in range(n)]


def test_text_corpus_holds_the_teacher_forced_topk_and_resumes(tiny, tmp_path):
  cfg, params = tiny
  batches = _text_batches(3)
  assert teacher.build_text_corpus(str(tmp_path), params, cfg, "train", batches, k=4,
                                   length=16) == 3
  recs = teacher.load_corpus(str(tmp_path), "train")
  assert [r["mode"] for r in recs] == ["text"] * 6
  p, r = batches[1][0][0]
  seq = np.concatenate([p, r])[None]
  out = forward(params, cfg, jnp.asarray(seq), jnp.arange(seq.shape[1])[None],
                init_cache(cfg, 1, seq.shape[1]))
  top, ids = jax.lax.top_k(jax.nn.log_softmax(out.logits[0], -1)[len(p) - 1:-1], 4)
  np.testing.assert_array_equal(recs[2]["topk_ids"], ids)
  np.testing.assert_allclose(recs[2]["topk_logp"], top, atol=1e-5)
  np.testing.assert_array_equal(recs[2]["response"], r)
  # a resumed run writes only the missing shards
  os.remove(tmp_path / "train-00001.npz")
  before = os.path.getmtime(tmp_path / "train-00000.npz")
  teacher.build_text_corpus(str(tmp_path), params, cfg, "train", batches, k=4, length=16)
  assert os.path.getmtime(tmp_path / "train-00000.npz") == before
  np.testing.assert_array_equal(teacher.load_corpus(str(tmp_path), "train")[2]["topk_ids"], ids)
  with pytest.raises(ValueError, match="does not fit length=8"):
    teacher.build_text_corpus(str(tmp_path / "short"), params, cfg, "train", batches, k=4,
                              length=8)


def test_a_full_disk_keeps_the_shards_written_and_says_how_to_continue(tmp_path, monkeypatch):
  made = []

  def make(i, batch):
    made.append(i)
    return [dict(prompt=np.ones(2, np.int32), response=np.ones(3, np.int32),
                 topk_ids=np.ones((3, 1), np.int32), topk_logp=np.zeros((3, 1), np.float32))], \
        [dict(source=str(i))]

  real = teacher.save_shard

  def fill_up(path, records, meta):
    if path.endswith("train-00002.npz"):
      raise OSError(errno.ENOSPC, "No space left on device")
    real(path, records, meta)

  monkeypatch.setattr(teacher, "save_shard", fill_up)
  with pytest.raises(teacher.CorpusDiskFull, match="the 2 train shards before it are kept"):
    teacher.write_shards(str(tmp_path), "train", range(4), make)
  assert sorted(os.listdir(tmp_path)) == ["train-00000.npz", "train-00001.npz"]
  monkeypatch.setattr(teacher, "save_shard", real)
  assert teacher.write_shards(str(tmp_path), "train", range(4), make) == 4
  assert made == [0, 1, 2, 2, 3]  # the rerun made only the missing shards
  assert [r["source"] for r in teacher.load_corpus(str(tmp_path), "train")] == ["0", "1", "2", "3"]
