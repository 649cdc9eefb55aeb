"""EAGLE feature drafter: its state tracks the target's true features, it trains, it ships."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import drafts
from specjax.distill import eagle, features, teacher, train, vocab
from specjax.drafters.eagle import (EagleDrafter, eagle_config, eagle_drafter, init_eagle_weights,
                                    pack_eagle_params, random_eagle_weights)
from specjax.kv_cache import init_cache
from specjax.loaders import CheckpointError
from specjax.generate import generate
from specjax.kernels import packed as pk
from specjax.kernels import policy as pol
from specjax.model import forward, target_features
from specjax.sampling import Sampling, SubsetProbs, dense_probs
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.testing import tiny_model

PROMPTS = [[1, 2, 3, 1, 2], [4, 5], [7, 8, 9, 10, 7, 8, 9, 10, 7], [3]]


def _draft_from_scratch(drafter, dp, target_params, target_cfg, seq, last_feature=None):
  """ĥ and logits of pair len(seq) − 1 recomputed from scratch: the target's features of
  the whole sequence (teacher-forced), shifted by one, through the draft; with
  ``last_feature`` that pair reads it instead of the target's. Padded to a fixed
  length (causal: padding never reaches earlier positions) and jitted with the length
  as an array, so one compile serves every sequence."""
  l = 32
  tokens = np.zeros((1, l), np.int32)
  tokens[0, :len(seq)] = seq
  return _from_scratch(drafter, dp, target_params, target_cfg, jnp.asarray(tokens),
                       jnp.int32(len(seq)), last_feature)


@functools.partial(jax.jit, static_argnames=("drafter", "target_cfg"))
def _from_scratch(drafter, dp, target_params, target_cfg, tokens, n, last_feature):
  l = tokens.shape[1]
  pos = jnp.arange(l)[None]
  layers = drafter.feature_layers
  out = forward(target_params, target_cfg, tokens, pos, init_cache(target_cfg, 1, l),
                return_layers=layers)
  feats = drafter.fuse(dp, target_features(out, layers))
  shifted = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)
  if last_feature is not None:
    shifted = shifted.at[:, n - 1].set(last_feature)
  h, _ = drafter.hidden(dp, shifted, tokens, pos, init_cache(drafter.cfg, 1, l))
  h = jax.lax.dynamic_index_in_dim(h, n - 1, axis=1, keepdims=False)
  return h, drafter.logits(dp, h)


@pytest.mark.parametrize("gamma,layers", [  # the fused γ = 3 case covers the others' paths
    pytest.param(1, (), marks=pytest.mark.heavy), pytest.param(3, (), marks=pytest.mark.heavy),
    (3, (0, 1))])
def test_every_proposal_reads_the_true_features_of_the_whole_committed_sequence(gamma, layers):
  """Across real steps (prefill, observe, partial acceptance), the first draft's q equals
  the draft run from scratch on the target's teacher-forced features (fused from several
  layers with ``layers``); the second draft reads the first one's predicted feature."""
  cfg, params = tiny_model(seed=0)
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(7), num_fused=len(layers))
  drafter, dp = eagle_drafter(cfg, params, weights, np.arange(0, cfg.vocab_size, 2), layers)
  sampler = Sampling(temperature=1.0)
  dec = SpeculativeDecoder(cfg, drafter, gamma=gamma, sampler=sampler, eos_ids=())
  checked = 0
  propose = jax.jit(dec.propose)
  for state, _ in dec.stream(params, dp, PROMPTS, 12, seed=1):
    if bool(jnp.all(state.done)):
      break
    proposal, _ = propose(dp, state, jax.random.PRNGKey(0))
    drafts_, q = proposal.tokens, dense_probs(proposal.q)
    for row in range(len(PROMPTS)):
      if bool(state.done[row]):  # finished rows draft garbage, which nobody reads
        continue
      seq = np.asarray(state.tokens[row, :int(state.seq_lens[row])])
      h, logits = _draft_from_scratch(drafter, dp, params, cfg, seq)
      np.testing.assert_allclose(np.asarray(q[row, 0]), np.asarray(sampler.probs(logits)[0]),
                                 atol=2e-5)
      if gamma > 1:  # pair s = (ĥ_{s−1}, d₁) on top of the true pairs
        _, logits2 = _draft_from_scratch(drafter, dp, params, cfg,
                                         np.append(seq, int(drafts_[row, 0])), h)
        np.testing.assert_allclose(np.asarray(q[row, 1]), np.asarray(sampler.probs(logits2)[0]),
                                   atol=2e-5)
      checked += 1
  assert checked >= 8


