"""The fused projections' column order: round trips, the model's reading of it, and the
reordering of files written in the older concatenated order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import drafts, param_layout as pl
from specjax.loaders.hf_layout import params_from_hf, params_to_hf
from specjax.model import forward, init_params
from specjax import kv_cache as kvc
from specjax.testing import tiny_config


def test_worked_example():
  q, k, v = np.array([["q0", "q1"]]), np.array([["k0", "k1"]]), np.array([["v0", "v1"]])
  assert pl.fuse_qkv(q, k, v, 2).tolist() == [["q0", "k0", "v0", "q1", "k1", "v1"]]
  assert pl.fuse_gate_up(np.array(["g0", "g1"]), np.array(["u0", "u1"])).tolist() == [
      "g0", "u0", "g1", "u1"]


@pytest.mark.parametrize("n,kh,h", [(4, 2, 3), (6, 2, 2), (4, 4, 2), (3, 1, 4)])
def test_round_trips_and_contiguous_shards(n, kh, h):
  rng = np.random.default_rng(0)
  d, f = 5, 6
  q, k, v = (rng.normal(size=(d, c)) for c in (n * h, kh * h, kh * h))
  w = pl.fuse_qkv(q, k, v, kh)
  assert w.shape == (d, (n + 2 * kh) * h)
  for a, b in zip(pl.split_qkv(w, n, kh, h), (q, k, v)):
    np.testing.assert_array_equal(a, b)
  # A contiguous column shard for kv heads [s·K/m, (s+1)·K/m) holds exactly their q, k, v.
  g = n // kh
  for m in [m for m in range(1, kh + 1) if kh % m == 0]:
    for s, cols in enumerate(np.split(w, m, axis=1)):
      heads = range(s * kh // m, (s + 1) * kh // m)
      want = np.concatenate([np.concatenate([q[:, j * g * h:(j + 1) * g * h],
                                             k[:, j * h:(j + 1) * h], v[:, j * h:(j + 1) * h]], 1)
                             for j in heads], 1)
      np.testing.assert_array_equal(cols, want)
  gate, up = rng.normal(size=(d, f)), rng.normal(size=(d, f))
  gu = pl.fuse_gate_up(gate, up)
  np.testing.assert_array_equal(np.stack(pl.split_gate_up(gu)), np.stack([gate, up]))
  for m in (1, 2, 3, 6):
    for s, cols in enumerate(np.split(gu, m, axis=1)):
      sl = slice(s * f // m, (s + 1) * f // m)
      np.testing.assert_array_equal(pl.split_gate_up(cols)[0], gate[:, sl])
  # jax in, jax out; the older concatenation reorders to the same fused matrices.
  assert isinstance(pl.fuse_qkv(*map(jnp.asarray, (q, k, v)), kh), jax.Array)
  old = {"wqkv": np.concatenate([q, k, v], 1), "bqkv": np.concatenate([q[0], k[0], v[0]]),
         "w_gate_up": np.concatenate([gate, up], 1), "wo": "kept"}
  new = pl.from_concatenated(old, n, kh, h)
  np.testing.assert_array_equal(new["wqkv"], w)
  np.testing.assert_array_equal(new["bqkv"], pl.fuse_qkv(q[0], k[0], v[0], kh))
  np.testing.assert_array_equal(new["w_gate_up"], gu)
  assert new["wo"] == "kept"
  with pytest.raises(ValueError, match="do not fit"):
    pl.fuse_qkv(q, k[:, :-1], v, kh)


def _torch_free_reference(cfg, hf, tokens):
  """Float64 numpy forward from HF-named tensors: the model must read its fused layout
  as these separate projections (GQA head j -> kv head j // G, SiLU(gate) * up)."""
  n, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  g = n // kh
  x = hf["model.embed_tokens.weight"][tokens].astype(np.float64)
  t = len(tokens)
  pos = np.arange(t)
  inv = 1.0 / cfg.rope_theta ** (np.arange(0, h, 2) / h)
  ang = pos[:, None] * inv[None]
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
  rope = lambda z: z * cos[:, None] + np.concatenate([-z[..., h // 2:], z[..., :h // 2]],
                                                     -1) * sin[:, None]
  rms = lambda z, w: z / np.sqrt((z * z).mean(-1, keepdims=True) + cfg.norm_eps) * w
  for i in range(cfg.num_layers):
    w = lambda name: hf[f"model.layers.{i}.{name}.weight"]
    y = rms(x, w("input_layernorm"))
    q = rope((y @ w("self_attn.q_proj").T).reshape(t, n, h))
    k = rope((y @ w("self_attn.k_proj").T).reshape(t, kh, h))
    v = (y @ w("self_attn.v_proj").T).reshape(t, kh, h)
    s = np.einsum("tnh,snh->nts", q, np.repeat(k, g, axis=1)) / np.sqrt(h)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("nts,snh->tnh", p, np.repeat(v, g, axis=1)).reshape(t, n * h)
    x = x + o @ w("self_attn.o_proj").T
    y = rms(x, w("post_attention_layernorm"))
    gate, up = y @ w("mlp.gate_proj").T, y @ w("mlp.up_proj").T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w("mlp.down_proj").T
  return rms(x, hf["model.norm.weight"]) @ hf["model.embed_tokens.weight"].T


def test_model_reads_the_layout_as_separate_projections():
  cfg = tiny_config(dim=48, num_heads=6, num_kv_heads=2, tie_embeddings=True)
  params = init_params(cfg, jax.random.PRNGKey(3), scale=0.3)
  hf = params_to_hf(cfg, params)
  tokens = np.array([3, 14, 15, 9, 2, 6])
  out = forward(params, cfg, jnp.asarray(tokens)[None], jnp.arange(6)[None],
                kvc.init_cache(cfg, 1, 8), attention_impl="reference")
  np.testing.assert_allclose(out.logits[0], _torch_free_reference(cfg, hf, tokens), atol=2e-4)
  back = params_from_hf(cfg, hf.__getitem__, jnp.float32)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_eagle_files_in_the_older_order_still_load(tmp_path):
  from specjax.drafters.eagle import random_eagle_weights
  cfg = tiny_config()
  params = init_params(cfg, jax.random.PRNGKey(0), scale=0.3)
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(1))
  drafts.save_eagle(str(tmp_path / "new"), cfg, weights, None, tokenizer_sha256="x",
                    dtype=np.float32)
  # The same weights as an older file: q|k|v and gate|up concatenated, no param_layout.
  import json, shutil
  from safetensors.numpy import load_file, save_file
  shutil.copytree(tmp_path / "new", tmp_path / "old")
  meta = json.loads((tmp_path / "old" / "draft.json").read_text())
  assert meta.pop("param_layout") == pl.LAYOUT
  (tmp_path / "old" / "draft.json").write_text(json.dumps(meta))
  t = load_file(tmp_path / "old" / "weights.safetensors")
  n, kh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  t["layers.0.wqkv"] = np.concatenate(pl.split_qkv(t["layers.0.wqkv"], n, kh, h), 1)
  t["layers.0.w_gate_up"] = np.concatenate(pl.split_gate_up(t["layers.0.w_gate_up"]), 1)
  save_file(t, tmp_path / "old" / "weights.safetensors")
  _, new = drafts.load_eagle(str(tmp_path / "new"), cfg, params)
  _, old = drafts.load_eagle(str(tmp_path / "old"), cfg, params)
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(old)):
    np.testing.assert_array_equal(a, b)
  meta["param_layout"] = "someday-v9"
  (tmp_path / "old" / "draft.json").write_text(json.dumps(meta))
  with pytest.raises(ValueError, match="someday-v9"):
    drafts.load_eagle(str(tmp_path / "old"), cfg, params)
