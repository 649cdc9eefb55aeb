"""Heads trained by self-distillation on the frozen target, Medusa-1's and the trained early
exit's: what each head reads, that training teaches them, their held-out accuracy table, the
directories they ship in, and that the trained exit decodes losslessly without recompiling."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import drafts
from specjax.distill import features, heads, train, vocab
from specjax.drafters import EarlyExitDrafter, early_exit_drafter, trained_exit_drafter
from specjax.drafters.early_exit import adapter_layer
from specjax.drafters.medusa import MedusaDrafter, init_medusa_weights, medusa_drafter
from specjax.drafters.residual_head import target_head, zero_blocks
from specjax.generate import generate, prefill
from specjax.kv_cache import init_cache
from specjax.loaders import CheckpointError
from specjax.model import forward
from specjax.sampling import Greedy, Sampling, dense_probs
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.drafter import SharedCache
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.testing import make_drafter, new_compiles_across_batches, tiny_model

from matrix import cases, grid

K_TOP = 8
SEQ = 32


@pytest.fixture(scope="module")
def toy(toy_corpus_features):
  """The toy target and corpus with the target's features attached to every record."""
  return toy_corpus_features


def _objective(cfg, num_heads=3):
  return heads.medusa_objective(cfg, num_heads)


def _batch(recs):
  return {k: jnp.asarray(v) for k, v in train.make_batch(recs, SEQ, K_TOP).items()}


def test_head_k_reads_the_feature_k_plus_one_back(toy):
  """For trained position p (the target's distribution of token p + 1), head k's log-probs
  are the drafter's head k on the feature at p − k − 1, as at decoding (h_{s−2} drafts
  depth k + 1 = token s + k). Random heads, so every head differs."""
  cfg, params, recs, _ = toy
  objective = _objective(cfg)
  w = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(1), x.shape),
                   init_medusa_weights(cfg, 3, 1))
  frozen = heads.frozen_arrays(cfg, params)
  batch = _batch(recs[:4])
  logp, aux = objective.logp_and_aux(w, frozen, None, batch, None)
  assert logp.shape == (3,) + batch["pred_pos"].shape + (cfg.vocab_size,) and aux == 0.0
  dp = dict(frozen, **w)
  for b in range(2):
    for r in (2, 3, 7):  # (p >= 4: prompts have 3 tokens or more)
      p = int(batch["pred_pos"][b, r])
      want = jax.nn.log_softmax(MedusaDrafter(cfg, 3).head_logits(
          dp, batch["features"][b, None, p - 3:p][:, ::-1].reshape(3, -1)), axis=-1)
      for k in range(3):  # row j of ``want`` is head j on feature p - 1 - j
        np.testing.assert_allclose(logp[k, b, r], want[k, k], atol=1e-5)


def test_untrained_heads_are_the_targets_own_next_token_prediction(toy):
  """Zero blocks: every head on h_i gives the target's distribution of token i + 1."""
  cfg, params, recs, _ = toy
  seq = features.record_sequence(recs[0])
  out = forward(params, cfg, jnp.asarray(seq)[None], jnp.arange(len(seq))[None],
                init_cache(cfg, 1, len(seq)))
  dp = dict(heads.frozen_arrays(cfg, params), **init_medusa_weights(cfg, 2, 1))
  logits = MedusaDrafter(cfg, 2, 1, shared_head=True).head_logits(dp, out.hidden[0])
  for k in range(2):
    np.testing.assert_allclose(logits[:, k], out.logits[0], atol=1e-4)


def test_heads_without_an_input_are_not_scored(toy):
  cfg, _, recs, _ = toy
  batch = _batch(recs[:4])
  objective = _objective(cfg)
  for k in range(3):
    w = train.step_weight(objective, batch, k)
    np.testing.assert_array_equal(w, batch["weight"] * (batch["pred_pos"] >= k + 1))
  assert objective.min_position(0) == 1 and heads.exit_objective(cfg).min_position(0) == 0
  with pytest.raises(ValueError, match="lag >= 0"):
    heads.HeadObjective(cfg, 2, lag=-1)
  with pytest.raises(ValueError, match="one head at lag 0"):
    heads.AdapterExitObjective(cfg, num_heads=2)


