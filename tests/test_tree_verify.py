"""pallas_kernels.tree_verify against the library: on a chain, greedy tree verification
is specjax's acceptance rule; on any tree, the kernels that ``accept_greedy`` runs on
GPU and TPU give exactly what its jnp rule gives on CPU.

It lives here, not beside the kernel, because pallas_kernels/ stands below
specjax and imports nothing of it (docs/architecture.md); tests/ may import
every layer. The kernels run in Pallas interpret mode on CPU.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_verify import tree_verify_reference
from specjax.speculative import tree_acceptance
from specjax.speculative.acceptance import accept
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.speculative.tree_acceptance import accept_greedy, accept_tree, resolve_greedy_impl

KERNEL_IMPLS = ("pallas_gpu_interpret",
                # Heavy as in pallas_kernels/tree_verify: XLA:CPU once crashed compiling the
                # TPU kernel in interpret mode late in the full default run.
                pytest.param("pallas_tpu_interpret", marks=pytest.mark.heavy))
STATIC_TREES = {
    "chain4": TreeTopology.chain(4),
    "wide3": TreeTopology((-1, -1, -1)),
    "medusa": TreeTopology.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0),
                                         (0, 1, 0), (0, 0, 0, 0)]),
}


def test_chain_matches_greedy_acceptance_rule():
  """A chain tree is plain greedy speculative decoding: specjax's acceptance rule with
  one-hot p and q (longest prefix with draft == argmax, then argmax) gives the same."""
  rng = np.random.default_rng(0)
  b, gamma, vocab = 8, 5, 4
  target_argmax = rng.integers(0, vocab, (b, gamma + 1)).astype(np.int32)
  drafts = np.where(rng.random((b, gamma)) < 0.7, target_argmax[:, :gamma],
                    rng.integers(0, vocab, (b, gamma))).astype(np.int32)
  drafts[0], drafts[1] = target_argmax[0, :gamma], (target_argmax[1, :gamma] + 1) % vocab
  parents = np.tile(np.arange(-1, gamma, dtype=np.int32), (b, 1))
  tokens = np.concatenate([np.zeros((b, 1), np.int32), drafts], axis=1)
  out = tree_verify_reference(parents, tokens, target_argmax, max_depth=gamma)
  onehot = lambda x: jax.nn.one_hot(x, vocab)
  want = accept(jax.random.key(0), jnp.asarray(drafts), onehot(drafts), onehot(target_argmax))
  np.testing.assert_array_equal(out.length, want.num_accepted)
  np.testing.assert_array_equal(out.next_token, want.next_token)
  assert out.length[0] == gamma and out.length[1] == 0  # all and none accepted both occur
  for r in range(b):
    n = int(out.length[r])
    assert out.path[r].tolist() == list(range(n + 1)) + [-1] * (gamma - n)


# --- accept_greedy: the kernel path against the jnp rule ------------------------------------


def _random_dynamic_parents(rng, b, n, depth):
  """[B, N] per-row topological trees (parents[r, i] < i, -1 = the root) of depth <= D;
  row 1 starts with a chain of D nodes, so a tree of the full depth occurs."""
  parents = np.zeros((b, n), np.int32)
  node_depth = np.zeros((b, n), np.int32)
  for r in range(b):
    for i in range(n):
      choices = [-1] + [j for j in range(i) if node_depth[r, j] < depth]
      if r == 1 and i < depth:
        choices = [i - 1]
      parents[r, i] = rng.choice(choices)
      node_depth[r, i] = 1 if parents[r, i] < 0 else node_depth[r, parents[r, i]] + 1
  return parents


def _greedy_inputs(seed, b, n, parents, vocab=4):
  """(Proposal, p [B, N+1, V]): p with many exact ties (its values are 0, 1 or 2 before
  normalising), most tokens the argmax after their parent, so paths of every length and
  matching duplicate siblings (ties between equally deep nodes) occur: row 0 matches
  nowhere, row 1 everywhere."""
  rng = np.random.default_rng(seed)
  p = rng.integers(0, 3, (b, n + 1, vocab)).astype(np.float32) + 1e-3
  p /= p.sum(-1, keepdims=True)
  target = p.argmax(-1)  # [B, N+1], the first of equal maxima
  planted = np.take_along_axis(target, parents + 1, axis=1)
  tokens = np.where(rng.random((b, n)) < 0.75, planted, rng.integers(0, vocab, (b, n)))
  tokens[0], tokens[1] = (planted[0] + 1) % vocab, planted[1]  # nothing, everything matches
  return Proposal(tokens=jnp.asarray(tokens, jnp.int32), draw="point_mass"), jnp.asarray(p)


def _assert_same(got, want, max_depth):
  for name in ("path", "num_accepted", "next_token"):
    g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
    assert g.dtype == w.dtype == np.int32, name
    np.testing.assert_array_equal(g, w, err_msg=name)
  np.testing.assert_array_equal(np.asarray(got.beta), np.zeros_like(np.asarray(want.beta)))
  n = np.asarray(want.num_accepted)
  assert n.min() == 0 and n.max() == max_depth  # nothing and everything accepted both occur


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("name", sorted(STATIC_TREES))
def test_kernel_matches_jnp_rule_on_static_trees(impl, name):
  topo = STATIC_TREES[name]
  b = 96
  parents = np.broadcast_to(np.asarray(topo.parents, np.int32), (b, topo.num_nodes))
  prop, p = _greedy_inputs(sorted(STATIC_TREES).index(name), b, topo.num_nodes, parents)
  want = accept_greedy(prop, p, topo, impl="reference")
  _assert_same(accept_greedy(prop, p, topo, impl=impl), want, topo.max_depth)
  # accept_tree(greedy=True), under jit as the decoder runs it
  run = jax.jit(lambda prop, p: accept_tree(jax.random.key(0), prop, p, topo, greedy=True,
                                            greedy_impl=impl))
  _assert_same(run(prop, p), want, topo.max_depth)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_kernel_matches_jnp_rule_on_dynamic_trees(impl):
  """Per-row parents (EAGLE-2 trees): each row its own tree, traced under jit."""
  b, n, depth = 128, 10, 4
  tree = DynamicTree(top_k=3, depth=depth, num_nodes=n)
  parents = _random_dynamic_parents(np.random.default_rng(1), b, n, depth)
  prop, p = _greedy_inputs(2, b, n, parents)
  prop = prop.replace(parents=jnp.asarray(parents))
  want = accept_greedy(prop, p, tree, impl="reference")
  _assert_same(accept_greedy(prop, p, tree, impl=impl), want, depth)
  run = jax.jit(lambda prop, p: accept_greedy(prop, p, tree, impl=impl))
  _assert_same(run(prop, p), want, depth)


@pytest.mark.heavy
def test_tpu_kernel_verifies_a_large_batch_in_slices(monkeypatch):
  """Batches past the TPU kernel's SMEM budget go through it in slices of rows."""
  monkeypatch.setattr(tree_acceptance, "TPU_SMEM_WORDS", 3 * 5 * 7)  # 7 rows a slice
  topo = STATIC_TREES["chain4"]
  b = 30
  parents = np.broadcast_to(np.asarray(topo.parents, np.int32), (b, 4))
  prop, p = _greedy_inputs(3, b, 4, parents)
  _assert_same(accept_greedy(prop, p, topo, impl="pallas_tpu_interpret"),
               accept_greedy(prop, p, topo, impl="reference"), 4)


