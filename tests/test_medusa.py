"""Medusa-1 heads as a drafter: the heads' forward, the mapping of heads to depths,
lossless greedy and sampled decoding over chains and Medusa trees, trees from measured
accuracies, FasterDecoding's checkpoints and every refusal.

The heads' forward is re-implemented below in numpy from FasterDecoding's
``ResBlock`` / ``medusa_head`` (x + SiLU(W x + b), then a bias-free linear,
on the target's final-normed last hidden state), independently of specjax.
"""

import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from specjax import drafts
from specjax import kv_cache as kvc
from specjax.drafts import medusa_published
from specjax.drafters import ModelDrafter
from specjax.drafters.medusa import (MedusaDrafter, best_product_paths, medusa_drafter,
                                     medusa_params, medusa_tree, random_medusa_weights)
from specjax.generate import generate
from specjax.loaders import CheckpointError
from specjax.model import forward
from specjax.sampling import Greedy, Sampling
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import DynamicTree, TreeTopology, depth_from_parents
from specjax.speculative.typical_acceptance import TypicalAcceptance, accept_typical
from specjax.testing import (chi_square_pvalue, empirical_joint, exact_joint,
                             new_compiles_across_batches, tiny_model)

from matrix import grid

PROMPTS = [[5, 9, 2, 7, 11, 3, 9], [4], [7, 8, 9, 10, 7, 8, 9, 10, 7], [3, 3]]
CHOICES = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]  # Medusa-style


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0)


@pytest.fixture(scope="module")
def heads(target):
  cfg, params = target
  return medusa_drafter(cfg, params, random_medusa_weights(cfg, 3, 2, jax.random.PRNGKey(1)))


# --------------------------------------------------------------- an independent numpy forward


def _np_heads(features, final_norm, eps, res_w, res_b, head):
  """FasterDecoding's heads on raw target features [D]: res_w [K, L, D_out, D_in] (torch),
  head [K, V, D] -> logits [K, V]."""
  f = np.asarray(features, np.float64)
  x = f / np.sqrt(np.mean(f * f) + eps) * np.asarray(final_norm, np.float64)
  out = []
  for k in range(res_w.shape[0]):
    y = x
    for j in range(res_w.shape[1]):
      z = np.asarray(res_w[k, j], np.float64) @ y + np.asarray(res_b[k, j], np.float64)
      y = y + z / (1.0 + np.exp(-z))
    out.append(np.asarray(head[k], np.float64) @ y)
  return np.stack(out)


def _features(cfg, params, seq):
  """[T, D] the target's last hidden states (pre final norm) over ``seq``."""
  t = len(seq)
  out = forward(params, cfg, jnp.asarray([seq]), jnp.arange(t)[None],
                kvc.init_cache(cfg, 1, t, jnp.float32))
  return np.asarray(out.hidden[0])


def test_heads_match_an_independent_forward_at_depths_one_to_k(target, heads):
  cfg, params = target
  drafter, dp = heads
  seq = PROMPTS[0]
  res_w = np.swapaxes(np.asarray(dp["res_w"]), -1, -2)  # specjax [in, out] -> torch [out, in]
  for s in range(2, len(seq) + 1):  # committed x_0..x_{s-1}: the heads read h_{s-2}
    h = _features(cfg, params, seq[:s])[s - 2]
    want = _np_heads(h, params["final_norm"], cfg.norm_eps, res_w, dp["res_b"], dp["head"])
    got = np.asarray(drafter.head_logits(dp, jnp.asarray(h)[None]))[0]
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    # The proposal of a full-width tree: node (depth d, rank r) = head d-1's rank-r token.
    state = drafter.init(dp, jnp.asarray([seq[:s]]), jnp.asarray([s]),
                         features=jnp.asarray(_features(cfg, params, seq[:s])[None]))
    tree = TreeTopology.from_choices([(r,) for r in range(3)] + [(0, r) for r in range(3)]
                                     + [(0, 0, r) for r in range(3)])
    prop, _ = drafter.propose(dp, state, jnp.asarray([seq[:s]]), jnp.asarray([s]),
                              jax.random.PRNGKey(0), Greedy(), tree)
    ranked = np.argsort(-want, axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.asarray(prop.tokens[0]), ranked.reshape(-1))
    assert prop.draw == "point_mass" and prop.q is None
    # A dynamic tree's node of depth d and sibling rank r holds the same token.
    prop, _ = drafter.propose(dp, state, jnp.asarray([seq[:s]]), jnp.asarray([s]),
                              jax.random.PRNGKey(0), Greedy(), DynamicTree(3, 3, 8))
    parents = np.asarray(prop.parents[0])
    depth = np.asarray(depth_from_parents(prop.parents, 3))[0, 1:]
    rank = [int(np.sum(parents[:i] == parents[i])) for i in range(8)]
    np.testing.assert_array_equal(np.asarray(prop.tokens[0]), ranked[depth - 1, rank])
    assert depth.max() > 1  # not just the root's top-k