def test_init_in_chunks_builds_the_pairs_of_feeding_the_whole_prompt_at_once(monkeypatch):
  """The prompt's pairs (f_{i−1}, x_i), i < P − 1, fed chunk by chunk (ragged prompts over
  several chunks) give the cache of one forward over all of them, and nothing past P − 1."""
  import functools

  from specjax.drafters import eagle as eagle_module
  from specjax.generate import over_chunks
  monkeypatch.setattr(eagle_module, "over_chunks", functools.partial(over_chunks, chunk=4))
  cfg, params = tiny_model(seed=0)
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(7), num_fused=2)
  drafter, dp = eagle_drafter(cfg, params, weights, None, (0, 1))
  s = 18  # not a multiple of the chunk: the last chunk runs past the buffer
  lens = jnp.asarray([s, 3, 6])
  tokens = jax.random.randint(jax.random.PRNGKey(1), (3, s), 0, cfg.vocab_size)
  feats = jax.random.normal(jax.random.PRNGKey(2), (3, s, 2 * cfg.dim))
  state = drafter.init(dp, tokens, lens, features=feats)
  fused = drafter.fuse(dp, feats)
  shifted = jnp.concatenate([jnp.zeros_like(fused[:, :1]), fused[:, :-1]], axis=1)
  _, whole = drafter.hidden(dp, shifted, tokens, jnp.broadcast_to(jnp.arange(s), (3, s)),
                            init_cache(drafter.cfg, 3, s), num_valid=lens - 1)
  np.testing.assert_array_equal(state.cache.lengths, lens - 1)
  valid = (jnp.arange(s)[None, :] < (lens - 1)[:, None])[:, None, :, None]
  for got, want in zip(state.cache.k + state.cache.v, whole.k + whole.v):
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, want, 0), atol=1e-5)


def test_fused_drafter_greedy_equals_plain_greedy_decoding():
  cfg, params = tiny_model(seed=0)
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(5), num_fused=2)
  drafter, dp = eagle_drafter(cfg, params, weights, None, (0, cfg.num_layers - 1))
  want = generate(params, cfg, PROMPTS, 12, eos_ids=())
  for tree in (TreeTopology.chain(3), DynamicTree(depth=3, top_k=2, num_nodes=5)):
    out = SpeculativeDecoder(cfg, drafter, tree=tree, eos_ids=()).generate(params, dp, PROMPTS, 12)
    for row in range(len(PROMPTS)):
      assert out.generated(row) == want.generated(row)


