"""Published EAGLE-1/2 and EAGLE-3 checkpoints load into EagleDrafter unchanged.

The checkpoints are tiny and written here in exactly SafeAILab's layouts
(eagle/model/cnets1.py and cnets.py at cb7e084: tensor names, [out, in]
shapes, float16, config.json fields). Their forward is re-implemented below in
numpy straight from the reference code, independently of specjax (target
included), and every draft distribution specjax proposes across real decoding
steps must equal it.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from specjax import drafts
from specjax.drafters import EagleArch, eagle_arch
from specjax.drafters.eagle import EagleDrafter, eagle_config, eagle_drafter, random_eagle_weights
from specjax.param_layout import split_gate_up, split_qkv
from specjax.drafts import eagle_published
from specjax.generate import generate
from specjax.loaders import CheckpointError, save_hf
from specjax.model import cast_params
from specjax.sampling import Greedy, Sampling, dense_probs
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.testing import tiny_model

from matrix import cases

L = 8  # target layers: EAGLE-3 reads the inputs of layers 2, 4 and 5
V, D, N, K, F, H = 64, 32, 4, 2, 64, 8
VD = 40  # EAGLE-3's draft vocabulary
PROMPTS = [[5, 9, 2, 7, 11, 3, 9], [4, 8], [7, 8, 9, 10, 7, 8, 9, 10, 7], [3]]


@pytest.fixture(scope="module")
def target():
  return tiny_model(seed=0, num_layers=L)


# --------------------------------------------------------- checkpoints in the published layouts


def _linear(rng, out, inp):
  return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float16)


def _norm(rng, d=D):
  return (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float16)


def _layer(rng, pre, width):
  """A LlamaDecoderLayer's attention (q/k/v reading ``width`` inputs), MLP and post norm."""
  return {f"{pre}.self_attn.q_proj.weight": _linear(rng, N * H, width),
          f"{pre}.self_attn.k_proj.weight": _linear(rng, K * H, width),
          f"{pre}.self_attn.v_proj.weight": _linear(rng, K * H, width),
          f"{pre}.self_attn.o_proj.weight": _linear(rng, D, N * H),
          f"{pre}.mlp.gate_proj.weight": _linear(rng, F, D),
          f"{pre}.mlp.up_proj.weight": _linear(rng, F, D),
          f"{pre}.mlp.down_proj.weight": _linear(rng, D, F),
          f"{pre}.post_attention_layernorm.weight": _norm(rng)}


def _config(**fields):
  """config.json as the published drafters ship it: the target's Llama config, one layer."""
  c = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
       "hidden_size": D, "intermediate_size": F, "num_attention_heads": N,
       "num_key_value_heads": K, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
       "vocab_size": V, "max_position_embeddings": 2048, "initializer_range": 0.02,
       "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
       "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True}
  return dict(c, **fields)


def eagle1_checkpoint(num_layers=1, bias=True, embed=True, seed=1, **fields):
  """(config, tensors) of an EAGLE-1/2 drafter (cnets1.Model): no input norm on layer 0,
  no final norm, no head; ``embed_tokens`` random here (published files copy the target's),
  so the tests see which table is read."""
  rng = np.random.default_rng(seed)
  config = _config(num_hidden_layers=num_layers, **fields)
  if bias is not None:
    config["bias"] = bias
  t = {"fc.weight": _linear(rng, D, 2 * D)}
  if bias in (None, True):  # the reference's default is a bias
    t["fc.bias"] = (0.1 * rng.standard_normal(D)).astype(np.float16)
  if embed:
    t["embed_tokens.weight"] = rng.standard_normal((V, D)).astype(np.float16)
  for i in range(num_layers):
    t.update(_layer(rng, f"layers.{i}", D))
    if i:
      t[f"layers.{i}.input_layernorm.weight"] = _norm(rng)
  return config, t


