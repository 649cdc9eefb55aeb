"""Token trees through the whole decoder: greedy equality, KV compaction, batching, compiles,
exact sampling, bad input and counters.

Topologies exercised (N nodes, depth D):
  chain     TreeTopology.chain(3)                 N = 3, D = 3 (the chain fast path)
  branchy   (-1, -1, 0, 0, 1)                     N = 5, D = 2
  medusa    a Medusa-style choice list            N = 8, D = 4
  wide      four children of the root             N = 4, D = 1

Drafts: a random tiny model (almost never right), the target itself (always
right), a *noisy* copy of the target (right about half the time, so rows
accept different lengths and non-first siblings), a reduced-vocabulary slice
of the target and the EAGLE feature drafter.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache as kvc
from specjax.drafters import ModelDrafter, early_exit_drafter
from specjax.model import forward
from specjax.sampling import Greedy, Sampling, dense_probs
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.decoder import prefill_models
from specjax.speculative.tree import TreeTopology
from specjax.speculative.tree_acceptance import AcceptedPath
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint,
                             make_drafter, tiny_model)

from matrix import grid

PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11, 12, 13], [3]]
NEW = 24
CACHE = 64  # one cache size everywhere, so equal decoders share compiled programs

MEDUSA = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0)]
TREES = {
    "chain": TreeTopology.chain(3),
    "branchy": TreeTopology((-1, -1, 0, 0, 1)),
    "medusa": TreeTopology.from_choices(MEDUSA),
    "wide": TreeTopology((-1, -1, -1, -1)),
}
CORPUS = [[1, 2, 5, 3, 3, 7, 1, 2, 5, 0], [4, 4, 1, 2, 6]]


# --- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0)


@pytest.fixture(scope="module")
def drafts(target):
  """name -> (drafter, draft_params)."""
  cfg, params = target
  rcfg, rparams = tiny_model(seed=1, num_layers=1, dim=16, num_heads=2, num_kv_heads=1,
                             ffn_dim=32)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(11), len(leaves))
  noisy = jax.tree.unflatten(treedef, [w + 0.35 * jnp.std(w) * jax.random.normal(k, w.shape)
                                       for w, k in zip(leaves, keys)])
  # Reduced vocabulary: the target restricted to its even ids (odd ids get q = 0).
  vocab_map = np.arange(0, cfg.vocab_size, 2)
  vcfg = dataclasses.replace(cfg, vocab_size=len(vocab_map))
  vparams = dict(params, embed=params["embed"][vocab_map], lm_head=params["lm_head"][:, vocab_map])
  reduced = ModelDrafter(vcfg, target_vocab_size=cfg.vocab_size)
  return {
      "random": (ModelDrafter(rcfg), {"model": rparams}),
      "self": (ModelDrafter(cfg), {"model": params}),
      "noisy": (ModelDrafter(cfg), {"model": noisy}),
      "reduced": (reduced, reduced.make_params(vparams, vocab_map)),
      # The same with full-vocabulary input: odd ids read the target's rows.
      "reduced_full_input": (reduced, reduced.make_params(vparams, vocab_map,
                                                          input_embed=params["embed"])),
      "eagle": make_drafter("eagle", cfg, params, CORPUS),
      # Early exits share the target's cache: drafts in its scratch slots.
      "exit_self": early_exit_drafter(cfg, params, cfg.num_layers),  # the target itself
      **{k: make_drafter(k, cfg, params, CORPUS)
         for k in ("early_exit", "trained_exit", "adapter_exit")},
  }


@pytest.fixture(scope="module")
def reference(target):
  cfg, params = target
  return specjax.generate(params, cfg, PROMPTS, NEW, eos_ids=(), cache_size=CACHE)


def _decoder(cfg, drafter, tree, sampler=Greedy(), eos_ids=()):
  return SpeculativeDecoder(cfg, drafter, tree=tree, sampler=sampler, eos_ids=eos_ids)


def _assert_same_generations(out, ref, rows):
  for row in range(rows):
    assert out.generated(row) == ref.generated(row), f"row {row}"


# --- 1. greedy equality ----------------------------------------------------------------


@pytest.mark.parametrize("which, tree", grid(["random", "noisy"], list(TREES), keep=(
    "random-chain", "noisy-chain", "noisy-branchy", "noisy-medusa", "noisy-wide")))
def test_greedy_tree_decoding_equals_plain_greedy(target, drafts, reference, tree, which):
  cfg, params = target
  drafter, dp = drafts[which]
  out = _decoder(cfg, drafter, TREES[tree]).generate(params, dp, PROMPTS, NEW, cache_size=CACHE)
  _assert_same_generations(out, reference, len(PROMPTS))
  np.testing.assert_array_equal(out.num_generated, NEW)


@pytest.mark.parametrize("which, tree", grid(["self", "exit_self"], list(TREES), keep=(
    "self-chain", "self-branchy", "self-medusa", "self-wide", "exit_self-medusa")))
def test_target_as_its_own_draft_accepts_the_full_depth_every_step(target, drafts, reference,
                                                                   tree, which):
  """The target as a draft model with its own cache, or as an early exit after all its
  layers drafting in the target's own cache: every step accepts the whole depth."""
  cfg, params = target
  topo = TREES[tree]
  d = topo.max_depth
  drafter, dp = drafts[which]
  out = _decoder(cfg, drafter, topo).generate(params, dp, PROMPTS, NEW, cache_size=CACHE)
  _assert_same_generations(out, reference, len(PROMPTS))
  r = out.per_row
  calls = -(-NEW // (d + 1))  # D + 1 tokens per call; the budget trims only the last call
  np.testing.assert_array_equal(r["target_calls"], calls)
  np.testing.assert_array_equal(r["accept_len_hist"][:, d], calls)  # every step accepts D
  np.testing.assert_array_equal(r["accepted_rank"][:, :, 1:], 0)  # always the first sibling
  assert out.metrics()["tokens_per_call"] == pytest.approx(NEW / calls)
  if NEW % (d + 1) == 0:
    assert out.metrics()["tokens_per_call"] == d + 1


@pytest.mark.parametrize("which, tree", grid(
    ["reduced", "reduced_full_input", "eagle", "early_exit", "trained_exit", "adapter_exit"],
    ["chain", "branchy", "medusa"],
    keep=("reduced-chain", "reduced_full_input-medusa", "eagle-branchy", "early_exit-medusa",
          "trained_exit-chain", "adapter_exit-branchy")))  # each drafter once, each tree twice
def test_greedy_equality_with_reduced_vocabulary_eagle_and_exits(target, drafts, reference, tree,
                                                           which):
  cfg, params = target
  drafter, dp = drafts[which]
  out = _decoder(cfg, drafter, TREES[tree]).generate(params, dp, PROMPTS, NEW, cache_size=CACHE)
  _assert_same_generations(out, reference, len(PROMPTS))
  if which.startswith("reduced"):  # the target's slice is right whenever its token is even
    assert out.metrics()["acceptance_rate"] > 0


def test_full_vocabulary_input_reads_the_target_rows_outside_the_map(target, drafts):
  """The even-id slice of the target with the target's table as input is the target
  itself on the even ids, for prompts full of odd (out-of-map) ids; through the
  substitute-row input map it is not."""
  cfg, params = target
  (drafter, full), (_, nearest) = drafts["reduced_full_input"], drafts["reduced"]
  vocab_map = np.asarray(full["vocab_map"])
  tokens = jnp.asarray([[3, 5, 8, 1, 7, 2], [9, 9, 4, 11, 13, 6]]) % cfg.vocab_size
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  run = lambda p, c, ids: forward(p, c, ids, pos, kvc.init_cache(c, 2, 8)).logits
  want = np.asarray(run(params, cfg, tokens))[..., vocab_map]
  np.testing.assert_allclose(np.asarray(run(full["model"], drafter.cfg, tokens)), want,
                             rtol=1e-5, atol=1e-5)
  mapped = nearest["inverse_map"][tokens]
  assert not np.allclose(np.asarray(run(nearest["model"], drafter.cfg, mapped)), want, atol=1e-3)
  with pytest.raises(ValueError, match="input_embed must be"):
    drafter.make_params(full["model"], vocab_map, input_embed=params["embed"][:, :4])
  with pytest.raises(ValueError, match="reduced-vocabulary draft"):
    ModelDrafter(cfg).make_params(params, input_embed=params["embed"])


ROOT_BRANCHING = TreeTopology((-1, -1, -1, 0, 1, 3))  # three matches: depths 3, 2, 1


@pytest.mark.parametrize("tree", [ROOT_BRANCHING, TREES["wide"], TREES["chain"]],
                         ids=["branches", "wide", "chain"])
def test_greedy_prompt_lookup_trees_equal_plain_greedy(target, reference, tree):
  cfg, params = target
  drafter, dp = make_drafter("prompt_lookup", cfg, params, CORPUS)
  out = _decoder(cfg, drafter, tree).generate(params, dp, PROMPTS, NEW, cache_size=CACHE)
  _assert_same_generations(out, reference, len(PROMPTS))


@pytest.mark.parametrize("tree", ["branchy", "medusa"])
@pytest.mark.parametrize("which", ["self", "noisy"])
def test_greedy_with_eos_equals_plain_greedy_with_eos(target, drafts, reference, tree, which):
  cfg, params = target
  eos = reference.generated(0)[5]  # the 6th greedy token of row 0: EOS lands mid-block
  expected = specjax.generate(params, cfg, PROMPTS, NEW, eos_ids=(eos,), cache_size=CACHE)
  drafter, dp = drafts[which]
  out = _decoder(cfg, drafter, TREES[tree], eos_ids=(eos,)).generate(params, dp, PROMPTS, NEW,
                                                                     cache_size=CACHE)
  _assert_same_generations(out, expected, len(PROMPTS))
  np.testing.assert_array_equal(out.seq_lens, expected.seq_lens)
  assert out.generated(0)[-1] == eos and len(out.generated(0)) <= 6
  np.testing.assert_array_equal(out.per_row["emitted"], out.num_generated)


# --- 2. KV compaction --------------------------------------------------------------------


def _all_paths(topo: TreeTopology) -> list[list[int]]:
  """Every accepted path as block indices from the root: n = 0, then one per node."""
  paths = [[0]]
  for node in range(topo.num_nodes):
    chain, j = [], node + 1
    while j >= 0:
      chain.append(j)
      j = int(topo.block_parents[j])
    paths.append(chain[::-1])
  return paths


def _pad(path, d):
  return path + [-1] * (d + 1 - len(path))


def _fresh_cache(params, cfg, seq, size):
  """The cache after prefilling ``seq`` from scratch."""
  t = len(seq)
  out = forward(params, cfg, jnp.asarray([seq]), jnp.arange(t)[None], kvc.init_cache(cfg, 1, size))
  return out.cache


def _assert_prefix_equal(cache, row, fresh, n):
  for a, b in zip(cache.k + cache.v, fresh.k + fresh.v):
    np.testing.assert_allclose(np.asarray(a[row, :, :n]), np.asarray(b[0, :, :n]), atol=1e-5)


@pytest.mark.parametrize("tree", ["branchy", "medusa", "wide"])
def test_compact_gives_the_cache_of_the_accepted_sequence(target, tree):
  cfg, params = target
  topo = TREES[tree]
  n_nodes, d = topo.num_nodes, topo.max_depth
  prompts = [[5, 9, 2, 7, 1], [3, 8, 4]]  # different lengths: different roots and starts
  lens = np.array([len(p) for p in prompts], np.int32)
  size = 24
  tokens = np.zeros((2, size), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  cache = kvc.init_cache(cfg, 2, size)
  # Commit each prompt minus its last token (the root), as the decoder does.
  cache = forward(params, cfg, jnp.asarray(tokens[:, :lens.max()]),
                  jnp.broadcast_to(jnp.arange(lens.max()), (2, lens.max())), cache,
                  num_valid=jnp.asarray(lens - 1), compute_logits=False).cache
  nodes = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, n_nodes)).astype(np.int32)
  block = np.concatenate([tokens[np.arange(2), lens - 1][:, None], nodes], axis=1)
  positions = (lens - 1)[:, None] + topo.block_depth[None, :]
  mask = jnp.broadcast_to(jnp.asarray(topo.block_mask), (2, n_nodes + 1, n_nodes + 1))
  verified = forward(params, cfg, jnp.asarray(block), jnp.asarray(positions), cache, mask,
                     num_valid=jnp.full((2,), n_nodes + 1, jnp.int32)).cache
  paths = _all_paths(topo)
  assert {len(p) - 1 for p in paths} == set(range(d + 1))  # n = 0 … D
  compact = jax.jit(kvc.compact)
  for i, path0 in enumerate(paths):
    path1 = paths[-1 - i]  # the two rows accept different paths in the same call
    path = jnp.asarray([_pad(path0, d), _pad(path1, d)], jnp.int32)
    out = compact(verified, jnp.asarray(lens - 1), path)
    np.testing.assert_array_equal(out.lengths, verified.lengths)  # lengths unchanged
    for b, pth in enumerate((path0, path1)):
      seq = prompts[b] + [int(block[b, j]) for j in pth[1:]]
      _assert_prefix_equal(out, b, _fresh_cache(params, cfg, seq, size), len(seq))