def _paths(ids, parents, b):
  """Row b's nodes as token paths from the root (parents before children checked)."""
  out = []
  for i in range(ids.shape[1]):
    assert parents[b, i] < i
    path, j = [], i
    while j >= 0:
      path.append(int(ids[b, j]))
      j = int(parents[b, j])
    out.append(tuple(reversed(path)))
  return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_tree_keeps_the_most_probable_paths_of_the_product(seed):
  """Against brute force over every path of the heads' top-k: the N paths of highest
  summed log-probability, each node's parent its prefix."""
  k, depth, n = 3, 3, 11
  logits = 2.0 * jax.random.normal(jax.random.PRNGKey(seed), (2, depth, 12))
  ids, parents = best_product_paths(logits, k, n)
  logp = np.asarray(jax.nn.log_softmax(logits), np.float64)
  for b in range(2):
    order = np.argsort(-logp[b], axis=-1, kind="stable")[:, :k]
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    score = [sum(logp[b, h, order[h, r]] for h, r in enumerate(p)) for p in paths]
    best = [paths[i] for i in np.argsort(-np.asarray(score), kind="stable")[:n]]
    want = {tuple(order[h, r] for h, r in enumerate(p)) for p in best}
    got = _paths(ids, parents, b)
    assert len(set(got)) == n and set(got) == want


@pytest.mark.parametrize("n", [1, 5, 14])
def test_dynamic_tree_is_a_tree_under_ties_and_impossible_tokens(n):
  """Heads with tied logits, a head certain of one token (log-probability 0: children tie
  their parent) and −inf entries still give a tree closed under prefixes and lower sibling
  ranks, up to the whole product (N = 2 + 4 + 8)."""
  neg = -np.inf
  logits = jnp.asarray([[[1.0, 1.0, 0.0, neg], [5.0, neg, neg, neg], [0.0, 0.0, 0.0, 0.0]]])
  ids, parents = best_product_paths(logits, 2, n)
  got = _paths(ids, parents, 0)
  assert len(set(got)) == n
  ranks = [[0, 1], [0, 1], [0, 1, 2, 3]]  # each head's tokens by rank (top_k: stable ties)
  for path in got:
    assert path[:-1] in set(got) | {()}
    r = ranks[len(path) - 1].index(path[-1])
    assert r == 0 or path[:-1] + (ranks[len(path) - 1][r - 1],) in got


