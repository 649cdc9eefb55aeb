"""Hybrid drafting (prompt lookup where the context repeats, a model drafter elsewhere) is
lossless: greedy equality for chains, dynamic trees and an adaptive policy, whichever model
drafts; the exact joint law at T > 0 on a prompt that copies, with a mislabelled-q variant
rejected; no recompilation; bad configurations refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.drafters import (HybridDrafter, JacobiDrafter, ModelDrafter, PromptLookupDrafter,
                              early_exit_drafter, hybrid_drafter)
from specjax.drafters.hybrid import HybridState, match_layout
from specjax.sampling import Sampling
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.speculative.drafter import Drafter
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.speculative.tree_acceptance import AcceptedPath
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint, make_drafter,
                             new_compiles_across_batches, tiny_model)

from matrix import cases, grid

# Rows that copy from their first step (1, 2 recurs; 7, 8, 9 recurs), rows that never match
# at first (4, 5), and a one-token prompt.
PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [7, 8, 9, 10, 7, 8, 9, 10, 7], [3]]
# Every row copies at its first step: the model's forward is skipped in decoding.
ALL_COPY = [[1, 2, 3, 1, 2], [7, 8, 9, 7, 8]]
TREE = DynamicTree(top_k=2, depth=3, num_nodes=5)


@dataclasses.dataclass(frozen=True)
class _NoSkipDrafter(ModelDrafter):
  """An independent draft that must see every step: the hybrid cannot skip its forward."""

  def tolerates_skipped_steps(self) -> bool:
    return False


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0)


def _models(kind, cfg, params):
  if kind == "eagle":
    return make_drafter("eagle", cfg, params, ())
  if kind == "early_exit":  # shares the target's cache: its state is a SharedCache
    return early_exit_drafter(cfg, params, 1)
  # "model": an independent draft, whose dynamic tree changes its state's type (no skip) and
  # whose rollback keeps its accepted drafts' cache; "no_skip": one that cannot skip steps.
  dcfg, dparams = tiny_model(seed=1, vocab_size=cfg.vocab_size, num_layers=1)
  drafter = (_NoSkipDrafter if kind == "no_skip" else ModelDrafter)(dcfg)
  return drafter, drafter.make_params(dparams)


def _assert_plain_greedy(dec, cfg, params, dp, prompts):
  out = dec.generate(params, dp, prompts, 24)
  ref = specjax.generate(params, cfg, prompts, 24, eos_ids=())
  for row in range(len(prompts)):
    assert out.generated(row) == ref.generated(row)


@pytest.mark.parametrize("prompts, shape, kind", grid(
    {"mixed": PROMPTS, "all_copy": ALL_COPY}, ["chain", "dynamic_tree"],
    ["eagle", "early_exit", "model", "no_skip"],
    keep=("mixed-chain-eagle", "mixed-dynamic_tree-model", "mixed-dynamic_tree-early_exit",
          "all_copy-chain-no_skip", "all_copy-dynamic_tree-eagle")))
def test_greedy_equals_plain_greedy_decoding(target, kind, shape, prompts):
  cfg, params = target
  model, dp = _models(kind, cfg, params)
  drafter = hybrid_drafter(model, min_match=2, max_ngram=3)
  dec = SpeculativeDecoder(cfg, drafter, gamma=3 if shape == "chain" else None,
                           tree=TREE if shape == "dynamic_tree" else None, eos_ids=())
  _assert_plain_greedy(dec, cfg, params, dp, prompts)


def test_a_lookup_that_never_matches_reproduces_the_models_run(target):
  """The hybrid's state and rollback pass the model's own steps through unchanged."""
  cfg, params = target
  for kind in ("model", "eagle"):
    model, dp = _models(kind, cfg, params)
    never = HybridDrafter(model, PromptLookupDrafter(cfg.vocab_size, 40, 40))
    runs = [SpeculativeDecoder(cfg, d, gamma=3, sampler=Sampling(temperature=0.8),
                               eos_ids=()).generate(params, dp, PROMPTS, 24, seed=3)
            for d in (model, never)]
    assert np.array_equal(runs[0].tokens, runs[1].tokens)
    for k in ("target_calls", "accepted", "beta_sum"):
      assert np.array_equal(runs[0].per_row[k], runs[1].per_row[k]), k


@dataclasses.dataclass(frozen=True)
class _RecordsRollback(Drafter):
  """Its state is the accepted count its last rollback was told."""

  vocab_size: int = 64

  def init(self, draft_params, tokens, prompt_lens, features=None):
    return jnp.full(tokens.shape[:1], -1)

  def rollback(self, state, seq_lens, accepted):
    return accepted.num_accepted


def test_the_model_rolls_back_as_if_rejected_where_a_row_copied_and_not_after_a_skip():
  drafter = HybridDrafter(_RecordsRollback(), PromptLookupDrafter(64))
  accepted = AcceptedPath(start=jnp.array([4, 6]), path=jnp.array([[0, 1, 2], [0, 1, -1]]),
                          num_accepted=jnp.array([2, 1]))
  before = jnp.array([-1, -1])
  for copied, skipped, after in (([True, False], False, [0, 1]), ([False, False], False, [2, 1]),
                                 ([True, True], True, [-1, -1])):
    state = HybridState(model=before, copied=jnp.array(copied), skipped=jnp.asarray(skipped))
    out = drafter.rollback(state, jnp.array([7, 8]), accepted)
    assert out.model.tolist() == after


def test_greedy_equality_under_an_adaptive_policy(target):
  """Plain steps (γ = 0), chains and a dynamic tree chosen per step, copying or not."""
  cfg, params = target
  model, dp = _models("eagle", cfg, params)
  policy = AdaptiveGamma(gammas=(0, 1, 2, 4), step_costs=(1.0, 1.2, 1.3, 1.5), trees=(TREE,),
                         tree_costs=(1.4,), rank_accept=((0.5, 0.1), (0.5, 0.1), (0.5, 0.1)),
                         prior_alpha=0.6, decay=0.7)
  dec = SpeculativeDecoder(cfg, hybrid_drafter(model, min_match=2), policy=policy, eos_ids=())
  _assert_plain_greedy(dec, cfg, params, dp, PROMPTS)


def test_rows_that_match_copy_and_the_others_take_the_models_proposal(target):
  cfg, params = target
  model, dp = _models("eagle", cfg, params)
  drafter = hybrid_drafter(model, min_match=2, max_ngram=3)
  dec = SpeculativeDecoder(cfg, drafter, tree=TREE, eos_ids=())
  prompts = [[1, 2, 3, 1, 2], [4, 5, 6]]
  state, _ = dec.prepare(params, dp, prompts, 8, cache_size=32)
  proposal, _ = dec.propose(dp, state, jax.random.PRNGKey(0))
  tokens = np.asarray(proposal.tokens)
  parents = np.asarray(proposal.parents)
  # Row 0: suffix (1, 2) occurred at 0; its continuation 3, 1, 2 fills the first chain
  # (depth 3); the second chain has no second match and repeats the last token.
  assert tokens[0].tolist() == [3, 2, 1, 2, 2]  # breadth-first: depth 1 of both chains first
  assert parents[0].tolist() == [-1, -1, 0, 1, 2]
  model_prop, _ = model.propose(dp, state.draft_state.model, state.tokens, state.seq_lens,
                                jax.random.PRNGKey(0), dec.proposal_sampler, TREE)
  assert tokens[1].tolist() == np.asarray(model_prop.tokens)[1].tolist()
  assert parents[1].tolist() == np.asarray(model_prop.parents)[1].tolist()


def test_match_layout_puts_one_match_per_chain_of_depth_nodes():
  branch, offset, parents = match_layout(5, 3)  # chains of 3 and 2 nodes, breadth-first
  assert branch.tolist() == [0, 1, 0, 1, 0]
  assert offset.tolist() == [0, 0, 1, 1, 2]
  assert parents.tolist() == [-1, -1, 0, 1, 2]
  assert match_layout(3, 3)[2].tolist() == [-1, 0, 1]  # a chain


def test_all_rows_copying_skips_the_models_forward(target):
  """The model's state comes back unchanged when every row copies, and advances otherwise."""
  cfg, params = target
  model, dp = _models("eagle", cfg, params)
  drafter = hybrid_drafter(model, min_match=2)
  toks = jnp.asarray([[1, 2, 3, 1, 2, 0, 0, 0], [7, 8, 7, 8, 0, 0, 0, 0]], jnp.int32)
  feats = jnp.ones((2, 8, cfg.dim * len(model.target_feature_layers() or (0,))), jnp.float32)
  for lens, skipped in (([5, 4], True), ([5, 3], False)):  # (7, 8, 7) ends in a 1-gram only
    lens = jnp.asarray(lens, jnp.int32)
    st = drafter.init(dp, toks, lens - 1, feats)
    _, st2 = drafter.propose(dp, st, toks, lens, jax.random.PRNGKey(0), Sampling(), TREE)
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), st.model, st2.model)
    assert all(jax.tree.leaves(same)) == skipped == bool(st2.skipped)
    assert np.asarray(st2.copied).tolist() == [True, skipped]


