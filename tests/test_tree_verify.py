"""pallas_kernels.tree_verify against the library: on a chain, greedy tree verification
is specjax's acceptance rule.

It lives here, not beside the kernel, because pallas_kernels/ stands below
specjax and imports nothing of it (docs/architecture.md); tests/ may import
every layer.
"""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_verify import tree_verify_reference
from specjax.speculative.acceptance import accept


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