# --------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("tree", ["chain1", "chain3", "choices", "default", "dynamic"])
def test_greedy_decoding_equals_plain_decoding(target, heads, tree):
  cfg, params = target
  drafter, dp = heads
  topology = {"chain1": TreeTopology.chain(1), "chain3": TreeTopology.chain(3),
              "choices": drafter.choices_tree(CHOICES), "default": None,
              "dynamic": drafter.dynamic_tree(8)}[tree]
  dec = SpeculativeDecoder(cfg, drafter, tree=topology)
  out = dec.generate(params, dp, PROMPTS, 14)
  ref = generate(params, cfg, PROMPTS, 14)
  for i in range(len(PROMPTS)):
    assert out.generated(i) == ref.generated(i)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_greedy_equality_when_drafts_are_accepted(dynamic):
  """V = 8 and a root of all 8 ranks: depth 1 is always accepted, deeper nodes often, so
  the accepted paths, the compaction and the window of features are all exercised (with a
  dynamic tree, per-row parents that change every step)."""
  cfg, params = tiny_model(seed=0, vocab_size=8, scale=1.0)
  drafter, dp = medusa_drafter(cfg, params, random_medusa_weights(cfg, 2, 1,
                                                                  jax.random.PRNGKey(3)),
                               top_k=8)
  tree = (DynamicTree(top_k=8, depth=2, num_nodes=17) if dynamic else drafter.choices_tree(
      [(r,) for r in range(8)] + [(r, q) for r in range(3) for q in range(3)]))
  prompts = [[t % 8 for t in p] for p in PROMPTS]
  dec = SpeculativeDecoder(cfg, drafter, tree=tree, eos_ids=())
  out = dec.generate(params, dp, prompts, 20)
  ref = generate(params, cfg, prompts, 20, eos_ids=())
  for i in range(len(prompts)):
    assert out.generated(i) == ref.generated(i)
  # The static root holds all 8 tokens, so every step accepts a draft; the dynamic tree
  # may trade root ranks for deeper nodes (1.86 with these weights).
  assert out.metrics()["tokens_per_call"] > (1.5 if dynamic else 2.0)


@pytest.mark.parametrize("plain_steps", [False, True])
def test_heads_read_the_feature_of_position_s_minus_2_at_every_step(plain_steps):
  """Across real steps (accepting 0, 1 or 2 drafts, and plain steps under a policy), the
  feature the heads read equals the target's h_{s−2} recomputed from the committed tokens."""
  cfg, params = tiny_model(seed=0, vocab_size=8, scale=1.0)
  drafter, dp = medusa_drafter(cfg, params, random_medusa_weights(cfg, 2, 1,
                                                                  jax.random.PRNGKey(3)),
                               top_k=8)
  prompts = [[1, 2, 5], [4], [7, 0, 3, 3, 6]]
  if plain_steps:
    dec = SpeculativeDecoder(cfg, drafter, eos_ids=(), policy=AdaptiveGamma(
        gammas=(0, 2), step_costs=(1.0, 1.9), prior_alpha=0.5, decay=0.5))
  else:
    dec = SpeculativeDecoder(cfg, drafter, eos_ids=(), tree=drafter.choices_tree(
        [(r,) for r in range(8)] + [(0, q) for q in range(3)]))
  accepted = set()
  for state, _ in dec.stream(params, dp, prompts, 12):
    got = np.asarray(drafter.feature(state.draft_state, state.seq_lens))
    for b in range(len(prompts)):
      s = int(state.seq_lens[b])
      want = _features(cfg, params, np.asarray(state.tokens[b, :s]).tolist())[s - 2]
      # Features of this model reach ~10³; a verify block and a full forward round apart.
      np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    accepted.update(np.asarray(state.counters.accept_len_hist).nonzero()[1].tolist())
  plain = int(np.asarray(state.counters.depth_hist)[:, 0].sum())
  assert plain > 0 if plain_steps else accepted >= {1, 2}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_shared_head_and_reduced_vocabulary_decode_losslessly(target, dynamic):
  cfg, params = target
  weights = random_medusa_weights(cfg, 2, 1, jax.random.PRNGKey(4), own_head=False)
  vocab_map = np.arange(0, cfg.vocab_size, 2)
  drafter, dp = medusa_drafter(cfg, params, weights, vocab_map=vocab_map)
  assert drafter.shared_head and dp["head"].shape == (cfg.vocab_size // 2, cfg.dim)
  tree = (drafter.dynamic_tree(3) if dynamic
          else drafter.choices_tree([(0,), (1,), (0, 0)]))
  dec = SpeculativeDecoder(cfg, drafter, tree=tree)
  out = dec.generate(params, dp, PROMPTS, 10)
  ref = generate(params, cfg, PROMPTS, 10)
  for i in range(len(PROMPTS)):
    assert out.generated(i) == ref.generated(i)
    # every draft is in the map (odd ids never proposed): checked on one proposal
  state = drafter.init(dp, jnp.asarray([PROMPTS[0]]), jnp.asarray([7]),
                       features=jnp.asarray(_features(cfg, params, PROMPTS[0])[None]))
  prop, _ = drafter.propose(dp, state, jnp.asarray([PROMPTS[0]]), jnp.asarray([7]),
                            jax.random.PRNGKey(0), Greedy(), tree)
  assert np.all(np.asarray(prop.tokens) % 2 == 0)


def test_adaptive_policy_with_plain_steps(target, heads):
  cfg, params = target
  drafter, dp = heads
  dec = SpeculativeDecoder(cfg, drafter, policy=AdaptiveGamma(
      gammas=(0, 1, 3), step_costs=(1.0, 1.2, 1.5), prior_alpha=0.6, decay=0.7))
  out = dec.generate(params, dp, PROMPTS, 24)
  ref = generate(params, cfg, PROMPTS, 24)
  for i in range(len(PROMPTS)):
    assert out.generated(i) == ref.generated(i)
  hist = out.metrics()["depth_hist"]
  assert hist[0] > 0 and sum(hist[1:]) > 0  # plain steps and speculative ones


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_no_recompilation_across_batches(target, heads, dynamic):
  cfg, params = target
  drafter, dp = heads
  tree = drafter.dynamic_tree(8) if dynamic else drafter.choices_tree(CHOICES)
  dec = SpeculativeDecoder(cfg, drafter, tree=tree)
  assert new_compiles_across_batches(dec, params, dp) == 0


# --------------------------------------------------------------- exact distribution

V, N, PROMPT = 8, 100_000, [1, 2, 5]


@pytest.fixture(scope="module")
def small():
  cfg, params = tiny_model(seed=0, vocab_size=V, scale=1.0)
  return (cfg, params), medusa_drafter(cfg, params, random_medusa_weights(
      cfg, 2, 1, jax.random.PRNGKey(5)), top_k=4)


SMALL_TREES = {"static": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)],
               "dynamic": DynamicTree(top_k=3, depth=2, num_nodes=6)}


