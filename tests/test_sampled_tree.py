"""Sampled dynamic trees: ``SampledDynamicTree``, ``tree_draft.grow_sampled``, the exact law
and a known-wrong selection rejected (greedy equality and no recompilation with the EAGLE-2
trees' in test_dynamic_tree.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafters import ModelDrafter, hybrid_drafter, tree_draft
from specjax.drafters.tree_draft import grow_sampled
from specjax.sampling import Greedy, Sampling
from specjax.speculative import SampledDynamicTree, SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint, make_drafter,
                             tiny_model)

TREE = SampledDynamicTree((3, 3, 2))


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0)


@pytest.fixture(scope="module")
def draft():
  return tiny_model(seed=1, num_layers=1)


def test_spec_is_static_and_validated():
  t = SampledDynamicTree([2, 3, 1])
  assert t.widths == (2, 3, 1) and t == SampledDynamicTree((2, 3, 1))
  assert hash(t) == hash(SampledDynamicTree((2, 3, 1)))
  assert (t.num_nodes, t.max_depth, t.max_children, t.cache_headroom, t.is_chain) == \
      (6, 3, 3, 6, False)
  for bad in [(), (0,), (2, 0), (2.5,), (True, 1), "21", (2, -1), None]:
    with pytest.raises(ValueError):
      SampledDynamicTree(bad)


def _logits_after(path, vocab):
  """A fixed draft: its logits after the root plus ``path`` (a deterministic function)."""
  rng = np.random.default_rng(hash(tuple(path)) % (1 << 32))
  return rng.normal(size=vocab).astype(np.float32) * 2


@pytest.mark.parametrize("sampler", [Greedy(), Sampling(temperature=1.3, top_k=5)],
                         ids=["greedy", "t1.3_topk5"])
def test_each_parent_keeps_its_first_draws_placed_by_score(sampler):
  """Grown eagerly from a fixed draft, recomputed by hand: every kept child is one of its
  parent's first draws in draw order (greedy: its top tokens; sampling: the Gumbel-top-k order
  of the warped law, from the same keys), parents precede children, each depth holds its
  width, the depth's best scores are kept, and a sampled node carries its parent's law."""
  vocab, tree, key = 12, SampledDynamicTree((2, 3, 2)), jax.random.PRNGKey(3)
  paths, recorded = {}, []  # node index -> its tokens from the root; every fed node's token

  def expand(level_tokens, carry, depth, mask):
    """Records each fed node's path (from the window mask); the fixed draft's logits after it."""
    del carry
    start, logits = sum(tree.widths[:depth - 1]), []
    for i, tok in enumerate(np.asarray(level_tokens)[0]):
      ancestors = [j for j in np.flatnonzero(np.asarray(mask)[0, i]) if j != start + i]
      paths[start + i] = tuple(recorded[j] for j in ancestors) + (int(tok),)
      logits.append(_logits_after(paths[start + i], vocab))
    recorded.extend(int(t) for t in np.asarray(level_tokens)[0])
    return jnp.asarray(np.stack(logits))[None], None

  root = jnp.asarray(_logits_after((), vocab))[None]
  prop = grow_sampled(tree, sampler, key, root, None, expand, lambda ids: ids, lambda q: q)
  greedy = isinstance(sampler, Greedy)
  assert prop.draw == ("point_mass" if greedy else "without_replacement")
  tokens, parents = np.asarray(prop.tokens)[0], np.asarray(prop.parents)[0]
  starts = np.cumsum((0,) + tree.widths)
  keys = jax.random.split(key, tree.max_depth)
  value = {-1: 1.0}  # V(root) = 1; a kept node's V is its own score
  for d in range(tree.max_depth):
    level = parents[starts[d]:starts[d + 1]]
    assert np.all(level == -1) if d == 0 else np.all((level >= starts[d - 1]) & (level < starts[d]))
    prev = [-1] if d == 0 else list(range(starts[d - 1], starts[d]))
    noise = np.asarray(jax.random.gumbel(keys[d], (1, len(prev), vocab)))[0]
    cands = []  # (score, parent, draw token) of each parent's first max_children draws
    for p, v in enumerate(prev):
      logits = _logits_after(() if v < 0 else paths[v], vocab)
      if greedy:
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = np.argsort(-logits, kind="stable")
      else:
        probs = np.asarray(sampler.probs(jnp.asarray(logits)))
        order = np.argsort(-(np.log(probs) + noise[p]), kind="stable")
        for i in np.flatnonzero(level == v):  # a sampled node carries its parent's law
          np.testing.assert_allclose(np.asarray(prop.q)[0, starts[d] + i], probs, rtol=1e-5)
      order = order[:tree.max_children]
      kids = [tokens[i] for i in range(starts[d], starts[d + 1]) if parents[i] == v]
      assert kids == list(order[:len(kids)])  # the first draws, in draw order
      before = 1.0 - np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
      cands += [(value[v] * b if probs[t] > 0 else -1.0, v, t) for t, b in zip(order, before)]
    keep = sorted(sorted(range(len(cands)), key=lambda c: -cands[c][0])[:tree.widths[d]])
    assert [cands[c][1:] for c in keep] == list(zip(level, tokens[starts[d]:starts[d + 1]]))
    value.update({starts[d] + i: cands[c][0] for i, c in enumerate(keep)})


V, N, PROMPT = 8, 100_000, [1, 2, 5]


@pytest.fixture(scope="module")
def small():
  return tiny_model(seed=0, vocab_size=V, scale=1.0), tiny_model(seed=1, vocab_size=V, scale=1.0,
                                                                 num_layers=1)


# (1, 2): the root draws two and keeps one, so which one is kept matters most.
@pytest.mark.parametrize("widths, sampler", [
    pytest.param((1, 2), Sampling(temperature=1.0), marks=pytest.mark.heavy),
    ((3, 3, 2), Sampling(temperature=1.0)),
    ((2, 2), Sampling(temperature=0.8, top_k=3)),
    pytest.param((2, 1), Sampling(temperature=1.2, top_p=0.8), marks=pytest.mark.heavy)],
    ids=["1-2_t1", "3-3-2_t1", "2-2_t0.8_topk3", "2-1_t1.2_topp0.8"])
def test_joint_of_first_two_tokens_matches_target(small, widths, sampler):
  target, draft = small
  dec = SpeculativeDecoder(target[0], ModelDrafter(draft[0]), tree=SampledDynamicTree(widths),
                           sampler=sampler, eos_ids=())
  counts = empirical_joint(dec, target, dec.drafter.make_params(draft[1]), PROMPT, N)
  exact = exact_joint(*target, sampler, PROMPT)
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / N - exact).sum() < 0.02


def test_the_eagle_draft_matches_target(small):
  target, _ = small
  sampler = Sampling(temperature=0.9, top_k=6)
  drafter, dp = make_drafter("eagle", *target, [])
  dec = SpeculativeDecoder(target[0], drafter, tree=SampledDynamicTree((2, 2)), sampler=sampler,
                           eos_ids=())
  counts = empirical_joint(dec, target, dp, PROMPT, N)
  assert chi_square_pvalue(counts, exact_joint(*target, sampler, PROMPT)) > 1e-3


def test_selecting_draws_by_their_own_probability_is_rejected(small, monkeypatch):
  """EAGLE-2's rule on sampled children (score = V(parent) · q(the draw itself)) keeps the
  likelier draws, not the first ones: verification's law is then wrong, and the test sees it."""
  target, draft = small
  sampler = Sampling(temperature=1.0)
  dec = SpeculativeDecoder(target[0], ModelDrafter(draft[0]), tree=SampledDynamicTree((1, 2)),
                           sampler=sampler, eos_ids=())
  # The decoder's jitted loop is cached by its (equal) configuration: trace the wrong rule
  # afresh, and leave no program traced with it behind.
  jax.clear_caches()
  monkeypatch.setattr(tree_draft, "slot_scores", lambda value, q_ids: value[:, :, None] * q_ids)
  try:
    counts = empirical_joint(dec, target, dec.drafter.make_params(draft[1]), PROMPT, N)
  finally:
    jax.clear_caches()
  assert chi_square_pvalue(counts, exact_joint(*target, sampler, PROMPT)) < 1e-6


