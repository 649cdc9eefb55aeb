"""Checkpoint loaders: every failure is a CheckpointError, and GGUF q/k layout round-trips."""

import dataclasses
import json
import os

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from specjax.loaders import CheckpointError, load_gguf, load_hf, load_model, load_tokenizer, save_hf
from specjax.loaders.hf_layout import params_to_hf
from specjax.testing import tiny_config, tiny_model

# --- GGUF -------------------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py's q/k permutation (rotate-half -> interleaved pairs)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _write_gguf(path, cfg, hf_tensors, arch="llama", permute=True):
  """A float32 GGUF as llama.cpp's converter would write it from HF-layout tensors."""
  names = gguf.TensorNameMap(gguf.MODEL_ARCH[arch.upper()], cfg.num_layers)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_vocab_size(cfg.vocab_size)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.dim)
  w.add_feed_forward_length(cfg.ffn_dim)
  w.add_block_count(cfg.num_layers)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  for name, t in hf_tensors.items():
    if permute and ".q_proj." in name:
      t = _llama_cpp_permute(t, cfg.num_heads)
    elif permute and ".k_proj." in name:
      t = _llama_cpp_permute(t, cfg.num_kv_heads)
    w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(t))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


@pytest.mark.parametrize("tie", [False, True])
def test_gguf_unpermutes_llama_q_k_back_to_hf_layout_exactly(tmp_path, tie):
  cfg, params = tiny_model(seed=3, tie_embeddings=tie)  # GQA: 4 query heads, 2 kv heads
  hf = params_to_hf(cfg, params)
  path = _write_gguf(tmp_path / "tiny.gguf", cfg, hf)
  cfg2, params2, md = load_gguf(path)
  assert md["general.architecture"] == "llama"
  assert cfg2.norm_eps == pytest.approx(cfg.norm_eps)  # GGUF stores it as float32
  assert dataclasses.replace(cfg2, norm_eps=cfg.norm_eps) == cfg
  back = params_to_hf(cfg2, params2)
  assert back.keys() == hf.keys()
  for name, t in hf.items():
    np.testing.assert_array_equal(back[name], t, err_msg=name)
  # The test has power: the stored q differs from the HF layout.
  q = "model.layers.0.self_attn.q_proj.weight"
  assert not np.array_equal(_llama_cpp_permute(hf[q], cfg.num_heads), hf[q])


def test_gguf_qwen2_keeps_q_k_unpermuted_and_loads_biases(tmp_path):
  cfg, params = tiny_model(seed=4, qkv_bias=True, name="qwen2")
  hf = params_to_hf(cfg, params)
  path = _write_gguf(tmp_path / "qwen2.gguf", cfg, hf, arch="qwen2", permute=False)
  cfg2, params2, _ = load_gguf(path)
  assert cfg2.qkv_bias and cfg2.name == "qwen2"
  back = params_to_hf(cfg2, params2)
  for name, t in hf.items():
    np.testing.assert_array_equal(back[name], t, err_msg=name)


def test_missing_gguf_names_the_path(tmp_path):
  path = str(tmp_path / "nowhere.gguf")
  with pytest.raises(CheckpointError, match="nowhere.gguf"):
    load_gguf(path)
  with pytest.raises(CheckpointError, match="nowhere.gguf"):
    load_model(path)


def test_random_bytes_gguf_is_a_checkpoint_error(tmp_path):
  path = tmp_path / "noise.gguf"
  path.write_bytes(np.random.default_rng(0).bytes(4096))
  with pytest.raises(CheckpointError, match="noise.gguf"):
    load_gguf(str(path))


@pytest.mark.parametrize("keep", [20, 0.5])
def test_truncated_gguf_is_a_checkpoint_error(tmp_path, keep):
  cfg, params = tiny_model(seed=5)
  good = _write_gguf(tmp_path / "good.gguf", cfg, params_to_hf(cfg, params))
  data = open(good, "rb").read()
  path = tmp_path / "cut.gguf"
  path.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
  with pytest.raises(CheckpointError):
    load_gguf(str(path))


def test_unsupported_gguf_architecture_is_named(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
  w.add_block_count(1)
  w.add_embedding_length(8)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError, match="gpt2"):
    load_gguf(str(tmp_path / "gpt2.gguf"))


def test_gguf_missing_metadata_is_named(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError, match="llama.attention.head_count"):
    load_gguf(str(tmp_path / "bare.gguf"))


def test_gguf_missing_tensor_is_named(tmp_path):
  cfg, params = tiny_model(seed=6)
  hf = params_to_hf(cfg, params)
  del hf["model.layers.1.mlp.up_proj.weight"]
  path = _write_gguf(tmp_path / "holey.gguf", cfg, hf)
  with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
    load_gguf(path)


# --- Hugging Face directories -----------------------------------------------------------------