@pytest.mark.parametrize("layers_kernel", [True, False])
def test_draft_packed_beside_a_target_takes_its_layers_and_its_heads_policies(layers_kernel):
  """The target's layers and head are packed under policies measured apart: the draft's
  projections take the layers', its own head the head's; either way it drafts as plain."""
  cfg, params = tiny_model(seed=0)
  layers, head = (pol.KERNEL, pol.XLA) if layers_kernel else (pol.XLA, pol.KERNEL)
  target = pk.pack_params(params, cfg.tie_embeddings, layers, head_policy=head)
  assert pk.policy_of(target) == layers and pk.head_policy_of(target) == head
  assert pk.head_policy_of(params) == pol.XLA
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(5), num_fused=2)
  feature_layers = (0, cfg.num_layers - 1)
  drafter, plain = eagle_drafter(cfg, params, weights, None, feature_layers)
  _, packed = eagle_drafter(cfg, target, weights, None, feature_layers)
  assert not any(isinstance(w, pk.PackedWeight) for w in jax.tree.leaves(
      plain, is_leaf=lambda x: isinstance(x, pk.PackedWeight)))
  for w in (packed["fuse"], packed["fc"], packed["layers"][0]["wqkv"]):
    assert isinstance(w, pk.PackedWeight) == layers_kernel
  assert isinstance(packed["head"], pk.PackedWeight) == (not layers_kernel)
  # The same packing in float32 panels, to compare with plain (the default float16 rounds:
  # tests/test_kernels.py).
  dp = pack_eagle_params(plain, layers, head, panel_dtype=jnp.float32)
  assert jax.tree.structure(dp, is_leaf=lambda x: isinstance(x, pk.PackedWeight)) == \
      jax.tree.structure(packed, is_leaf=lambda x: isinstance(x, pk.PackedWeight))
  np.testing.assert_allclose(np.asarray(drafter.plain_params(dp)["head"]),
                             np.asarray(plain["head"]))
  seq = [1, 5, 9, 2, 7, 3]
  want = _draft_from_scratch(drafter, plain, params, cfg, seq)
  got = _draft_from_scratch(drafter, dp, params, cfg, seq)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_untrained_fusion_of_the_last_layer_reads_what_eagle1_reads():
  """``fuse`` starts as the identity on the highest layer: with (…, last) fused, the
  drafter's first-step output equals the unfused drafter's on the same weights."""
  cfg, params = tiny_model(seed=0)
  plain = init_eagle_weights(cfg, params, 1, key=jax.random.PRNGKey(4))
  fused = init_eagle_weights(cfg, params, 1, key=jax.random.PRNGKey(4),
                             feature_layers=(0, cfg.num_layers - 1))
  seq = [1, 5, 9, 2, 7, 3]
  outs = []
  for w, layers in ((plain, ()), (fused, (0, cfg.num_layers - 1))):
    drafter, dp = eagle_drafter(cfg, params, w, None, layers)
    outs.append(_draft_from_scratch(drafter, dp, params, cfg, seq)[1])
  np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), rtol=1e-4, atol=1e-4)


def test_bad_fusion_is_refused():
  cfg, params = tiny_model(seed=0)
  fused = random_eagle_weights(cfg, 1, jax.random.PRNGKey(0), num_fused=2)
  with pytest.raises(ValueError, match="fusion"):
    eagle_drafter(cfg, params, random_eagle_weights(cfg, 1, jax.random.PRNGKey(0)), None, (0, 1))
  with pytest.raises(ValueError, match="do not fuse 1 layers"):
    eagle_drafter(cfg, params, fused, None, (1,))
  with pytest.raises(ValueError, match="do not exist"):
    eagle_drafter(cfg, params, fused, None, (0, cfg.num_layers))
  with pytest.raises(ValueError, match="sorted"):
    EagleDrafter(eagle_config(cfg, 1), feature_layers=(1, 0))


def test_reduced_vocabulary_gives_zero_q_outside_the_map():
  cfg, params = tiny_model(seed=0)
  vm = np.arange(0, cfg.vocab_size, 2)
  drafter, dp = eagle_drafter(cfg, params, random_eagle_weights(cfg, 1, jax.random.PRNGKey(1)), vm)
  dec = SpeculativeDecoder(cfg, drafter, gamma=2, sampler=Sampling(1.0), eos_ids=())
  state, _ = dec.prepare(params, dp, PROMPTS, 4)
  proposal, _ = dec.propose(dp, state, jax.random.PRNGKey(0))
  assert isinstance(proposal.q, SubsetProbs)  # q travels at the map's width
  np.testing.assert_array_equal(np.asarray(proposal.q.ids), vm)
  drafts_, q = proposal.tokens, proposal.q.dense()
  assert np.all(np.asarray(q)[..., 1::2] == 0.0)
  assert np.all(np.asarray(drafts_) % 2 == 0)
  np.testing.assert_allclose(np.asarray(q).sum(-1), 1.0, atol=1e-5)