@pytest.mark.parametrize("sampler, tree", grid(
    {"t1": Sampling(temperature=1.0), "t0.7_k4": Sampling(temperature=0.7, top_k=4)},
    ["static", "dynamic"], keep=("t1-static", "t0.7_k4-dynamic")))
def test_sampled_tree_keeps_the_targets_law(small, sampler, tree):
  target, (drafter, dp) = small
  topology = SMALL_TREES[tree]
  if tree == "static":
    topology = drafter.choices_tree(topology)
  dec = SpeculativeDecoder(target[0], drafter, sampler=sampler, eos_ids=(), tree=topology)
  counts = empirical_joint(dec, target, dp, PROMPT, N)
  exact = exact_joint(*target, sampler, PROMPT)
  assert chi_square_pvalue(counts, exact) > 1e-3
  assert 0.5 * np.abs(counts / N - exact).sum() < 0.02


class _SoftQMedusa(MedusaDrafter):
  """Wrong: proposes the heads' nodes but reports each node's head's softmax as q."""

  def propose(self, draft_params, state, tokens, seq_lens, key, sampler, topology):
    prop, state = super().propose(draft_params, state, tokens, seq_lens, key, sampler, topology)
    probs = sampler.probs(self.head_logits(draft_params, self.feature(state, seq_lens)))
    if prop.parents is None:
      head = jnp.broadcast_to(jnp.asarray(topology.depth) - 1, prop.tokens.shape)
    else:
      head = depth_from_parents(prop.parents, topology.max_depth)[:, 1:] - 1
    q = jnp.take_along_axis(probs, head[:, :, None], axis=1)  # [B, N, V]
    return type(prop)(tokens=prop.tokens, q=q, parents=prop.parents, draw="sampled"), state