@pytest.mark.parametrize("online", [False, True])
def test_tiny_medusa_training_lowers_loss_and_raises_head_accuracy(toy, tmp_path, online):
  """Trained on the toy corpus (stored features, or an id-only corpus through the online
  teacher), the heads' loss falls, every head's top-1 accuracy rises, the accuracy table
  matches a count by hand, and the heads decode losslessly and accept more drafts."""
  cfg, params, recs, held = toy
  vm = vocab.select_vocab(vocab.token_counts(recs, cfg.vocab_size), 48)
  teacher = None
  if online:
    teacher = (train.Teacher(cfg, K_TOP, ()), params)
    recs = [dict(prompt=r["prompt"], response=r["response"], mode=r["mode"]) for r in recs]
    held = [dict(prompt=r["prompt"], response=r["response"], mode=r["mode"]) for r in held]
  objective = _objective(cfg)
  frozen = heads.frozen_arrays(cfg, params, vm)
  draft = train.Draft(cfg=dataclasses.replace(cfg, vocab_size=len(vm)),
                      target_vocab_size=cfg.vocab_size, vocab_map=vm)
  tc = train.TrainConfig(steps=80, batch_size=8, seq_len=SEQ, lr=2e-2, warmup_steps=2,
                         eval_every=80, checkpoint_every=80)
  weights = init_medusa_weights(cfg, 3, 1)
  batch = _batch(recs[:8])
  if teacher:
    batch = teacher[0].fill(params, batch)
  v, i = draft.maps()
  loss = lambda w: float(train.loss_fn(w, objective, "fkl", v, i, frozen, batch))
  before = loss(weights)
  trained, hist = train.train(draft, weights, recs, held, tc, str(tmp_path), k=K_TOP,
                              log=lambda m: 0, progress=False, objective=objective,
                              frozen=frozen, teacher=teacher)
  assert loss(trained) < 0.8 * before
  acc0, _ = heads.head_accuracy(weights, objective, vm, frozen, held, SEQ, K_TOP, ranks=4,
                                 teacher=teacher)
  acc1, n = heads.head_accuracy(trained, objective, vm, frozen, held, SEQ, K_TOP, ranks=4,
                                 teacher=teacher)
  print(acc0, acc1)
  assert np.all(acc1[:, 0] > acc0[:, 0] + 0.1)
  assert hist[-1]["alpha_T0"] == pytest.approx(acc1[0, 0], abs=1e-6)  # α is head 0's top-1
  assert np.all(acc1.sum(1) <= 1 + 1e-9) and np.all(n > 0)
  # the table by hand: head k's rank-r token against the argmax after position p
  greedy = [r for r in held if r["mode"] == "greedy"]
  dp = dict(frozen, **trained)
  hits, count = np.zeros((3, 4)), np.zeros(3)
  for rec in greedy:
    seq = features.record_sequence(rec)
    out = forward(params, cfg, jnp.asarray(seq)[None], jnp.arange(len(seq))[None],
                  init_cache(cfg, 1, len(seq)))
    argmax = np.asarray(jnp.argmax(out.logits[0], -1))
    top = np.asarray(vm)[np.argsort(-np.asarray(MedusaDrafter(cfg, 3).head_logits(
        dp, out.hidden[0])), axis=-1, kind="stable")[..., :4]]  # [L, K, 4]
    for p in range(len(rec["prompt"]) - 1, len(seq) - 1):
      for k in range(3):
        if p - k - 1 >= 0:
          hits[k] += top[p - k - 1, k] == argmax[p]
          count[k] += 1
  np.testing.assert_allclose(acc1, hits / count[:, None], atol=0.02)
  # lossless, and the trained heads' own tree accepts more than the untrained heads'
  prompts = [r["prompt"] for r in held[:8]]
  plain = generate(params, cfg, prompts, 12, Greedy(), eos_ids=())
  per_call = []
  for w, acc in ((weights, acc0), (trained, acc1)):
    d, dp = medusa_drafter(cfg, params, w, vm, top_k=4, accuracy=acc)
    dec = SpeculativeDecoder(cfg, d, tree=d.tree(8), eos_ids=())
    out = dec.generate(params, dp, prompts, 12)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    per_call.append(out.metrics()["tokens_per_call"])
  assert per_call[1] > per_call[0]