def test_weights_of_another_width_are_refused():
  cfg, params = tiny_model(seed=0)
  other, _ = tiny_model(seed=0, dim=48, num_heads=4, num_kv_heads=2)
  with pytest.raises(ValueError, match="width"):
    eagle_drafter(cfg, params, random_eagle_weights(other, 1, jax.random.PRNGKey(0)))


@pytest.fixture(scope="module")
def toy(toy_corpus_features):
  """The shared toy target and corpus (conftest), each record with the target's features."""
  return toy_corpus_features


@pytest.mark.parametrize("ttt_steps,layers,online", [  # default run: TTT + fusion + online
    pytest.param(1, (), False, marks=pytest.mark.heavy),
    pytest.param(3, (), False, marks=pytest.mark.heavy), (3, (0,), True)])
def test_tiny_eagle_training_lowers_loss_and_raises_alpha(toy, tmp_path, ttt_steps, layers,
                                                          online):
  """Also with a fusion, trained from an id-only corpus by the online teacher."""
  cfg, params, recs, held = toy
  vm = vocab.select_vocab(vocab.token_counts(recs, cfg.vocab_size), 48)
  online_teacher = None
  if online:
    online_teacher = (train.Teacher(cfg, 8, layers), params)
    recs = [dict(prompt=r["prompt"], response=r["response"], mode=r["mode"]) for r in recs]
    held = [dict(prompt=r["prompt"], response=r["response"], mode=r["mode"]) for r in held]
  drafter = EagleDrafter(eagle_config(cfg, 1), feature_layers=layers)
  objective = eagle.EagleObjective(drafter, feature_weight=0.1, noise=0.05, ttt_steps=ttt_steps)
  frozen = eagle.frozen_arrays(cfg, params, vm)
  draft = train.Draft(cfg=dataclasses.replace(drafter.cfg, vocab_size=len(vm)),
                      target_vocab_size=cfg.vocab_size, vocab_map=vm)
  tc = train.TrainConfig(steps=60, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=2,
                         eval_every=60, checkpoint_every=60)
  weights = init_eagle_weights(cfg, params, 1, feature_layers=layers)
  batch = {k: jnp.asarray(v) for k, v in train.make_batch(recs[:8], tc.seq_len, 8).items()}
  if online_teacher:
    batch = online_teacher[0].fill(params, batch)
  v, i = draft.maps()
  loss = lambda w: float(train.loss_fn(w, objective, "fkl", v, i, frozen, batch))
  before = loss(weights)
  trained, hist = train.train(draft, weights, recs, held, tc, str(tmp_path), k=8,
                              log=lambda m: 0, progress=False, objective=objective, frozen=frozen,
                              teacher=online_teacher)
  assert loss(trained) < 0.8 * before
  assert hist[-1]["alpha_T0"] > hist[0]["alpha_T0"] + 0.1
  assert hist[-1]["alpha_T1"] > hist[0]["alpha_T1"] + 0.1
  # The trained drafter speculates losslessly and accepts more than the untrained one.
  accepted = []
  for w in (weights, trained):
    d, dp = eagle_drafter(cfg, params, w, vm, layers)
    dec = SpeculativeDecoder(cfg, d, gamma=3, eos_ids=())
    out = dec.generate(params, dp, [r["prompt"] for r in held[:8]], 12)
    accepted.append(out.metrics()["acceptance_rate"])
  assert accepted[1] > accepted[0]


