"""The CPU attention kernel (``specjax/kernels/cpu_attention.py``) against its reference.

Pins: the kernel's output equals ``tree_attention_reference`` for trees, windows,
ragged lengths, full caches and rows that see nothing; a query's output is
bit-identical whatever else is in the call (other tokens, other rows) and to
decoding it alone; differentiated calls compute the reference path's value and
gradient; "auto" sends blocks of up to ``MAX_TOKENS`` to it on CPU and the rest
to the reference; operands it does not take are refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_attention import ancestor_mask, tree_attention_reference
from specjax import attention
from specjax.kernels import cpu_attention as ca

pytestmark = pytest.mark.skipif(not ca.available(), reason=f"{ca.unavailable_reason()}")

PARENTS = (-1, 0, 0, 1, 1, 2, 3)


def _operands(b, t, kh, g, s, h, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, kh * g, h)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, kh, s, h)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, kh, s, h)), jnp.float32)
  return q, k, v


def _random_trees(rng, b, t):
  """[B, T, T] ancestor masks of random trees (parents[i] < i)."""
  masks = []
  for _ in range(b):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
    masks.append(ancestor_mask(parents))
  return jnp.asarray(np.stack(masks))


@pytest.mark.parametrize("b,t,kh,g,s,h", [(1, 1, 3, 3, 64, 64), (2, 7, 2, 3, 40, 16),
                                          (3, 5, 1, 4, 9, 8), (2, 4, 2, 2, 30, 256),
                                          (4, 16, 3, 3, 80, 64), (1, 3, 2, 1, 12, 24),
                                          (2, 3, 2, 2, 20, 96)])  # 8 + 4 value vectors
def test_matches_the_reference_on_random_trees_and_ragged_lengths(b, t, kh, g, s, h):
  rng = np.random.default_rng(b * 100 + t)
  q, k, v = _operands(b, t, kh, g, s, h, seed=t)
  lengths = jnp.asarray(rng.integers(0, s - t + 1, size=b), jnp.int32).at[0].set(0)
  mask = _random_trees(rng, b, t)
  got = ca.cpu_attention(q, k, v, lengths, mask)
  want = tree_attention_reference(q, k, v, lengths, mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-5)


def test_full_cache_and_rows_that_see_nothing():
  """lengths + T past the cache (scratch writes of finished rows) reads only the slots that
  exist; a query that sees no slot (length 0, its own mask row empty) gets zeros."""
  q, k, v = _operands(3, 4, 2, 2, 10, 8)
  lengths = jnp.asarray([8, 0, 10], jnp.int32)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((4, 4), bool)), (3, 4, 4)).at[1, 2].set(False)
  got = np.asarray(ca.cpu_attention(q, k, v, lengths, mask))
  np.testing.assert_allclose(got, np.asarray(tree_attention_reference(q, k, v, lengths, mask)),
                             atol=2e-6, rtol=2e-5)
  np.testing.assert_array_equal(got[1, 2], 0.0)


def test_window_masks_match_the_reference_path():
  """A drafter extending a tree passes [B, T, W] windows: the new tokens are the last T of W
  slots after the committed prefix."""
  rng = np.random.default_rng(3)
  q, k, v = _operands(2, 3, 2, 3, 40, 16)
  lengths = jnp.asarray([5, 20], jnp.int32)
  window = jnp.asarray(rng.random((2, 3, 7)) < 0.5).at[:, :, 0].set(True)
  got = attention.attention(q, k, v, lengths, window, impl="cpu")
  want = attention.attention(q, k, v, lengths, window, impl="reference")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(ca.reference(q, k, v, lengths, window)),
                             np.asarray(want), atol=2e-6, rtol=2e-5)


def test_a_query_is_bit_identical_whatever_else_is_in_the_call():
  """Verification scores a tree's tokens exactly as decoding them one at a time would: each
  token alone (as a one-token window over the same slots), each row alone, and the whole
  block give the same bits."""
  t = len(PARENTS)
  q, k, v = _operands(3, t, 3, 3, 64, 64, seed=5)
  lengths = jnp.asarray([17, 0, 40], jnp.int32)
  mask = jnp.broadcast_to(jnp.asarray(ancestor_mask(PARENTS)), (3, t, t))
  block = np.asarray(jax.jit(ca.cpu_attention)(q, k, v, lengths, mask))
  for i in range(t):
    alone = ca.cpu_attention(q[:, i:i + 1], k, v, lengths, mask[:, i:i + 1])
    np.testing.assert_array_equal(np.asarray(alone)[:, 0], block[:, i])
  for b in range(3):
    row = ca.cpu_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], lengths[b:b + 1], mask[b:b + 1])
    np.testing.assert_array_equal(np.asarray(row)[0], block[b])


def test_a_verified_token_is_scored_exactly_as_decoding_it_would_be():
  """Chain verification (a causal block of T tokens after L committed) and decoding each token
  alone (T = 1 after L + i committed slots, the earlier tokens now committed) give the same
  bits. Control: decoding with one committed slot fewer changes the output, so the
  comparison would catch a kernel that loses a slot."""
  t, length = 5, 17
  q, k, v = _operands(1, t, 3, 3, 64, 64, seed=6)
  block = np.asarray(ca.cpu_attention(q, k, v, jnp.asarray([length], jnp.int32),
                                      jnp.tril(jnp.ones((1, t, t), bool))))
  one = jnp.ones((1, 1, 1), bool)
  for i in range(t):
    alone = ca.cpu_attention(q[:, i:i + 1], k, v, jnp.asarray([length + i], jnp.int32), one)
    np.testing.assert_array_equal(np.asarray(alone)[:, 0], block[:, i])
  short = ca.cpu_attention(q[:, 2:3], k, v, jnp.asarray([length + 1], jnp.int32), one)
  assert np.abs(np.asarray(short)[:, 0] - block[:, 2]).max() > 1e-3


def test_differentiated_calls_compute_the_reference_paths_value_and_gradient():
  """Training through the "cpu" implementation computes what it did before the kernel: the
  reference path's forward and gradient (the kernel has no derivative of its own)."""
  q, k, v = _operands(2, 3, 2, 2, 12, 8, seed=2)
  lengths = jnp.asarray([4, 9], jnp.int32)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((3, 3), bool)), (2, 3, 3))
  loss = lambda impl: lambda q, k, v: jnp.sum(jnp.sin(
      attention.attention(q, k, v, lengths, mask, impl=impl)))
  grad = lambda impl: jax.jit(jax.value_and_grad(loss(impl), argnums=(0, 1, 2)))(q, k, v)
  (got_value, got), (want_value, want) = grad("cpu"), grad("reference")
  np.testing.assert_allclose(float(got_value), float(want_value), rtol=1e-6)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)


