"""Bad inputs fail early and by name, or follow a documented total rule; never a silent result.

Classes pinned here: corrupt or mismatched checkpoints (CheckpointError naming
the tensor), sampler and decoder parameters (checked at construction),
pathological logits and probabilities (the total rule of specjax.sampling and
specjax.speculative.acceptance), sequence-length and cache-memory limits
(checked before allocation), draft paths (tokenizer fingerprint, finite
weights) and export into a used directory.
"""

import dataclasses
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from specjax import drafts
from specjax.drafters import ModelDrafter
from specjax.generate import generate
from specjax.loaders import CheckpointError, load_gguf, load_hf, load_model, save_hf
from specjax.loaders.hf_layout import params_to_hf
from specjax.prompts import pack_prompts
from specjax.sampling import Greedy, Sampling, make_sampler
from specjax.speculative import SpeculativeDecoder, accept
from specjax.testing import tiny_model

INF, NAN = np.inf, np.nan

# --- checkpoints -------------------------------------------------------------------------------


@pytest.fixture
def hf_tensors(tmp_path):
  """(directory, cfg, HF tensors) of a saved tiny model; tests rewrite its safetensors."""
  cfg, params = tiny_model(seed=7)
  save_hf(str(tmp_path), cfg, params)
  return tmp_path, cfg, params_to_hf(cfg, params)


def _corrupt(tensors, name, fn):
  return dict(tensors, **{name: fn(tensors[name])})


def _set_first(value):
  def fn(t):
    t = t.copy()
    t.flat[0] = value
    return t
  return fn


@pytest.mark.parametrize("name,fn,match", [
    ("model.layers.0.mlp.up_proj.weight", _set_first(NAN), "non-finite"),
    ("model.layers.1.self_attn.q_proj.weight", _set_first(INF), "non-finite"),
    ("model.norm.weight", _set_first(-INF), "non-finite"),
    ("model.embed_tokens.weight", lambda t: t[:-1], r"shape \(63, 32\).*\(64, 32\)"),
    ("lm_head.weight", lambda t: np.concatenate([t, t[:1]]), r"shape \(65, 32\)"),
    ("model.layers.0.self_attn.k_proj.weight", lambda t: t.T.copy(), "shape"),
    ("model.layers.0.input_layernorm.weight", lambda t: t.astype(np.int32), "not a float"),
])
def test_corrupt_tensor_is_a_checkpoint_error_naming_it(hf_tensors, name, fn, match):
  path, _, tensors = hf_tensors
  save_file(_corrupt(tensors, name, fn), str(path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=match) as e:
    load_hf(str(path))
  assert name in str(e.value) and str(path) in str(e.value)


def test_unused_tensor_is_a_checkpoint_error(hf_tensors):
  path, _, tensors = hf_tensors
  save_file(dict(tensors, **{"model.layers.2.mlp.up_proj.weight": np.zeros((64, 32), np.float32)}),
            str(path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"unused.*model\.layers\.2\.mlp\.up_proj"):
    load_hf(str(path))


def test_recomputed_rotary_tensor_is_not_counted_as_unused(hf_tensors):
  path, _, tensors = hf_tensors
  inv_freq = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
  save_file(dict(tensors, **inv_freq), str(path / "model.safetensors"))
  load_hf(str(path))


def test_tied_checkpoint_may_store_the_head_only_if_it_is_the_embedding(tmp_path):
  cfg, params = tiny_model(seed=7, tie_embeddings=True)
  save_hf(str(tmp_path), cfg, params)
  tensors = params_to_hf(cfg, params)
  embed = tensors["model.embed_tokens.weight"]
  save_file(dict(tensors, **{"lm_head.weight": embed}), str(tmp_path / "model.safetensors"))
  load_hf(str(tmp_path))
  save_file(dict(tensors, **{"lm_head.weight": embed + 1}), str(tmp_path / "model.safetensors"))
  with pytest.raises(CheckpointError, match="differs"):
    load_hf(str(tmp_path))


def test_gguf_with_garbage_in_its_tensor_data_is_a_checkpoint_error(tmp_path):
  from test_loaders import _write_gguf  # tests/ is on sys.path (rootdir-relative imports)
  cfg, params = tiny_model(seed=3)
  path = _write_gguf(tmp_path / "tiny.gguf", cfg, params_to_hf(cfg, params))
  data = bytearray(open(path, "rb").read())
  data[-4096:] = b"\xff" * 4096  # float32 0xffffffff is NaN
  open(path, "wb").write(bytes(data))
  with pytest.raises(CheckpointError, match="non-finite"):
    load_gguf(path)


@pytest.mark.parametrize("dtype", ["int8", jnp.int32, bool])
def test_non_float_load_dtype_is_refused(hf_tensors, dtype):
  with pytest.raises(ValueError, match="floating-point dtype"):
    load_model(str(hf_tensors[0]), dtype=dtype)


@pytest.mark.parametrize("source,error,match", [
    (None, TypeError, "str or os.PathLike"), (3, TypeError, "str or os.PathLike"),
    (b"smollm2", TypeError, "str or os.PathLike")])
def test_model_source_of_the_wrong_type_is_named(source, error, match):
  with pytest.raises(error, match=match):
    load_model(source)


def test_model_source_may_be_a_pathlib_path(hf_tensors):
  cfg, _ = load_model(pathlib.Path(hf_tensors[0]), packed=False)
  assert cfg == hf_tensors[1]


# --- sampler parameters ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(temperature=INF), ValueError, "finite number"),
    (dict(temperature=NAN), ValueError, "finite number"),
    (dict(temperature=1e-40), ValueError, "finite number"),
    (dict(temperature=-1.0), ValueError, "finite number"),
    (dict(temperature=0), ValueError, "Greedy"),
    (dict(temperature=True), TypeError, "temperature must be a number"),
    (dict(temperature="1"), TypeError, "temperature must be a number"),
    (dict(top_k=True), TypeError, "top_k must be an integer"),
    (dict(top_k=2.0), TypeError, "top_k must be an integer"),
    (dict(top_k=0), ValueError, "top_k must be >= 1"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), ValueError, "top_p must be a finite number"),
    (dict(top_p=NAN), ValueError, "top_p must be a finite number"),
])
def test_bad_sampling_parameter_is_named(kwargs, error, match):
  with pytest.raises(error, match=match):
    Sampling(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(temperature=INF), dict(temperature=1e-40),
                                    dict(temperature=0.0, top_k=True)])