def test_heads_directory_round_trip_and_refusals(toy, tmp_path):
  cfg, params, _, _ = toy
  w = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(jax.random.PRNGKey(2), x.shape),
                   init_medusa_weights(cfg, 2, 1))
  vm = np.arange(0, 64, 2)
  acc = np.array([[0.5, 0.2, 0.1], [0.3, 0.1, 0.05]])
  path = str(tmp_path / "heads")
  drafts.save_medusa(path, cfg, w, vm, tokenizer_sha256="abc", head_accuracy=acc,
                     info=dict(steps=3))
  d, dp = drafts.load_medusa(path, cfg, params, tokenizer_sha256="abc")
  assert (d.num_heads, d.num_layers, d.shared_head) == (2, 1, True)
  assert np.allclose(d.accuracy, acc) and d.default_tree() == d.tree(8)
  want_d, want_dp = medusa_drafter(cfg, params, jax.tree.map(
      lambda x: np.asarray(x, np.float16).astype(np.float32), w), vm)
  f = jax.random.normal(jax.random.PRNGKey(3), (2, cfg.dim))
  np.testing.assert_allclose(d.head_logits(dp, f), want_d.head_logits(want_dp, f), atol=1e-5)
  np.testing.assert_array_equal(dp["vocab_map"], vm)
  np.testing.assert_array_equal(dp["head"], target_head(cfg, params)[vm])
  # drafter_from_path knows the format
  d2, _, note = drafts.drafter_from_path(path, cfg, params, None)
  assert isinstance(d2, MedusaDrafter) and "Medusa heads" in note
  # refusals: another tokenizer, vocabulary, width; corrupt or missing tensors
  with pytest.raises(ValueError, match="another tokenizer"):
    drafts.load_medusa(path, cfg, params, tokenizer_sha256="xyz")
  with pytest.raises(ValueError, match="vocabulary"):
    drafts.load_medusa(path, dataclasses.replace(cfg, vocab_size=80), params)
  with pytest.raises(ValueError, match="width"):
    drafts.load_medusa(path, dataclasses.replace(cfg, dim=48), params)
  with pytest.raises(ValueError, match=r"\[2 heads, ranks\]"):
    drafts.save_medusa(str(tmp_path / "bad"), cfg, w, vm, tokenizer_sha256="abc",
                       head_accuracy=acc[:1])
  bad = dict(w, res_b=np.full((2, 1, cfg.dim), np.nan))
  drafts.save_medusa(str(tmp_path / "nan"), cfg, bad, vm, tokenizer_sha256="abc")
  with pytest.raises(CheckpointError, match="non-finite"):
    drafts.load_medusa(str(tmp_path / "nan"), cfg, params)
  os.remove(os.path.join(path, "weights.safetensors"))
  with pytest.raises(CheckpointError, match="missing or corrupt Medusa heads weights"):
    drafts.load_medusa(path, cfg, params)
  meta = json.load(open(os.path.join(path, "draft.json")))
  assert meta["format"] == drafts.MEDUSA_FORMAT and meta["info"] == dict(steps=3)


def test_accuracy_tables_that_are_not_probabilities_are_refused(toy):
  cfg = toy[0]
  for bad in ([[0.5, 0.2]], [[1.5, 0.1], [0.2, 0.1]], [[np.nan, 0.1], [0.2, 0.1]]):
    with pytest.raises(ValueError, match="accuracy must be"):
      MedusaDrafter(cfg, 2, accuracy=bad)


# ------------------------------------------------------------------ the trained exit


@pytest.fixture(scope="module")
def deep(make_toy_records):
  """A 3-layer toy target whose top layers matter (so exiting after layer 1 loses something)
  and its greedy / T = 1 corpus with features of layer 0 (the exit after 1 layer)."""
  cfg, params = tiny_model(seed=5, vocab_size=64, num_layers=3)
  params = dict(params, layers=jax.tree.map(lambda w: w * 0.5, params["layers"]))
  return (cfg, params, *make_toy_records(cfg, params, layers=(0,)))