def _fused_setup(cfg, params, recs, *, noise, ttt_steps, layers=(0,)):
  """Records with the toy target's stored features of ``layers``, a 48-row vocabulary and a
  fused one-layer EAGLE objective and draft over it."""
  feats = features.sequence_features(params, cfg, [features.record_sequence(r) for r in recs],
                                     layers=layers)
  recs = [dict(r, features=f) for r, f in zip(recs, feats)]
  vm = vocab.select_vocab(vocab.token_counts(recs, cfg.vocab_size), 48)
  drafter = EagleDrafter(eagle_config(cfg, 1), feature_layers=layers)
  objective = eagle.EagleObjective(drafter, feature_weight=0.1, noise=noise, ttt_steps=ttt_steps)
  draft = train.Draft(cfg=dataclasses.replace(drafter.cfg, vocab_size=len(vm)),
                      target_vocab_size=cfg.vocab_size, vocab_map=vm)
  return recs, feats, vm, objective, draft


@pytest.mark.heavy  # 45 s
def test_a_trimmed_batch_gives_the_eagle_loss_of_the_padded_one(toy):
  """``make_batch(pad_to=...)`` (length-grouped training) cuts the trailing padding of tokens
  and stored features; the EAGLE loss, training-time test unrolled over 3 steps (its cache and
  mask are 3L long), is the untrimmed one (noise off: its draw depends on the shape)."""
  cfg, params, recs, _ = toy
  layers = (0,)
  recs = sorted(recs, key=lambda r: len(r["prompt"]) + len(r["response"]))[:4]
  recs, feats, vm, objective, draft = _fused_setup(cfg, params, recs, noise=0.0, ttt_steps=3)
  longest = max(len(f) for f in feats)
  full = {k: jnp.asarray(v) for k, v in train.make_batch(recs, longest + 24, 8).items()}
  cut = {k: jnp.asarray(v) for k, v in train.make_batch(recs, longest + 24, 8, pad_to=8).items()}
  assert cut["tokens"].shape[1] == -(-longest // 8) * 8 < full["tokens"].shape[1]
  assert cut["features"].shape[1] == cut["tokens"].shape[1]
  v, i = draft.maps()
  weights = init_eagle_weights(cfg, params, 1, feature_layers=layers)
  frozen = eagle.frozen_arrays(cfg, params, vm)
  for kind in ("fkl", "top1"):
    losses = [float(train.loss_fn(weights, objective, kind, v, i, frozen, b,
                                  jax.random.PRNGKey(0))) for b in (full, cut)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


@pytest.mark.heavy  # 55 s
def test_a_fusion_trains_on_stored_zero_padded_features_with_finite_gradients(toy):
  """Stored features pad a batch with zeros (the online teacher's are the target's over pad
  tokens); the input noise's scale must not make the fusion's gradients NaN there."""
  cfg, params, recs, _ = toy
  layers = (0,)  # (the toy target's one layer)
  recs, feats, vm, objective, draft = _fused_setup(cfg, params, recs[:4], noise=0.05,
                                                   ttt_steps=2)
  longest = max(len(f) for f in feats)
  batch = {k: jnp.asarray(v) for k, v in train.make_batch(recs, longest + 8, 8).items()}
  assert not np.any(np.asarray(batch["features"][:, -8:]))  # zero padding in every row
  v, i = draft.maps()
  weights = init_eagle_weights(cfg, params, 1, feature_layers=layers)
  for kind in ("fkl", "top1"):
    grads = jax.grad(train.loss_fn)(weights, objective, kind, v, i,
                                    eagle.frozen_arrays(cfg, params, vm), batch,
                                    jax.random.PRNGKey(0))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
      assert np.all(np.isfinite(np.asarray(g))), (kind, jax.tree_util.keystr(path))


def test_ttt_mask_sees_the_committed_prefix_and_its_own_path():
  m = eagle.ttt_mask(4, 3)  # L = 4, step 3: slots 0-3 step 1, 4-7 step 2, 8-11 step 3
  assert np.flatnonzero(m[3]).tolist() == [0, 1, 6, 11]  # true pairs <= 1, step 2 at 2, itself
  assert np.flatnonzero(m[1]).tolist() == [4, 9]  # no committed prefix yet
  assert np.flatnonzero(eagle.ttt_mask(4, 2)[2]).tolist() == [0, 1, 6]


def test_training_time_test_steps_read_their_own_predictions():
  """Step k of the unroll at position i equals decoding's k-th draft step after committing
  positions <= i − k + 1 with teacher-forced tokens: prefill the true-feature pairs, then
  feed the drafter's own ĥ forward one position at a time."""
  cfg, params = tiny_model(seed=0)
  drafter = EagleDrafter(eagle_config(cfg, 1))
  dp = eagle.frozen_arrays(cfg, params) | random_eagle_weights(cfg, 1, jax.random.PRNGKey(3))
  objective = eagle.EagleObjective(drafter, ttt_steps=3)
  l = 12
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, l), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(l), (2, l))
  feats = forward(params, cfg, tokens, pos, init_cache(cfg, 2, l)).hidden
  hs = objective.unroll(random_eagle_weights(cfg, 1, jax.random.PRNGKey(3)),
                        eagle.frozen_arrays(cfg, params), dict(tokens=tokens, features=feats))
  assert hs.shape == (3, 2, l, cfg.dim)
  shifted = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)
  i = 8
  for k in (2, 3):
    committed = i - k + 2  # pairs 0 .. i - k + 1 carry true features
    _, cache = drafter.hidden(dp, shifted[:, :committed], tokens[:, :committed],
                              pos[:, :committed], init_cache(drafter.cfg, 2, l))
    h = hs[0][:, committed - 1:committed]  # step 1's prediction at the last committed pair
    for j in range(committed, i + 1):  # draft steps 2 .. k along the path
      h, cache = drafter.hidden(dp, h, tokens[:, j:j + 1], pos[:, j:j + 1], cache)
    np.testing.assert_allclose(np.asarray(h[:, 0]), np.asarray(hs[k - 1][:, i]),
                               rtol=1e-4, atol=1e-4)
  # Step 1 is teacher forcing on the true features (the unroll's cache is 3x longer: rounding).
  h1, _ = drafter.hidden(dp, shifted, tokens, pos, init_cache(drafter.cfg, 2, l))
  np.testing.assert_allclose(np.asarray(h1), np.asarray(hs[0]), rtol=1e-4, atol=1e-4)


