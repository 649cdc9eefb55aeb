"""Draft distillation: losses, α, orbax checkpoints and resumption, export, draft loading."""

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import drafts
from specjax.distill import checkpoint as ckpt
from specjax.distill import losses, teacher, train, vocab
from specjax.drafters import reduced_vocab
from specjax.loaders import CheckpointError, load_hf
from specjax.model import embed_inputs, forward, init_params
from specjax.kv_cache import init_cache

K = 8
TC = train.TrainConfig(steps=6, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2,
                       eval_every=3, checkpoint_every=3)


def _np_divergence(kind, p, q):
  if kind == "fkl":
    return np.sum(np.where(p > 0, p * (np.log(p) - np.log(q)), 0.0), -1)
  if kind == "rkl":
    return np.sum(np.where(q > 0, q * (np.log(q) - np.log(p)), 0.0), -1)
  if kind == "top1":
    return -np.log(np.take_along_axis(q, np.argmax(p, -1)[..., None], -1)[..., 0])
  return 0.5 * np.sum(np.abs(p - q), -1)


@pytest.mark.parametrize("kind", losses.DIVERGENCES)
def test_divergence_matches_numpy_and_is_zero_iff_equal(kind):
  rng = np.random.default_rng(0)
  p = rng.dirichlet(np.ones(7), size=5)
  q = rng.dirichlet(np.ones(7), size=5)
  got = np.asarray(losses.divergence(kind, jnp.log(p), jnp.log(q)))
  np.testing.assert_allclose(got, _np_divergence(kind, p, q), rtol=1e-5, atol=1e-6)
  assert np.all(got > 1e-4)
  np.testing.assert_allclose(losses.divergence(kind, jnp.log(p), jnp.log(p)), 0.0, atol=1e-6)


@pytest.mark.parametrize("kind", losses.LOSSES)
def test_divergence_handles_zero_probabilities(kind):
  p = np.array([0.5, 0.5, 0.0])
  q = np.array([0.25, 0.5, 0.25])
  got = losses.divergence(kind, jnp.log(p), jnp.log(q))
  if kind == "rkl":  # q puts mass where p has none
    assert np.isinf(got)
  else:
    np.testing.assert_allclose(got, _np_divergence(kind, p, q), rtol=1e-6)
  grad = jax.grad(lambda lq: losses.divergence("fkl", jnp.log(p), lq))(jnp.log(q))
  assert np.all(np.isfinite(grad))


def test_top1_loss_is_the_cross_entropy_to_the_targets_argmax():
  """'top1' matches numpy, is minimal (0) only when q puts all its mass on argmax p, and a
  coarsened target whose top token is outside the draft's vocabulary scores the best kept
  outcome, finitely."""
  rng = np.random.default_rng(0)
  p, q = rng.dirichlet(np.ones(7), size=5), rng.dirichlet(np.ones(7), size=5)
  got = np.asarray(losses.divergence("top1", jnp.log(p), jnp.log(q)))
  np.testing.assert_allclose(got, _np_divergence("top1", p, q), rtol=1e-5)
  assert np.all(np.asarray(losses.divergence("top1", jnp.log(p), jnp.log(p))) > 0)
  one_hot = np.log(np.eye(7)[np.argmax(p, -1)] * (1 - 1e-9) + 1e-10)
  assert np.all(np.asarray(losses.divergence("top1", jnp.log(p), one_hot)) < 1e-6)
  pc, qc = losses.coarsen(np.array([[0, 2]]), jnp.log(np.array([[0.6, 0.3]])),
                          np.array([[False, True]]), jnp.log(np.array([[0.2, 0.3, 0.5]])))
  np.testing.assert_allclose(losses.divergence("top1", pc, qc), -np.log(0.5), rtol=1e-5)


def test_coarsen_with_all_tokens_kept_is_the_dense_divergence():
  rng = np.random.default_rng(1)
  p, q = rng.dirichlet(np.ones(6), size=3), rng.dirichlet(np.ones(6), size=3)
  ids = np.tile(np.arange(6), (3, 1))
  pc, qc = losses.coarsen(ids, jnp.log(p), np.ones((3, 6), bool), jnp.log(q))
  assert np.all(np.exp(np.asarray(qc))[:, -1] < 1e-6)
  for kind in losses.LOSSES:
    np.testing.assert_allclose(losses.divergence(kind, pc, qc),
                               _np_divergence(kind, p, q), rtol=1e-4, atol=1e-6)


def test_coarsen_moves_unkept_tokens_to_other_bucket():
  p = np.array([[0.6, 0.3, 0.1]])
  q = np.array([[0.2, 0.3, 0.5]])
  # keep tokens 0 and 2 only; token 2 is "not in the draft vocabulary"
  pc, qc = losses.coarsen(np.array([[0, 2]]), jnp.log(p[:, [0, 2]]), np.array([[True, False]]),
                          jnp.log(q))
  np.testing.assert_allclose(np.exp(pc), [[0.6, 0.0, 0.4]], atol=1e-6)
  np.testing.assert_allclose(np.exp(qc), [[0.2, 0.0, 0.8]], atol=1e-6)