def test_truncated_features_are_the_full_forwards_layer_output(deep):
  cfg, params, recs, _ = deep
  seq = features.record_sequence(recs[0])
  out = forward(params, cfg, jnp.asarray(seq)[None], jnp.arange(len(seq))[None],
                init_cache(cfg, 1, len(seq)), return_layers=(0,))
  np.testing.assert_allclose(recs[0]["features"], out.intermediates[0][0], rtol=2e-3, atol=2e-3)


def test_zero_exit_head_is_the_training_free_exit(deep):
  """Zero blocks over all V rows: the same drafts and the same q as the training-free exit."""
  cfg, params, _, _ = deep
  free, free_dp = early_exit_drafter(cfg, params, 1)
  trained, dp = trained_exit_drafter(cfg, params, 1, zero_blocks(1, 2, cfg.dim))
  assert trained.trained and not free.trained
  tokens = jnp.asarray([[5, 6, 7, 8, 0, 0, 0, 0, 0, 0, 0, 0]] * 2)
  seq_lens = jnp.asarray([4, 4])
  cache = forward(params, cfg, tokens[:, :3], jnp.arange(3)[None].repeat(2, 0),
                  init_cache(cfg, 2, 12)).cache
  key = jax.random.PRNGKey(0)
  for sampler in (Greedy(), Sampling(1.0)):
    a = free.propose_chain(free_dp, SharedCache(cache, ()), tokens, seq_lens, key, sampler, 3)
    b = trained.propose_chain(dp, SharedCache(cache, ()), tokens, seq_lens, key, sampler, 3)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], atol=1e-5)


@pytest.mark.parametrize("adapter", cases([False, True], ids=["head", "adapter"],
                                           keep=("adapter",)))
def test_tiny_exit_training_raises_alpha_and_decodes_losslessly(deep, tmp_path, adapter):
  """The exit after 1 of 3 layers, trained on stored layer-0 features (with or without an
  attention adapter): held-out α at T = 0 rises from the untrained exit's, as does the
  acceptance of real decoding, which stays greedy-exact; no recompilation across batches;
  the directory it is shipped in loads back to the same decoder."""
  cfg, params, recs, held = deep
  vm = vocab.select_vocab(vocab.token_counts(recs, cfg.vocab_size), 48)
  objective = heads.exit_objective(cfg, adapter=adapter)
  frozen = heads.frozen_arrays(cfg, params, vm)
  draft = train.Draft(cfg=dataclasses.replace(cfg, vocab_size=len(vm)),
                      target_vocab_size=cfg.vocab_size, vocab_map=vm)
  tc = train.TrainConfig(steps=200, batch_size=8, seq_len=SEQ, lr=2e-2 if not adapter else 5e-3,
                         warmup_steps=2, eval_every=200, checkpoint_every=200)
  weights = zero_blocks(1, 2, cfg.dim)
  if adapter:
    weights["adapter"] = adapter_layer(cfg, params, 1)
  trained, hist = train.train(draft, weights, recs, held, tc, str(tmp_path), k=K_TOP,
                              log=lambda m: 0, progress=False, objective=objective,
                              frozen=frozen)
  print(hist[0], hist[-1])
  assert hist[-1]["alpha_T0"] > hist[0]["alpha_T0"] + 0.1
  acc, _ = heads.head_accuracy(trained, objective, vm, frozen, held, SEQ, K_TOP, ranks=1)
  assert acc[0, 0] == pytest.approx(hist[-1]["alpha_T0"], abs=1e-6)
  prompts = [r["prompt"] for r in held[:8]]
  plain = generate(params, cfg, prompts, 12, Greedy(), eos_ids=())
  rates = []
  for w in (weights, trained):
    d, dp = trained_exit_drafter(cfg, params, 1, w, vm)
    dec = SpeculativeDecoder(cfg, d, gamma=3, eos_ids=())
    out = dec.generate(params, dp, prompts, 12)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    rates.append(out.metrics()["acceptance_rate"])
  assert rates[1] > rates[0]
  assert new_compiles_across_batches(dec, params, dp) == 0
  # shipped as a directory, read back by its own loader and by drafter_from_path
  path = str(tmp_path / "exit")
  drafts.save_exit(path, cfg, trained, vm, exit_layer=1, tokenizer_sha256="abc")
  d2, dp2 = drafts.load_exit(path, cfg, params, tokenizer_sha256="abc")
  assert d2.trained and d2.adapter == adapter and d2.cfg.num_layers == 1
  np.testing.assert_array_equal(dec.generate(params, dp2, prompts, 12).tokens, plain.tokens)
  d3, _, note = drafts.drafter_from_path(path, cfg, params, None)
  assert d3 == d2 and "trained exit" in note
  # what a warm start reads: the trained arrays as stored (float16) and the rows' ids
  meta, weights, rows = drafts.load_trained_weights(path, cfg, tokenizer_sha256="abc")
  assert meta["exit_layer"] == 1 and jax.tree.structure(weights) == jax.tree.structure(trained)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4), weights,
               trained)
  np.testing.assert_array_equal(rows, vm)
  with pytest.raises(ValueError, match="another tokenizer"):
    drafts.load_trained_weights(path, cfg, tokenizer_sha256="xyz")