def test_make_sampler_refuses_what_sampling_refuses(kwargs):
  with pytest.raises((TypeError, ValueError)):
    make_sampler(**kwargs)


def test_numpy_scalars_are_accepted_and_normalised():
  s = Sampling(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9))
  assert (type(s.temperature), type(s.top_k), type(s.top_p)) == (float, int, float)
  assert s == Sampling(temperature=0.5, top_k=3, top_p=0.9)
  hash(s)


# --- pathological logits: the total rule --------------------------------------------------------

V = 6
ROWS = {
    "all_nan": [NAN] * V,
    "all_neg_inf": [-INF] * V,
    "nan_and_neg_inf": [NAN, -INF, NAN, -INF, NAN, -INF],
    "one_pos_inf": [0.0, 1.0, INF, 2.0, -INF, NAN],
    "two_pos_inf": [INF, 1.0, INF, NAN, -INF, 3.0],
    "nan_among_finite": [1.0, NAN, 3.0, 0.5, NAN, 2.0],
    "neg_inf_among_finite": [1.0, -INF, 3.0, -INF, 0.0, 2.0],
    "huge_finite": [3e38, -3e38, 1e38, 0.0, 3e38, -1.0],
}
SAMPLERS = [Greedy(), Sampling(1.0), Sampling(1e-4), Sampling(1e4), Sampling(0.7, top_k=2),
            Sampling(1.0, top_p=0.5), Sampling(2.0, top_k=3, top_p=0.9)]


def _expected_support(row):
  """Ids that may get mass under the documented rule (before top-k / top-p)."""
  row = np.asarray(row, np.float64)
  if np.any(row == INF):
    return set(np.flatnonzero(row == INF))
  finite = np.isfinite(row)
  return set(np.flatnonzero(finite)) if finite.any() else set(range(V))


@pytest.mark.parametrize("sampler", SAMPLERS, ids=repr)
@pytest.mark.parametrize("name", ROWS)
def test_every_sampler_gives_a_finite_distribution_on_pathological_logits(sampler, name):
  logits = jnp.asarray([ROWS[name]], jnp.float32)
  tok, p = sampler.sample(jax.random.PRNGKey(0), logits)
  p = np.asarray(p)[0]
  assert np.all(np.isfinite(p)) and np.all(p >= 0)
  np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(p, np.asarray(sampler.probs(logits))[0])
  assert set(np.flatnonzero(p)) <= _expected_support(ROWS[name])  # NaN never gets mass
  assert p[int(tok[0])] > 0


