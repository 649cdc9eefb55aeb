"""specjax.attention: dispatch, input checks, and tree-verify forwards through the kernels.

The kernels run in Pallas interpret mode here, down to greedy tree speculative
decoding whose verification goes through them.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import ancestor_mask, tree_attention_reference
from specjax import attention
from specjax import kv_cache as kvc
from specjax.model import forward
from specjax.testing import tiny_model

KERNEL_IMPLS = ("pallas_tpu_interpret", "pallas_gpu_interpret")
PARENTS = (-1, 0, 0, 1, 1, 2, 3)  # a 7-node tree, depths 0, 1, 1, 2, 2, 2, 3


def _inputs(b=2, t=3, kh=2, g=3, s=40, h=16, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, kh * g, h)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, kh, s, h)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, kh, s, h)), jnp.float32)
  lengths = jnp.asarray(np.linspace(0, s - t, b), jnp.int32)
  return q, k, v, lengths, jnp.tril(jnp.ones((t, t), bool))


def test_resolve_auto_and_pallas_per_backend(monkeypatch):
  assert attention.resolve_impl("auto", "cpu") == (
      "cpu" if attention.cpu_attention.available() else "reference")
  monkeypatch.setattr(attention.cpu_attention, "available", lambda: False)
  assert attention.resolve_impl("auto", "cpu") == "reference"
  with pytest.raises(ValueError, match="'cpu' attention kernel does not run here"):
    attention.resolve_impl("cpu", "cpu")
  monkeypatch.undo()
  with pytest.raises(ValueError, match="'cpu' attention kernel does not run here"):
    attention.resolve_impl("cpu", "tpu")
  assert attention.resolve_impl("auto", "tpu") == "pallas_tpu"
  assert attention.resolve_impl("auto", "gpu") == "pallas_gpu"
  assert attention.resolve_impl("pallas", "cuda") == "pallas_gpu"
  with pytest.raises(ValueError, match="no Pallas attention kernel"):
    attention.resolve_impl("pallas", "cpu")


def test_unknown_impl_raises_before_tracing():
  with pytest.raises(ValueError, match="unknown attention implementation"):
    attention.attention(*_inputs(), impl="flash")
  cfg, params = tiny_model(seed=0)
  with pytest.raises(ValueError, match="unknown attention implementation"):
    forward(params, cfg, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
            kvc.init_cache(cfg, 1, 8), attention_impl="flash")


def test_choice_is_logged_once(monkeypatch, caplog):
  monkeypatch.setattr(attention, "_logged", set())
  with caplog.at_level(logging.INFO):
    for _ in range(3):
      attention.attention(*_inputs(), impl="reference")
  assert sum("impl='reference' -> 'reference'" in r.getMessage() for r in caplog.records) == 1


def test_bad_mask_shape_raises_on_reference_path():
  q, k, v, lengths, mask = _inputs()
  with pytest.raises(ValueError, match="mask must be"):
    attention.attention(q, k, v, lengths, mask[:2], impl="reference")
  with pytest.raises(ValueError, match="not a multiple"):
    attention.attention(q[:, :, :5], k, v, lengths, mask, impl="reference")


@pytest.mark.parametrize("impl", ("reference",) + KERNEL_IMPLS)
def test_every_impl_matches_the_kernel_reference(impl):
  args = _inputs()
  got = attention.attention(*args, impl=impl)
  np.testing.assert_allclose(np.asarray(got), np.asarray(tree_attention_reference(*args)),
                             atol=1e-5, rtol=1e-5)


def test_auto_takes_window_masks_to_the_reference_on_gpu_and_tpu(monkeypatch):
  """Tree drafting and EAGLE's training-time test pass [B, T, W] window masks, which no
  Pallas kernel takes: "auto" must not send them to a kernel on a GPU or TPU (on CPU the
  CPU kernel takes them: tests/test_cpu_attention.py)."""
  q, k, v, lengths, _ = _inputs()
  b, t = q.shape[:2]
  window = jnp.ones((b, t, t + 2), bool)
  want = attention.attention(q, k, v, lengths, window, impl="reference")
  for backend in ("gpu", "tpu"):
    monkeypatch.setattr(attention.jax, "default_backend", lambda backend=backend: backend)
    assert attention.resolve_impl("auto") == "pallas_" + backend
    np.testing.assert_array_equal(np.asarray(attention.attention(q, k, v, lengths, window)),
                                  np.asarray(want))
    with pytest.raises(ValueError, match="window mask"):
      attention.attention(q, k, v, lengths, window, impl="pallas")


def test_auto_takes_blocks_over_the_kernel_budget_to_the_reference(monkeypatch):
  """Prefill and teacher-forced training run hundreds of new tokens at once, past the
  kernels' tree budget: "auto" sends them to the reference on a GPU or TPU; naming a
  kernel still refuses them."""
  from pallas_kernels.tree_attention.block_sizes import BlockSizes
  t = BlockSizes().max_tree_tokens + 1
  q = jax.random.normal(jax.random.PRNGKey(0), (1, t, 4, 8))
  k = jax.random.normal(jax.random.PRNGKey(1), (1, 2, t + 8, 8))
  lengths = jnp.array([3])
  causal = jnp.tril(jnp.ones((t, t), bool))
  want = attention.attention(q, k, k, lengths, causal, impl="reference")
  for backend in ("gpu", "tpu"):
    monkeypatch.setattr(attention.jax, "default_backend", lambda backend=backend: backend)
    np.testing.assert_array_equal(np.asarray(attention.attention(q, k, k, lengths, causal)),
                                  np.asarray(want))
    with pytest.raises(ValueError, match="budget"):
      attention.attention(q, k, k, lengths, causal, impl="pallas")


@pytest.mark.parametrize("threshold", (0, 1 << 40))  # K q^T order always / q K^T always
def test_reference_score_orders_match_the_kernel_reference(monkeypatch, threshold):
  monkeypatch.setattr(attention, "CACHE_MAJOR_SCORES_BYTES", threshold)
  args = _inputs()
  got = attention.attention(*args, impl="reference")
  np.testing.assert_allclose(np.asarray(got), np.asarray(tree_attention_reference(*args)),
                             atol=1e-5, rtol=1e-5)


def _tree_verify(cfg, params, impls, *, prompt_lengths=(13, 29), size=50):
  """Prefills rows of different lengths, then one tree-verify forward per impl."""
  b = len(prompt_lengths)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, max(prompt_lengths))), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(prompt.shape[1], dtype=jnp.int32), prompt.shape)
  lens = jnp.asarray(prompt_lengths, jnp.int32)
  cache = forward(params, cfg, prompt, pos, kvc.init_cache(cfg, b, size), num_valid=lens).cache
  mask = ancestor_mask(PARENTS)
  depth = mask.sum(-1) - 1  # a node sees itself and its ancestors
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, len(PARENTS))), jnp.int32)
  positions = lens[:, None] + jnp.asarray(depth)[None, :]
  masks = jnp.broadcast_to(jnp.asarray(mask), (b,) + mask.shape)
  return {impl: forward(params, cfg, tokens, positions, cache, masks, attention_impl=impl)
          for impl in impls}


def test_tree_verify_forward_through_kernels_matches_reference():
  # SmolLM2's attention geometry (9 query heads over 3 kv heads, head dim 64), two layers.
  cfg, params = tiny_model(seed=1, dim=576, num_heads=9, num_kv_heads=3, ffn_dim=128)
  outs = _tree_verify(cfg, params, ("reference",) + KERNEL_IMPLS)
  ref = outs["reference"]
  for impl in KERNEL_IMPLS:
    np.testing.assert_allclose(np.asarray(outs[impl].logits), np.asarray(ref.logits),
                               atol=1e-4, rtol=1e-4, err_msg=impl)
    np.testing.assert_array_equal(np.asarray(outs[impl].cache.lengths),
                                  np.asarray(ref.cache.lengths))


@pytest.mark.heavy
@pytest.mark.real_model
def test_smollm2_tree_verify_through_kernels_matches_reference():
  from specjax.loaders import load_model
  cfg, params = load_model()
  outs = _tree_verify(cfg, params, ("reference",) + KERNEL_IMPLS, prompt_lengths=(20, 45),
                      size=64)
  ref = np.asarray(outs["reference"].logits)
  for impl in KERNEL_IMPLS:
    got = np.asarray(outs[impl].logits)
    np.testing.assert_allclose(got, ref, atol=5e-4, rtol=1e-4, err_msg=impl)
    np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_greedy_tree_decoding_through_kernels_equals_plain_greedy(impl):
  """The target verifies each token tree through the interpret-mode kernel; the output is
  plain greedy decoding's, token for token (and the self-draft accepts full depth)."""
  import specjax
  from specjax.drafters import ModelDrafter
  from specjax.speculative import SpeculativeDecoder, TreeTopology

  cfg, params = tiny_model(seed=0)
  prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
  ref = specjax.generate(params, cfg, prompts, 10, eos_ids=())
  tree = TreeTopology((-1, -1, 0, 0, 1))
  for dcfg, dparams in (tiny_model(seed=1, num_layers=1), (cfg, params)):
    dec = SpeculativeDecoder(cfg, ModelDrafter(dcfg), tree=tree, eos_ids=(), attention_impl=impl)
    out = dec.generate(params, dec.drafter.make_params(dparams), prompts, 10)
    assert [out.generated(r) for r in range(2)] == [ref.generated(r) for r in range(2)]
  assert out.metrics()["tokens_per_call"] >= 2.5  # the self-draft accepts (nearly) full depth


def test_decoder_rejects_an_unknown_attention_impl():
  from specjax.drafters import ModelDrafter
  from specjax.speculative import SpeculativeDecoder
  cfg, _ = tiny_model(seed=0)
  with pytest.raises(ValueError, match="unknown attention implementation"):
    SpeculativeDecoder(cfg, ModelDrafter(cfg), attention_impl="flash")


def test_the_environment_replaces_auto_and_is_checked(monkeypatch):
  from specjax.attention import ENV, resolve_impl
  monkeypatch.setenv(ENV, "reference")
  assert resolve_impl("auto") == "reference"
  assert resolve_impl("pallas_gpu_interpret") == "pallas_gpu_interpret"  # explicit names stay
  monkeypatch.setenv(ENV, "xla")
  with pytest.raises(ValueError, match="SPECJAX_ATTENTION='xla' is not an attention"):
    resolve_impl("auto")
