"""Draft directories past one file's size (``specjax.drafts.shards``): the tensors go to shards
of at most ``MAX_FILE_BYTES`` tensor bytes each (a larger tensor flattened and cut into
parts), listed by an index, and load back bit for bit in every draft format; broken shard
sets and malformed indexes are refused."""

import glob
import json
import os
import struct

import jax
import numpy as np
import pytest

from specjax import drafts
from specjax.drafters.eagle import random_eagle_weights
from specjax.drafters.medusa import random_medusa_weights
from specjax.drafts import shards
from specjax.loaders import CheckpointError
from specjax.testing import tiny_model

LIMIT = 6_000  # bytes: small enough that every tiny draft below needs several files


@pytest.fixture(scope="module")
def model():
  return tiny_model(seed=0)


def _tensor_bytes(file):
  """Bytes of tensor data in a safetensors file: its size less the 8-byte length and header."""
  with open(file, "rb") as f:
    header = struct.unpack("<Q", f.read(8))[0]
  return os.path.getsize(file) - 8 - header


def _save_and_load(kind, cfg, params, path):
  """The loaded params of one draft of ``kind`` written to ``path``."""
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
  assert drafts.weight_files(str(tmp_path / "one")) == ["weights.safetensors"]
  monkeypatch.setattr(shards, "MAX_FILE_BYTES", LIMIT)
  path = str(tmp_path / "sharded")
  sharded = _save_and_load(kind, cfg, params, path)
  files = sorted(glob.glob(os.path.join(path, "weights-*.safetensors")))
  assert len(files) > 1 and not os.path.exists(os.path.join(path, "weights.safetensors"))
  assert all(_tensor_bytes(f) <= LIMIT for f in files)
  index = json.load(open(os.path.join(path, shards.INDEX_FILE)))
  assert sorted(set(index["weight_map"].values())) == [os.path.basename(f) for f in files]
  assert drafts.weight_files(path) == [shards.INDEX_FILE] + [os.path.basename(f) for f in files]
  if kind == "medusa":  # its own [3, 32, D] head is larger than a file: cut into parts
    assert index["split"]["head"]["parts"] > 1 and "head@0" in index["weight_map"]
  jax.tree.map(np.testing.assert_array_equal, sharded, whole)


def test_any_shape_round_trips_and_every_file_keeps_to_the_limit(tmp_path):
  rng = np.random.default_rng(0)
  tensors = {"scalar": np.float32(2.5) * np.ones(()), "empty": np.zeros((0, 3), np.float16),
             "wide_row": rng.normal(size=(2, 2_000)).astype(np.float32),  # a row > LIMIT
             "one_row": rng.normal(size=(1, 3_000)).astype(np.float16),
             "ids": np.arange(5_000, dtype=np.int32), "small": np.ones((3, 4), np.float16)}
  for limit in (LIMIT, 10**9):  # sharded, then one file
    shards.write_tensors(str(tmp_path), tensors, max_file_bytes=limit)
    back = shards.read_tensors(str(tmp_path))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
      assert back[k].shape == v.shape and back[k].dtype == v.dtype, k
      np.testing.assert_array_equal(back[k], v)
    assert all(_tensor_bytes(os.path.join(tmp_path, f)) <= limit
               for f in shards.weight_files(str(tmp_path)) if f.endswith(".safetensors"))
  assert sorted(os.listdir(tmp_path)) == ["weights.safetensors"]  # no stale shard left


def test_parts_cut_along_leading_axes_read_as_the_tensor(tmp_path):
  """The reader joins any parts whose C-order values are the tensor's, e.g. one per head."""
  from safetensors.numpy import save_file

  t = np.arange(3 * 4 * 5, dtype=np.float16).reshape(3, 4, 5)
  save_file({f"head@{i}": t[i:i + 1] for i in range(3)},
            str(tmp_path / "weights-00001-of-00001.safetensors"))
  with open(tmp_path / shards.INDEX_FILE, "w") as f:
    json.dump({"weight_map": {f"head@{i}": "weights-00001-of-00001.safetensors"
                              for i in range(3)},
               "split": {"head": {"parts": 3, "shape": [3, 4, 5]}}}, f)
  np.testing.assert_array_equal(shards.read_tensors(str(tmp_path))["head"], t)


def test_the_shipped_sharded_drafts_read_whole():
  assets = os.path.join(os.path.dirname(drafts.__file__), "..", "assets")
  medusa = shards.read_tensors(os.path.join(assets, "smollm2_medusa"))
  assert medusa["head"].shape == (4, 8192, 576) and medusa["res_w"].shape == (4, 2, 576, 576)
  token = shards.read_tensors(os.path.join(assets, "smollm2_draft"))
  assert token["model.embed_tokens.weight"].shape == (11008, 576)