@pytest.mark.parametrize("tree", ["chain", "dynamic"])
def test_treating_the_point_mass_as_the_heads_softmax_is_rejected(small, tree):
  target, (drafter, dp) = small
  sampler = Sampling(temperature=1.0)
  wrong = _SoftQMedusa(drafter.cfg, drafter.num_heads, drafter.num_layers, drafter.top_k)
  topology = TreeTopology.chain(2) if tree == "chain" else SMALL_TREES["dynamic"]
  dec = SpeculativeDecoder(target[0], wrong, sampler=sampler, eos_ids=(), tree=topology)
  counts = empirical_joint(dec, target, dp, PROMPT, N)
  assert chi_square_pvalue(counts, exact_joint(*target, sampler, PROMPT)) < 1e-6


# --------------------------------------------------------------- trees from accuracies


def test_medusa_tree_from_head_accuracies():
  acc = [[0.8, 0.1, 0.05], [0.6, 0.1, 0.05], [0.5, 0.1, 0.0]]
  tree = medusa_tree(acc, 4)
  # (0,) .8, (0,0) .48, (0,0,0) .24, then (1,) .1 / (0,1) .08: (1,)
  assert tree == TreeTopology.from_choices([(0,), (1,), (0, 0), (0, 0, 0)])
  assert medusa_tree(acc, 4).max_depth <= 3
  with pytest.raises(ValueError, match="beyond top_k=3"):
    medusa_tree(acc, 40)
  with pytest.raises(ValueError, match=r"\[heads, ranks\] table"):
    medusa_tree([0.5, 0.2], 2)
  with pytest.raises(ValueError, match="probabilities in"):
    medusa_tree([[1.5]], 1)


@pytest.mark.parametrize("k,top_k", [(2, 1), (1, 2), (3, 10), (20, 10)])
def test_default_tree_fits_the_heads(target, k, top_k):
  drafter = MedusaDrafter(target[0], k, top_k=top_k)
  tree = drafter.default_tree()
  assert drafter.supports(tree)
  assert tree.num_nodes == min(4 * k, 64, sum(top_k ** d for d in range(1, k + 1)))
  for n in (1, 7, 400):  # cut to what the heads and DynamicTree admit, never refused
    dynamic = drafter.dynamic_tree(n)
    assert drafter.supports(dynamic) and dynamic.num_nodes <= n
  seven = drafter.dynamic_tree(7)
  assert seven.num_nodes == min(7, seven.pool_size)


# --------------------------------------------------------------- refusals


