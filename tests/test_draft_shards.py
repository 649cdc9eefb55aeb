"""Draft directories past one file's size: the tensors go to shards of at most
``MAX_FILE_BYTES`` each (a larger tensor cut along its first axis), listed by an index,
and load back bit for bit in every draft format; broken shard sets are refused."""

import glob
import json
import os

import jax
import numpy as np
import pytest

from specjax import drafts
from specjax.drafters.eagle import random_eagle_weights
from specjax.drafters.medusa import random_medusa_weights
from specjax.drafts import format as draft_format
from specjax.loaders import CheckpointError
from specjax.testing import tiny_model

LIMIT = 6_000  # bytes: small enough that every tiny draft below needs several files


@pytest.fixture(scope="module")
def model():
  return tiny_model(seed=0)


def _save_and_load(kind, cfg, params, path):
  """(saved weights, loaded params) of one draft of ``kind`` written to ``path``."""
  vm = np.arange(0, cfg.vocab_size, 2)
  if kind == "token":
    dcfg, dparams = tiny_model(seed=1, num_layers=1)
    drafts.save_draft(path, dcfg, dparams, None, target_vocab_size=cfg.vocab_size,
                      tokenizer_sha256="abc")
    return drafts.load_draft(path, target_vocab_size=cfg.vocab_size, tokenizer_sha256="abc")[1]
  if kind == "eagle":
    w = random_eagle_weights(cfg, 1, jax.random.PRNGKey(1))
    drafts.save_eagle(path, cfg, w, vm, tokenizer_sha256="abc")
    return drafts.load_eagle(path, cfg, params, tokenizer_sha256="abc")[1]
  w = random_medusa_weights(cfg, 3, 2, jax.random.PRNGKey(2), head_rows=len(vm))
  drafts.save_medusa(path, cfg, w, vm, tokenizer_sha256="abc")
  return drafts.load_medusa(path, cfg, params, tokenizer_sha256="abc")[1]


@pytest.mark.parametrize("kind", ["token", "eagle", "medusa"])
def test_sharded_drafts_load_as_the_single_file(model, tmp_path, monkeypatch, kind):
  cfg, params = model
  whole = _save_and_load(kind, cfg, params, str(tmp_path / "one"))
  assert os.listdir(tmp_path / "one") and os.path.exists(tmp_path / "one/weights.safetensors")
  monkeypatch.setattr(draft_format, "MAX_FILE_BYTES", LIMIT)
  path = str(tmp_path / "sharded")
  sharded = _save_and_load(kind, cfg, params, path)
  shards = sorted(glob.glob(os.path.join(path, "weights-*.safetensors")))
  assert len(shards) > 1 and not os.path.exists(os.path.join(path, "weights.safetensors"))
  assert all(os.path.getsize(s) <= LIMIT + 4_096 for s in shards)  # + the safetensors header
  index = json.load(open(os.path.join(path, draft_format.INDEX_FILE)))
  assert sorted(set(index["weight_map"].values())) == [os.path.basename(s) for s in shards]
  assert drafts.weight_files(path) == [draft_format.INDEX_FILE] + [os.path.basename(s)
                                                                   for s in shards]
  if kind == "medusa":  # its own [3, 32, D] head is larger than a file: cut into parts
    assert index["split"]["head"] > 1 and "head@0" in index["weight_map"]
  jax.tree.map(np.testing.assert_array_equal, sharded, whole)


def test_rewriting_a_directory_leaves_no_stale_weight_files(model, tmp_path, monkeypatch):
  cfg, params = model
  path = str(tmp_path / "d")
  monkeypatch.setattr(draft_format, "MAX_FILE_BYTES", LIMIT)
  _save_and_load("medusa", cfg, params, path)
  monkeypatch.setattr(draft_format, "MAX_FILE_BYTES", 10**9)
  loaded = _save_and_load("eagle", cfg, params, path)  # loads: no Medusa shard is in the way
  assert sorted(os.listdir(path)) == ["draft.json", "weights.safetensors"]
  jax.tree.map(np.testing.assert_array_equal, loaded,
               _save_and_load("eagle", cfg, params, str(tmp_path / "fresh")))


def test_broken_shard_sets_are_refused(model, tmp_path, monkeypatch):
  cfg, params = model
  monkeypatch.setattr(draft_format, "MAX_FILE_BYTES", LIMIT)
  path = str(tmp_path / "d")
  _save_and_load("medusa", cfg, params, path)
  index_file = os.path.join(path, draft_format.INDEX_FILE)
  index = json.load(open(index_file))
  load = lambda: drafts.load_medusa(path, cfg, params)

  bad = dict(index, split=dict(index["split"], head=index["split"]["head"] + 1))
  json.dump(bad, open(index_file, "w"))
  with pytest.raises(CheckpointError, match=r"tensor 'head' is split into .* the shards lack"):
    load()
  wm = dict(index["weight_map"])
  wm.pop("res_b")
  json.dump(dict(index, weight_map=wm), open(index_file, "w"))
  with pytest.raises(CheckpointError, match="other than"):
    load()
  json.dump(index, open(index_file, "w"))
  load()  # intact again
  shard = os.path.join(path, index["weight_map"]["head@0"])
  os.remove(shard)
  with pytest.raises(CheckpointError, match="missing or corrupt Medusa heads weights"):
    load()


def test_a_non_finite_part_of_a_split_tensor_is_refused(model, tmp_path, monkeypatch):
  from safetensors.numpy import load_file, save_file

  cfg, params = model
  monkeypatch.setattr(draft_format, "MAX_FILE_BYTES", LIMIT)
  path = str(tmp_path / "d")
  _save_and_load("medusa", cfg, params, path)
  index = json.load(open(os.path.join(path, draft_format.INDEX_FILE)))
  last = f"head@{index['split']['head'] - 1}"
  shard = os.path.join(path, index["weight_map"][last])
  t = load_file(shard)
  t[last][0, 0] = np.nan
  save_file(t, shard)
  with pytest.raises(CheckpointError, match="'head' holds non-finite"):
    drafts.load_medusa(path, cfg, params)


def test_no_shipped_file_is_over_16_mb():
  assets = os.path.join(os.path.dirname(drafts.__file__), "..", "assets")
  sizes = {f: os.path.getsize(f) for f in glob.glob(os.path.join(assets, "**", "*"),
                                                    recursive=True) if os.path.isfile(f)}
  assert sizes and max(sizes.values()) <= 16_000_000, max(sizes, key=sizes.get)
  assert draft_format.MAX_FILE_BYTES <= 16_000_000