def test_self_instructed_prompts_are_cleaned_and_split_by_topic():
  from specjax.distill import data
  assert data.clean_question('User: "How do I start a compost heap?"\nSure!') == \
      "How do I start a compost heap?"
  assert data.clean_question("Yes.") is None  # too short
  assert data.clean_question("Hello there") is None  # fewer than four words
  reqs = data.self_instruct_requests(0, 2)
  topics = data.CHAT_TOPICS + data.EXTRA_CHAT_TOPICS
  assert len(reqs) == 2 * len(topics)
  # the target's question keeps its request's source, so the split holds by topic
  assert {r.source for r in reqs} == {f"chat:{t}" for t in topics}
  train_p, held_p = data.split_by_source(reqs)
  assert not {p.source for p in train_p} & {p.source for p in held_p} and held_p


def test_prompt_sources_do_not_depend_on_what_the_caller_imported(monkeypatch):
  """A library that replaces a module's function (importing torch replaces inspect.getfile)
  makes the function foreign to the module in that process; the items are read in a fresh
  interpreter, so the prompt set, and its held-out split, stay the same."""
  import inspect

  from specjax.distill import data

  def getfile(obj):  # what torch.package installs, in miniature
    return "patched"

  getfile.__module__ = "somelib.patch"
  monkeypatch.setattr(inspect, "getfile", getfile)
  names = [name for _, name, _, _ in data.stdlib_items(("inspect", "fnmatch"))]
  assert "inspect.getfile" in names and "fnmatch.fnmatch" in names
  in_process = [name for _, name, _, _ in data._own_items(("inspect",))]  # the old reading
  assert "inspect.getfile" not in in_process and "inspect.getsource" in in_process


def test_prompt_batches_sort_by_length_keep_metadata_and_drop_short_batches():
  from specjax.distill import data
  prompts = [data.Prompt("chat", f"chat:{i % 3}", "w " * (10 - i)) for i in range(10)]
  encode = lambda text: list(range(len(text.split())))
  batches = data.prompt_batches(encode, prompts, 4, max_tokens=9)  # the 10-word one is dropped
  assert [len(ids) for ids, _ in batches] == [4, 4]  # 9 prompts: the short last batch goes
  lengths = [len(x) for ids, _ in batches for x in ids]
  assert lengths == sorted(lengths) and max(lengths) <= 9
  assert batches[0][1][0] == dict(category="chat", source="chat:0")  # 1 word: prompt 9
  assert len(data.prompt_batches(encode, prompts, 4, 9, drop_last=False)) == 3


def test_leading_records_cut_each_corpus_to_the_same_share_in_order():
  def recs(*lens):
    return [dict(response=np.zeros(n, np.int32), i=i) for i, n in enumerate(lens)]
  a, b = recs(4, 4, 4, 4), recs(2, 2)  # 16 and 4 tokens
  cut_a, cut_b = teacher.leading_records([a, b], 10)  # half of each: 8 and 2 tokens
  assert [r["i"] for r in cut_a] == [0, 1] and [r["i"] for r in cut_b] == [0]
  # a record that would pass the share is left out, and so is every record after it
  [cut] = teacher.leading_records([recs(3, 5, 1)], 6)
  assert [r["i"] for r in cut] == [0]
  assert teacher.leading_records([a, b], 20) == [a, b]
  for bad in (0, 21):
    with pytest.raises(ValueError, match="the corpus holds 20"):
      teacher.leading_records([a, b], bad)


def test_select_vocab_and_maps():
  counts = np.array([9.0, 1.0, 5.0, 5.0, 0.0, 7.0])
  assert vocab.select_vocab(counts, 4, always=(4,)).tolist() == [0, 4, 5, 2]
  vm = vocab.select_vocab(counts, 4)
  assert vm.tolist() == [0, 5, 2, 3]  # fallback first, then by count, ties by id
  im = np.asarray(reduced_vocab.input_map(vm, 6))
  assert im.tolist() == [0, 0, 2, 3, 0, 1]
  lifted = np.asarray(reduced_vocab.lift_logits(jnp.array([1.0, 2.0, 3.0, 4.0]), vm, 6))
  assert lifted.tolist() == [1.0, -np.inf, 3.0, 4.0, -np.inf, 2.0]


def test_nearest_input_map_reads_the_most_similar_kept_token():
  embed = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.8], [-1.0, 0.0]])
  vm = np.array([0, 2])
  assert vocab.nearest_input_map(vm, embed).tolist() == [0, 0, 1, 1, 1]


# ------------------------------------------------------------------ toy end to end