def _shared_state(drafter, dp, cfg, params, tokens, seq_lens, prompt_lens):
  """What ``propose`` gets for rows ``tokens[b, :seq_lens[b]]``: the target's cache of them
  (a prefill) beside the exit's own state, whose adapter saw ``prompt_lens[b]`` of them."""
  layers = drafter.target_feature_layers()
  out = prefill(params, cfg, tokens, seq_lens - 1, init_cache(cfg, *tokens.shape),
                return_hidden=bool(layers), feature_layers=layers)
  cache, feats = out if layers else (out, None)
  return SharedCache(cache, drafter.init(dp, tokens, prompt_lens, features=feats))


def test_adapter_exit_drafts_are_the_training_objective_on_the_same_tokens(deep):
  """The adapter's own cache is built from true layer-k features (the prefill's, and a
  backlog of 6 committed tokens one row never drafted over), so at every chain depth the
  drafted q equals the training objective's distribution teacher-forced on the same tokens:
  the draft's input is exact at every depth, and teacher-forced α is the real one."""
  cfg, params, _, _ = deep
  drafter, dp = make_drafter("adapter_exit", cfg, params, None)
  assert drafter.adapter and drafter.target_feature_layers() == (0,)
  gamma, s = 3, 16
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, s)), jnp.int32)
  seq_lens, prompt_lens = jnp.asarray([7, 10]), jnp.asarray([7, 4])
  # row 1's adapter saw only its prompt: a backlog of 6 committed tokens
  state = _shared_state(drafter, dp, cfg, params, tokens, seq_lens, prompt_lens)
  drafts_, q, own = drafter.propose_chain(dp, state, tokens, seq_lens, jax.random.PRNGKey(1),
                                          Sampling(1.0), gamma)
  np.testing.assert_array_equal(own.cache.lengths, seq_lens - 1)
  full = tokens
  for j in range(gamma - 1):  # the drafts each depth was conditioned on
    full = full.at[jnp.arange(2), seq_lens + j].set(drafts_[:, j])
  out = forward(params, cfg, full, jnp.arange(s)[None].repeat(2, 0), init_cache(cfg, 2, s),
                return_layers=(0,))
  ep = dp["exit"]
  objective = heads.exit_objective(cfg, adapter=True)
  batch = dict(features=out.intermediates[0], pred_pos=seq_lens[:, None] - 1 + jnp.arange(gamma))
  logp, _ = objective.logp_and_aux({k: ep[k] for k in ("res_w", "res_b", "adapter")},
                                   {"final_norm": ep["final_norm"], "head": ep["head"]}, None,
                                   batch, None)
  np.testing.assert_allclose(dense_probs(q)[:, :, np.asarray(ep["vocab_map"])], np.exp(logp),
                             atol=1e-5)


@pytest.mark.parametrize("tree, kind", grid(
    {"static": TreeTopology((-1, -1, 0, 1, 2, 3)), "dynamic": DynamicTree(2, 3, 5)},
    ["trained_exit", "adapter_exit"], keep=("static-trained_exit", "dynamic-adapter_exit")))
