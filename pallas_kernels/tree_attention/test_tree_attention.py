"""Tree-attention kernels against the reference, and the reference on a hand-computed case.

On CPU the kernels run in Pallas interpret mode (TPU kernel under
``pltpu.InterpretParams()``, GPU kernel with ``interpret=True``) on small shapes;
the ``*Kernel`` classes run the compiled kernels and skip unless their backend
is present. Sweeps over T, S, GQA groups and dtypes are marked heavy.

Tolerances (max abs and rel error against the fp32 reference): float32 1e-5;
bfloat16 2e-2 (the kernels feed bf16 probabilities to the p @ v product, as
flash attention does, and round the output to bf16).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_attention import (BlockSizes, ancestor_mask, pack_mask,
                                           tree_attention_gpu, tree_attention_reference,
                                           tree_attention_tpu)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SMALL = BlockSizes(block_kv=128, block_kv_gpu=32, num_kv_splits=4, block_q_gpu=32)


def random_parents(rng, t: int) -> list[int]:
  return [-1] + [int(rng.integers(0, i)) for i in range(1, t)]


def make_inputs(*, b=2, t=3, kh=2, g=2, s=128, h=64, lengths=None, mask=None, dtype=jnp.float32,
                seed=0):
  """Random q, k, v and lengths (default spread over [0, S - T]) plus a mask."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, kh * g, h)) * 2.0, dtype)
  k = jnp.asarray(rng.normal(size=(b, kh, s, h)), dtype)
  v = jnp.asarray(rng.normal(size=(b, kh, s, h)), dtype)
  if lengths is None:
    lengths = np.linspace(0, s - t, b).astype(np.int32)
  if mask is None:
    mask = np.stack([ancestor_mask(random_parents(rng, t)) for _ in range(b)])
  return q, k, v, jnp.asarray(lengths, jnp.int32), jnp.asarray(mask)


def test_reference_hand_computed():
  # One row, one kv head, two query heads (G=2), H=1, sm_scale = 1/sqrt(1) = 1.
  # lengths=[1]: slot 0 committed; slots 1, 2 hold sibling tree nodes 0 and 1;
  # slot 3 is scratch (huge key) that nobody may see.
  k = jnp.asarray(np.log([1.0, 3.0, 2.0, 1e6]).reshape(1, 1, 4, 1), jnp.float32)
  v = jnp.asarray([1.0, 2.0, 3.0, 1000.0]).reshape(1, 1, 4, 1)
  q = jnp.asarray([[1.0, 0.0], [1.0, 0.0]]).reshape(1, 2, 2, 1)  # head 0: q=1, head 1: q=0
  mask = jnp.asarray([[True, False], [False, True]])
  out = np.asarray(tree_attention_reference(q, k, v, jnp.asarray([1]), mask))[0, :, :, 0]
  # Token 0 sees slots {0, 1}: weights 1, 3 -> 1/4 * 1 + 3/4 * 2; q=0 -> plain mean.
  # Token 1 sees slots {0, 2}: weights 1, 2 -> 1/3 * 1 + 2/3 * 3.
  np.testing.assert_allclose(out, [[1.75, 1.5], [7 / 3, 2.0]], rtol=1e-6)


def test_pack_mask_bit_layout():
  mask = np.zeros((1, 40, 40), bool)
  mask[0, 0, [0, 2]] = True        # word 0 = 0b101
  mask[0, 1, 31] = True            # the sign bit of word 0
  mask[0, 2, 33] = True            # bit 1 of word 1
  words = np.asarray(pack_mask(jnp.asarray(mask)))
  assert words.shape == (1, 40, 2) and words.dtype == np.int32
  assert words[0, 0].tolist() == [5, 0]
  assert words[0, 1].tolist() == [-2**31, 0]
  assert words[0, 2].tolist() == [0, 2]