@pytest.fixture(scope="module")
def toy(toy_corpus):
  """The shared toy target and corpus (conftest) and a reduced-vocab draft spec."""
  cfg, params, train_recs, held = toy_corpus
  vm = vocab.select_vocab(vocab.token_counts(train_recs, cfg.vocab_size), 48)
  return cfg, params, train_recs, held, vm


def _draft(toy, seed=0):
  cfg, _, _, _, vm = toy
  dcfg = dataclasses.replace(cfg, vocab_size=len(vm), num_layers=1, tie_embeddings=True)
  d = train.Draft(cfg=dcfg, target_vocab_size=cfg.vocab_size, vocab_map=vm)
  return d, init_params(dcfg, jax.random.PRNGKey(seed), scale=0.1)


def test_teacher_topk_matches_teacher_forced_forward(toy):
  cfg, params, recs, _, _ = toy
  r = recs[0]
  seq = np.concatenate([r["prompt"], r["response"]])[None]
  out = forward(params, cfg, jnp.asarray(seq), jnp.arange(seq.shape[1])[None],
                init_cache(cfg, 1, seq.shape[1]))
  logp = jax.nn.log_softmax(out.logits[0], -1)[len(r["prompt"]) - 1:-1]
  top, ids = jax.lax.top_k(logp, K)
  np.testing.assert_array_equal(ids, r["topk_ids"])
  np.testing.assert_allclose(top, r["topk_logp"], atol=1e-5)
  assert np.all(r["response"] == r["topk_ids"][:, 0])  # greedy records follow the argmax


def test_online_teacher_recomputes_the_stored_topk_and_features(toy):
  """``Teacher.fill`` on an id-only batch gives the stored corpus' top-k (teacher-forced)
  and the cached features, also for fused layers."""
  from specjax.distill import features
  cfg, params, recs, _, _ = toy
  recs = recs[:6]
  stored = {k: jnp.asarray(v) for k, v in train.make_batch(recs, TC.seq_len, K).items()}
  ids_only = [dict(prompt=r["prompt"], response=r["response"]) for r in recs]
  batch = {k: jnp.asarray(v) for k, v in train.make_batch(ids_only, TC.seq_len, K).items()}
  for layers in ((), (0,)):
    filled = train.Teacher(cfg, K, layers).fill(params, batch)
    w = np.asarray(stored["weight"]) > 0
    np.testing.assert_array_equal(np.asarray(filled["topk_ids"])[w],
                                  np.asarray(stored["topk_ids"])[w])
    np.testing.assert_allclose(np.asarray(filled["topk_logp"])[w],
                               np.asarray(stored["topk_logp"])[w], atol=1e-5)
    assert np.all(np.isneginf(np.asarray(filled["topk_logp"])[~w]))
    feats = features.sequence_features(params, cfg, [features.record_sequence(r) for r in recs],
                                       layers=layers)
    for i, f in enumerate(feats):
      np.testing.assert_allclose(np.asarray(filled["features"])[i, :len(f)],
                                 f.astype(np.float32), rtol=2e-3, atol=2e-3)
  assert "features" not in train.Teacher(cfg, K).fill(params, batch)


@pytest.mark.parametrize("kind", losses.LOSSES)
def test_tiny_training_lowers_loss_and_raises_alpha(toy, tmp_path, kind):
  _, _, recs, held, _ = toy
  draft, params = _draft(toy)
  tc = dataclasses.replace(TC, loss=kind, lr=1e-2, steps=60, batch_size=8,
                           eval_every=60, checkpoint_every=60)
  batch = {k: jnp.asarray(v) for k, v in train.make_batch(recs[:8], tc.seq_len, K).items()}
  vm, im = draft.maps()
  before = float(train.loss_fn(params, train.TokenObjective(draft.cfg), kind, vm, im, {}, batch))
  trained, hist = train.train(draft, params, recs, held, tc, str(tmp_path), k=K, log=lambda m: 0,
                              progress=False)
  after = float(train.loss_fn(trained, train.TokenObjective(draft.cfg), kind, vm, im, {}, batch))
  print(kind, before, after, hist[0], hist[-1])
  assert after < 0.8 * before
  assert hist[-1]["alpha_T0"] > hist[0]["alpha_T0"] + 0.1
  assert hist[-1]["alpha_T1"] > hist[0]["alpha_T1"] + 0.1
  assert hist[-1]["alpha_T1"] <= hist[-1]["alpha_T1_upper"] <= 1.0