def test_exit_tree_nodes_are_drawn_from_the_teacher_forced_draft_of_their_ancestors(
    deep, kind, tree):
  """An exit's tree, drafted in the target cache's scratch slots (one row with a 6-token
  backlog for the adapter), against the draft's distribution teacher-forced on each node's
  ancestors from a fresh prefill through the chain path: a static tree drawn without
  replacement at T = 1 carries exactly that q for every node; every node of a dynamic tree
  is among the top-k tokens there. So the tree's masks, positions and caches are the
  chain's."""
  cfg, params, _, _ = deep
  drafter, dp = make_drafter(kind, cfg, params, None)
  drafter = dataclasses.replace(drafter, tree_draw="without_replacement")
  s = 20
  tokens = jnp.asarray(np.random.default_rng(1).integers(1, cfg.vocab_size, (2, s)), jnp.int32)
  seq_lens, prompt_lens = jnp.asarray([7, 10]), jnp.asarray([7, 4])
  shared = lambda toks, lens, plens: _shared_state(drafter, dp, cfg, params, toks, lens, plens)

  @jax.jit
  def teacher_forced_q(toks, lens):  # the draft's q after toks[:, :lens] (one compile)
    return drafter.propose_chain(dp, shared(toks, lens, lens), toks, lens,
                                 jax.random.PRNGKey(0), Sampling(1.0), 1)[1].dense()[:, 0]

  prop, own = jax.jit(lambda: drafter.propose(
      dp, shared(tokens, seq_lens, prompt_lens), tokens, seq_lens, jax.random.PRNGKey(0),
      Sampling(1.0), tree))()
  if drafter.adapter:
    np.testing.assert_array_equal(own.cache.lengths, seq_lens - 1)
  toks = np.asarray(prop.tokens)
  for b in range(2):
    parents = (np.asarray(prop.parents[b]) if isinstance(tree, DynamicTree)
               else np.asarray(tree.parents))
    for i in range(toks.shape[1]):
      path, p = [], parents[i]
      while p >= 0:
        path, p = [int(toks[b, p])] + path, parents[p]
      ext = tokens.at[:, int(seq_lens[b]):int(seq_lens[b]) + len(path)].set(
          jnp.asarray(path, jnp.int32))
      q = np.asarray(teacher_forced_q(ext, jnp.full((2,), int(seq_lens[b]) + len(path))))[b]
      if isinstance(tree, DynamicTree):
        assert np.sum(q > q[toks[b, i]]) < tree.top_k, (b, i)
      else:
        np.testing.assert_allclose(prop.q.dense()[b, i], q, atol=1e-5,
                                   err_msg=f"row {b} node {i}")


def test_bad_exits_are_refused(deep, tmp_path):
  cfg, params, _, _ = deep
  w = zero_blocks(1, 1, cfg.dim)
  with pytest.raises(ValueError, match=r"exit_layer must be in \[1, 2\]"):
    drafts.save_exit(str(tmp_path / "e"), cfg, w, None, exit_layer=3, tokenizer_sha256="-")
  with pytest.raises(ValueError, match="one head"):
    drafts.save_exit(str(tmp_path / "e"), cfg, zero_blocks(2, 1, cfg.dim), None, exit_layer=1,
                     tokenizer_sha256="-")
  drafts.save_exit(str(tmp_path / "e"), cfg, w, None, exit_layer=2, tokenizer_sha256="-")
  shallow = dataclasses.replace(cfg, num_layers=2)
  with pytest.raises(ValueError, match="exits after layer 2, but the target has 2 layers"):
    drafts.load_exit(str(tmp_path / "e"), shallow, params)
  with pytest.raises(ValueError, match="does not fit width"):
    trained_exit_drafter(cfg, params, 1, zero_blocks(1, 1, cfg.dim + 1))
  # an attention adapter: shaped like the target's layers, declared in draft.json, trained
  adapter = adapter_layer(cfg, params, 1)
  with pytest.raises(ValueError, match="not shaped like the target's layers"):
    trained_exit_drafter(cfg, params, 1, dict(w, adapter=dict(adapter, wo=adapter["wo"][:-1])))
  with pytest.raises(ValueError, match="belongs to a trained exit"):
    EarlyExitDrafter(cfg, adapter=True)
  path = str(tmp_path / "a")
  drafts.save_exit(path, cfg, dict(w, adapter=adapter), None, exit_layer=1, tokenizer_sha256="-")
  meta = json.load(open(os.path.join(path, "draft.json")))
  assert meta["adapter"] and drafts.load_exit(path, cfg, params)[0].adapter
  for bad, msg in ((dict(meta, adapter=False), "does not declare an attention adapter"),
                   (dict(meta, param_layout="q|k|v"), "stored in layout 'q|k|v'")):
    json.dump(bad, open(os.path.join(path, "draft.json"), "w"))
    with pytest.raises(CheckpointError, match=msg):
      drafts.load_exit(path, cfg, params)
  d, dp = trained_exit_drafter(cfg, params, 1, w)
  with pytest.raises(ValueError, match="draft_params\\['exit'\\]"):
    d.check_params({k: v for k, v in dp.items() if k != "exit"})