def test_bad_writes_are_refused(tmp_path):
  big = np.zeros(4_000, np.float32)
  with pytest.raises(ValueError, match="contain '@'"):
    shards.write_tensors(str(tmp_path), {"a@0": big, "a": big}, max_file_bytes=LIMIT)
  for limit in (0, 2, True, 1.5e4):
    with pytest.raises(ValueError, match="max_file_bytes must be an int >= 4"):
      shards.write_tensors(str(tmp_path), {"a": big}, max_file_bytes=limit)


def test_rewriting_a_directory_leaves_no_stale_weight_files(model, tmp_path, monkeypatch):
  cfg, params = model
  path = str(tmp_path / "d")
  monkeypatch.setattr(shards, "MAX_FILE_BYTES", LIMIT)
  _save_and_load("medusa", cfg, params, path)
  monkeypatch.setattr(shards, "MAX_FILE_BYTES", 10**9)
  loaded = _save_and_load("eagle", cfg, params, path)  # loads: no Medusa shard is in the way
  assert sorted(os.listdir(path)) == ["draft.json", "weights.safetensors"]
  jax.tree.map(np.testing.assert_array_equal, loaded,
               _save_and_load("eagle", cfg, params, str(tmp_path / "fresh")))


def test_a_head_cut_from_a_sharded_eagle_draft(model, tmp_path, monkeypatch):
  cfg, params = model
  monkeypatch.setattr(shards, "MAX_FILE_BYTES", LIMIT)
  src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
  _save_and_load("eagle", cfg, params, src)
  drafts.cut_eagle_head(src, dst, 8)
  d, dp = drafts.load_eagle(dst, cfg, params, tokenizer_sha256="abc")
  np.testing.assert_array_equal(dp["vocab_map"], np.arange(0, cfg.vocab_size, 2)[:8])


def _index_case(index, case):
  """``index`` broken one way (the name says how)."""
  wm, split = dict(index["weight_map"]), json.loads(json.dumps(index["split"]))
  if case == "no_weight_map":
    return {"split": split}
  if case == "outside":
    wm["res_b"] = "../weights-00001-of-00002.safetensors"
  if case == "listed_not_held":
    wm["ghost"] = wm["res_b"]
  if case == "held_not_listed":
    wm.pop("res_b")
  if case == "missing_part":
    split["head"]["parts"] += 1
  if case == "stray_part":
    split["head"]["parts"] -= 1
  if case == "wrong_shape":
    split["head"]["shape"][0] += 1
  if case == "whole_and_split":
    wm["head"] = wm["res_b"]
  if case == "bad_split":
    split["head"] = 3
  return dict(index, weight_map=wm, split=split)


@pytest.mark.parametrize("case,match", [
    ("no_weight_map", "no weight_map"), ("outside", "not shard names"),
    ("listed_not_held", r"lacks \['ghost'\], which .* lists there"),
    ("held_not_listed", r"holds \['res_b'\], which .* does not list there"),
    ("missing_part", r"parts \['head@\d+'\] are not in weight_map"),
    ("stray_part", r"look like parts of a split tensor"),
    ("wrong_shape", "values, not the"), ("whole_and_split", "both whole and split"),
    ("bad_split", "split must map")])
def test_malformed_indexes_are_refused(model, tmp_path, monkeypatch, case, match):
  cfg, params = model
  monkeypatch.setattr(shards, "MAX_FILE_BYTES", LIMIT)
  path = str(tmp_path / "d")
  _save_and_load("medusa", cfg, params, path)
  index_file = os.path.join(path, shards.INDEX_FILE)
  with open(index_file) as f:
    index = json.load(f)
  with open(index_file, "w") as f:
    json.dump(_index_case(index, case), f)
  with pytest.raises(CheckpointError, match=match):
    drafts.load_medusa(path, cfg, params)


def test_a_missing_shard_or_a_non_finite_part_is_refused(model, tmp_path, monkeypatch):
  from safetensors.numpy import load_file, save_file

  cfg, params = model
  monkeypatch.setattr(shards, "MAX_FILE_BYTES", LIMIT)
  path = str(tmp_path / "d")
  _save_and_load("medusa", cfg, params, path)
  with open(os.path.join(path, shards.INDEX_FILE)) as f:
    index = json.load(f)
  last = f"head@{index['split']['head']['parts'] - 1}"
  shard = os.path.join(path, index["weight_map"][last])
  t = load_file(shard)
  t[last][0] = np.nan
  save_file(t, shard)
  with pytest.raises(CheckpointError, match="'head' holds non-finite"):
    drafts.load_medusa(path, cfg, params)
  os.remove(shard)
  with pytest.raises(CheckpointError, match="missing or corrupt Medusa heads weights"):
    drafts.load_medusa(path, cfg, params)


def test_no_shipped_file_is_over_16_mb():
  assets = os.path.join(os.path.dirname(drafts.__file__), "..", "assets")
  sizes = {f: os.path.getsize(f) for f in glob.glob(os.path.join(assets, "**", "*"),
                                                    recursive=True) if os.path.isfile(f)}
  assert sizes and max(sizes.values()) <= 16_000_000, max(sizes, key=sizes.get)
  assert shards.MAX_FILE_BYTES <= 16_000_000 - 100_000  # room for a header