def test_adaspec_selection_keeps_the_largest_gaps_among_weighted_positions():
  gap = jnp.array([[0.5, -1.0, 3.0, 2.0], [9.0, 0.1, 2.0, 0.0]])
  w = jnp.array([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])  # 9.0 is not weighted
  np.testing.assert_array_equal(train.selected(gap, w, 0.5),
                                [[0, 0, 1, 1], [0, 0, 1, 0]])  # 3 of 6: 3.0, 2.0, 2.0 (tie)
  np.testing.assert_array_equal(train.selected(gap, w, 1.0), w)
  np.testing.assert_array_equal(train.selected(gap, w, 0.1), [[0, 0, 1, 0], [0, 0, 0, 0]])
  with pytest.raises(ValueError, match="keep_fraction"):
    train.TrainConfig(keep_fraction=0.0)


def test_adaspec_loss_trains_only_where_the_draft_trails_the_reference_most(toy):
  _, _, recs, _, _ = toy
  draft, params = _draft(toy)
  _, reference = _draft(toy, seed=1)
  batch = {k: jnp.asarray(v) for k, v in train.make_batch(recs[:8], 32, K).items()}
  vm, im = draft.maps()
  obj = train.TokenObjective(draft.cfg)
  frozen = dict(reference=reference)

  def divergence(p):  # [B, R] forward KL of a draft at every position
    logp, _ = obj.logp_and_aux(p, {}, im, batch, None)
    pk, qk, _, _ = train._coarsened(logp, batch["topk_ids"], batch["topk_logp"], vm, im)
    return np.asarray(losses.divergence("fkl", pk, qk)).reshape(batch["weight"].shape)

  gap, w = divergence(params) - divergence(reference), np.asarray(batch["weight"])
  n = int(w.sum())
  order = np.argsort(-np.where(w > 0, gap, -np.inf), axis=None)
  top = np.zeros(w.size)
  top[order[:-(-n // 2)]] = 1.0  # the half with the largest gaps
  mean_over = lambda m: float((divergence(params) * m).sum() / m.sum())
  loss = float(train.loss_fn(params, obj, "fkl", vm, im, frozen, batch, None, 0.5))
  np.testing.assert_allclose(loss, mean_over(top.reshape(w.shape)), rtol=1e-5)
  bottom = w.ravel() * (1 - top)  # the known-wrong variant: the smallest gaps
  assert abs(loss - mean_over(bottom.reshape(w.shape))) > 1e-3
  np.testing.assert_allclose(float(train.loss_fn(params, obj, "fkl", vm, im, frozen, batch)),
                             mean_over(w), rtol=1e-5)  # keep 1: every weighted position
  grads = jax.grad(train.loss_fn)(params, obj, "fkl", vm, im, frozen, batch, None, 0.5)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
  with pytest.raises(ValueError, match="frozen\\['reference'\\]"):
    train.loss_fn(params, obj, "fkl", vm, im, {}, batch, None, 0.5)


def test_full_input_rows_and_lookup_match_their_docstring_examples():
  reads = reduced_vocab.full_input(np.array([0, 7, 3]), np.zeros((8, 2)), 8, 2)
  np.testing.assert_array_equal(reads["input_rows"], [0, -1, -1, 2, -1, -1, -1, 1])
  own = jnp.asarray([[10.0], [11.0], [12.0]])
  target = jnp.asarray([[0.0], [1.0], [2.0], [3.0]])
  params = dict(embed=own, input_embed=target, input_rows=jnp.asarray([-1, 0, -1, 2]))
  np.testing.assert_array_equal(embed_inputs(params, jnp.asarray([0, 1, 2, 3]))[:, 0],
                                [0.0, 10.0, 2.0, 12.0])
  with pytest.raises(ValueError, match="input_embed must be"):
    reduced_vocab.full_input(np.array([0, 7, 3]), np.zeros((8, 3)), 8, 2)


def test_full_input_objective_reads_what_the_full_input_drafter_reads(toy):
  """Training with ``TokenObjective(full_input=True)`` sees the log-probs inference sees
  through ``ModelDrafter.make_params(input_embed=target_embed)``, on sequences full of ids
  outside the draft's vocabulary; the substitute-row objective does not."""
  from specjax.drafters import ModelDrafter
  cfg, tparams, _, _, vm = toy
  draft, params = _draft(toy)
  dp = ModelDrafter(draft.cfg, target_vocab_size=cfg.vocab_size).make_params(
      params, vm, input_embed=tparams["embed"])
  rng = np.random.default_rng(2)
  outside = np.setdiff1d(np.arange(cfg.vocab_size), vm)
  seq = np.where(rng.random((2, 12)) < 0.5, rng.choice(outside, (2, 12)), rng.choice(vm, (2, 12)))
  batch = dict(tokens=jnp.asarray(seq), pred_pos=jnp.broadcast_to(jnp.arange(12), (2, 12)))
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  served = jax.nn.log_softmax(forward(dp["model"], draft.cfg, batch["tokens"], pos,
                                      init_cache(draft.cfg, 2, 12)).logits, -1)
  _, im = draft.maps()
  frozen = reduced_vocab.full_input(vm, tparams["embed"], cfg.vocab_size, draft.cfg.dim)
  full, _ = train.TokenObjective(draft.cfg, full_input=True).logp_and_aux(
      params, frozen, im, batch, None)
  mapped, _ = train.TokenObjective(draft.cfg).logp_and_aux(params, {}, im, batch, None)
  np.testing.assert_allclose(np.asarray(full), np.asarray(served), atol=1e-5)
  assert np.abs(np.asarray(mapped) - np.asarray(served)).max() > 1e-2
  with pytest.raises(ValueError, match="frozen"):
    train.TokenObjective(draft.cfg, full_input=True).logp_and_aux(params, {}, im, batch, None)


def test_tiny_full_input_training_lowers_loss_and_raises_alpha(toy, tmp_path):
  """The full-vocabulary-input token draft trains (its own rows and layers; the target's
  rows stay frozen), and full input is refused where it has no meaning."""
  cfg, tparams, recs, held, vm = toy
  draft, params = _draft(toy)
  objective = train.TokenObjective(draft.cfg, full_input=True)
  frozen = reduced_vocab.full_input(vm, tparams["embed"], cfg.vocab_size, draft.cfg.dim)
  tc = dataclasses.replace(TC, lr=1e-2, steps=60, batch_size=8, eval_every=60,
                           checkpoint_every=60)
  batch = {k: jnp.asarray(v) for k, v in train.make_batch(recs[:8], tc.seq_len, K).items()}
  vm_j, im = draft.maps()
  before = float(train.loss_fn(params, objective, "fkl", vm_j, im, frozen, batch))
  trained, hist = train.train(draft, params, recs, held, tc, str(tmp_path / "run"), k=K,
                              log=lambda m: 0, progress=False, objective=objective,
                              frozen=frozen)
  after = float(train.loss_fn(trained, objective, "fkl", vm_j, im, frozen, batch))
  assert after < 0.8 * before
  assert hist[-1]["alpha_T0"] > hist[0]["alpha_T0"] + 0.1
  assert set(trained) == set(params)  # the target's table is not a trained parameter
  full_vocab = train.Draft(cfg=cfg, target_vocab_size=cfg.vocab_size)
  with pytest.raises(ValueError, match="reduced-vocabulary"):
    train.train(full_vocab, tparams, recs, held, tc, str(tmp_path / "a"), k=K,
                objective=train.TokenObjective(cfg, full_input=True), frozen=frozen)
  with pytest.raises(ValueError, match="on-policy"):
    train.train(draft, params, recs, held, dataclasses.replace(tc, on_policy_every=2),
                str(tmp_path / "b"), k=K, target=(cfg, tparams), objective=objective,
                frozen=frozen)


def test_heldout_alpha_t1_bounds_contain_exact_beta(toy):
  cfg, tparams, _, held, _ = toy
  draft, params = _draft(toy)
  got = train.heldout_alpha(params, draft, held, 32, K)
  vm, im = draft.maps()
  betas = []
  for r in held:
    if r["mode"] == "greedy":
      continue
    seq = jnp.asarray(np.concatenate([r["prompt"], r["response"]]))[None]
    n, pos = seq.shape[1], jnp.arange(seq.shape[1])[None]
    p = jax.nn.softmax(forward(tparams, cfg, seq, pos, init_cache(cfg, 1, n)).logits[0], -1)
    dl = forward(params, draft.cfg, im[seq], pos, init_cache(draft.cfg, 1, n)).logits[0]
    q = jax.nn.softmax(reduced_vocab.lift_logits(dl, vm, cfg.vocab_size), -1)
    betas.append(np.asarray(losses.beta(p, q))[len(r["prompt"]) - 1:-1])
  exact = float(np.mean(np.concatenate(betas)))
  assert got["alpha_T1"] - 1e-5 <= exact <= got["alpha_T1_upper"] + 1e-5


def test_on_policy_step_runs(toy, tmp_path):
  cfg, tparams, recs, _, _ = toy
  draft, params = _draft(toy)
  tc = dataclasses.replace(TC, steps=2, on_policy_every=2, eval_every=2, checkpoint_every=2)
  out, _ = train.train(draft, params, recs, [], tc, str(tmp_path), k=K, target=(cfg, tparams),
                       log=lambda m: 0, progress=False)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(out))
  scored = train.on_policy_records(params, draft, tparams, cfg, [recs[0]["prompt"]], 5, K, 0)
  assert scored[0]["topk_ids"].shape == (len(scored[0]["response"]), K)
  assert np.all(np.isin(scored[0]["response"], draft.vocab_map))


# ------------------------------------------------------------------ checkpoints


def test_checkpoint_roundtrip_is_bit_exact(toy, tmp_path):
  draft, params = _draft(toy)
  state = train.init_state(params, TC)
  state["step"] = jnp.asarray(7, jnp.int32)
  mngr = ckpt.manager(str(tmp_path))
  ckpt.save(mngr, 7, state)
  restored = ckpt.restore(ckpt.manager(str(tmp_path)), train.init_state(params, TC))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_interrupted_run_resumes_at_saved_step(toy, tmp_path):
  _, _, recs, held, _ = toy
  draft, params = _draft(toy)
  full, _ = train.train(draft, params, recs, held, TC, str(tmp_path / "a"), k=K,
                        log=lambda m: 0, progress=False)
  train.train(draft, params, recs, held, TC, str(tmp_path / "b"), k=K, stop_after=3,
              log=lambda m: 0, progress=False)
  assert ckpt.manager(str(tmp_path / "b" / "checkpoints")).latest_step() == 3
  resumed, hist = train.train(draft, params, recs, held, TC, str(tmp_path / "b"), k=K,
                              log=lambda m: 0, progress=False)
  assert [m["step"] for m in hist] == [6]  # started at 3: no step-0 eval, one eval at 6
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_grouped_batches_cover_each_epoch_once_by_length_and_depend_on_the_step_alone():
  """``batch_indices(..., group=G)``: an epoch's n // B batches hold distinct records (the
  n % B left over differ between epochs), a window's batches are cut from its records in
  length order (so with G = all batches, consecutive length ranges), and the batch of a step
  is the same however it is reached."""
  rng = np.random.default_rng(0)
  n, b = 103, 4
  lengths = rng.integers(5, 400, n)
  per_epoch = n // b
  for group in (1, 5, per_epoch):
    for epoch in range(2):
      steps = range(epoch * per_epoch, (epoch + 1) * per_epoch)
      idx = np.concatenate([train.batch_indices(s, b, n, 7, lengths, group) for s in steps])
      assert len(idx) == per_epoch * b and len(set(idx.tolist())) == len(idx)
    np.testing.assert_array_equal(train.batch_indices(31, b, n, 7, lengths, group),
                                  train.batch_indices(31, b, n, 7, lengths, group))
  whole = [lengths[train.batch_indices(s, b, n, 7, lengths, per_epoch)] for s in range(per_epoch)]
  whole.sort(key=min)
  assert all(a.max() <= c.min() for a, c in zip(whole, whole[1:]))
  spread = lambda g: np.mean([np.ptp(lengths[train.batch_indices(s, b, n, 7, lengths, g)])
                              for s in range(per_epoch)])
  assert spread(5) < 0.5 * np.mean([np.ptp(lengths[train.batch_indices(s, b, n, 7)])
                                   for s in range(per_epoch)])
  assert spread(per_epoch) < spread(5)
  with pytest.raises(ValueError, match="one length per record"):
    train.batch_indices(0, b, n, 7, None, 4)
  with pytest.raises(ValueError, match="make no batch"):
    train.batch_indices(0, b, 3, 7, lengths[:3], 4)
  with pytest.raises(ValueError, match="length_group"):
    train.TrainConfig(length_group=-1)


def test_a_trimmed_batch_gives_the_untrimmed_loss_and_alpha(toy):
  """``make_batch(pad_to=...)`` cuts the trailing padding (L = the longest row rounded up)
  and changes neither the loss nor held-out α; ``heldout_alpha`` in length order agrees."""
  _, _, recs, held, _ = toy
  draft, params = _draft(toy)
  vm, im = draft.maps()
  obj = train.TokenObjective(draft.cfg)
  short = sorted(recs, key=lambda r: train.record_length(r, TC.seq_len))[:8]
  full = {k: jnp.asarray(v) for k, v in train.make_batch(short, TC.seq_len, K).items()}
  cut = {k: jnp.asarray(v) for k, v in train.make_batch(short, TC.seq_len, K, pad_to=8).items()}
  longest = max(train.record_length(r, TC.seq_len) for r in short)
  assert cut["tokens"].shape[1] == -(-longest // 8) * 8 < TC.seq_len
  for kind in ("fkl", "top1"):
    np.testing.assert_allclose(float(train.loss_fn(params, obj, kind, vm, im, {}, cut)),
                               float(train.loss_fn(params, obj, kind, vm, im, {}, full)),
                               rtol=1e-5)
  a = train.heldout_alpha(params, draft, held, TC.seq_len, K, batch_size=3)
  b = train.heldout_alpha(params, draft, held, TC.seq_len, K, batch_size=3, pad_to=8)
  assert a.keys() == b.keys() and a["positions_T0"] == b["positions_T0"] > 0
  for key in a:
    np.testing.assert_allclose(b[key], a[key], rtol=1e-5)


def test_a_length_grouped_run_resumes_bit_exact(toy, tmp_path, monkeypatch):
  """Grouped, trimmed batches (several lengths, so several programs) keep resumption exact,
  and the run trains on other batches than the ungrouped one."""
  _, _, recs, held, _ = toy
  monkeypatch.setattr(train, "LENGTH_PAD", 8)
  draft, params = _draft(toy)
  tc = dataclasses.replace(TC, length_group=3)
  lengths = [train.record_length(r, tc.seq_len) for r in recs]
  widths = {train.make_batch([recs[i] for i in train.batch_indices(
      s, tc.batch_size, len(recs), tc.seed, lengths, 3)], tc.seq_len, K, tc.pad_to)["tokens"]
            .shape[1] for s in range(tc.steps)}
  assert len(widths) > 1 and max(widths) <= tc.seq_len
  full, _ = train.train(draft, params, recs, held, tc, str(tmp_path / "a"), k=K,
                        log=lambda m: 0, progress=False)
  train.train(draft, params, recs, held, tc, str(tmp_path / "b"), k=K, stop_after=3,
              log=lambda m: 0, progress=False)
  resumed, _ = train.train(draft, params, recs, held, tc, str(tmp_path / "b"), k=K,
                           log=lambda m: 0, progress=False)
  for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  logged = [json.loads(line) for line in (tmp_path / "a" / "steps.jsonl").read_text().splitlines()]
  assert [m["step"] for m in logged] == list(range(1, tc.steps + 1))
  assert {m["length"] for m in logged} == widths and all(m["trained"] > 0 for m in logged)
  plain, _ = train.train(draft, params, recs, held, TC, str(tmp_path / "c"), k=K,
                         log=lambda m: 0, progress=False)
  assert any(not np.array_equal(np.asarray(a), np.asarray(b))
             for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(plain)))
  # Too few records for one batch: refused before the workdir or an evaluation is made.
  with pytest.raises(ValueError, match="make no batch"):
    train.train(draft, params, recs[:tc.batch_size - 1], held, tc, str(tmp_path / "d"), k=K,
                log=lambda m: pytest.fail(f"evaluated before the check: {m}"), progress=False)
  assert not (tmp_path / "d").exists()


def test_a_passed_deadline_takes_no_step_and_returns_the_checkpoint(toy, tmp_path):
  """A run resumed out of time (train_draft --max_minutes=0) gives its last checkpoint's
  parameters back untouched, and logs nothing: the draft of a run stopped between
  checkpoints."""
  _, _, recs, held, _ = toy
  draft, params = _draft(toy)
  saved, _ = train.train(draft, params, recs, held, TC, str(tmp_path), k=K, stop_after=3,
                         log=lambda m: 0, progress=False)
  metrics = (tmp_path / "metrics.jsonl").read_text()
  again, hist = train.train(draft, params, recs, held, TC, str(tmp_path), k=K,
                            deadline=time.time() - 1, log=lambda m: 0, progress=False)
  assert hist == [] and (tmp_path / "metrics.jsonl").read_text() == metrics
  assert ckpt.manager(str(tmp_path / "checkpoints")).latest_step() == 3
  for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_warm_start_may_change_the_corpus_but_not_the_draft():
  """--init_from continues a draft on another corpus: only data keys may differ."""
  exit10 = dict(corpus="/c/a", draft_vocab=8192, draft_layers=1, train_responses=10,
                train_tokens=900, draft_kind="exit", exit_layer=10, exit_adapter=True)
  more_data = dict(exit10, corpus="/c/b", train_responses=20, train_tokens=1800,
                   teacher="online", teacher_topk=64, init_from="/runs/a",
                   also_corpora=["/c/c"], length_group=16)  # more answers, other batches
  assert ckpt.draft_mismatch(exit10, more_data) == {}
  assert ckpt.draft_mismatch(exit10, dict(more_data, exit_layer=6)) == {"exit_layer": (10, 6)}
  no_adapter = {k: v for k, v in exit10.items() if k != "exit_adapter"}
  assert ckpt.draft_mismatch(exit10, no_adapter) == {"exit_adapter": (True, None)}
  assert set(ckpt.draft_mismatch(exit10, dict(exit10, draft_vocab=16384, own_head=True))) == {
      "draft_vocab", "own_head"}


def test_missing_or_corrupt_checkpoint_is_a_clear_error(toy, tmp_path):
  draft, params = _draft(toy)
  state = train.init_state(params, TC)
  mngr = ckpt.manager(str(tmp_path))
  with pytest.raises(CheckpointError, match="no checkpoint in"):
    ckpt.restore(mngr, state)
  ckpt.save(mngr, 3, state)
  with pytest.raises(CheckpointError, match="no checkpoint for step 5.*available steps: \\[3\\]"):
    ckpt.restore(mngr, state, step=5)
  for root, _, files in os.walk(tmp_path / "3"):
    for f in files:
      with open(os.path.join(root, f), "wb") as fh:
        fh.write(b"\x00garbage")
  with pytest.raises(CheckpointError, match="corrupt"):
    ckpt.restore(ckpt.manager(str(tmp_path)), state)


# ------------------------------------------------------------------ storage and export


def test_draft_save_load_roundtrip_and_refusal(toy, tmp_path):
  cfg, _, _, _, vm = toy
  draft, params = _draft(toy)
  im = np.arange(cfg.vocab_size, dtype=np.int32) % len(vm)
  drafts.save_draft(str(tmp_path), draft.cfg, params, vm, target_vocab_size=cfg.vocab_size,
                    tokenizer_sha256="a" * 64, input_map=im)
  assert np.array_equal(drafts.load_draft(str(tmp_path), with_input_map=True)[3], im)
  dcfg, p2, vm2 = drafts.load_draft(str(tmp_path), target_vocab_size=cfg.vocab_size,
                                    tokenizer_sha256="a" * 64)
  assert dcfg == draft.cfg and np.array_equal(vm2, vm)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p2)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)  # float16 storage
  with pytest.raises(ValueError, match="another tokenizer"):
    drafts.load_draft(str(tmp_path), tokenizer_sha256="b" * 64)
  with pytest.raises(ValueError, match="vocabulary of 64 tokens"):
    drafts.load_draft(str(tmp_path), target_vocab_size=49152)
  with pytest.raises(CheckpointError, match="not a draft directory"):
    drafts.load_draft(str(tmp_path / "nope"))