@pytest.mark.parametrize("name", ["all_nan", "all_neg_inf", "nan_and_neg_inf"])
def test_rows_without_a_usable_logit_are_uniform(name):
  p = np.asarray(Sampling(1.0).probs(jnp.asarray([ROWS[name]], jnp.float32)))[0]
  np.testing.assert_allclose(p, 1.0 / V, rtol=1e-6)


@pytest.mark.parametrize("name", ["one_pos_inf", "two_pos_inf"])
def test_pos_inf_logits_share_the_mass_equally(name):
  row = np.asarray(ROWS[name])
  p = np.asarray(Sampling(1.0).probs(jnp.asarray([row], jnp.float32)))[0]
  np.testing.assert_allclose(p, np.where(row == INF, 1.0 / np.sum(row == INF), 0.0))


def test_greedy_never_picks_a_nan():
  tok, _ = Greedy().sample(None, jnp.asarray([[NAN, 1.0, NAN, 5.0, NAN, 2.0]], jnp.float32))
  assert int(tok[0]) == 3


BAD_PROBS = {
    "nan_row": lambda p: p.at[0, 0].set(NAN),
    "inf_entry": lambda p: p.at[0, 1, 2].set(INF),
    "negative_entries": lambda p: p.at[0].set(-p[0]),
    "all_zero": lambda p: jnp.zeros_like(p),
}


@pytest.mark.parametrize("target", BAD_PROBS)
@pytest.mark.parametrize("draft", BAD_PROBS)
def test_acceptance_rule_is_total_on_bad_probabilities(target, draft):
  gamma, b = 3, 4
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  p = jax.nn.softmax(jax.random.normal(k1, (b, gamma + 1, V)), axis=-1)
  q = jax.nn.softmax(jax.random.normal(k2, (b, gamma, V)), axis=-1)
  drafts_ = jax.random.randint(k3, (b, gamma), 0, V)
  acc = accept(jax.random.PRNGKey(1), drafts_, BAD_PROBS[draft](q), BAD_PROBS[target](p))
  n, nxt, beta = map(np.asarray, (acc.num_accepted, acc.next_token, acc.beta))
  assert np.all((0 <= n) & (n <= gamma)) and np.all((0 <= nxt) & (nxt < V))
  assert np.all(np.isfinite(beta)) and np.all((beta >= 0) & (beta <= 1 + 1e-6))


def test_acceptance_of_sampler_outputs_on_pathological_logits_is_finite():
  rows = jnp.asarray(list(ROWS.values()), jnp.float32)  # [8, V]: as 2 rows of γ+1 = 4
  sampler = Sampling(1.0, top_k=3)
  _, p = sampler.sample(jax.random.PRNGKey(0), rows.reshape(2, 4, V))
  d, q = sampler.sample(jax.random.PRNGKey(1), rows[::-1].reshape(2, 4, V)[:, :3])
  acc = accept(jax.random.PRNGKey(2), d, q, p)
  assert np.all(np.isfinite(np.asarray(acc.beta)))
  assert np.all(np.asarray(acc.next_token) < V)


# --- decoders: parameters, lengths and memory, before compilation --------------------------------


@pytest.fixture(scope="module")
def model():
  return tiny_model(seed=0, max_position_embeddings=64)


@pytest.fixture
def no_compile(monkeypatch):
  """Makes compiling (or running) either decoding loop a test failure."""
  gen = sys.modules["specjax.generate"]  # the package re-exports a function of that name

  def fail(*args, **kwargs):
    raise AssertionError("reached the jitted program")
  monkeypatch.setattr(gen, "_prefill", fail)
  monkeypatch.setattr(gen, "_decode", fail)
  monkeypatch.setattr(SpeculativeDecoder, "init", fail)