def test_trees_the_heads_cannot_draft_are_refused_before_compiling(target, heads):
  cfg, _ = target
  drafter, _ = heads
  with pytest.raises(ValueError, match="3 heads draft 3 tokens at most"):
    drafter.choices_tree([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
  with pytest.raises(ValueError, match="beyond the heads' top_k=10"):
    drafter.choices_tree([(r,) for r in range(11)])
  with pytest.raises(ValueError, match="without its prefix"):
    drafter.choices_tree([(0,), (1, 0)])
  with pytest.raises(ValueError, match="skip a sibling rank"):
    drafter.choices_tree([(0,), (2,)])
  with pytest.raises(ValueError, match="MedusaDrafter cannot build"):
    SpeculativeDecoder(cfg, drafter, gamma=4)
  for tree, why in [(DynamicTree(top_k=2, depth=4, num_nodes=4), "3 heads draft 3"),
                    (DynamicTree(top_k=11, depth=2, num_nodes=4), "beyond the heads' 10")]:
    assert why in drafter.tree_error(tree)
    with pytest.raises(ValueError, match="MedusaDrafter cannot build DynamicTree"):
      SpeculativeDecoder(cfg, drafter, tree=tree)
  wide = MedusaDrafter(cfg, 6, top_k=10)
  assert "1111110 candidate paths" in wide.tree_error(DynamicTree(10, 6, 6))
  assert wide.supports(DynamicTree(10, 5, 5))


def test_bad_params_are_refused(target, heads):
  cfg, params = target
  drafter, dp = heads
  with pytest.raises(ValueError, match=r"missing \['res_b'\]"):
    drafter.check_params({k: v for k, v in dp.items() if k != "res_b"})
  with pytest.raises(ValueError, match=r"'res_w' has shape \(3, 1, 32, 32\)"):
    drafter.check_params(dict(dp, res_w=dp["res_w"][:, :1]))
  with pytest.raises(ValueError, match=r"expected \[K, Vd, D\]"):
    drafter.check_params(dict(dp, head=dp["head"][:2]))
  with pytest.raises(ValueError, match="pass a vocab_map"):
    drafter.check_params(dict(dp, head=dp["head"][:, :20]))
  with pytest.raises(ValueError, match="does not name the head's 20 rows"):
    drafter.check_params(dict(dp, head=dp["head"][:, :20], vocab_map=jnp.arange(10)))
  with pytest.raises(ValueError, match="top_k=10 exceeds the head's 8 rows"):
    drafter.check_params(dict(dp, head=dp["head"][:, :8], vocab_map=jnp.arange(8)))
  with pytest.raises(ValueError, match="width 16 do not fit a target of width 32"):
    medusa_drafter(cfg, params, {"res_w": jnp.zeros((2, 1, 16, 16)),
                                 "res_b": jnp.zeros((2, 1, 16))})
  with pytest.raises(ValueError, match="num_heads must be >= 1"):
    MedusaDrafter(cfg, 0)
  assert set(medusa_params(cfg, params, {"res_w": jnp.zeros((1, 0, 32, 32)),
                                         "res_b": jnp.zeros((1, 0, 32))})) == {
      "final_norm", "res_w", "res_b", "head"}


# --------------------------------------------------------------- FasterDecoding's checkpoints


def _published(cfg, k=3, l=1, seed=0):
  """(config.json, state dict) exactly as FasterDecoding writes them: the state dict of
  ``MedusaModel.medusa_head`` in float16, torch [out, in] layout."""
  rng = np.random.default_rng(seed)
  d, v = cfg.dim, cfg.vocab_size
  tensors = {}
  for h in range(k):
    for j in range(l):
      tensors[f"{h}.{j}.linear.weight"] = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(
          np.float16)
      tensors[f"{h}.{j}.linear.bias"] = (0.1 * rng.standard_normal(d)).astype(np.float16)
    tensors[f"{h}.{l}.weight"] = (rng.standard_normal((v, d)) / np.sqrt(d)).astype(np.float16)
  config = {"medusa_num_heads": k, "medusa_num_layers": l,
            "base_model_name_or_path": "tiny/target", "hidden_size": d, "vocab_size": v}
  return config, tensors


def _write(path, config, tensors, fmt="safetensors"):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if fmt == "safetensors":
    save_file(tensors, os.path.join(path, "medusa_lm_head.safetensors"))
  else:
    import torch
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()},
               os.path.join(path, "medusa_lm_head.pt"))
  return str(path)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_published_heads_load_and_decode_losslessly(tmp_path, target, fmt):
  cfg, params = target
  config, tensors = _published(cfg, k=3, l=2)
  path = _write(tmp_path, config, tensors, fmt)
  assert medusa_published.published_medusa_weights(path).endswith(
      "safetensors" if fmt == "safetensors" else ".pt")
  drafter, dp, note = drafts.drafter_from_path(path, cfg, params, None)
  assert "published Medusa heads" in note
  assert (drafter.num_heads, drafter.num_layers, drafter.shared_head) == (3, 2, False)
  # The heads compute FasterDecoding's forward on the stored float16 weights.
  res_w = np.stack([np.stack([tensors[f"{h}.{j}.linear.weight"] for j in range(2)])
                    for h in range(3)]).astype(np.float32)
  res_b = np.stack([np.stack([tensors[f"{h}.{j}.linear.bias"] for j in range(2)])
                    for h in range(3)]).astype(np.float32)
  head = np.stack([tensors[f"{h}.2.weight"] for h in range(3)]).astype(np.float32)
  h = _features(cfg, params, PROMPTS[0])[-1]
  np.testing.assert_allclose(
      np.asarray(drafter.head_logits(dp, jnp.asarray(h)[None]))[0],
      _np_heads(h, params["final_norm"], cfg.norm_eps, res_w, res_b, head), rtol=2e-4,
      atol=2e-4)
  dec = SpeculativeDecoder(cfg, drafter, tree=drafter.choices_tree(CHOICES))
  out = dec.generate(params, dp, PROMPTS, 12)
  ref = generate(params, cfg, PROMPTS, 12)
  for i in range(len(PROMPTS)):
    assert out.generated(i) == ref.generated(i)


