"""EAGLE-2 dynamic trees: ``DynamicTree``, ``tree_draft.grow_dynamic`` and the drafters using them;
end to end, sampled dynamic trees too (``SampledDynamicTree``; the rest in test_sampled_tree.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache as kvc
from specjax.drafters import ModelDrafter, early_exit_drafter
from specjax.drafters.tree_draft import grow_dynamic
from specjax.model import forward
from specjax.sampling import Sampling
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology
from specjax.testing import new_compiles_across_batches, make_drafter, tiny_model

from matrix import cases, grid

PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11, 12, 13], [3]]
TREE = DynamicTree(top_k=3, depth=3, num_nodes=8)
SAMPLED = SampledDynamicTree((3, 3, 2))


def _stable_top(x, k):
  """Indices of the k largest (ties: smaller index first), like ``lax.top_k``."""
  return np.argsort(-np.asarray(x), kind="stable")[:k]


def reference_tree(logp_fn, k, depth, n):
  """EAGLE-2 spelled out over explicit paths: (tokens [N], parents [N], scores [N]).

  ``logp_fn(path)`` is the draft's log-softmax after the context plus ``path``.
  """
  pool = []  # (score, token, parent pool index, path)
  for t in _stable_top(logp_fn(()), k):
    pool.append((np.float32(logp_fn(())[t]), int(t), -1, (int(t),)))
  frontier = list(range(k))
  for d in range(1, depth):
    children = []
    for f in frontier:
      score, _, _, path = pool[f]
      lp = logp_fn(path)
      for t in _stable_top(lp, k):
        children.append((np.float32(score + np.float32(lp[t])), int(t), f, path + (int(t),)))
    base = len(pool)
    pool += children
    frontier = [base + i for i in _stable_top([c[0] for c in children], k)]
  chosen = sorted(_stable_top([p[0] for p in pool], n))
  node_of = {c: i for i, c in enumerate(chosen)}
  tokens = [pool[c][1] for c in chosen]
  parents = [-1 if pool[c][2] < 0 else node_of[pool[c][2]] for c in chosen]
  return np.array(tokens), np.array(parents), np.array([pool[c][0] for c in chosen])


# --- the spec ---------------------------------------------------------------------------


def test_spec_is_static_and_validated():
  t = DynamicTree(4, 3, 10)
  assert hash(t) == hash(DynamicTree(4, 3, 10)) and t.pool_size == 4 + 2 * 16
  assert (t.max_depth, t.num_nodes, t.is_chain, t.max_children) == (3, 10, False, 4)
  for bad in [(0, 2, 2), (2, 0, 2), (2, 3, 2), (2, 2, 7), (2.5, 2, 2), (True, 2, 2)]:
    with pytest.raises(ValueError):
      DynamicTree(*bad)
  assert TreeTopology((-1, -1, 0)).max_children == 2


def test_decoder_accepts_dynamic_trees_only_from_tree_drafters(target, draft):
  cfg, params = target
  dec = SpeculativeDecoder(cfg, ModelDrafter(draft[0]), tree=TREE)
  assert dec.gamma == TREE.depth
  chain_only = make_drafter("bigram", cfg, params, [[1, 2, 3]])[0]
  with pytest.raises(ValueError, match="cannot build"):
    SpeculativeDecoder(cfg, chain_only, tree=TREE)
  with pytest.raises(ValueError, match="gamma"):
    SpeculativeDecoder(cfg, ModelDrafter(draft[0]), gamma=2, tree=TREE)


def test_compact_moves_explicit_sources():
  cache = kvc.init_cache(tiny_model()[0], 2, 12)
  vals = jnp.broadcast_to(jnp.arange(12.0)[None, None, :, None], cache.k[0].shape)
  cache = cache.replace(k=(vals,) * len(cache.k), v=(vals,) * len(cache.v))
  out = kvc.compact(cache, jnp.array([2, 0]), jnp.array([[0, 3, 7, -1], [0, 1, -1, -1]]))
  got = np.asarray(out.k[0][:, 0, :, 0])
  np.testing.assert_array_equal(got[0], [0, 1, 2, 5, 9, 5, 6, 7, 8, 9, 10, 11])
  np.testing.assert_array_equal(got[1], np.arange(12))


# --- the grower -------------------------------------------------------------------------


def test_grow_dynamic_keeps_the_n_best_candidates_as_bfs_trees():
  """A fake draft whose logits are a hash of the path: grow_dynamic equals the brute force."""
  k, depth, n, v, b = 2, 4, 7, 6, 3
  table = jax.random.normal(jax.random.PRNGKey(0), (997, v)) * 2.0
  roots = jax.random.randint(jax.random.PRNGKey(1), (b,), 0, 997)

  def code(h, tok):
    return (h * 31 + tok + 1) % 997

  def expand(tokens, carry, depth, mask):
    assert mask.shape == (b, k, depth * k)
    h = code(carry, tokens)
    return table[h], h

  tree = DynamicTree(k, depth, n)
  proposal, slots = jax.jit(lambda r: grow_dynamic(tree, table[r], r, expand, lambda i: i))(roots)
  assert proposal.draw == "point_mass" and proposal.q is None
  for row in range(b):
    def logp(path, row=row):
      h = int(roots[row])
      for t in path:
        h = (h * 31 + t + 1) % 997
      return np.asarray(jax.nn.log_softmax(table[h]))
    tokens, parents, _ = reference_tree(logp, k, depth, n)
    np.testing.assert_array_equal(proposal.tokens[row], tokens)
    np.testing.assert_array_equal(proposal.parents[row], parents)
    assert all(parents[i] < i for i in range(n))
    # Fed nodes (those with children) have slots 1 + (d - 1) k + f; the leaves may not.
    has_child = np.isin(np.arange(n), parents)
    assert np.all(np.asarray(slots[row])[has_child] >= 1)
    assert np.all(np.asarray(slots[row]) <= (depth - 1) * k)


def _full_logp(dcfg, dparams, context, length=64):
  """The draft's log-softmax after ``context`` by one uncached forward (padded to
  ``length``: causal, so the padding never reaches the context; one compile for all)."""
  assert len(context) <= length
  toks = np.zeros((1, length), np.int32)
  toks[0, :len(context)] = context
  return np.asarray(_last_logp(dparams, dcfg, jnp.asarray(toks), jnp.int32(len(context))))


@functools.partial(jax.jit, static_argnames=("dcfg",))
def _last_logp(dparams, dcfg, toks, n):
  length = toks.shape[1]
  out = forward(dparams, dcfg, toks, jnp.arange(length)[None], kvc.init_cache(dcfg, 1, length))
  return jax.nn.log_softmax(jax.lax.dynamic_index_in_dim(out.logits[0], n - 1, keepdims=False))


@pytest.mark.parametrize("which", ["random_draft", "target_as_draft"])
def test_proposals_during_decoding_match_the_brute_force(target, draft, which):
  """Every step's tree (after catch-up and rollback of the cache) is EAGLE-2's on the context."""
  cfg, params = target
  dcfg, dparams = draft if which == "random_draft" else target
  dec = SpeculativeDecoder(cfg, ModelDrafter(dcfg), tree=TREE, eos_ids=())
  dp = dec.drafter.make_params(dparams)
  propose = jax.jit(dec.propose)
  steps = 0
  for state, _ in dec.stream(params, dp, PROMPTS[:2], 10, cache_size=32):
    if bool(jnp.all(state.done)):
      break
    proposal, _ = propose(dp, state, jax.random.PRNGKey(0))
    for row in range(2):
      if bool(state.done[row]):
        continue
      ctx = [int(t) for t in state.tokens[row, :int(state.seq_lens[row])]]
      tokens, parents, _ = reference_tree(lambda path: _full_logp(dcfg, dparams, ctx + list(path)),
                                          TREE.top_k, TREE.depth, TREE.num_nodes)
      np.testing.assert_array_equal(proposal.tokens[row], tokens)
      np.testing.assert_array_equal(proposal.parents[row], parents)
    steps += 1
  assert steps >= 2


# --- end to end ---------------------------------------------------------------------------


@pytest.mark.parametrize("which, tree", grid(
    ["random_draft", "target_as_draft", "eagle", "exit_self", "trained_exit", "adapter_exit"],
    {"eagle2": TREE, "sampled": SAMPLED},
    keep=("random_draft-eagle2", "target_as_draft-sampled", "eagle-sampled",
          "exit_self-sampled", "adapter_exit-eagle2")))
def test_greedy_equals_plain_greedy_decoding(target, draft, which, tree):
  cfg, params = target
  ref = specjax.generate(params, cfg, PROMPTS, 20, eos_ids=())
  drafter, dp = _drafter(which, target, draft)
  dec = SpeculativeDecoder(cfg, drafter, tree=tree, eos_ids=())
  out = dec.generate(params, dp, PROMPTS, 20)
  for row in range(len(PROMPTS)):
    assert out.generated(row) == ref.generated(row)
  m = out.metrics()
  assert m["drafted"] == tree.num_nodes * m["target_calls"]
  if which in ("target_as_draft", "exit_self") and tree == TREE:
    # EAGLE-2 may prune the greedy path from the frontier, but never its first token.
    assert min(m["accepted_at"]) > 0 and m["accept_len_hist"][0] == 0
    assert m["tokens_per_call"] > 3.0
  elif which in ("target_as_draft", "exit_self"):
    # A sampled tree keeps the first draw of each depth's best node: the greedy path, whole
    # (the draft's cache, rolled back after each step, stays the target's).
    assert m["accept_len_hist"][:-1] == [0] * tree.max_depth


def test_a_one_wide_self_draft_accepts_every_level(target):
  """k = 1 is a chain grown through the dynamic path: the target as draft accepts all D."""
  cfg, params = target
  tree = DynamicTree(top_k=1, depth=4, num_nodes=4)
  dec = SpeculativeDecoder(cfg, ModelDrafter(cfg), tree=tree, eos_ids=())
  out = dec.generate(params, dec.drafter.make_params(params), PROMPTS, 20)
  ref = specjax.generate(params, cfg, PROMPTS, 20, eos_ids=())
  for row in range(len(PROMPTS)):
    assert out.generated(row) == ref.generated(row)
  assert out.metrics()["accept_len_hist"][:-1] == [0] * tree.depth


def _drafter(kind, target, draft):
  cfg, params = target
  if kind == "exit_self":  # the early exit after every layer: the target, in its own cache
    return early_exit_drafter(cfg, params, cfg.num_layers)
  if kind in ("eagle", "trained_exit", "adapter_exit"):
    return make_drafter(kind, cfg, params, [])
  dcfg, dparams = draft if kind == "random_draft" else target
  drafter = ModelDrafter(dcfg)
  return drafter, drafter.make_params(dparams)


@pytest.mark.parametrize("kind", cases(["random_draft", "eagle"], keep=("eagle",)))
def test_batch_rows_equal_each_row_alone(target, draft, kind):
  cfg, params = target
  drafter, dp = _drafter(kind, target, draft)
  dec = SpeculativeDecoder(cfg, drafter, tree=DynamicTree(2, 3, 5), eos_ids=())
  batch = dec.generate(params, dp, PROMPTS, 16, cache_size=48)
  for row, prompt in enumerate(PROMPTS):
    assert dec.generate(params, dp, [prompt], 16, cache_size=48).generated(0) == \
        batch.generated(row)


@pytest.mark.parametrize("kind", cases(["target_as_draft", "eagle"], keep=("target_as_draft",)))
def test_sampling_run_works(target, draft, kind):
  cfg, params = target
  drafter, dp = _drafter(kind, target, draft)
  dec = SpeculativeDecoder(cfg, drafter, tree=TREE, sampler=Sampling(temperature=1.0),
                           eos_ids=())
  out = dec.generate(params, dp, PROMPTS, 16, seed=2)
  for row in range(len(PROMPTS)):
    gen = out.generated(row)
    assert len(gen) == 16 and all(0 <= t < cfg.vocab_size for t in gen)
  if kind == "target_as_draft":
    assert out.metrics()["tokens_per_call"] > 1.5


@pytest.mark.parametrize("kind, tree", cases(
    [("random_draft", DynamicTree(2, 3, 5)), ("adapter_exit", DynamicTree(2, 3, 5)),
     ("random_draft", SAMPLED), ("eagle", SAMPLED)],
    ids=["random_draft-eagle2", "adapter_exit-eagle2", "random_draft-sampled", "eagle-sampled"],
    keep=("adapter_exit-eagle2", "eagle-sampled")))
def test_no_recompilation_across_prompts_and_trees(target, draft, kind, tree):
  cfg, params = target
  drafter, dp = _drafter(kind, target, draft)
  dec = SpeculativeDecoder(cfg, drafter, tree=tree, sampler=Sampling(temperature=1.0))
  assert new_compiles_across_batches(dec, params, dp) == 0