def _decoder(cfg, **kw):
  return SpeculativeDecoder(cfg, ModelDrafter(cfg), **kw)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(gamma=0), ValueError, "gamma must be >= 1"),
    (dict(gamma=2.0), TypeError, "gamma must be an integer"),
    (dict(gamma=True), TypeError, "gamma must be an integer"),
    (dict(gamma="4"), TypeError, "gamma must be an integer"),
    (dict(eos_ids=[1, 2.5]), TypeError, r"eos_ids\[1\] must be an integer"),
    (dict(eos_ids=[-1]), ValueError, r"eos_ids\[0\] must be >= 0"),
    (dict(eos_ids="2"), TypeError, "eos_ids must be a sequence"),
    (dict(sampler="greedy"), TypeError, "sampler must be Greedy"),
    (dict(sampler=0.0), TypeError, "sampler must be Greedy"),
    (dict(sampler=Sampling(temperature=1.0), draft_sampler=0.5), TypeError,
     "sampler must be Greedy"),
    (dict(draft_sampler=Sampling(temperature=0.5)), ValueError, "under a greedy sampler"),
])
def test_bad_decoder_parameter_is_named_at_construction(model, kwargs, error, match):
  with pytest.raises(error, match=match):
    _decoder(model[0], **kwargs)


def test_numpy_gamma_and_list_eos_ids_are_normalised(model):
  dec = _decoder(model[0], gamma=np.int64(3), eos_ids=[np.int32(2), 5])
  assert dec.gamma == 3 and type(dec.gamma) is int
  assert dec.eos_ids == (2, 5)
  assert dec == _decoder(model[0], gamma=3, eos_ids=(2, 5)) and hash(dec) == hash(
      _decoder(model[0], gamma=3, eos_ids=(2, 5)))
  assert _decoder(model[0], eos_ids=7).eos_ids == (7,)


def _spec_prepare(cfg, params, prompts, max_new_tokens, draft_params=None, **kw):
  dec = _decoder(cfg)
  dp = dec.drafter.make_params(params) if draft_params is None else draft_params
  return dec.prepare(params, dp, prompts, max_new_tokens, **kw)


def _gen(cfg, params, prompts, max_new_tokens, **kw):
  return generate(params, cfg, prompts, max_new_tokens, **kw)


@pytest.mark.parametrize("run", [_gen, _spec_prepare], ids=["generate", "speculative"])
@pytest.mark.parametrize("max_new_tokens,error,match", [
    (4.0, TypeError, "max_new_tokens must be an integer"),
    (np.float32(4), TypeError, "max_new_tokens must be an integer"),
    (True, TypeError, "max_new_tokens must be an integer"),
    (-1, ValueError, "max_new_tokens must be >= 0"),
    (60, ValueError, "maximum of 64 positions"),
])
def test_bad_budget_fails_before_compilation(model, no_compile, run, max_new_tokens, error, match):
  with pytest.raises(error, match=match):
    run(*model, [[1, 2, 3, 4, 5]], max_new_tokens)


@pytest.mark.parametrize("run", [_gen, _spec_prepare], ids=["generate", "speculative"])
def test_wrong_config_params_fail_before_compilation(model, no_compile, run):
  _, other = tiny_model(seed=0, dim=16, num_heads=2, num_kv_heads=1)
  with pytest.raises(ValueError, match=r"params.*shape"):
    run(model[0], other, [[1, 2]], 4)


def test_draft_params_of_another_config_fail_before_compilation(model, no_compile):
  cfg, params = model
  dcfg, dparams = tiny_model(seed=1, num_layers=1)
  with pytest.raises(ValueError, match=r"draft_params\['model'\].*lack"):
    _spec_prepare(cfg, params, [[1, 2]], 4, draft_params={"model": dparams})
  with pytest.raises(ValueError, match="make_params"):
    _spec_prepare(cfg, params, [[1, 2]], 4, draft_params=dparams)
  del dcfg


def test_numpy_budget_is_accepted(model):
  out = generate(model[1], model[0], [[1, 2, 3]], np.int64(3), eos_ids=[])
  assert out.num_generated.tolist() == [3]


def test_cache_larger_than_free_memory_is_refused_before_allocation():
  with pytest.raises(ValueError, match=r"needs .* GiB but the device has"):
    pack_prompts([[1, 2, 3]] * 8, 100, cache_bytes_per_slot=2**40)


# --- drafts ------------------------------------------------------------------------------------


class _FakeTokenizer:
  """What tokenizer_fingerprint reads: a length and id -> token strings."""

  def __init__(self, n, salt=""):
    self.n, self.salt = n, salt

  def __len__(self):
    return self.n

  def convert_ids_to_tokens(self, ids):
    return [f"{self.salt}{i}" for i in ids]