def test_drafter_from_path_serves_full_input_unless_told_not_to(toy, tmp_path):
  """A saved reduced token draft is served with the target's rows for out-of-map ids by
  default, and with the input map it shipped with when ``target_input=False``."""
  cfg, tparams, _, _, vm = toy
  draft, params = _draft(toy)
  im = vocab.nearest_input_map(vm, np.asarray(tparams["embed"]))
  drafts.save_draft(str(tmp_path), draft.cfg, params, vm, target_vocab_size=cfg.vocab_size,
                    tokenizer_sha256="a" * 64, input_map=im)
  _, full, _ = drafts.drafter_from_path(str(tmp_path), cfg, tparams, None)
  _, mapped, _ = drafts.drafter_from_path(str(tmp_path), cfg, tparams, None, target_input=False)
  assert full["model"]["input_embed"] is tparams["embed"] and "inverse_map" not in full
  assert "input_embed" not in mapped["model"]
  np.testing.assert_array_equal(mapped["inverse_map"], im)


def test_exported_hf_directory_matches_transformers_and_load_hf(toy, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  cfg, _, _, _, vm = toy
  draft, params = _draft(toy)
  drafts.export_hf(str(tmp_path), draft.cfg, params, vm, cfg.vocab_size)
  hcfg, hparams = load_hf(str(tmp_path))
  assert hcfg.vocab_size == cfg.vocab_size
  seq = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  ours = np.asarray(forward(hparams, hcfg, jnp.asarray(seq), pos, init_cache(hcfg, 2, 12)).logits)
  hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
  with torch.no_grad():
    theirs = hf(torch.tensor(seq)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, atol=1e-4)
  # on the draft's vocabulary the export predicts exactly what the reduced draft does
  vmj, im = draft.maps()
  reduced = forward(params, draft.cfg, im[jnp.asarray(seq)], pos,
                    init_cache(draft.cfg, 2, 12)).logits
  np.testing.assert_allclose(ours[..., vm], reduced, atol=1e-5)
  outside = np.setdiff1d(np.arange(cfg.vocab_size), vm)
  assert np.all(ours[..., outside] == 0.0)


def test_export_with_the_target_table_reads_what_the_full_input_drafter_reads(toy, tmp_path):
  from specjax.drafters import ModelDrafter
  cfg, tparams, _, _, vm = toy
  draft, params = _draft(toy)
  drafter = ModelDrafter(draft.cfg, target_vocab_size=cfg.vocab_size)
  dp = drafter.make_params(params, vm, input_embed=tparams["embed"])
  hcfg, hparams = drafts.expand_to_full_vocab(draft.cfg, params, vm, cfg.vocab_size,
                                              input_embed=tparams["embed"])
  every_id = jnp.arange(cfg.vocab_size)
  np.testing.assert_array_equal(np.asarray(hparams["embed"]),
                                np.asarray(embed_inputs(dp["model"], every_id)))
  assert dp["model"]["input_embed"] is tparams["embed"]  # shared, not copied
  seq = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 10)))
  pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
  ours = forward(hparams, hcfg, seq, pos, init_cache(hcfg, 2, 10)).logits
  theirs = forward(dp["model"], draft.cfg, seq, pos, init_cache(draft.cfg, 2, 10)).logits
  np.testing.assert_allclose(np.asarray(ours)[..., vm], np.asarray(theirs), atol=1e-5)
  with pytest.raises(ValueError, match="input_embed must be"):
    drafts.expand_to_full_vocab(draft.cfg, params, vm, cfg.vocab_size,
                                input_embed=tparams["embed"][:3])