@pytest.mark.heavy  # 99 s; growing a drafter is the ablation's, not decoding's
def test_a_grown_drafter_proposes_what_it_grew_from_and_its_new_layer_trains():
  cfg, params = tiny_model(seed=0)
  layers = (0, 1)
  small = random_eagle_weights(cfg, 1, jax.random.PRNGKey(2), num_fused=len(layers))
  init = init_eagle_weights(cfg, params, 2, feature_layers=layers)
  big = eagle.grown(small, init)
  assert len(big["layers"]) == 2 and big["layers"][0] is small["layers"][0]
  prompts = [[1, 5, 9, 2], [7, 3, 3, 8, 4, 6]]
  l = 8
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, l), 0, cfg.vocab_size)
  pos = jnp.broadcast_to(jnp.arange(l), (2, l))
  fused = jax.random.normal(jax.random.PRNGKey(1), (2, l, len(layers) * cfg.dim))
  outs = []
  for w in (small, big):
    d, dp = eagle_drafter(cfg, params, w, None, layers)
    h, _ = d.hidden(dp, d.fuse(dp, fused), tokens, pos, init_cache(d.cfg, 2, l))
    dec = SpeculativeDecoder(cfg, d, gamma=3, eos_ids=())
    outs.append((np.asarray(d.head_logits(dp, h)),
                 np.asarray(dec.generate(params, dp, prompts, 16).tokens)))
  np.testing.assert_array_equal(outs[0][0], outs[1][0])  # the new layer adds exactly zero
  np.testing.assert_array_equal(outs[0][1], outs[1][1])
  # the new layer is not stuck at the identity: its output projections get gradients
  drafter = EagleDrafter(eagle_config(cfg, 2), feature_layers=layers)
  objective = eagle.EagleObjective(drafter, feature_weight=0.1, noise=0.0, ttt_steps=1)
  recs = [dict(prompt=np.asarray(p, np.int32), response=np.asarray(p[::-1], np.int32),
               topk_ids=np.asarray(p[1:] + p[:1], np.int32)[:, None],
               topk_logp=np.zeros((len(p), 1), np.float32)) for p in prompts]
  feats = features.sequence_features(params, cfg, [features.record_sequence(r) for r in recs],
                                     layers=layers)
  recs = [dict(r, features=f) for r, f in zip(recs, feats)]
  batch = {k: jnp.asarray(v) for k, v in train.make_batch(recs, 16, 1).items()}
  draft = train.Draft(cfg=drafter.cfg, target_vocab_size=cfg.vocab_size)
  v, i = draft.maps()
  grads = jax.grad(train.loss_fn)(big, objective, "top1", v, i, eagle.frozen_arrays(cfg, params),
                                  batch, jax.random.PRNGKey(0))
  for k in ("wo", "w_down"):
    assert np.abs(np.asarray(grads["layers"][1][k])).max() > 0, k
  with pytest.raises(ValueError, match="cannot grow 2 EAGLE layers to 1"):
    eagle.grown(big, small)