def _bad(cfg, change):
  config, tensors = _published(cfg, k=2, l=1)
  change(config, tensors)
  return config, tensors


BAD = {
    "no_heads_field": (lambda c, t: c.pop("medusa_num_heads"), CheckpointError,
                       "lacks the field 'medusa_num_heads'"),
    "bad_layers_field": (lambda c, t: c.update(medusa_num_layers="1"), CheckpointError,
                         "medusa_num_layers '1' is not an integer >= 0"),
    "other_width_config": (lambda c, t: c.update(hidden_size=64), ValueError,
                           "hidden_size is 64, this target's hidden size is 32"),
    "other_vocab_shape": (lambda c, t: (c.pop("vocab_size"), t.update(
        {"0.1.weight": np.zeros((80, 32), np.float16)})), ValueError,
                          "head 0's rows is 80, this target's vocabulary is 64"),
    "missing": (lambda c, t: t.pop("1.0.linear.bias"), CheckpointError,
                r"1 tensor\(s\) missing, e.g. \['1.0.linear.bias'\]"),
    "extra": (lambda c, t: t.update({"2.1.weight": np.zeros((64, 32), np.float16)}),
              CheckpointError, r"Medusa heads do not have, e.g. \['2.1.weight'\]"),
    "misshapen": (lambda c, t: t.update({"1.0.linear.weight": np.zeros((32, 16), np.float16)}),
                  CheckpointError, r"'1.0.linear.weight' has shape \(32, 16\)"),
    "int_dtype": (lambda c, t: t.update({"1.0.linear.bias": np.zeros(32, np.int32)}),
                  CheckpointError, "has dtype int32, not a float"),
    "nan": (lambda c, t: t["1.1.weight"].__setitem__((3, 4), np.nan), CheckpointError,
            "'1.1.weight' holds non-finite values"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_published_heads_are_refused_by_name(tmp_path, target, case):
  change, error, message = BAD[case]
  path = _write(tmp_path, *_bad(target[0], change))
  with pytest.raises(error, match=message):
    medusa_published.load_published_medusa(path, *target)


def test_bad_directories_are_refused(tmp_path, target):
  with pytest.raises(CheckpointError, match="does not exist"):
    medusa_published.load_published_medusa(str(tmp_path / "nowhere"), *target)
  with pytest.raises(CheckpointError, match="has no config.json"):
    medusa_published.load_published_medusa(str(tmp_path), *target)
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"medusa_num_heads": 2, "medusa_num_layers": 1}, f)
  with pytest.raises(CheckpointError, match="holds no medusa_lm_head.safetensors"):
    medusa_published.load_published_medusa(str(tmp_path), *target)
  assert medusa_published.published_medusa_weights(str(tmp_path)) is None


# --------------------------------------------------------------- typical acceptance (lossy)


def test_first_token_tv_of_the_typical_acceptance_benchmark(benchmark_module):
  """benchmarks/typical_acceptance.py's per-step TV: its docstring example."""
  first_token_tv = benchmark_module("typical_acceptance").first_token_tv
  p0 = np.array([[0.5, 0.3, 0.2]] * 2)
  tv = first_token_tv(p0, np.array([1, 0]), np.array([1, 1]), np.array([0.25, 0.25]))
  np.testing.assert_allclose(tv, [0.7, 0.2])