def test_vmap_over_a_leading_axis():
  q, k, v = _operands(2, 2, 1, 2, 10, 8, seed=4)
  lengths = jnp.asarray([3, 6], jnp.int32)
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((2, 2), bool)), (2, 2, 2))
  stack = lambda x: jnp.stack([x, x * 0.5])
  got = jax.vmap(ca.cpu_attention, in_axes=(0, 0, 0, None, None))(
      stack(q), stack(k), stack(v), lengths, mask)
  for i, scale in enumerate((1.0, 0.5)):
    np.testing.assert_allclose(np.asarray(got[i]), np.asarray(
        tree_attention_reference(q * scale, k * scale, v * scale, lengths, mask)),
                               atol=2e-6, rtol=2e-5)


def test_auto_sends_decode_and_verify_blocks_here_and_the_rest_to_the_reference(monkeypatch):
  calls = []
  real = ca.cpu_attention
  monkeypatch.setattr(ca, "cpu_attention", lambda *a: calls.append(a[0].shape) or real(*a))
  q, k, v = _operands(1, 4, 2, 2, 200, 8)
  lengths = jnp.asarray([3], jnp.int32)
  attention.attention(q, k, v, lengths, jnp.tril(jnp.ones((4, 4), bool)))
  assert calls == [(1, 4, 4, 8)]
  t = ca.MAX_TOKENS + 1  # a long prefill
  qp, kp, vp = _operands(1, t, 2, 2, t + 8, 8)
  attention.attention(qp, kp, vp, lengths, jnp.tril(jnp.ones((t, t), bool)))
  attention.attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                      lengths, jnp.tril(jnp.ones((4, 4), bool)))
  assert len(calls) == 1


def test_refuses_operands_it_does_not_take():
  q, k, v = _operands(1, 2, 1, 2, 8, 12)  # head dim 12: not a multiple of 8
  mask = jnp.ones((1, 2, 2), bool)
  lengths = jnp.zeros((1,), jnp.int32)
  with pytest.raises(ValueError, match="multiple of 8"):
    ca.cpu_attention(q, k, v, lengths, mask)
  q, k, v = _operands(1, 2, 1, 2, 8, 8)
  with pytest.raises(ValueError, match="float32"):
    ca.cpu_attention(q.astype(jnp.bfloat16), k, v, lengths, mask)
  with pytest.raises(ValueError, match=r"mask \[B, T, W\]"):
    ca.cpu_attention(q, k, v, lengths, mask[:, :, :1])
  with pytest.raises(ValueError, match=r"mask \[B, T, W\]"):
    ca.cpu_attention(q, k, v, lengths, jnp.ones((1, 2, 2), jnp.int32))