@pytest.mark.parametrize("layers", [(), (0, 1)])
def test_save_and_load_round_trip_and_refusals(tmp_path, layers):
  cfg, params = tiny_model(seed=0)
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(2), num_fused=len(layers))
  vm = np.arange(0, cfg.vocab_size, 2)
  path = str(tmp_path / "eagle")
  drafts.save_eagle(path, cfg, weights, vm, tokenizer_sha256="abc", dtype=np.float32,
                    feature_layers=layers)
  drafter, dp = drafts.load_eagle(path, cfg, params, tokenizer_sha256="abc")
  assert drafter.feature_layers == layers
  _, ref = eagle_drafter(cfg, params, weights, vm, layers)
  for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # what a warm start (train_draft --init_from=DIR) reads: the trained arrays, in the
  # layout training optimises (init_eagle_weights'), and the rows' ids
  meta, trained, rows = drafts.load_trained_weights(path, cfg, tokenizer_sha256="abc")
  assert meta["format"] == drafts.EAGLE_FORMAT
  assert jax.tree.structure(trained) == jax.tree.structure(weights)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               trained, weights)
  np.testing.assert_array_equal(rows, vm)
  with pytest.raises(ValueError, match="tokenizer"):
    drafts.load_trained_weights(path, cfg, tokenizer_sha256="xyz")
  with pytest.raises(ValueError, match="tokenizer"):
    drafts.load_eagle(path, cfg, params, tokenizer_sha256="xyz")
  other, other_params = tiny_model(seed=0, vocab_size=80)
  with pytest.raises(ValueError, match="vocabulary"):
    drafts.load_eagle(path, other, other_params)
  with open(f"{path}/weights.safetensors", "wb") as f:
    f.write(b"not safetensors")
  with pytest.raises(CheckpointError, match="corrupt"):
    drafts.load_eagle(path, cfg, params)
  with pytest.raises(CheckpointError, match="no draft.json"):
    drafts.load_eagle(str(tmp_path / "missing"), cfg, params)