COPY_V, COPY_N, COPY_PROMPT = 8, 100_000, [1, 2, 5, 1, 2]


@pytest.fixture(scope="module")
def small():
  return tiny_model(seed=0, vocab_size=COPY_V, scale=1.0)


def _law(dec, small, dp, sampler):
  counts = empirical_joint(dec, small, dp, COPY_PROMPT, COPY_N)
  return counts, exact_joint(*small, sampler, COPY_PROMPT)


@pytest.mark.parametrize("shape", ["chain", "dynamic_tree"])
def test_sampling_keeps_the_targets_law_on_a_prompt_that_copies(small, shape):
  cfg, params = small
  sampler = Sampling(temperature=1.0)
  model, dp = _models("eagle", cfg, params)
  tree = DynamicTree(top_k=2, depth=2, num_nodes=3) if shape == "dynamic_tree" else None
  dec = SpeculativeDecoder(cfg, hybrid_drafter(model, min_match=2), sampler=sampler, eos_ids=(),
                           gamma=2 if tree is None else None, tree=tree)
  counts, exact = _law(dec, small, dp, sampler)
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / COPY_N - exact).sum() < 0.02


@dataclasses.dataclass(frozen=True)
class _ModelQForCopies(HybridDrafter):
  """Wrong: copied tokens carry the model's q (as if the model had drafted them)."""

  def propose(self, draft_params, state, tokens, seq_lens, key, sampler, topology):
    mine, new_state = super().propose(draft_params, state, tokens, seq_lens, key, sampler,
                                      topology)
    theirs, _ = self.model.propose(draft_params, state.model, tokens, seq_lens, key, sampler,
                                   topology)
    return Proposal.chain(mine.tokens, theirs.q), new_state


