"""The forward pass: cache consistency, explicit masks/positions, rollback, and HF parity."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv_cache as kvc
from specjax.config import RopeScaling
from specjax.generate import prefill
from specjax.loaders import load_hf, save_hf
from specjax.model import causal_mask, forward
from specjax.rope import inverse_frequencies, rope_tables
from specjax.testing import tiny_model

CACHE = 32
FULL = 16  # every teacher-forced reference is one [2, FULL] forward: one compile


@pytest.fixture(scope="module")
def model():
  return tiny_model(seed=0)


def _tokens(cfg, batch, length, seed=0):
  return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length), dtype=np.int32)


def _positions(batch, start, length):
  return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))


def _close(actual, desired):
  # float32 through two layers: a few ulps of logits of magnitude ~5 exceed 1e-5 absolute.
  np.testing.assert_allclose(actual, desired, atol=1e-5, rtol=1e-5)


def _teacher_forced(params, cfg, *seqs):
  """Logits [len, V] of one forward over each whole sequence from an empty cache.

  Sequences are right-padded into a [2, FULL] batch; causality keeps the padding
  from affecting the real positions.
  """
  assert len(seqs) <= 2 and all(len(s) <= FULL for s in seqs)
  tokens = np.zeros((2, FULL), np.int32)
  for i, s in enumerate(seqs):
    tokens[i, :len(s)] = s
  logits = np.asarray(forward(params, cfg, jnp.asarray(tokens), _positions(2, 0, FULL),
                              kvc.init_cache(cfg, 2, CACHE)).logits)
  return [logits[i, :len(s)] for i, s in enumerate(seqs)]


def test_token_by_token_decode_matches_full_forward(model):
  cfg, params = model
  tokens = _tokens(cfg, 2, 12)
  cache = kvc.init_cache(cfg, 2, CACHE)
  steps = []
  for t in range(tokens.shape[1]):
    out = forward(params, cfg, jnp.asarray(tokens[:, t:t + 1]), _positions(2, t, 1), cache)
    cache = out.cache
    steps.append(np.asarray(out.logits))
  _close(np.concatenate(steps, 1), np.stack(_teacher_forced(params, cfg, *tokens)))
  np.testing.assert_array_equal(np.asarray(cache.lengths), [12, 12])


def test_chunked_prefill_matches_full_forward(model):
  cfg, params = model
  tokens = _tokens(cfg, 2, 12, seed=1)
  cache = kvc.init_cache(cfg, 2, CACHE)
  chunks, start = [], 0
  for size in (5, 3, 4):
    out = forward(params, cfg, jnp.asarray(tokens[:, start:start + size]),
                  _positions(2, start, size), cache)
    cache, start = out.cache, start + size
    chunks.append(np.asarray(out.logits))
  _close(np.concatenate(chunks, 1), np.stack(_teacher_forced(params, cfg, *tokens)))


def test_rows_of_different_lengths_via_num_valid_match_each_row_alone(model):
  # Row 1's prompt is shorter: its padding is written as scratch past its length
  # and must be invisible to (and overwritten by) its later decode steps.
  cfg, params = model
  lens = np.array([9, 4])
  seqs = _tokens(cfg, 2, 13, seed=2)
  prompt = np.where(np.arange(9)[None] < lens[:, None], seqs[:, :9], 0)
  out = forward(params, cfg, jnp.asarray(prompt), _positions(2, 0, 9),
                kvc.init_cache(cfg, 2, CACHE), num_valid=jnp.asarray(lens))
  cache = out.cache
  np.testing.assert_array_equal(np.asarray(cache.lengths), lens)
  decoded = [np.asarray(out.logits)[np.arange(2), lens - 1]]
  for i in range(3):  # each row continues with its own next token at its own position
    pos = lens + i
    out = forward(params, cfg, jnp.asarray(seqs[np.arange(2), pos][:, None]),
                  jnp.asarray(pos[:, None], jnp.int32), cache)
    cache = out.cache
    decoded.append(np.asarray(out.logits[:, 0]))
  decoded = np.stack(decoded, 1)  # [B, 4, V]: logits after tokens len-1 .. len+2
  alone = _teacher_forced(params, cfg, *(seqs[b, :lens[b] + 3] for b in range(2)))
  for b in range(2):
    _close(decoded[b], alone[b][lens[b] - 1:])


def test_generate_prefill_matches_full_forward(model):
  # specjax.generate.prefill, chunk smaller than the prompts and rows of different lengths.
  cfg, params = model
  lens = np.array([11, 6])
  seqs = _tokens(cfg, 2, 12, seed=3)
  cache = prefill(params, cfg, jnp.asarray(seqs), jnp.asarray(lens),
                  kvc.init_cache(cfg, 2, CACHE), chunk=4)
  np.testing.assert_array_equal(np.asarray(cache.lengths), lens)
  nxt = seqs[np.arange(2), lens][:, None]
  logits = np.asarray(forward(params, cfg, jnp.asarray(nxt), jnp.asarray(lens[:, None]),
                              cache).logits[:, 0])
  alone = _teacher_forced(params, cfg, *(seqs[b, :lens[b] + 1] for b in range(2)))
  for b in range(2):
    _close(logits[b], alone[b][-1])


def test_tree_mask_with_shared_position_equals_the_branch_alone(model):
  # Tokens [a, b, c] where b and c are siblings after a: c sees a but not b, and
  # b and c share position p+1. c's logits must equal a plain forward over [a, c].
  cfg, params = model
  prefix = _tokens(cfg, 2, 5, seed=4)
  p = prefix.shape[1]
  abc = np.array([[7, 19, 42], [3, 30, 11]], np.int32)
  base = forward(params, cfg, jnp.asarray(prefix), _positions(2, 0, p),
                 kvc.init_cache(cfg, 2, CACHE)).cache
  mask = jnp.broadcast_to(jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool), (2, 3, 3))
  tree_pos = jnp.asarray([[p, p + 1, p + 1]] * 2, jnp.int32)
  tree = np.asarray(forward(params, cfg, jnp.asarray(abc), tree_pos, base, mask=mask).logits)
  branch_b = _teacher_forced(params, cfg, *np.concatenate([prefix, abc[:, :2]], 1))
  branch_c = _teacher_forced(params, cfg, *np.concatenate([prefix, abc[:, ::2]], 1))
  for r in range(2):
    _close(tree[r, :2], branch_b[r][p:])
    _close(tree[r, 2], branch_c[r][p + 1])
  # Sanity: the mask matters (c attending to b would give different logits).
  causal = forward(params, cfg, jnp.asarray(abc), tree_pos, base)
  assert np.abs(np.asarray(causal.logits)[:, 2] - tree[:, 2]).max() > 1e-3


def test_default_mask_is_causal(model):
  cfg, params = model
  tokens = jnp.asarray(_tokens(cfg, 2, FULL, seed=5))
  cache = kvc.init_cache(cfg, 2, CACHE)
  implicit = forward(params, cfg, tokens, _positions(2, 0, FULL), cache).logits
  explicit = forward(params, cfg, tokens, _positions(2, 0, FULL), cache,
                     mask=causal_mask(2, FULL)).logits
  np.testing.assert_array_equal(np.asarray(implicit), np.asarray(explicit))


def test_rope_tables_are_computed_once_per_forward(model):
  # XLA:CPU fused the cos and sin into every layer's rotation (once per head); rope_tables
  # keeps them one computation (a conditional's two branches), and the values are unchanged.
  cfg, params = model
  tokens = jnp.asarray(_tokens(cfg, 1, 9, seed=6))
  cache = kvc.init_cache(cfg, 1, CACHE)
  run = jax.jit(lambda t, p: forward(params, cfg, t, p, cache).logits)
  hlo = run.lower(tokens, _positions(1, 3, 9)).compile().as_text()
  if jax.default_backend() == "cpu":
    assert cfg.num_layers >= 2 and hlo.count("cosine(") <= 2, hlo.count("cosine(")
  positions = _positions(2, 0, 9) * 7
  cos, sin = rope_tables(positions, inverse_frequencies(cfg))
  angles = np.asarray(positions, np.float32)[..., None] * inverse_frequencies(cfg)
  np.testing.assert_allclose(np.asarray(cos)[:, :, 0], np.cos(angles), atol=2e-6)
  np.testing.assert_allclose(np.asarray(sin)[:, :, 0], np.sin(angles), atol=2e-6)
  assert cos.shape == sin.shape == (2, 9, 1, cfg.head_dim // 2)


def test_rope_tables_skip_the_conditional_under_a_multi_device_mesh(model, monkeypatch):
  # Under a mesh of several devices the conditional's predicate would be a reduction across
  # them in every forward: the tables are computed plainly there, with the same values.
  from specjax import sharding
  cfg, _ = model
  positions = _positions(1, 3, 9)
  inv = inverse_frequencies(cfg)
  primitives = lambda: {e.primitive.name for e in jax.make_jaxpr(
      lambda p: rope_tables(p, inv))(positions).jaxpr.eqns}
  single = rope_tables(positions, inv)
  if jax.default_backend() == "cpu":
    assert "cond" in primitives()
  monkeypatch.setattr(sharding, "multi_device", lambda: True)
  assert "cond" not in primitives()
  for a, b in zip(rope_tables(positions, inv), single):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_rollback_equals_never_writing_the_rejected_tokens(model):
  cfg, params = model
  seqs = _tokens(cfg, 2, 12, seed=6)
  prefix, drafts, fresh = seqs[:, :5], seqs[:, 5:9], seqs[:, 9:12]
  cache = forward(params, cfg, jnp.asarray(prefix), _positions(2, 0, 5),
                  kvc.init_cache(cfg, 2, CACHE)).cache
  cache = forward(params, cfg, jnp.asarray(drafts), _positions(2, 5, 4), cache).cache
  keep = np.array([6, 8])  # row 0 keeps 1 draft, row 1 keeps 3
  cache = cache.rollback(jnp.asarray(keep))
  np.testing.assert_array_equal(np.asarray(cache.lengths), keep)
  out = forward(params, cfg, jnp.asarray(fresh), jnp.asarray(keep[:, None] + np.arange(3)), cache)
  never = _teacher_forced(params, cfg, *(np.concatenate([seqs[b, :keep[b]], fresh[b]])
                                         for b in range(2)))
  for b in range(2):
    _close(np.asarray(out.logits)[b], never[b][-3:])


def test_rollback_never_grows_a_row(model):
  cfg, _ = model
  cache = kvc.init_cache(cfg, 2, CACHE).with_lengths(jnp.asarray([3, 5]))
  np.testing.assert_array_equal(np.asarray(cache.rollback(jnp.asarray([4, 2])).lengths), [3, 2])


# --- Parity with Hugging Face transformers (torch) on tiny random checkpoints ---------------


def _randomize(model, std=0.15, seed=0):
  """Non-trivial weights everywhere: HF inits biases to 0 and norms to 1."""
  import torch

  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen) * std
      p.copy_(1.0 + noise if "norm" in name else noise * (5 if "bias" in name else 1))
  return model.eval()


def _hf_roundtrip(hf_model, path):
  hf_model.save_pretrained(path, safe_serialization=True)
  return load_hf(str(path))


def _hf_logits(hf_model, tokens, positions=None):
  import torch

  with torch.no_grad():
    kw = {} if positions is None else {"position_ids": torch.as_tensor(positions)}
    return hf_model(input_ids=torch.as_tensor(tokens, dtype=torch.long), **kw).logits.numpy()


def _ours(params, cfg, tokens, start=0):
  b, t = tokens.shape
  return np.asarray(forward(params, cfg, jnp.asarray(tokens), _positions(b, start, t),
                            kvc.init_cache(cfg, b, t)).logits)


def _tiny_hf(config_cls, **kw):
  base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager")
  return config_cls(**{**base, **kw})


def test_llama3_rope_gqa_untied_head_match_transformers(tmp_path):
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  # head_dim 8, theta 1e4: wavelengths 2π·{1, 10, 100, 1000}. With an original
  # context of 64 (thresholds 16 and 64) they fall in all three llama3 regimes.
  rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64, "rope_theta": 10000.0}
  torch.manual_seed(0)
  hf = _randomize(LlamaForCausalLM(_tiny_hf(LlamaConfig, rope_scaling=rope,
                                            tie_word_embeddings=False)))
  cfg, params = _hf_roundtrip(hf, tmp_path)
  assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)
  assert not cfg.tie_embeddings and "lm_head" in params
  assert cfg.num_kv_heads == 2 and cfg.num_heads == 4
  tokens = _tokens(cfg, 3, 10, seed=7)
  start = 50  # positions 50..59: the scaled low frequencies rotate noticeably
  ours = _ours(params, cfg, tokens, start)
  np.testing.assert_allclose(ours, _hf_logits(hf, tokens, _positions(3, start, 10)),
                             atol=1e-4, rtol=0)
  # The test has power: ignoring the scaling changes the logits well beyond tolerance.
  unscaled = _ours(params, dataclasses.replace(cfg, rope_scaling=None), tokens, start)
  assert np.abs(unscaled - ours).max() > 1e-2


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
  import torch
  from transformers import Qwen2Config, Qwen2ForCausalLM

  torch.manual_seed(0)
  hf = _randomize(Qwen2ForCausalLM(_tiny_hf(Qwen2Config, tie_word_embeddings=False)), std=0.3)
  cfg, params = _hf_roundtrip(hf, tmp_path_factory.mktemp("qwen2"))
  return hf, cfg, params


def test_qwen2_qkv_biases_match_transformers_logits(qwen2):
  hf, cfg, params = qwen2
  assert cfg.qkv_bias and "bqkv" in params["layers"][0]
  assert np.abs(np.asarray(params["layers"][0]["bqkv"])).max() > 0.1
  for seed in range(3):
    tokens = _tokens(cfg, 2, 9, seed=seed)
    np.testing.assert_allclose(_ours(params, cfg, tokens), _hf_logits(hf, tokens),
                               atol=1e-4, rtol=0)


def test_qwen2_greedy_generation_matches_transformers(qwen2):
  import torch
  from specjax.generate import generate

  hf, cfg, params = qwen2
  prompt = [3, 17, 5, 60, 22]
  ours = generate(params, cfg, [prompt], 20, eos_ids=()).generated(0)
  with torch.no_grad():
    ids = torch.tensor([prompt])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
  assert len(set(ours)) > 3  # a varied continuation, not one repeated token
  assert ours == ref[0, len(prompt):].tolist()


def test_save_hf_sharded_reloads_bit_exact(tmp_path):
  cfg, params = tiny_model(seed=1, rope_scaling=RopeScaling(4.0, 1.0, 4.0, 128),
                           eos_token_ids=(2,), bos_token_id=1)
  save_hf(str(tmp_path), cfg, params, max_shard_bytes=16_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  assert len(shards) > 2 and all((tmp_path / s).exists() for s in shards)
  assert not (tmp_path / "model.safetensors").exists()
  cfg2, params2 = load_hf(str(tmp_path))
  assert cfg2 == cfg
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_hf_output_loads_in_transformers(tmp_path):
  from transformers import LlamaForCausalLM

  cfg, params = tiny_model(seed=2, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
  save_hf(str(tmp_path), cfg, params)
  hf = LlamaForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
  tokens = _tokens(cfg, 2, 8, seed=8)
  np.testing.assert_allclose(_ours(params, cfg, tokens), _hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_mistral_config_loads_and_matches_transformers(tmp_path):
  import torch
  from transformers import MistralConfig, MistralForCausalLM

  torch.manual_seed(0)
  hf = _randomize(MistralForCausalLM(_tiny_hf(MistralConfig, head_dim=8)))
  cfg, params = _hf_roundtrip(hf, tmp_path)
  assert cfg.name == "mistral" and not cfg.qkv_bias
  assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mistral"
  tokens = _tokens(cfg, 2, 8, seed=9)
  np.testing.assert_allclose(_ours(params, cfg, tokens), _hf_logits(hf, tokens), atol=1e-4, rtol=0)
