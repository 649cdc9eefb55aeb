"""Greedy tree verification: the reference on hand-computed cases and a host oracle,
the kernels against the reference.

On CPU the kernels run in Pallas interpret mode (TPU kernel under
``pltpu.InterpretParams()``, GPU kernel with ``interpret=True``) on small trees;
the ``*Kernel`` classes run them compiled and skip unless their backend is
present. ``test_lowers_for`` lowers both kernels for their platform on CPU
(Mosaic for tpu, Triton IR for cuda), which catches block-shape and lowering
errors without the hardware. Sweeps are marked heavy. Everything is integer:
results must match exactly.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_verify import (Verified, tree_verify_gpu, tree_verify_reference,
                                        tree_verify_tpu)
from pallas_kernels.tree_verify.gpu_kernel import _tree_verify_gpu
from pallas_kernels.tree_verify.tpu_kernel import _tree_verify_tpu


def oracle(parents, tokens, target_argmax, max_depth):
  """Host restatement of the rule, one row and one node at a time."""
  b, n = parents.shape
  path = np.full((b, max_depth + 1), -1, np.int32)
  length, next_token = np.zeros(b, np.int32), np.zeros(b, np.int32)
  for r in range(b):
    depth = {0: 0}
    for c in range(1, n):
      p = parents[r, c]
      if p in depth and depth[p] < max_depth and tokens[r, c] == target_argmax[r, p]:
        depth[c] = depth[p] + 1
    best = min(depth, key=lambda c: (-depth[c], c))  # deepest, then smallest index
    length[r], next_token[r] = depth[best], target_argmax[r, best]
    node = best
    for k in range(depth[best], -1, -1):
      path[r, k] = node
      node = parents[r, node]
  return Verified(path, length, next_token)


def random_trees(rng, b, n, *, vocab=6, p_match=0.6, p_pad=0.0):
  """Random topological trees with planted matches (so paths of many lengths occur)."""
  parents = np.stack([[-1] + [int(rng.integers(0, c)) for c in range(1, n)] for _ in range(b)])
  target_argmax = rng.integers(0, vocab, (b, n))
  tokens = rng.integers(0, vocab, (b, n))
  planted = rng.random((b, n)) < p_match
  tokens = np.where(planted, np.take_along_axis(target_argmax, np.maximum(parents, 0), 1),
                    tokens)
  pad = (rng.random((b, n)) < p_pad) & (np.arange(n) > 0)
  parents, tokens = np.where(pad, -1, parents), np.where(pad, -1, tokens)
  # Children of padding nodes keep their parent, so they are never accepted either.
  return [x.astype(np.int32) for x in (parents, tokens, target_argmax)]


def assert_equal(got: Verified, want: Verified):
  for name, g, w in zip(Verified._fields, got, want):
    assert np.asarray(g).dtype == np.int32, name
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


# The module docstring's example: nodes 1, 2 children of the root, 3 under 1, 4 under 2.
HAND = (np.array([[-1, 0, 0, 1, 2]]), np.array([[0, 7, 5, 9, 4]]), np.array([[5, 8, 9, 1, 6]]))


def test_reference_hand_computed():
  out = tree_verify_reference(*HAND, max_depth=2)
  # Node 2 matches argmax 5 at the root; node 4 (token 4) misses argmax 9 at node 2.
  assert_equal(out, Verified(np.array([[0, 2, -1]]), np.array([1]), np.array([9])))
  # Fix node 4's token: path 0 -> 2 -> 4, bonus token argmax[4] = 6; default D = N - 1 = 4.
  tokens = HAND[1].copy()
  tokens[0, 4] = 9
  out = tree_verify_reference(HAND[0], tokens, HAND[2])
  assert_equal(out, Verified(np.array([[0, 2, 4, -1, -1]]), np.array([2]), np.array([6])))


def test_reference_tie_smallest_index():
  # Duplicate siblings 1 and 2 both match; 3 under 2 misses: depth-1 tie -> node 1.
  parents, tokens, am = [[-1, 0, 0, 2]], [[0, 5, 5, 0]], [[5, 3, 4, 0]]
  out = tree_verify_reference(np.array(parents), np.array(tokens), np.array(am), max_depth=2)
  assert_equal(out, Verified(np.array([[0, 1, -1]]), np.array([1]), np.array([3])))
  # ... unless the later sibling leads deeper: 3 matches argmax 4 at node 2.
  tokens = [[0, 5, 5, 4]]
  out = tree_verify_reference(np.array(parents), np.array(tokens), np.array(am), max_depth=2)
  assert_equal(out, Verified(np.array([[0, 2, 3]]), np.array([2]), np.array([0])))


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_oracle(seed):
  rng = np.random.default_rng(seed)
  args = random_trees(rng, 6, 12, p_pad=0.15 * (seed % 2))
  assert_equal(tree_verify_reference(*args), oracle(*args, 11))


class TpuKernelTest:
  """The TPU kernel against the reference; skipped off TPU unless INTERPRET."""

  INTERPRET = False
  BACKEND = "tpu"

  def verify(self, *args, **kw):
    if not self.INTERPRET and jax.default_backend() != self.BACKEND:
      pytest.skip(f"needs a {self.BACKEND} (or interpret mode)")
    interpret = pltpu.InterpretParams() if self.INTERPRET else False
    return tree_verify_tpu(*args, interpret=interpret, **kw)

  def check(self, parents, tokens, target_argmax, max_depth=None):
    got = self.verify(parents, tokens, target_argmax, max_depth=max_depth)
    want = tree_verify_reference(parents, tokens, target_argmax, max_depth=max_depth)
    assert_equal(got, want)
    return got

  def test_hand_case(self):
    got = self.check(*HAND, max_depth=2)
    assert got.path.tolist() == [[0, 2, -1]] and int(got.next_token[0]) == 9

  @pytest.mark.parametrize("seed", range(3))
  def test_random_trees(self, seed):
    got = self.check(*random_trees(np.random.default_rng(seed), 4, 16))
    assert len(set(np.asarray(got.length).tolist())) > 1  # varied path lengths

  def test_chain(self):
    rng = np.random.default_rng(1)
    b, n = 4, 8
    am = rng.integers(0, 3, (b, n)).astype(np.int32)
    tokens = np.concatenate([np.zeros((b, 1), np.int32), am[:, :-1]], axis=1)
    tokens[np.arange(b), 1 + 2 * np.arange(b)] += 1  # first miss at depth 1, 3, 5, 7
    parents = np.tile(np.arange(-1, n - 1, dtype=np.int32), (b, 1))
    got = self.check(parents, tokens, am)
    assert got.length.tolist() == [0, 2, 4, 6]

  def test_single_node(self):  # N=1: only the root; the bonus token is the root's argmax
    got = self.check(np.full((2, 1), -1), np.array([[3], [4]]), np.array([[7], [8]]))
    assert got.path.tolist() == [[0], [0]] and got.length.tolist() == [0, 0]
    assert got.next_token.tolist() == [7, 8]

  def test_all_accepted(self):  # every node matches: the deepest, smallest-index leaf wins
    parents, _, am = random_trees(np.random.default_rng(2), 3, 10)
    tokens = np.take_along_axis(am, np.maximum(parents, 0), 1)
    self.check(parents, tokens, am)

  def test_none_accepted(self):
    parents, _, am = random_trees(np.random.default_rng(3), 3, 10)
    got = self.check(parents, np.full_like(am, 99), am, max_depth=9)
    assert got.length.tolist() == [0] * 3 and got.next_token.tolist() == am[:, 0].tolist()

  def test_ragged_batch(self):  # one shared tree, rows accepting 0 .. D nodes
    parents = np.array([-1, 0, 0, 1, 1, 3, 2], np.int32)
    am = np.array([1, 2, 3, 4, 5, 6, 7], np.int32)
    full = np.array([0, 1, 9, 2, 2, 4, 9], np.int32)  # path 0 -> 1 -> 3 -> 5 (ties at 3/4)
    tokens = np.stack([full, full, full, full])
    tokens[0, 1] = tokens[0, 2] = 0   # nothing
    tokens[1, 3] = tokens[1, 4] = 0   # root -> 1
    tokens[2, 5] = 0                  # root -> 1 -> 3 (3 beats its twin 4)
    got = self.check(np.tile(parents, (4, 1)), tokens, np.tile(am, (4, 1)), max_depth=3)
    assert got.length.tolist() == [0, 1, 2, 3]
    assert got.path.tolist()[3] == [0, 1, 3, 5] and got.next_token.tolist() == [1, 2, 4, 6]

  def test_padding_nodes(self):  # parent -1 / token -1 nodes and their subtrees never accept
    args = random_trees(np.random.default_rng(4), 4, 16, p_match=0.9, p_pad=0.3)
    assert np.any(args[0][:, 1:] == -1)
    self.check(*args)

  def test_traced_inputs(self):
    """Under an outer jit parents are not checked: deeper-than-D trees are truncated and
    invalid parents (>= index) make nodes unaccepted, in the kernel as in the reference."""
    parents, tokens, am = random_trees(np.random.default_rng(5), 4, 12, p_match=0.95)
    parents[1, 5], parents[2, 3] = 7, 3  # not earlier nodes
    got = jax.jit(functools.partial(self.verify, max_depth=2))(parents, tokens, am)
    want = jax.jit(functools.partial(tree_verify_reference, max_depth=2))(parents, tokens, am)
    assert_equal(got, want)
    assert_equal(want, oracle(np.where(parents < np.arange(12), parents, -1), tokens, am, 2))
    assert max(want.length.tolist()) == 2

  @pytest.mark.heavy
  @pytest.mark.parametrize("n,b,pad", list(itertools.product((1, 2, 8, 33, 64), (1, 9),
                                                             (0.0, 0.2))))
  def test_sweep(self, n, b, pad):
    self.check(*random_trees(np.random.default_rng(n * b), b, n, vocab=3, p_pad=pad))

  def test_bad_inputs(self):
    parents, tokens, am = random_trees(np.random.default_rng(6), 2, 5)
    cases = [
        ((parents[0], tokens, am), {}, "parents must be"),
        ((parents, tokens[:, :4], am), {}, "tokens must be"),
        ((parents, tokens, am.astype(np.float32)), {}, "target_argmax must be integers"),
        ((parents[:, :0], tokens[:, :0], am[:, :0]), {}, "N >= 1"),
        ((parents, tokens, am), {"max_depth": -1}, "max_depth must be"),
    ]
    bad_root = parents.copy()
    bad_root[1, 0] = 0
    cases.append(((bad_root, tokens, am), {}, r"parents\[:, 0\]"))
    for bad in (4, 3, -2):  # parent == index, parent > index, below -1
      p = parents.copy()
      p[1, 3] = bad
      cases.append(((p, tokens, am), {}, r"parents\[1, 3\]"))
    chain = np.tile(np.arange(-1, 4, dtype=np.int32), (2, 1))
    cases.append(((chain, tokens, am), {"max_depth": 3}, "exceeds max_depth=3"))
    for args, kw, message in cases:
      for fn in (self.verify, tree_verify_reference):
        with pytest.raises(ValueError, match=message):
          fn(*args, **kw)


class TestTpuKernel(TpuKernelTest):
  pass


# Heavy: XLA:CPU once crashed (segfault while compiling) in this class late in the
# full default run, never when the folder ran alone; run with `pytest -m heavy`.
@pytest.mark.heavy
class TestTpuKernelInterpret(TpuKernelTest):
  INTERPRET = True


class GpuKernelTest(TpuKernelTest):
  """The same regimes through the Triton kernel; skipped off GPU unless INTERPRET."""

  BACKEND = "gpu"

  def verify(self, *args, **kw):
    if not self.INTERPRET and jax.default_backend() != self.BACKEND:
      pytest.skip(f"needs a {self.BACKEND} (or interpret mode)")
    return tree_verify_gpu(*args, interpret=self.INTERPRET, **kw)

  def test_power_of_two_padding(self):  # N = 17 pads to 32 nodes, D + 1 = 17 to 32 slots
    self.check(*random_trees(np.random.default_rng(7), 3, 17, p_match=0.9))


class TestGpuKernel(GpuKernelTest):
  pass


class TestGpuKernelInterpret(GpuKernelTest):
  INTERPRET = True


@pytest.mark.parametrize("fn,platform,marker", [(_tree_verify_tpu, "tpu", "tpu_custom_call"),
                                                (_tree_verify_gpu, "cuda", "triton")])
def test_lowers_for(fn, platform, marker):
  """Lowering on CPU: Mosaic (block shapes, SMEM scratch, scalar loop) or Triton IR."""
  f = jax.jit(functools.partial(fn, max_depth=5, interpret=False))
  spec = jax.ShapeDtypeStruct((8, 13), jnp.int32)
  text = f.trace(spec, spec, spec).lower(lowering_platforms=(platform,)).as_text()
  assert marker in text