@pytest.mark.parametrize("tree, which", grid(["branchy", "medusa"], ["random", "reduced"],
                                             keep=("branchy-reduced", "medusa-random")))
def test_draft_cache_after_rollback_is_the_cache_of_the_committed_sequence(target, drafts,
                                                                            which, tree):
  """After propose + rollback along any path, the draft's cache and its next proposal are
  those of a draft freshly prefilled with the committed sequence."""
  cfg, _ = target
  base, dp = drafts[which]
  drafter = dataclasses.replace(base, tree_draw="without_replacement")
  topo = TREES[tree]
  d = topo.max_depth
  sampler = Sampling(temperature=1.0)
  prompts = [[5, 9, 2, 7, 1], [3, 8, 4]]
  lens = np.array([len(p) for p in prompts], np.int32)
  size = 24
  tokens = np.zeros((2, size), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  propose = jax.jit(drafter.propose, static_argnames=("sampler", "topology"))
  init = jax.jit(drafter.init)
  state = init(dp, jnp.asarray(tokens), jnp.asarray(lens))
  key, key2 = jax.random.PRNGKey(3), jax.random.PRNGKey(4)
  proposal, after = propose(dp, state, jnp.asarray(tokens), jnp.asarray(lens), key,
                            sampler=sampler, topology=topo)
  assert proposal.draw == "without_replacement"
  drafted = np.asarray(proposal.tokens)
  paths = _all_paths(topo)
  for i, path0 in enumerate(paths):
    chosen = (path0, paths[-1 - i])
    n = np.array([len(p) - 1 for p in chosen], np.int32)
    new_tokens = tokens.copy()
    seqs = []
    for b, pth in enumerate(chosen):
      seq = prompts[b] + [int(drafted[b, j - 1]) for j in pth[1:]] + [60 + b]  # + extra token
      new_tokens[b, :len(seq)] = seq
      seqs.append(seq)
    new_lens = lens + n + 1
    accepted = AcceptedPath(start=jnp.asarray(lens - 1),
                            path=jnp.asarray([_pad(p, d) for p in chosen], jnp.int32),
                            num_accepted=jnp.asarray(n))
    rolled = drafter.rollback(after, jnp.asarray(new_lens), accepted)
    kept = np.asarray(rolled.lengths)
    assert np.all((kept >= new_lens - 2) & (kept <= new_lens - 1)), (kept, new_lens)
    for b in range(2):
      fresh = _fresh_cache(dp["model"], drafter.cfg,
                           np.asarray(drafter._draft_ids(dp, jnp.asarray(seqs[b]))).tolist(), size)
      _assert_prefix_equal(rolled, b, fresh, int(kept[b]))
    # The next proposal is the same as from a fresh prefill of the committed sequence.
    nxt, _ = propose(dp, rolled, jnp.asarray(new_tokens), jnp.asarray(new_lens), key2,
                     sampler=sampler, topology=topo)
    ref, _ = propose(dp, init(dp, jnp.asarray(new_tokens), jnp.asarray(new_lens)),
                     jnp.asarray(new_tokens), jnp.asarray(new_lens), key2, sampler=sampler,
                     topology=topo)
    np.testing.assert_array_equal(nxt.tokens, ref.tokens)
    np.testing.assert_allclose(dense_probs(nxt.q), dense_probs(ref.q), atol=1e-5)


# --- 3. batches with ragged acceptance -------------------------------------------------------


@pytest.mark.parametrize("tree", ["branchy", "medusa"])
def test_batch_rows_equal_each_row_alone(target, drafts, tree):
  cfg, params = target
  drafter, dp = drafts["noisy"]
  dec = _decoder(cfg, drafter, TREES[tree])
  batch = dec.generate(params, dp, PROMPTS, NEW, cache_size=CACHE)
  hist = batch.per_row["accept_len_hist"]
  assert len({tuple(h) for h in hist}) > 1, "rows should accept different lengths"
  for row, prompt in enumerate(PROMPTS):
    alone = dec.generate(params, dp, [prompt], NEW, cache_size=CACHE)
    assert alone.generated(0) == batch.generated(row)
    for name, counts in alone.per_row.items():  # greedy: the same steps, row by row
      np.testing.assert_array_equal(counts[0], batch.per_row[name][row], err_msg=name)


# --- 4. no recompilation --------------------------------------------------------------------


def test_one_compiled_run_serves_prompts_budgets_and_acceptance_patterns(target, drafts):
  cfg, params = target
  drafter, dp = drafts["noisy"]
  tree = (-1, -1, 0, 0, 1)
  dec = _decoder(cfg, drafter, TreeTopology(tree), Sampling(temperature=1.0))
  dec.generate(params, dp, [[1], [2, 3]], 8, cache_size=CACHE)
  runs, inits = SpeculativeDecoder.run._cache_size(), prefill_models._cache_size()
  lengths = set()
  for seed, prompts in enumerate([[[5, 6, 7, 8], [9]], [[1] * 30, [2] * 11], [[3, 4], [5]]]):
    # An equal decoder built anew (an equal topology) is the same static argument.
    again = _decoder(cfg, drafter, TreeTopology(list(tree)), Sampling(temperature=1.0))
    out = again.generate(params, dp, prompts, 8 + seed, cache_size=CACHE, seed=seed)
    lengths |= {tuple(h) for h in out.per_row["accept_len_hist"]}
  assert len(lengths) > 1  # different acceptance patterns went through the same program
  assert SpeculativeDecoder.run._cache_size() == runs
  assert prefill_models._cache_size() == inits


# --- 5. the exact distribution through the decoder -------------------------------------------

V, ROWS, PROMPT = 8, 100_000, [1, 2, 5]
BRANCHY = TreeTopology((-1, -1, 0, 0, 1))


@pytest.fixture(scope="module")
def small_models():
  return (tiny_model(seed=0, vocab_size=V, scale=1.0),
          tiny_model(seed=1, vocab_size=V, scale=1.0, num_layers=1))


@pytest.mark.parametrize("draw,sampler", [
    ("point_mass", Sampling(temperature=1.0)),
    ("without_replacement", Sampling(temperature=1.0)),
    pytest.param("point_mass", Sampling(temperature=0.7, top_k=4), marks=pytest.mark.heavy),
    ("without_replacement", Sampling(temperature=1.2, top_p=0.8)),
], ids=["point_mass-t1", "without_replacement-t1", "point_mass-topk4", "without_replacement-topp"])
def test_tree_decoding_samples_the_exact_joint(small_models, draw, sampler):
  target, (dcfg, dparams) = small_models
  dec = _decoder(target[0], ModelDrafter(dcfg, tree_draw=draw), BRANCHY, sampler)
  counts = empirical_joint(dec, target, {"model": dparams}, PROMPT, ROWS)
  exact = exact_joint(*target, sampler, PROMPT)
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / ROWS - exact).sum() < 0.02


