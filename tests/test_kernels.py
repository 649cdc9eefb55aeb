"""The CPU streaming matmul against its jnp reference, and packed weights in the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache as kvc
from specjax.drafters import ModelDrafter
from specjax.kernels import packed as pk
from specjax.kernels import streaming_matmul as sm
from specjax.model import forward
from specjax.speculative import SpeculativeDecoder
from specjax.testing import tiny_model

pytestmark = pytest.mark.skipif(not sm.available(), reason=str(sm.unavailable_reason()))


def _rand(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("k,n", [(3, 64), (64, 192), (100, 100), (576, 960)])
def test_kernel_matches_reference_and_numpy(m, k, n):
  x, w = _rand((m, k), 0), _rand((k, n), 1)
  panels = jnp.asarray(sm.to_panels(w))
  got = np.asarray(jax.jit(sm.streaming_matmul)(jnp.asarray(x), panels))
  ref = np.asarray(sm.reference(jnp.asarray(x), panels))
  assert got.shape == (m, panels.shape[0] * sm.PANEL)
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.sqrt(k))
  np.testing.assert_allclose(got[:, :n], x.astype(np.float64) @ w, rtol=1e-5,
                             atol=1e-5 * np.sqrt(k))
  assert np.all(got[:, n:] == 0)  # zero padding columns stay zero


def test_each_row_is_bit_identical_whatever_else_is_in_the_call():
  """What makes a verify step agree exactly with decode steps on the same rows."""
  x, w = _rand((13, 576), 2), _rand((576, 256), 3)
  panels = jnp.asarray(sm.to_panels(w))
  f = jax.jit(sm.streaming_matmul)
  full = np.asarray(f(jnp.asarray(x), panels))
  for r in range(13):
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[r:r + 1]), panels))[0], full[r])
  np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[5:12]), panels)), full[5:12])


def test_pack_unpack_round_trip_and_dense():
  w = _rand((40, 130), 4)
  pw = pk.pack(w)
  assert pw.shape == (40, 130) and pw.panels.shape == (3, 40, 64)
  np.testing.assert_array_equal(np.asarray(pw.unpack()), w)
  np.testing.assert_array_equal(np.asarray(pk.unpacked(pw)), w)
  for rows in (1, 3 * 7, 200):
    x = _rand((rows, 40), rows).reshape(1, rows, 40)
    got = np.asarray(pk.dense(jnp.asarray(x), pw))
    assert got.shape == (1, rows, 130)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(pk.dense(jnp.asarray(x), jnp.asarray(w))),
                                np.asarray(jnp.asarray(x) @ jnp.asarray(w)))


def test_bad_inputs_are_refused():
  panels = jnp.asarray(sm.to_panels(_rand((8, 64), 0)))
  with pytest.raises(ValueError, match="panels"):
    sm.streaming_matmul(jnp.ones((2, 9)), panels)
  with pytest.raises(ValueError, match="float32"):
    sm.streaming_matmul(jnp.ones((2, 8), jnp.bfloat16), panels)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_forward_matches_plain(tied):
  cfg, params = tiny_model(seed=0, tie_embeddings=tied)
  if not tied:
    params = dict(params, lm_head=jnp.asarray(_rand((cfg.dim, cfg.vocab_size), 5)))
  packed = pk.pack_params(params, cfg.tie_embeddings)
  assert pk.pack_params(packed, cfg.tie_embeddings)["lm_head"] is packed["lm_head"]  # idempotent
  assert isinstance(packed["layers"][0]["wqkv"], pk.PackedWeight)
  tokens = jnp.asarray([[1, 5, 9, 2, 7], [3, 3, 4, 0, 1]])
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  a = forward(params, cfg, tokens, pos, kvc.init_cache(cfg, 2, 8))
  b = forward(packed, cfg, tokens, pos, kvc.init_cache(cfg, 2, 8))
  np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(b.cache.k[1]), np.asarray(a.cache.k[1]), atol=1e-5)


def test_unpack_inverts_pack_and_consumers_of_raw_weights_accept_packed_models(tmp_path):
  from specjax.distill.vocab import DraftSpec, init_from_target
  from specjax.loaders import load_hf, save_hf
  cfg, params = tiny_model(seed=0, tie_embeddings=False)
  params = dict(params, lm_head=jnp.asarray(_rand((cfg.dim, cfg.vocab_size), 5)))
  packed = pk.pack_params(params, cfg.tie_embeddings)
  for a, b in zip(jax.tree.leaves(pk.unpack_params(packed, False)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  save_hf(str(tmp_path), cfg, packed)
  _, loaded = load_hf(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(loaded["layers"][1]["w_down"]),
                                np.asarray(params["layers"][1]["w_down"]))
  _, draft = init_from_target(cfg, packed, DraftSpec(layers=(1,)), None)
  assert not any(isinstance(w, pk.PackedWeight) for w in draft["layers"][0].values())


@pytest.mark.parametrize("gamma", [1, 4])
def test_speculative_greedy_on_packed_models_equals_plain_greedy(gamma):
  cfg, params = tiny_model(seed=0)
  dcfg, dparams = tiny_model(seed=1, num_layers=1)
  params = pk.pack_params(params, cfg.tie_embeddings)
  prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11, 12, 13]]
  ref = specjax.generate(params, cfg, prompts, 24, eos_ids=())
  for drafter, draft in ((ModelDrafter(dcfg), pk.pack_params(dparams, dcfg.tie_embeddings)),
                         (ModelDrafter(cfg), params)):
    dec = SpeculativeDecoder(cfg, drafter, gamma=gamma, eos_ids=())
    out = dec.generate(params, drafter.make_params(draft), prompts, 24)
    for row in range(len(prompts)):
      assert out.generated(row) == ref.generated(row)


def test_load_model_packs_by_default_and_falls_back_without_the_kernel(tmp_path, monkeypatch,
                                                                       caplog):
  from specjax.loaders import load_model, save_hf
  cfg, params = tiny_model(seed=0)
  save_hf(str(tmp_path), cfg, params)
  assert isinstance(load_model(str(tmp_path))[1]["layers"][0]["wqkv"], pk.PackedWeight)
  assert not isinstance(load_model(str(tmp_path), packed=False)[1]["layers"][0]["wqkv"],
                        pk.PackedWeight)
  monkeypatch.setattr(sm, "_register", lambda: "no C++ compiler (test)")
  with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
    load_model(str(tmp_path), packed=True)
  _, fallback = load_model(str(tmp_path))
  assert not isinstance(fallback["layers"][0]["wqkv"], pk.PackedWeight)
  assert "no C++ compiler" in caplog.text