def test_typical_acceptance_by_hand():
  # Root -> {a: token 0, b: token 1}; a -> {c: token 2}. Root's p = (.5, .45, .05) has
  # H ≈ 0.86, so τ = min(.09, .3 e^-H ≈ .13) = .09 and both children pass. a's p = (.6, .35,
  # .05) has τ = .09 too and gives token 2 only .05: c fails, the path stops at depth 1, and
  # of a and b the likelier (a, .5) wins; the next token comes from a's p without token 2.
  tree = TreeTopology((-1, -1, 0))
  p = jnp.asarray([[[0.5, 0.45, 0.05], [0.6, 0.35, 0.05], [0.2, 0.2, 0.6], [1 / 3] * 3]])
  prop = Proposal(tokens=jnp.asarray([[0, 1, 2]]), draw="point_mass")
  acc = accept_typical(jax.random.PRNGKey(0), prop, p, tree, TypicalAcceptance())
  assert int(acc.num_accepted[0]) == 1 and acc.path.tolist() == [[0, 1, -1]]
  draws = [int(accept_typical(jax.random.PRNGKey(i), prop, p, tree,
                              TypicalAcceptance()).next_token[0]) for i in range(40)]
  assert set(draws) <= {0, 1}
  # With c's probability raised above τ the whole path is kept.
  p2 = p.at[0, 1].set(jnp.asarray([0.3, 0.2, 0.5]))
  acc = accept_typical(jax.random.PRNGKey(0), prop, p2, tree, TypicalAcceptance())
  assert int(acc.num_accepted[0]) == 2 and acc.path.tolist() == [[0, 1, 3]]


def test_typical_acceptance_is_opt_in_and_moves_the_law(small):
  target, (drafter, dp) = small
  sampler = Sampling(temperature=1.0)
  tree = drafter.choices_tree([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
  assert SpeculativeDecoder(target[0], drafter, tree=tree).verification == "tokenwise"
  dec = SpeculativeDecoder(target[0], drafter, sampler=sampler, eos_ids=(), tree=tree,
                           verification="typical_lossy")
  assert dec.verification == TypicalAcceptance() and dec.verification.lossy
  counts = empirical_joint(dec, target, dp, PROMPT, N)
  assert chi_square_pvalue(counts, exact_joint(*target, sampler, PROMPT)) < 1e-6


def test_typical_acceptance_of_a_sampled_chain_records_no_beta(target):
  """Typical acceptance computes no β: a chain it verifies leaves α unmeasured (NaN in the
  summary), where its zero βs used to read α = 0."""
  cfg, params = target
  dcfg, dparams = tiny_model(seed=1, num_layers=1)
  drafter = ModelDrafter(dcfg)
  dec = SpeculativeDecoder(cfg, drafter, gamma=2, sampler=Sampling(temperature=1.0),
                           eos_ids=(), verification="typical_lossy")
  out = dec.generate(params, drafter.make_params(dparams), PROMPTS, 10)
  assert out.per_row["beta_count"].sum() == 0 and out.per_row["drafted"].sum() > 0
  assert np.isnan(out.metrics()["alpha"])


def test_typical_acceptance_keeps_greedy_exact(target, heads):
  cfg, params = target
  drafter, dp = heads
  dec = SpeculativeDecoder(cfg, drafter, tree=drafter.choices_tree(CHOICES),
                           verification=TypicalAcceptance(threshold=0.2, alpha=0.5))
  out = dec.generate(params, dp, PROMPTS, 10)
  ref = generate(params, cfg, PROMPTS, 10)
  for i in range(len(PROMPTS)):
    assert out.generated(i) == ref.generated(i)


def test_typical_acceptance_refusals(target, heads):
  cfg, _ = target
  drafter, _ = heads
  with pytest.raises(ValueError, match=r"typical threshold must be a finite number in \[0, 1\]"):
    TypicalAcceptance(threshold=2.0)
  with pytest.raises(ValueError, match="'typical_lossy' / a TypicalAcceptance"):
    SpeculativeDecoder(cfg, drafter, gamma=2, verification="typical")
