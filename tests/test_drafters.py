"""Every drafter keeps greedy speculative decoding identical to plain greedy decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.drafters import NgramDrafter, PromptLookupDrafter, early_exit_drafter, fit_ngram
from specjax.sampling import Greedy, Sampling
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.drafter import SharedCache
from specjax.speculative.tree import TreeTopology
from specjax.testing import DRAFTER_KINDS as KINDS, make_drafter, tiny_model

PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [7, 8, 9, 10, 7, 8, 9, 10, 7], [3]]




@pytest.fixture(scope="module")
def target():
  cfg, params = tiny_model(seed=0)
  corpus = specjax.generate(params, cfg, PROMPTS, 16, eos_ids=(), sampler=specjax.Sampling())
  return cfg, params, [corpus.generated(i) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_greedy_decoding(target, kind):
  cfg, params, corpus = target
  drafter, dp = make_drafter(kind, cfg, params, corpus)
  dec = SpeculativeDecoder(cfg, drafter, gamma=3, eos_ids=())
  out = dec.generate(params, dp, PROMPTS, 20)
  ref = specjax.generate(params, cfg, PROMPTS, 20, eos_ids=())
  for row in range(len(PROMPTS)):
    assert out.generated(row) == ref.generated(row)


def test_prompt_lookup_proposes_the_continuation_of_the_latest_match():
  d = PromptLookupDrafter(16, max_ngram=3)
  tokens = jnp.array([[1, 2, 3, 4, 5, 9, 1, 2, 3, 6, 1, 2, 3, 0, 0, 0],
                      [5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
  props = np.asarray(d.lookup(tokens, jnp.array([13, 4]), 4))
  assert props[0].tolist() == [6, 1, 2, 3]  # latest earlier [1,2,3] is at 6..8
  assert props[1].tolist() == [8, 8, 8, 8]  # no match: repeat the last token


def test_prompt_lookup_ranks_matches_longest_then_latest():
  d = PromptLookupDrafter(16, max_ngram=2)
  # Suffix [..., 2, 3]: [2, 3] occurs at 1..2 (then 7) and 4..5 (then 8); [3] alone at 9 (then 4).
  tokens = jnp.array([[1, 2, 3, 7, 2, 3, 8, 5, 3, 4, 2, 3, 0, 0]])
  starts = np.asarray(d.match_starts(tokens, jnp.array([12]), 4))[0]
  assert starts.tolist() == [6, 3, 9, -1]  # both 2-gram matches (latest first), then the 1-gram
  assert tokens[0, starts[:3]].tolist() == [8, 7, 4]
  _, lengths = d.matches(tokens, jnp.array([12]), 4)
  assert np.asarray(lengths)[0].tolist() == [2, 2, 1, 0]  # suffix tokens matched; 0: none


def test_prompt_lookup_tree_puts_one_match_per_branch():
  d = PromptLookupDrafter(16, max_ngram=2)
  tokens = jnp.array([[1, 2, 3, 7, 2, 3, 8, 5, 3, 4, 2, 3, 0, 0]])
  topo = TreeTopology((-1, -1, -1, 0, 1, 3))  # three branches: depths 3, 2 and 1
  assert d.supports(topo) and not d.supports(TreeTopology((-1, 0, 0)))
  proposal, _ = d.propose((), (), tokens, jnp.array([12]), None, Greedy(), topo)
  assert proposal.draw == "point_mass" and proposal.q is None
  # Branch 0 continues after the latest [2, 3] (8, 5, 3), branch 1 after the older (7, 2),
  # branch 2 after [3] (4).
  assert np.asarray(proposal.tokens)[0].tolist() == [8, 7, 4, 5, 2, 3]
  with pytest.raises(ValueError, match="only at the root"):
    d.propose((), (), tokens, jnp.array([12]), None, Greedy(), TreeTopology((-1, 0, 0)))


def test_bigram_fit_normalises_and_prefers_seen_successors():
  tables = fit_ngram([[1, 2, 1, 2, 1, 3]], vocab_size=8, top_k=2)
  d = NgramDrafter(8, order=2)
  q = np.exp(np.asarray(d.log_q(tables, jnp.array([1]))))[0]
  assert q.sum() == pytest.approx(1.0, abs=1e-5)
  assert q[2] > q[3] > q[5]
  np.testing.assert_allclose(np.asarray(tables["unigram"]).sum(), 1.0, atol=1e-6)


def test_early_exit_shares_the_target_arrays():
  cfg, params = tiny_model(num_layers=3)
  drafter, dp = early_exit_drafter(cfg, params, 2)
  assert drafter.cfg.num_layers == 2 and dp["embed"] is params["embed"]
  assert dp["layers"][1] is params["layers"][1]
  assert drafter.init(dp, None, None) == ()  # no cache of its own: it reads the target's
  with pytest.raises(ValueError):
    early_exit_drafter(cfg, params, 4)


def test_early_exit_on_the_target_cache_equals_the_truncated_model_with_its_own_cache():
  """Sharing the target's KV is exact: same drafts and q as a separate k-layer model."""
  from specjax.drafters import ModelDrafter
  from specjax.generate import prefill
  from specjax.kv_cache import init_cache

  cfg, params = tiny_model(num_layers=3)
  shared, dp = early_exit_drafter(cfg, params, 2)
  own = ModelDrafter(shared.cfg)
  own_dp = own.make_params(dp)
  tokens = jnp.array([[5, 9, 3, 7, 1, 0, 0, 0], [2, 4, 0, 0, 0, 0, 0, 0]])
  seq_lens = jnp.array([5, 2])
  target_cache = prefill(params, cfg, tokens, seq_lens - 1, init_cache(cfg, 2, 8))
  key = jax.random.PRNGKey(3)
  for sampler in (Greedy(), Sampling(temperature=1.0)):
    d1, q1, _ = shared.propose_chain(dp, SharedCache(target_cache, ()), tokens, seq_lens, key, sampler, 3)
    d2, q2, _ = own.propose_chain(own_dp, own.init(own_dp, tokens, seq_lens), tokens, seq_lens, key,
                                  sampler, 3)
    np.testing.assert_array_equal(np.asarray(d1), np.asarray(d2))
    np.testing.assert_allclose(np.asarray(q1), np.asarray(q2), atol=1e-5)