@pytest.mark.parametrize("case", ["wide_more_siblings_than_support", "eagle", "adapter_exit"])
def test_tree_decoding_samples_the_exact_joint_edge_cases(small_models, case):
  """Four root children drawn without replacement from a top-2 support (the last two get
  q = 0 and must be skipped), EAGLE's tree over half the vocabulary, and the adapter
  exit's point-mass tree over half the vocabulary in the target's own cache."""
  target, (dcfg, dparams) = small_models
  if case == "eagle":
    sampler, tree = Sampling(temperature=0.9, top_p=0.9), BRANCHY
    drafter, dp = make_drafter("eagle", *target, CORPUS)
    drafter = dataclasses.replace(drafter, tree_draw="without_replacement")
  elif case == "adapter_exit":
    sampler, tree = Sampling(temperature=0.8, top_k=6), BRANCHY
    drafter, dp = make_drafter("adapter_exit", *target, CORPUS)
  else:
    sampler, tree = Sampling(temperature=1.0, top_k=2), TREES["wide"]
    drafter, dp = ModelDrafter(dcfg, tree_draw="without_replacement"), {"model": dparams}
  counts = empirical_joint(_decoder(target[0], drafter, tree, sampler), target, dp, PROMPT, ROWS)
  exact = exact_joint(*target, sampler, PROMPT)
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / ROWS - exact).sum() < 0.02