def test_cut_head_keeps_the_most_frequent_rows_and_the_same_weights(tmp_path):
  cfg, params = tiny_model(seed=0)
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(2), num_fused=2)
  vm = np.array([0, 9, 4, 17, 3, 30, 11, 2])  # frequency-ranked, as select_vocab writes it
  src, dst = str(tmp_path / "full"), str(tmp_path / "cut")
  drafts.save_eagle(src, cfg, weights, vm, tokenizer_sha256="abc", dtype=np.float32,
                    feature_layers=(0, 1))
  drafts.cut_eagle_head(src, dst, 5)
  drafter, dp = drafts.load_eagle(dst, cfg, params, tokenizer_sha256="abc")
  _, ref = eagle_drafter(cfg, params, weights, vm[:5], (0, 1))
  assert drafter.feature_layers == (0, 1)
  np.testing.assert_array_equal(np.asarray(dp["vocab_map"]), vm[:5])
  for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  info = drafts.read_draft_metadata(dst, (drafts.EAGLE_FORMAT,))["info"]
  assert (info["draft_vocab"], info["head_cut_from"]) == (5, 8)
  for rows in (1, 9):
    with pytest.raises(ValueError, match=r"rows must be in \[2, 8\]"):
      drafts.cut_eagle_head(src, str(tmp_path / "bad"), rows)
  drafts.save_eagle(str(tmp_path / "nomap"), cfg, weights, None, tokenizer_sha256="abc",
                    feature_layers=(0, 1))
  with pytest.raises(ValueError, match="no frequency-ranked vocab_map"):
    drafts.cut_eagle_head(str(tmp_path / "nomap"), str(tmp_path / "bad"), 4)


def test_corpus_features_are_cached_extended_recomputed_and_refused_for_another_target(
    tmp_path, toy, monkeypatch):
  cfg, params, recs, _ = toy
  recs = [dict(r) for r in recs[:5]]
  fresh = features.sequence_features(params, cfg, [features.record_sequence(r) for r in recs])
  computed = []  # the records of each computation (written into the file as computed)
  batches = features._feature_batches
  monkeypatch.setattr(features, "_feature_batches",
                      lambda p, c, seqs, *a, **k: computed.append(len(seqs)) or batches(
                          p, c, seqs, *a, **k))

  def attach(records, c=cfg):
    records = [dict(r) for r in records]
    features.corpus_features(str(tmp_path), "train", records, params, c, progress=False)
    return [np.array(r["features"]) for r in records]

  first = attach(recs[:3])
  for a, b in zip(attach(recs[:3]), first):  # cached: nothing computed
    np.testing.assert_array_equal(a, b)
  grown = attach(recs)  # two records appended: only they are computed
  assert computed == [3, 2]
  for a, b in zip(grown, fresh):
    np.testing.assert_array_equal(a, b)
  changed = [dict(r) for r in recs]  # same lengths, another token: all recomputed
  changed[1]["response"] = (np.asarray(changed[1]["response"]) + 1) % cfg.vocab_size
  attach(changed)
  assert computed == [3, 2, 5]
  with pytest.raises(AssertionError):
    np.testing.assert_array_equal(attach(changed)[1], grown[1])
  assert computed == [3, 2, 5]
  for a, b in zip(attach(recs[:2]), fresh):  # fewer records than cached: recomputed
    np.testing.assert_array_equal(a, b)
  assert computed == [3, 2, 5, 2]
  for other in (dataclasses.replace(cfg, name="other"),
                dataclasses.replace(cfg, rope_theta=cfg.rope_theta * 2)):
    with pytest.raises(CheckpointError, match="another target"):
      attach(recs[:2], other)
  # a file written before, which recorded four of the target's fields, is still read
  meta_path = tmp_path / "features-train.json"
  meta = json.loads(meta_path.read_text())
  assert meta["target"] == teacher.target_shape(cfg)
  legacy = {f: meta["target"][f] for f in ("name", "vocab_size", "dim", "num_layers")}
  meta_path.write_text(json.dumps(dict(meta, target=legacy)))
  for a, b in zip(attach(recs[:2]), fresh):
    np.testing.assert_array_equal(a, b)
  assert computed == [3, 2, 5, 2]
  meta_path.write_text(json.dumps(dict(meta, target=dict(legacy, dim=legacy["dim"] + 1))))
  with pytest.raises(CheckpointError, match="another target"):
    attach(recs[:2])