def eagle3_checkpoint(draft_vocab=VD, seed=2, **fields):
  """(config, tensors) of an EAGLE-3 drafter (cnets.Model), with d2t/t2d over a random
  subset of the target vocabulary; no rope_theta (base 10000), a head_dim it ignores."""
  rng = np.random.default_rng(seed)
  config = _config(draft_vocab_size=draft_vocab, head_dim=64, **fields)
  t = dict(_layer(rng, "midlayer", 2 * D), **{
      "fc.weight": _linear(rng, D, 3 * D), "midlayer.hidden_norm.weight": _norm(rng),
      "midlayer.input_layernorm.weight": _norm(rng), "norm.weight": _norm(rng),
      "lm_head.weight": _linear(rng, draft_vocab, D)})
  if draft_vocab != V:
    ids = np.sort(rng.choice(V, draft_vocab, replace=False))
    t["d2t"] = (ids - np.arange(draft_vocab)).astype(np.int64)
    t["t2d"] = np.isin(np.arange(V), ids)
  return config, t


def write(path, config, tensors, fmt="safetensors"):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  if fmt == "safetensors":
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  else:
    import torch
    torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
               os.path.join(path, "pytorch_model.bin"))
  return str(path)


# --------------------------------------------------------- the reference forward, in numpy


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):
  """Llama RoPE (rotate_half) of x [T, heads, H] at positions 0 … T − 1."""
  h = x.shape[-1]
  ang = np.arange(len(x))[:, None] / theta ** (np.arange(0, h, 2) / h)[None, :]
  ang = np.concatenate([ang, ang], axis=-1)[:, None, :]
  rot = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], axis=-1)
  return x * np.cos(ang) + rot * np.sin(ang)