@pytest.mark.parametrize("sampler", [
    Sampling(temperature=1.0),
    pytest.param(Sampling(temperature=0.8, top_k=3), marks=pytest.mark.heavy),
], ids=["t1", "topk3"])
def test_prompt_lookup_trees_sample_the_exact_joint(small_models, sampler):
  """Repeated suffixes give the root several distinct matches (2 -> 5, 6 or 7)."""
  target, _ = small_models
  prompt = [1, 2, 5, 2, 6, 2, 7, 2]
  drafter = make_drafter("prompt_lookup", *target, CORPUS)[0]
  dec = _decoder(target[0], drafter, ROOT_BRANCHING, sampler)
  counts = empirical_joint(dec, target, (), prompt, ROWS)
  exact = exact_joint(*target, sampler, prompt)
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / ROWS - exact).sum() < 0.02


@dataclasses.dataclass(frozen=True)
class _RawQDrafter(ModelDrafter):
  """Wrong: draws siblings without replacement but labels them "sampled", so verification
  applies SpecInfer's raw-q rule to them."""

  def propose(self, *args, **kwargs):
    proposal, state = super().propose(*args, **kwargs)
    return proposal.replace(draw="sampled"), state


def test_raw_q_rule_on_without_replacement_siblings_is_rejected(small_models):
  target, (dcfg, dparams) = small_models
  sampler = Sampling(temperature=1.0)
  dec = _decoder(target[0], _RawQDrafter(dcfg, tree_draw="without_replacement"), BRANCHY,
                 sampler)
  counts = empirical_joint(dec, target, {"model": dparams}, PROMPT, ROWS)
  exact = exact_joint(*target, sampler, PROMPT)
  assert chi_square_pvalue(counts, exact) < 1e-6
  assert 0.5 * np.abs(counts / ROWS - exact).sum() > 0.1  # total variation about 0.32