@pytest.fixture
def draft_dir(tmp_path, model):
  cfg, _ = model
  dcfg, dparams = tiny_model(seed=1, num_layers=1)
  path = str(tmp_path / "draft")
  drafts.save_draft(path, dcfg, dparams, None, target_vocab_size=cfg.vocab_size,
                    tokenizer_sha256=drafts.tokenizer_fingerprint(_FakeTokenizer(cfg.vocab_size)),
                    dtype=np.float32)
  return path


def test_draft_path_with_the_right_tokenizer_loads(model, draft_dir):
  drafter, dp, _ = drafts.drafter_from_path(draft_dir, *model, _FakeTokenizer(64))
  drafter.check_params(dp)


def test_draft_path_of_another_tokenizer_is_refused(model, draft_dir):
  with pytest.raises(ValueError, match="another tokenizer"):
    drafts.drafter_from_path(draft_dir, *model, _FakeTokenizer(64, salt="x"))


def test_model_draft_path_whose_tokenizer_cannot_be_read_is_refused(model, tmp_path):
  dcfg, dparams = tiny_model(seed=1, num_layers=1)
  save_hf(str(tmp_path), dcfg, dparams)
  with pytest.raises(CheckpointError, match="cannot check that draft"):
    drafts.drafter_from_path(str(tmp_path), *model, _FakeTokenizer(64))


def test_draft_with_nan_weights_is_refused(model, draft_dir):
  from safetensors.numpy import load_file
  weights = os.path.join(draft_dir, "weights.safetensors")
  tensors = load_file(weights)
  tensors["model.layers.0.mlp.down_proj.weight"][0, 0] = NAN
  save_file(tensors, weights)
  with pytest.raises(CheckpointError, match=r"down_proj.*non-finite"):
    drafts.drafter_from_path(draft_dir, *model, _FakeTokenizer(64))


def test_eagle_draft_with_nan_weights_is_refused(model, tmp_path):
  from specjax.drafters.eagle import random_eagle_weights
  cfg, params = model
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(1))
  weights["layers"][0]["wo"] = weights["layers"][0]["wo"].at[0, 0].set(NAN)
  drafts.save_eagle(str(tmp_path), cfg, weights, None, tokenizer_sha256="-")
  with pytest.raises(CheckpointError, match="non-finite"):
    drafts.load_eagle(str(tmp_path), cfg, params)


@pytest.mark.parametrize("bad, match", [
    ([3, 5, 3, 9], r"names target ids \[3\] more than once"),
    ([3, 5, 64, 9], r"outside the target's vocabulary \[0, 64\)"),
])
def test_a_vocab_map_of_repeated_or_foreign_ids_is_refused_on_save_and_load(model, tmp_path,
                                                                              bad, match):
  """Each draft row is one target token: a map naming a token twice would count its draft
  probability twice in every acceptance rule. Refused when written and, for a directory
  edited afterwards, when read (EAGLE, token, Medusa and trained-exit drafts)."""
  from safetensors.numpy import load_file
  from specjax.drafters.eagle import random_eagle_weights
  from specjax.drafters.medusa import random_medusa_weights
  cfg, params = model
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(1))
  heads = random_medusa_weights(cfg, 2, 1, jax.random.PRNGKey(2), own_head=False)
  exit_w = random_medusa_weights(cfg, 1, 1, jax.random.PRNGKey(3), own_head=False)
  save = {
      "e": lambda path, vm: drafts.save_eagle(path, cfg, weights, vm, tokenizer_sha256="-"),
      "m": lambda path, vm: drafts.save_medusa(path, cfg, heads, vm, tokenizer_sha256="-"),
      "x": lambda path, vm: drafts.save_exit(path, cfg, exit_w, vm, exit_layer=1,
                                             tokenizer_sha256="-")}
  for d, write in save.items():
    with pytest.raises(CheckpointError, match=match):
      write(str(tmp_path / f"{d}0"), np.array(bad))
  dcfg, dparams = tiny_model(seed=1, num_layers=1)
  dcfg = dataclasses.replace(dcfg, vocab_size=4)
  dparams = dict(dparams, embed=dparams["embed"][:4])
  if "lm_head" in dparams:
    dparams["lm_head"] = dparams["lm_head"][:4]
  with pytest.raises(CheckpointError, match=match):
    drafts.save_draft(str(tmp_path / "t0"), dcfg, dparams, np.array(bad),
                      target_vocab_size=cfg.vocab_size, tokenizer_sha256="-")
  good = np.array([3, 5, 7, 9])
  for d, write in save.items():
    write(str(tmp_path / d), np.arange(3, 64, 4))  # Medusa's top-10 needs 10 rows
  drafts.save_draft(str(tmp_path / "t"), dcfg, dparams, good, target_vocab_size=cfg.vocab_size,
                    tokenizer_sha256="-")
  drafts.load_medusa(str(tmp_path / "m"), cfg, params)  # the good map loads
  for d in ("e", "m", "x", "t"):
    file = str(tmp_path / d / "weights.safetensors")
    tensors = load_file(file)
    tensors["vocab_map"] = np.array(bad, np.int32)
    save_file(tensors, file)
  with pytest.raises(CheckpointError, match=match):
    drafts.load_eagle(str(tmp_path / "e"), cfg, params)
  with pytest.raises(CheckpointError, match=match):
    drafts.load_draft(str(tmp_path / "t"), target_vocab_size=cfg.vocab_size)
  with pytest.raises(CheckpointError, match=match):
    drafts.load_medusa(str(tmp_path / "m"), cfg, params)
  with pytest.raises(CheckpointError, match=match):
    drafts.load_exit(str(tmp_path / "x"), cfg, params)