def test_a_draft_sampler_of_its_own_keeps_the_targets_law(small):
  target, draft = small
  sampler = Sampling(temperature=1.0, top_k=6)
  dec = SpeculativeDecoder(target[0], ModelDrafter(draft[0]), tree=SampledDynamicTree((2, 2)),
                           sampler=sampler, draft_sampler=Sampling(temperature=0.6), eos_ids=())
  counts = empirical_joint(dec, target, dec.drafter.make_params(draft[1]), PROMPT, N)
  assert chi_square_pvalue(counts, exact_joint(*target, sampler, PROMPT)) > 1e-3


def test_drafters_that_cannot_build_it_say_so(target, draft):
  cfg, params = target
  for kind in ("prompt_lookup", "bigram", "medusa"):
    drafter = make_drafter(kind, cfg, params, [[1, 2, 3]])[0]
    with pytest.raises(ValueError, match="cannot build"):
      SpeculativeDecoder(cfg, drafter, tree=TREE)
  with pytest.raises(ValueError, match="cannot build"):
    SpeculativeDecoder(cfg, hybrid_drafter(ModelDrafter(draft[0])), tree=TREE)
  with pytest.raises(ValueError, match="gamma"):
    SpeculativeDecoder(cfg, ModelDrafter(draft[0]), gamma=2, tree=TREE)
  with pytest.raises(ValueError, match="TreeTopology or DynamicTree"):
    AdaptiveGamma(gammas=(0, 2), step_costs=(1.0, 1.2), trees=(TREE,), tree_costs=(1.3,))