# ------------------------------------------------------------------ own heads (--own_head)


@pytest.mark.heavy  # 47 s
def test_own_heads_train_their_rows_and_ship_with_them(toy, deep, tmp_path):
  """``--own_head``: each head trains its own copy of the frozen LM-head rows (Medusa-1's
  design), which start as the shared head (same logits before training), move in training,
  ship in the directory and load back as the drafter's own [K, Vd, D] head; decoding with
  them stays greedy-exact."""
  for (cfg, params, recs, held), objective, init, save, load in (
      (toy, _objective(toy[0]), init_medusa_weights(toy[0], 3, 1),
       lambda p, c, w, vm: drafts.save_medusa(p, c, w, vm, tokenizer_sha256="abc"),
       drafts.load_medusa),
      (deep, heads.exit_objective(deep[0]), zero_blocks(1, 1, deep[0].dim),
       lambda p, c, w, vm: drafts.save_exit(p, c, w, vm, exit_layer=1, tokenizer_sha256="abc"),
       drafts.load_exit)):
    vm = vocab.select_vocab(vocab.token_counts(recs, cfg.vocab_size), 48)
    frozen = heads.frozen_arrays(cfg, params, vm)
    own = dict(init, head=heads.own_heads(frozen, objective.num_heads))
    assert own["head"].shape == (objective.num_heads, 48, cfg.dim)
    batch = _batch(recs[:4])
    np.testing.assert_allclose(objective.logp_and_aux(own, frozen, None, batch, None)[0],
                               objective.logp_and_aux(init, frozen, None, batch, None)[0],
                               atol=1e-5)
    draft = train.Draft(cfg=dataclasses.replace(cfg, vocab_size=len(vm)),
                        target_vocab_size=cfg.vocab_size, vocab_map=vm)
    tc = train.TrainConfig(steps=30, batch_size=8, seq_len=SEQ, lr=2e-2, warmup_steps=2,
                           eval_every=30, checkpoint_every=30)
    run_dir = str(tmp_path / f"run{objective.num_heads}")
    trained, hist = train.train(draft, own, recs, held, tc, run_dir, k=K_TOP, log=lambda m: 0,
                                progress=False, objective=objective, frozen=frozen)
    assert float(jnp.max(jnp.abs(trained["head"] - own["head"]))) > 1e-3
    assert hist[-1]["alpha_T0"] > hist[0]["alpha_T0"]
    path = str(tmp_path / f"own{objective.num_heads}")
    save(path, cfg, trained, vm)
    d, dp = load(path, cfg, params, tokenizer_sha256="abc")
    head = dp["head"] if "head" in dp else dp["exit"]["head"]
    np.testing.assert_allclose(head, np.asarray(trained["head"], np.float16), atol=1e-6)
    if isinstance(d, MedusaDrafter):
      assert not d.shared_head
      dec = SpeculativeDecoder(cfg, d, tree=d.tree(8), eos_ids=())
    else:
      dec = SpeculativeDecoder(cfg, d, gamma=3, eos_ids=())
    prompts = [r["prompt"] for r in held[:4]]
    np.testing.assert_array_equal(dec.generate(params, dp, prompts, 10).tokens,
                                  generate(params, cfg, prompts, 10, Greedy(), eos_ids=()).tokens)


def test_an_exit_head_of_the_wrong_rows_is_refused(deep):
  cfg, params, _, _ = deep
  w = dict(zero_blocks(1, 1, cfg.dim), head=jnp.zeros((1, 40, cfg.dim)))
  with pytest.raises(ValueError, match=r"own head must be \[1, 48, "):
    trained_exit_drafter(cfg, params, 1, w, np.arange(48))