# --- 6. bad input: clear errors before anything compiles ---------------------------------------


@pytest.mark.parametrize("parents,match", [
    ((1, 0), "cycle"),
    ((0,), "cycle"),
    ((-1, 5), "outside"),
    ((-1, -2), "outside"),
    ((), "at least one"),
])
def test_bad_topologies_raise(parents, match):
  with pytest.raises(ValueError, match=match):
    TreeTopology(parents)


def test_from_parents_and_from_choices_reject_bad_trees():
  with pytest.raises(ValueError, match="cycle"):
    TreeTopology.from_parents((-1, 2, 1))
  with pytest.raises(ValueError, match="prefix"):
    TreeTopology.from_choices([(0,), (0, 0, 0)])
  with pytest.raises(ValueError, match="non-empty"):
    TreeTopology.from_choices([])


@pytest.mark.parametrize("kind,match", [("prompt_lookup", "only at the root"),
                                        ("bigram", "chains only")])
def test_drafters_refuse_trees_they_cannot_build(target, kind, match):
  cfg, params = target
  drafter, _ = make_drafter(kind, cfg, params, CORPUS)
  with pytest.raises(ValueError, match=match):
    _decoder(cfg, drafter, TREES["branchy"])
  _decoder(cfg, drafter, TreeTopology.chain(3))  # a chain is fine