# --- export into a used directory --------------------------------------------------------------


def test_export_refuses_a_non_empty_directory_without_overwrite(tmp_path):
  from absl import app
  from experiments.export_draft import check_out_dir
  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(app.UsageError, match="--overwrite"):
    check_out_dir(str(tmp_path), overwrite=False)
  check_out_dir(str(tmp_path), overwrite=True)
  check_out_dir(str(tmp_path / "new"), overwrite=False)
  with pytest.raises(app.UsageError, match="not a directory"):
    check_out_dir(str(tmp_path / "config.json"), overwrite=True)


def test_saving_over_a_sharded_checkpoint_removes_its_stale_shards(tmp_path):
  old_cfg, old = tiny_model(seed=8)
  save_hf(str(tmp_path), old_cfg, old, max_shard_bytes=16_000)
  assert os.path.exists(tmp_path / "model.safetensors.index.json")
  (tmp_path / "README.md").write_text("not part of the checkpoint")
  cfg, params = tiny_model(seed=9, num_layers=1)
  save_hf(str(tmp_path), cfg, params)
  assert sorted(os.listdir(tmp_path)) == ["README.md", "config.json", "model.safetensors"]
  cfg2, params2 = load_hf(str(tmp_path))
  assert cfg2 == cfg
  np.testing.assert_array_equal(params2["embed"], params["embed"])
  assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 1


TRAIN_DRAFT_REFUSALS = [
    (["--stage=train", "--own_head", "--draft_kind=eagle"],
     "--own_head is for --draft_kind=medusa or exit"),
    (["--stage=all", "--corpus=mix"], "--corpus=mix trains on fixed text: give --text_tokens"),
    (["--stage=train", "--corpus=text"], "--corpus=text needs the fixed-text corpus"),
    (["--stage=data", "--text_tokens=1000", "--text_kinds=code,poems"],
     "--text_kinds must be some of code,docstring,docs,reference"),
    (["--stage=train", "--adaspec_keep=0.8"], "AdaSPEC needs both --adaspec_keep < 1 and"),
    (["--stage=train", "--adaspec_keep=0", "--adaspec_reference=x"],
     "--adaspec_keep must be in (0, 1], got 0.0"),
    (["--stage=train", "--init_from=nowhere"], "--init_from=nowhere holds no training run"),
    (["--stage=train", "--init_from=specjax/assets/smollm2_draft"],
     "a draft directory warm-starts an EAGLE drafter, Medusa heads or a trained exit"),
    (["--stage=train", "--mesh=2by4"], "--mesh='2by4': expected DATAxMODEL, e.g. 2x4"),
    (["--stage=train", "--mesh=2x4"], "needs 8 devices, but only 1 are present"),
]


def test_train_draft_refuses_bad_flags_before_touching_a_corpus(tmp_path, refused):
  """Refused before any corpus or model is touched (in a process of their own: the script's
  flags would collide with other entry points' in this one)."""
  workdir = f"--workdir={tmp_path / 'w'}"
  refused("experiments.train_draft",
          *[([*flags, workdir], message) for flags, message in TRAIN_DRAFT_REFUSALS],
          env=dict(os.environ, SPECJAX_CACHE=str(tmp_path / "cache")))
  assert not (tmp_path / "cache").exists() and not (tmp_path / "w").exists()