def test_greedy_impl_resolves_per_backend():
  assert resolve_greedy_impl("auto", "cpu") == "reference"
  assert resolve_greedy_impl("auto", "gpu") == "pallas_gpu"
  assert resolve_greedy_impl("auto", "tpu") == "pallas_tpu"
  assert resolve_greedy_impl("pallas", "cuda") == "pallas_gpu"
  assert resolve_greedy_impl("pallas_gpu_interpret", "cpu") == "pallas_gpu_interpret"
  with pytest.raises(ValueError, match="no Pallas tree verification kernel"):
    resolve_greedy_impl("pallas", "cpu")
  with pytest.raises(ValueError, match="unknown greedy verification implementation"):
    accept_greedy(Proposal(tokens=jnp.zeros((1, 2), jnp.int32), draw="point_mass"),
                  jnp.ones((1, 3, 4)) / 4, TreeTopology.chain(2), impl="triton")


def test_cpu_default_is_the_jnp_rule_and_gpu_default_the_kernel(monkeypatch, caplog):
  """"auto" (the decoder's default) never reaches a kernel on CPU and always does on a GPU
  or TPU; the choice is logged once."""
  topo = STATIC_TREES["medusa"]
  parents = np.broadcast_to(np.asarray(topo.parents, np.int32), (8, topo.num_nodes))
  prop, p = _greedy_inputs(5, 8, topo.num_nodes, parents)
  calls = []

  def kernel(*args):
    calls.append(args[-1])
    return accept_greedy(prop, p, topo, impl="reference")

  monkeypatch.setattr(tree_acceptance, "_greedy_by_kernel", kernel)
  monkeypatch.setattr(tree_acceptance, "_logged", set())
  monkeypatch.setattr(tree_acceptance.jax, "default_backend", lambda: "cpu")
  with caplog.at_level(logging.INFO):
    for _ in range(2):
      accept_greedy(prop, p, topo)
      accept_tree(jax.random.key(0), prop, p, topo, greedy=True)
  assert calls == []
  assert sum("impl='auto' -> 'reference'" in r.getMessage() for r in caplog.records) == 1
  for backend in ("gpu", "tpu"):
    monkeypatch.setattr(tree_acceptance.jax, "default_backend", lambda backend=backend: backend)
    accept_tree(jax.random.key(0), prop, p, topo, greedy=True)
  assert calls == ["pallas_gpu", "pallas_tpu"]