def test_gamma_must_agree_with_the_tree_depth(target, drafts):
  cfg, _ = target
  drafter, _ = drafts["random"]
  with pytest.raises(ValueError, match="gamma"):
    SpeculativeDecoder(cfg, drafter, gamma=3, tree=TREES["branchy"])  # depth 2
  assert SpeculativeDecoder(cfg, drafter, gamma=2, tree=TREES["branchy"]).gamma == 2
  assert SpeculativeDecoder(cfg, drafter, tree=TREES["medusa"]).gamma == 4
  with pytest.raises(TypeError, match="TreeTopology"):
    SpeculativeDecoder(cfg, drafter, tree=(-1, -1))
  with pytest.raises(ValueError, match="tree_draw"):
    ModelDrafter(cfg, tree_draw="sampled")


def test_cache_too_small_for_the_tree_is_refused_before_compiling(target, drafts):
  cfg, params = target
  drafter, dp = drafts["random"]
  topo = TreeTopology((-1, -1, -1, 0, 0, 0, 1))  # N = 7, D = 2; used by no other test
  dec = _decoder(cfg, drafter, topo)
  prompt, new = PROMPTS[2], 10
  runs, inits = SpeculativeDecoder.run._cache_size(), prefill_models._cache_size()
  size = len(prompt) + new + topo.num_nodes
  with pytest.raises(ValueError, match="cache"):
    dec.generate(params, dp, [prompt], new, cache_size=size - 1)
  with pytest.raises(ValueError, match="cache"):
    dec.prepare(params, dp, [prompt], new, cache_size=size - 1)
  assert SpeculativeDecoder.run._cache_size() == runs
  assert prefill_models._cache_size() == inits
  out = dec.generate(params, dp, [prompt], new, cache_size=size)  # exactly enough
  ref = specjax.generate(params, cfg, [prompt], new, eos_ids=())
  assert out.generated(0) == ref.generated(0)