def test_copied_tokens_labelled_with_the_models_q_are_rejected(small):
  cfg, params = small
  sampler = Sampling(temperature=1.0)
  model, dp = _models("eagle", cfg, params)
  wrong = _ModelQForCopies(model, PromptLookupDrafter(cfg.vocab_size, max_ngram=4, min_ngram=2))
  dec = SpeculativeDecoder(cfg, wrong, gamma=2, sampler=sampler, eos_ids=())
  counts, exact = _law(dec, small, dp, sampler)
  assert chi_square_pvalue(counts, exact) < 1e-6


@pytest.mark.parametrize("shape", cases(["chain", "dynamic_tree"], keep=("dynamic_tree",)))
def test_no_recompilation_across_prompts_budgets_and_seeds(target, shape):
  cfg, params = target
  model, dp = _models("eagle", cfg, params)
  dec = SpeculativeDecoder(cfg, hybrid_drafter(model, min_match=2),
                           gamma=2 if shape == "chain" else None,
                           tree=TREE if shape == "dynamic_tree" else None,
                           sampler=Sampling(temperature=0.8), eos_ids=())
  assert new_compiles_across_batches(dec, params, dp) == 0


def test_bad_configurations_are_refused(target):
  cfg, params = target
  model, dp = _models("eagle", cfg, params)
  lookup = PromptLookupDrafter(cfg.vocab_size)
  with pytest.raises(TypeError, match="model must be a Drafter"):
    HybridDrafter(hybrid_drafter(model), lookup)
  with pytest.raises(TypeError, match="lookup must be a PromptLookupDrafter"):
    HybridDrafter(model, model)
  with pytest.raises(ValueError, match="Jacobi"):
    HybridDrafter(JacobiDrafter(cfg.vocab_size), lookup)
  with pytest.raises(ValueError, match="vocabulary"):
    HybridDrafter(model, PromptLookupDrafter(cfg.vocab_size + 1))
  with pytest.raises(ValueError, match="min_ngram"):
    hybrid_drafter(model, min_match=5, max_ngram=4)
  fork = TreeTopology.from_choices([(0,), (1,), (0, 0)])
  with pytest.raises(ValueError, match="dynamic trees"):
    SpeculativeDecoder(cfg, hybrid_drafter(model), tree=fork, eos_ids=())
  wide = DynamicTree(top_k=2, depth=2, num_nodes=5)  # 3 copied chains > 2 root children
  assert model.supports(wide) and not hybrid_drafter(model).supports(wide)
  with pytest.raises(ValueError, match="N <= top_k · depth"):
    SpeculativeDecoder(cfg, hybrid_drafter(model), tree=wide, eos_ids=())