class TpuKernelTest:
  """The TPU kernel; skipped off TPU unless INTERPRET."""

  INTERPRET = False
  BACKEND = "tpu"

  def attend(self, *args, **kw):
    if not self.INTERPRET and jax.default_backend() != self.BACKEND:
      pytest.skip(f"needs a {self.BACKEND} (or interpret mode)")
    interpret = pltpu.InterpretParams() if self.INTERPRET else False
    return tree_attention_tpu(*args, interpret=interpret, **kw)

  def check(self, q, k, v, lengths, mask, block_sizes=SMALL):
    got = self.attend(q, k, v, lengths, mask, block_sizes=block_sizes)
    want = tree_attention_reference(q, k, v, lengths, mask)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOL[q.dtype.type]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)

  def test_decode_only(self):  # T=1: a single node, lengths 0 .. S-1
    self.check(*make_inputs(b=3, t=1, g=3, s=128, lengths=[0, 64, 127]))

  def test_verify_chain(self):  # causal block, S not a multiple of block_kv
    t = 3
    self.check(*make_inputs(b=2, t=t, g=3, s=300, lengths=[5, 297],
                            mask=np.tril(np.ones((t, t), bool))))

  def test_random_tree(self):  # per-row [B, T, T] trees, GQA group 8
    self.check(*make_inputs(b=2, t=16, kh=1, g=8, s=200, lengths=[70, 130], seed=1))

  def test_shared_tree_mask(self):  # one [T, T] mask for every row
    t = 16
    mask = ancestor_mask(random_parents(np.random.default_rng(2), t))
    self.check(*make_inputs(b=2, t=t, g=1, s=256, lengths=[0, 100], mask=mask, seed=2))

  def test_mixed_lengths(self):  # rows from empty to full, blocks skipped per row
    self.check(*make_inputs(b=4, t=3, g=3, s=300, lengths=[0, 1, 150, 297], seed=3))

  def test_full_cache(self):  # tree ends at S; and a row whose tree falls off the end
    self.check(*make_inputs(b=2, t=16, g=1, s=128, lengths=[112, 128], seed=4))

  def test_empty_prefix(self):  # nothing committed: only the tree is visible
    self.check(*make_inputs(b=2, t=16, g=3, s=128, lengths=[0, 0], seed=5))

  def test_large_tree(self):  # T=64: two mask words per token
    self.check(*make_inputs(b=1, t=64, kh=1, g=1, s=200, lengths=[60], seed=6))

  def test_bfloat16(self):
    self.check(*make_inputs(b=2, t=16, g=3, s=300, lengths=[10, 250], dtype=jnp.bfloat16,
                            seed=7))

  def test_default_block_sizes(self):  # block_kv=512 > S: one block per row
    self.check(*make_inputs(b=2, t=3, g=3, s=300, lengths=[0, 200], seed=8),
               block_sizes=BlockSizes.get_default())

  @pytest.mark.heavy
  @pytest.mark.parametrize("t,s,g", list(itertools.product((1, 3, 16, 64), (128, 1000, 2048),
                                                           (1, 3, 8))))
  def test_sweep_float32(self, t, s, g):
    self.check(*make_inputs(b=3, t=t, kh=2, g=g, s=s, lengths=[0, s // 3, s - t], seed=t + s))

  @pytest.mark.heavy
  @pytest.mark.parametrize("t,g", list(itertools.product((1, 3, 16, 64), (1, 3, 8))))
  def test_sweep_bfloat16(self, t, g):
    s = 1000
    self.check(*make_inputs(b=3, t=t, kh=2, g=g, s=s, lengths=[0, 517, s - t],
                            dtype=jnp.bfloat16, seed=t))

  def test_bad_inputs(self):
    q, k, v, lengths, mask = make_inputs(t=3, kh=2, g=2)
    cases = [
        ((q[:, :, :3], k, v, lengths, mask), "not a multiple"),
        ((q, k, v, lengths, mask[:, :2]), "mask must be"),
        ((q, k, v, lengths, mask.astype(jnp.int32)), "mask must be bool"),
        ((q.astype(jnp.float16), k, v, lengths, mask), "unsupported"),
        ((q, k[..., :32], v[..., :32], lengths, mask), "head dim"),
        ((q, k, v, lengths[:1], mask), "lengths must be"),
    ]
    for args, message in cases:
      with pytest.raises(ValueError, match=message):
        self.attend(*args)
    with pytest.raises(ValueError, match="budget"):
      self.attend(q, k, v, lengths, mask, block_sizes=BlockSizes(max_tree_tokens=2))


class TestTpuKernel(TpuKernelTest):
  pass


class TestTpuKernelInterpret(TpuKernelTest):
  INTERPRET = True


class GpuKernelTest(TpuKernelTest):
  """The same regimes through the Triton kernel; skipped off GPU unless INTERPRET."""

  BACKEND = "gpu"

  def attend(self, *args, **kw):
    if not self.INTERPRET and jax.default_backend() != self.BACKEND:
      pytest.skip(f"needs a {self.BACKEND} (or interpret mode)")
    return tree_attention_gpu(*args, interpret=self.INTERPRET, **kw)

  def test_many_splits_few_blocks(self):  # more splits than blocks: empty splits combine to 0
    self.check(*make_inputs(b=2, t=3, g=3, s=100, lengths=[0, 97], seed=9),
               block_sizes=BlockSizes(block_kv_gpu=16, num_kv_splits=16, block_q_gpu=16))


class TestGpuKernel(GpuKernelTest):
  pass


class TestGpuKernelInterpret(GpuKernelTest):
  INTERPRET = True