# --- 7. counters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", ["branchy", "medusa"])
def test_counters_are_consistent(target, drafts, tree):
  cfg, params = target
  topo = TREES[tree]
  d, n_nodes = topo.max_depth, topo.num_nodes
  drafter, dp = drafts["noisy"]
  dec = _decoder(cfg, drafter, topo, Sampling(temperature=1.0))
  out = dec.generate(params, dp, PROMPTS, NEW, cache_size=CACHE, seed=1)
  r = out.per_row
  hist, at, rank = r["accept_len_hist"], r["accepted_at"], r["accepted_rank"]
  assert hist.shape == (len(PROMPTS), d + 1) and at.shape == (len(PROMPTS), d)
  assert rank.shape == (len(PROMPTS), d, max(topo.num_children))
  np.testing.assert_array_equal(r["emitted"], out.num_generated)
  np.testing.assert_array_equal(hist.sum(axis=1), r["target_calls"])
  np.testing.assert_array_equal(hist @ np.arange(d + 1), r["accepted"])
  np.testing.assert_array_equal(r["drafted"], n_nodes * r["target_calls"])
  np.testing.assert_array_equal(at.sum(axis=1), r["accepted"])
  for k in range(d):  # a node at depth k + 1 is accepted iff n > k
    np.testing.assert_array_equal(at[:, k], hist[:, k + 1:].sum(axis=1))
  np.testing.assert_array_equal(rank.sum(axis=2), at)
  # Only (depth, rank) pairs that exist in the topology can be hit.
  exists = np.zeros(rank.shape[1:], bool)
  for dep, rk in zip(topo.depth, topo.ranks):
    exists[dep - 1, rk] = True
  assert np.all(rank[:, ~exists] == 0)
  assert rank[:, :, 1:].sum() > 0, "some non-first sibling should be accepted"
  # β is defined for chains of sampled drafts only.
  np.testing.assert_array_equal(r["beta_count"], 0)
  assert np.isnan(out.metrics()["alpha"])
  # Without EOS, only the last step of a row can be trimmed by the budget.
  assert np.all(r["emitted"] <= r["accepted"] + r["target_calls"])
  assert np.all(r["emitted"] > r["accepted"] + r["target_calls"] - d - 1)
  assert out.steps == r["target_calls"].max()
  m = out.metrics()
  assert m["accept_len_hist"] == hist.sum(axis=0).tolist()
  assert m["tokens_per_call"] == pytest.approx(r["emitted"].sum() / r["target_calls"].sum())


def test_chain_counters_put_every_acceptance_at_rank_zero(target, drafts):
  cfg, params = target
  drafter, dp = drafts["noisy"]
  out = _decoder(cfg, drafter, TREES["chain"], Sampling(temperature=1.0)).generate(
      params, dp, PROMPTS, NEW, cache_size=CACHE, seed=2)
  r = out.per_row
  assert r["accepted_rank"].shape == (len(PROMPTS), 3, 1)
  np.testing.assert_array_equal(r["accepted_rank"][:, :, 0], r["accepted_at"])
  assert np.all(r["beta_count"] > 0)  # β is scored on chains


def test_stream_twin_matches_the_fused_loop_on_a_tree(target, drafts):
  cfg, params = target
  drafter, dp = drafts["noisy"]
  dec = _decoder(cfg, drafter, TREES["branchy"], Sampling(temperature=0.8, top_k=5))
  fused = dec.generate(params, dp, PROMPTS, 16, cache_size=CACHE, seed=7)
  state = None
  for state, _ in dec.stream(params, dp, PROMPTS, 16, cache_size=CACHE, seed=7):
    pass
  np.testing.assert_array_equal(np.asarray(state.tokens), fused.tokens)
  np.testing.assert_array_equal(np.asarray(state.counters.accepted_rank),
                                fused.per_row["accepted_rank"])