def _attention(x, wq, wk, wv, wo, n, k, theta):
  """Causal grouped-query attention over x [T, in] with torch [out, in] weights."""
  t, h = len(x), wq.shape[0] // n
  q = _rope((x @ wq.T).reshape(t, n, h), theta)
  kk = np.repeat(_rope((x @ wk.T).reshape(t, k, h), theta), n // k, axis=1)
  v = np.repeat((x @ wv.T).reshape(t, k, h), n // k, axis=1)
  s = np.einsum("qnh,knh->nqk", q, kk) / np.sqrt(h)
  s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("nqk,knh->qnh", p, v).reshape(t, n * h) @ wo.T


def _mlp(x, wg, wu, wd):
  g = x @ wg.T
  return (g / (1.0 + np.exp(-g)) * (x @ wu.T)) @ wd.T


def _torch_layer(t, pre):
  return [t[f"{pre}.self_attn.{x}_proj.weight"] for x in "qkvo"], [
      t[f"{pre}.mlp.{x}_proj.weight"] for x in ("gate", "up", "down")]


def target_hidden_states(cfg, params, tokens):
  """HF's hidden_states of the target: [0] the embeddings, [i] the output of layer i − 1
  (the input of layer i), and the last one after the final norm (HF's outputs[0])."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  x = p["embed"][np.asarray(tokens)]
  states = [x]
  for lp in p["layers"]:
    q, kk, v = split_qkv(lp["wqkv"], n, k, h)
    x = x + _attention(_rms(x, lp["attn_norm"], cfg.norm_eps), q.T, kk.T, v.T, lp["wo"].T, n, k,
                       cfg.rope_theta)
    gate, up = split_gate_up(lp["w_gate_up"])
    x = x + _mlp(_rms(x, lp["mlp_norm"], cfg.norm_eps), gate.T, up.T, lp["w_down"].T)
    states.append(x)
  return states[:-1] + [_rms(x, p["final_norm"], cfg.norm_eps)], x


def eagle1_forward(c, t, embed, hidden_states, input_ids):
  """cnets1.Model.forward: hidden = fc(cat(embed(ids), hidden_states)); layer 0 attends
  over it un-normalised; layers > 0 have an input norm; no final norm."""
  eps, theta = c["rms_norm_eps"], c.get("rope_theta", 10000.0)
  x = np.concatenate([embed[input_ids], np.stack(hidden_states)], axis=-1) @ t["fc.weight"].T
  if "fc.bias" in t:
    x = x + t["fc.bias"]
  for i in range(c["num_hidden_layers"]):
    y = x if i == 0 else _rms(x, t[f"layers.{i}.input_layernorm.weight"], eps)
    attn, mlp = _torch_layer(t, f"layers.{i}")
    x = x + _attention(y, *attn, N, K, theta)
    x = x + _mlp(_rms(x, t[f"layers.{i}.post_attention_layernorm.weight"], eps), *mlp)
  return x


def eagle3_forward(c, t, embed, hidden_states, input_ids):
  """cnets.Model.forward: fc on 3D-wide features (the drafter's own D-wide outputs skip
  it), then the midlayer: attention over cat(input_layernorm(embed), hidden_norm(g))."""
  eps, theta = c["rms_norm_eps"], c.get("rope_theta", 10000.0)
  g = np.stack([hs @ t["fc.weight"].T if len(hs) == 3 * D else hs for hs in hidden_states])
  e = _rms(embed[input_ids], t["midlayer.input_layernorm.weight"], eps)
  attn, mlp = _torch_layer(t, "midlayer")
  x = g + _attention(np.concatenate([e, _rms(g, t["midlayer.hidden_norm.weight"], eps)], -1),
                     *attn, N, K, theta)
  return x + _mlp(_rms(x, t["midlayer.post_attention_layernorm.weight"], eps), *mlp)


def reference_logits(kind, c, t, target, seq, drafts_=()):
  """[1 + len(drafts_), V] logits of the published drafter's first draft after ``seq`` (and
  of the next ones after ``drafts_``), over the target vocabulary (−inf outside Vd): pairs
  (f_t, x_{t+1}) of true features, then each draft paired with the previous output."""
  cfg, params = target
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  embed = t.get("embed_tokens.weight", np.asarray(params["embed"], np.float64))
  states, _ = target_hidden_states(cfg, params, seq)
  if kind == "eagle1":
    forward, feats = eagle1_forward, list(states[-1][:-1])  # post-norm last hidden
    head = lambda h: h @ np.asarray(params["lm_head"], np.float64)  # the target's, no norm
  else:
    forward = eagle3_forward
    feats = list(np.concatenate([states[2], states[L // 2], states[L - 3]], axis=-1)[:-1])
    vd = len(t["lm_head.weight"])
    ids = np.arange(vd) + (t["d2t"].astype(int) if vd != V else 0)  # ignored when Vd = V
    head = lambda h: _lift(_rms(h, t["norm.weight"], c["rms_norm_eps"]) @ t["lm_head.weight"].T,
                           ids)
  ids_in, out = list(seq[1:]), []
  for d in (None,) + tuple(drafts_):
    if d is not None:
      ids_in.append(d)
    h = forward(c, t, embed, feats, np.asarray(ids_in))[-1]
    out.append(head(h))
    feats.append(h)
  return np.stack(out)


def _lift(logits, ids):
  out = np.full(V, -np.inf)
  out[ids] = logits
  return out


def _softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


# --------------------------------------------------------- loading, the forward, decoding

VARIANTS = {  # name: (kind, checkpoint); between them every optional part is on and off
    "eagle1": ("eagle1", lambda: eagle1_checkpoint(num_layers=2, bias=False, rope_theta=1000.0)),
    "eagle1_default_bias": ("eagle1", lambda: eagle1_checkpoint(bias=None, embed=False)),
    "eagle3": ("eagle3", eagle3_checkpoint),
    "eagle3_full_vocab": ("eagle3", lambda: eagle3_checkpoint(draft_vocab=V)),
}


@pytest.fixture(scope="module")
def published(tmp_path_factory, target):
  """name -> (kind, config, tensors, drafter, draft params, path) of every variant."""
  out = {}
  for name, (kind, build) in VARIANTS.items():
    c, t = build()
    path = write(tmp_path_factory.mktemp(name), c, t)
    out[name] = (kind, c, t, *eagle_published.load_published_eagle(path, *target), path)
  return out


def test_published_checkpoints_load_with_their_wiring(published, target):
  cfg = target[0]
  _, _, t, drafter, dp, _ = published["eagle3"]
  assert drafter.arch == eagle_arch.EAGLE3 and drafter.feature_layers == (1, 3, 4)
  assert (drafter.cfg.head_dim, drafter.cfg.rope_theta) == (D // N, 10000.0)  # head_dim ignored
  np.testing.assert_array_equal(np.asarray(dp["vocab_map"]), np.flatnonzero(t["t2d"]))
  assert dp["layers"][0]["wqkv"].shape == (2 * D, (N + 2 * K) * H)
  assert "vocab_map" not in published["eagle3_full_vocab"][4]
  _, _, _, drafter, dp, _ = published["eagle1"]
  assert drafter.arch == eagle_arch.eagle1(cfg.norm_eps) and drafter.feature_layers == ()
  assert (drafter.cfg.num_layers, drafter.cfg.rope_theta) == (2, 1000.0)
  assert "attn_norm" not in dp["layers"][0] and "attn_norm" in dp["layers"][1]
  assert "fc_bias" not in dp and "fc_bias" in published["eagle1_default_bias"][4]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_first_drafts_equal_the_reference_forward(published, target, name):
  """After the prefill, the first two drafts' q equal softmax of the numpy reference's
  logits (the second one reads the first one's output as its feature)."""
  kind, c, t, drafter, dp, _ = published[name]
  dec = SpeculativeDecoder(target[0], drafter, gamma=2, sampler=Sampling(1.0), eos_ids=())
  state, _ = dec.prepare(target[1], dp, PROMPTS, 4)
  proposal, _ = dec.propose(dp, state, jax.random.PRNGKey(0))
  for row, seq in enumerate(PROMPTS):
    if len(seq) < 2:  # no pair yet: the reference cannot draft, specjax drafts from (0, x_0)
      continue
    want = _softmax(reference_logits(kind, c, t, target, seq, [int(proposal.tokens[row, 0])]))
    np.testing.assert_allclose(np.asarray(dense_probs(proposal.q)[row]), want, atol=2e-5)


@pytest.mark.parametrize("name", ["eagle1", "eagle3"])
def test_every_proposal_across_real_steps_equals_the_reference(published, target, name):
  """Through real steps (prefill, observe after partial acceptance, plain steps of an
  adaptive policy whose backlog the drafter then catches up on), every proposal's two
  drafts equal the reference run from scratch on the whole committed sequence."""
  kind, c, t, drafter, dp, _ = published[name]
  cfg, params = target
  sampler = Sampling(1.0)
  policy = AdaptiveGamma(gammas=(0, 2), step_costs=(1.0, 1.3))
  run = SpeculativeDecoder(cfg, drafter, policy=policy, sampler=sampler, eos_ids=())
  propose = jax.jit(SpeculativeDecoder(cfg, drafter, gamma=2, sampler=sampler,
                                       eos_ids=()).propose)
  checked, backlog = 0, 0
  for state, _ in run.stream(params, dp, PROMPTS, 16, seed=1):
    if bool(np.all(state.done)):
      break
    proposal, _ = propose(dp, state, jax.random.PRNGKey(0))
    for row in range(len(PROMPTS)):
      s = int(state.seq_lens[row])
      if bool(state.done[row]) or s < 2:
        continue
      seq = np.asarray(state.tokens[row, :s])
      want = _softmax(reference_logits(kind, c, t, target, seq, [int(proposal.tokens[row, 0])]))
      np.testing.assert_allclose(np.asarray(dense_probs(proposal.q)[row]), want, atol=2e-5)
      backlog = max(backlog, s - 1 - int(state.draft_state.cache.lengths[row]))
      checked += 1
  assert checked >= 8
  assert backlog > 3  # more pairs pending than one window (γ + 1): the backlog path ran


@pytest.mark.parametrize("name", cases(["eagle1", "eagle3"], keep=("eagle3",)))
def test_greedy_equals_plain_decoding(published, target, name):
  cfg, params = target
  drafter, dp = published[name][3:5]
  want = generate(params, cfg, PROMPTS, 12, eos_ids=())
  for kw in (dict(gamma=1), dict(gamma=3), dict(tree=TreeTopology((-1, -1, 0, 0, 2))),
             dict(tree=DynamicTree(depth=3, top_k=2, num_nodes=5)),
             dict(policy=AdaptiveGamma(gammas=(0, 1, 3), step_costs=(1.0, 1.2, 1.4)))):
    out = SpeculativeDecoder(cfg, drafter, sampler=Greedy(), eos_ids=(), **kw).generate(
        params, dp, PROMPTS, 12)
    for row in range(len(PROMPTS)):
      assert out.generated(row) == want.generated(row), kw


def test_weights_take_the_targets_compute_dtype(tmp_path, target):
  cfg, params = target
  bf16 = cast_params(params, jnp.bfloat16)
  drafter, dp = eagle_published.load_published_eagle(write(tmp_path, *eagle3_checkpoint()),
                                                     cfg, bf16)
  floats = {a.dtype for a in jax.tree.leaves(dp) if jnp.issubdtype(a.dtype, jnp.floating)}
  assert floats == {jnp.dtype(jnp.bfloat16)}
  assert dp["vocab_map"].dtype == jnp.int32
  out = SpeculativeDecoder(cfg, drafter, gamma=2, eos_ids=()).generate(bf16, dp, PROMPTS[:2], 4)
  assert list(out.num_generated) == [4, 4]


def test_drafter_from_path_serves_either_weights_file(tmp_path, target, published):
  cfg, params = target
  drafter, _, note = drafts.drafter_from_path(published["eagle3"][5], cfg, params, None)
  assert drafter == published["eagle3"][3] and note.startswith("published EAGLE-3 drafter")
  pytest.importorskip("torch")
  c, t = eagle1_checkpoint()
  from_bin = drafts.drafter_from_path(write(tmp_path / "bin", c, t, fmt="bin"), cfg, params,
                                      None)
  from_st = eagle_published.load_published_eagle(write(tmp_path / "st", c, t), cfg, params)
  assert from_bin[0] == from_st[0] and "EAGLE-1/2" in from_bin[2]
  for a, b in zip(jax.tree.leaves(from_bin[1]), jax.tree.leaves(from_st[1])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------- bad input


def _pop(name):
  return lambda c, t: t.pop(name)


def _bump_last_d2t(c, t):
  t["d2t"][-1] += V


def _repeat_d2t(c, t):  # draft ids 0 and 1 both name draft id 0's target token
  t["d2t"][1] = t["d2t"][0] - 1


def _flip_t2d(c, t):
  t["t2d"][np.argmin(t["t2d"])] = True


def _nan(c, t):
  t["fc.weight"][0, 0] = np.nan


BAD = {  # id: (checkpoint, change, target, error, message)
    # not a supported architecture
    "midlayer_and_layers": ("eagle1", lambda c, t: t.update(_layer(np.random.default_rng(0),
                                                                   "midlayer", 2 * D)),
                            {}, CheckpointError, "not a checkpoint of a supported architecture"),
    "gelu": ("eagle1", lambda c, t: c.update(hidden_act="gelu"), {}, CheckpointError,
             "hidden_act 'gelu' is not supported"),
    "rope_scaling": ("eagle1", lambda c, t: c.update(rope_scaling={"type": "linear",
                                                                   "factor": 2.0}),
                     {}, CheckpointError, "rope_scaling .* is not supported"),
    "two_midlayers": ("eagle3", lambda c, t: c.update(num_hidden_layers=2), {}, CheckpointError,
                      "one midlayer"),
    "no_draft_vocab": ("eagle3", lambda c, t: c.pop("draft_vocab_size"), {}, CheckpointError,
                       "lacks draft_vocab_size"),
    "draft_vocab_null": ("eagle3", lambda c, t: c.update(draft_vocab_size=None), {},
                         CheckpointError, "draft_vocab_size None is not a positive integer"),
    "no_hidden_size": ("eagle1", lambda c, t: c.pop("hidden_size"), {}, CheckpointError,
                       "lacks the field 'hidden_size'"),
    "heads": ("eagle1", lambda c, t: c.update(num_attention_heads=3, num_key_value_heads=3), {},
              CheckpointError, "hidden_size 32 is not a multiple of the 3 heads"),
    # built for another target
    "hidden_size": ("eagle1", None, dict(dim=48), ValueError,
                    "hidden_size is 32, this target's hidden size is 48"),
    "target_hidden_size": ("eagle3", lambda c, t: c.update(target_hidden_size=48), {},
                           ValueError, "target_hidden_size is 48"),
    "vocabulary": ("eagle3", None, dict(vocab_size=80), ValueError,
                   "vocabulary has 64 tokens, this target's 80"),
    "shallow_target": ("eagle3", None, dict(num_layers=6), ValueError,
                       r"layers 2, L//2 and L-3 of a target of L = 6 layers give \[2, 3, 3\]"),
    "layer_ids": ("eagle3", lambda c, t: c.update(
        eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}), {}, ValueError,
                  r"eagle_aux_hidden_state_layer_ids give \[2, 4, 8\]"),
    "d2t_range": ("eagle3", _bump_last_d2t, {}, ValueError,
                  "outside this target's vocabulary of 64"),
    # missing, extra, misshapen or mistyped tensors
    "missing": ("eagle1", _pop("layers.0.post_attention_layernorm.weight"), {}, CheckpointError,
                r"1 tensor\(s\) missing, e\.g\. \['layers.0.post_attention_layernorm.weight'\]"),
    "layer0_input_norm": ("eagle1", lambda c, t: t.update({
        "layers.0.input_layernorm.weight": np.ones(D, np.float16)}), {}, CheckpointError,
                          r"does not use, e\.g\. \['layers.0.input_layernorm.weight'\]"),
    "bias_false": ("eagle1", lambda c, t: c.update(bias=False), {}, CheckpointError,
                   r"does not use, e\.g\. \['fc.bias'\]"),
    "no_d2t": ("eagle3", _pop("d2t"), {}, CheckpointError, r"missing, e\.g\. \['d2t'\]"),
    "misshapen": ("eagle3", lambda c, t: t.update({"lm_head.weight": t["lm_head.weight"][:-1]}),
                  {}, CheckpointError, r"'lm_head.weight' has shape \(39, 32\)"),
    "d2t_dtype": ("eagle3", lambda c, t: t.update(d2t=t["d2t"].astype(np.float32)), {},
                  CheckpointError, "'d2t' has dtype float32, not an integer"),
    "t2d_disagrees": ("eagle3", _flip_t2d, {}, CheckpointError, "t2d and d2t disagree"),
    "d2t_repeats": ("eagle3", _repeat_d2t, {}, CheckpointError,
                    r"d2t: vocab_map names target ids \[\d+\] more than once"),
    "non_finite": ("eagle1", _nan, {}, CheckpointError, "'fc.weight' holds non-finite values"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoints_are_refused_before_the_weights_are_read(tmp_path, monkeypatch, case):
  base, change, target_kw, error, message = BAD[case]
  c, t = eagle1_checkpoint() if base == "eagle1" else eagle3_checkpoint()
  if change is not None:
    change(c, t)
  path = write(tmp_path, c, t)
  read, real_open = [], eagle_published._open

  def spy(p):  # records which tensors are read
    ckpt = real_open(p)
    return ckpt._replace(get=lambda name: read.append(name) or ckpt.get(name))

  monkeypatch.setattr(eagle_published, "_open", spy)
  with pytest.raises(error, match=message):
    eagle_published.load_published_eagle(path, *tiny_model(seed=0, **dict(dict(num_layers=L),
                                                                           **target_kw)))
  if case != "non_finite":
    assert set(read) <= {"d2t", "t2d"}, read  # the vocabulary maps are small


def test_a_whole_llama_model_is_not_taken_for_an_eagle_drafter(tmp_path, target):
  save_hf(str(tmp_path), *tiny_model(seed=1, num_layers=1))
  assert eagle_published.published_eagle_weights(str(tmp_path)) is None
  with pytest.raises(CheckpointError, match="not a checkpoint of a supported architecture"):
    eagle_published.load_published_eagle(str(tmp_path), *target)


def test_a_pickle_without_torch_asks_for_safetensors(tmp_path, monkeypatch, target):
  with open(tmp_path / "config.json", "w") as f:
    json.dump(eagle1_checkpoint()[0], f)
  (tmp_path / "pytorch_model.bin").write_bytes(b"PK not read")
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
  assert eagle_published.published_eagle_weights(str(tmp_path)).endswith("pytorch_model.bin")
  with pytest.raises(CheckpointError, match="torch is not installed: convert it to "
                                            "model.safetensors"):
    drafts.drafter_from_path(str(tmp_path), *target, None)


def test_params_of_another_wiring_are_refused(target):
  cfg, params = target
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(0))
  _, dp = eagle_drafter(cfg, params, weights)
  with pytest.raises(ValueError, match=r"missing \[\], unexpected \['fc', 'fc_bias', "
                                       r"'feature_norm'\]"):
    EagleDrafter(eagle_config(cfg), feature_layers=(1, 3, 4), arch=eagle_arch.EAGLE3
                 ).check_params(dict(dp, fuse=jnp.zeros((3 * D, D))))
  with pytest.raises(ValueError, match="input must be one of"):
    EagleArch(input="concat")
  with pytest.raises(ValueError, match="not both"):
    EagleDrafter(eagle_config(cfg), feature_layers=(1,), arch=eagle_arch.eagle1(1e-5))
  from specjax.distill.eagle import EagleObjective
  with pytest.raises(ValueError, match="training covers specjax's own wiring only"):
    EagleObjective(EagleDrafter(eagle_config(cfg), arch=eagle_arch.EAGLE3))