@pytest.fixture
def hf_dir(tmp_path):
  cfg, params = tiny_model(seed=7)
  save_hf(str(tmp_path), cfg, params)
  return tmp_path


def test_hf_dir_roundtrip_is_the_baseline(hf_dir):
  cfg, _ = load_hf(str(hf_dir))
  assert cfg == tiny_config()


def test_unsupported_hf_model_type_is_named(hf_dir):
  config = json.loads((hf_dir / "config.json").read_text())
  (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
  with pytest.raises(CheckpointError, match="gpt2"):
    load_hf(str(hf_dir))


def test_missing_hf_dir_and_config_are_checkpoint_errors(tmp_path, hf_dir):
  with pytest.raises(CheckpointError, match="does not exist"):
    load_hf(str(tmp_path / "nowhere"))
  os.remove(hf_dir / "config.json")
  with pytest.raises(CheckpointError, match="no config.json"):
    load_hf(str(hf_dir))


def test_corrupt_config_json_is_a_checkpoint_error(hf_dir):
  (hf_dir / "config.json").write_text('{"model_type": "llama", "vocab_')
  with pytest.raises(CheckpointError, match="config.json"):
    load_hf(str(hf_dir))


def test_config_json_missing_a_field_is_a_checkpoint_error(hf_dir):
  config = json.loads((hf_dir / "config.json").read_text())
  del config["hidden_size"]
  (hf_dir / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match="hidden_size"):
    load_hf(str(hf_dir))


def test_config_json_that_is_not_an_object_is_a_checkpoint_error(hf_dir):
  (hf_dir / "config.json").write_text("[1, 2]")
  with pytest.raises(CheckpointError, match="config.json"):
    load_hf(str(hf_dir))


@pytest.mark.parametrize("field", ["attention_bias", "mlp_bias"])
def test_llama_biases_specjax_cannot_represent_are_rejected(hf_dir, field):
  # Silently dropping the o_proj / MLP biases would load a different model.
  config = json.loads((hf_dir / "config.json").read_text())
  (hf_dir / "config.json").write_text(json.dumps({**config, field: True}))
  with pytest.raises(CheckpointError, match=field):
    load_hf(str(hf_dir))


def test_missing_safetensors_is_a_checkpoint_error(hf_dir):
  os.remove(hf_dir / "model.safetensors")
  with pytest.raises(CheckpointError, match="no model.safetensors"):
    load_hf(str(hf_dir))


def test_missing_shard_is_named(tmp_path):
  cfg, params = tiny_model(seed=8)
  save_hf(str(tmp_path), cfg, params, max_shard_bytes=16_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shard = index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
  os.remove(tmp_path / shard)
  with pytest.raises(CheckpointError, match=shard):
    load_hf(str(tmp_path))


def test_corrupt_safetensors_is_a_checkpoint_error(hf_dir):
  (hf_dir / "model.safetensors").write_bytes(np.random.default_rng(1).bytes(2048))
  with pytest.raises(CheckpointError, match="corrupt safetensors"):
    load_hf(str(hf_dir))


def test_truncated_safetensors_is_a_checkpoint_error(hf_dir):
  path = hf_dir / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(CheckpointError, match="model.safetensors"):
    load_hf(str(hf_dir))


def test_missing_tensor_is_named(hf_dir):
  cfg, params = tiny_model(seed=7)
  tensors = params_to_hf(cfg, params)
  del tensors["model.layers.0.self_attn.o_proj.weight"]
  save_file(tensors, str(hf_dir / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight"):
    load_hf(str(hf_dir))


def test_unknown_model_source_and_tokenizer_path_are_checkpoint_errors(tmp_path):
  with pytest.raises(CheckpointError, match="neither"):
    load_model(str(tmp_path / "model.bin"))
  with pytest.raises(CheckpointError, match="does not exist"):
    load_tokenizer(str(tmp_path / "tok.gguf"))


def test_smollm2_gguf_env_override_is_checked(tmp_path, monkeypatch):
  from specjax.loaders import embedded
  monkeypatch.setenv(embedded.GGUF_ENV, str(tmp_path / "absent.gguf"))
  with pytest.raises(CheckpointError, match="is not a file"):
    embedded.smollm2_gguf_path()
  short = tmp_path / "short.gguf"
  short.write_bytes(b"GGUF" + bytes(100))
  monkeypatch.setenv(embedded.GGUF_ENV, str(short))
  with pytest.raises(CheckpointError, match="not the 98362432 of"):
    embedded.smollm2_gguf_path()
  right = tmp_path / "right.gguf"
  with open(right, "wb") as f:
    f.truncate(embedded.GGUF_BYTES)
  monkeypatch.setenv(embedded.GGUF_ENV, str(right))
  assert embedded.smollm2_gguf_path() == str(right)
