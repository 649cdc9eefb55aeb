"""bfloat16 end to end: dtypes where they belong, greedy speculative decoding identical to
plain decoding in the same dtype (on SmolLM2: away from near-ties), agreement with float32
away from near-ties, one program per shape. (The exact-distribution tests in bfloat16 are in
test_speculative_distribution.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.config import ExperimentConfig
from specjax import kv_cache as kvc
from specjax import validation
from specjax.drafters import ModelDrafter
from specjax.generate import generate, prefill
from specjax.kernels.packed import dense
from specjax.model import cast_params, compute_dtype, forward
from specjax.sampling import Greedy
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.tree import TreeTopology
from specjax.testing import DRAFTER_KINDS, make_drafter, new_compiles_across_batches, tiny_model

from matrix import cases

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
PROMPTS = [[1, 2, 3, 4, 5, 1, 2], [7, 8, 9]]
CORPUS = [[1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9, 7, 8]]
# The near-tie rule: wherever float32's top-two logit gap is at least NEAR_TIE (natural-log
# units: the favourite is e ≈ 2.7 times likelier), bfloat16 picks the same argmax. Below it
# bfloat16's rounding (|Δ logit| up to ~1.2 on SmolLM2, benchmarks/results/bf16.md) may
# flip the choice, and greedy texts may part there.
NEAR_TIE = 2.0


@pytest.fixture(scope="module")
def target():
  cfg, params = tiny_model(seed=1)
  return cfg, params, cast_params(params, jnp.bfloat16)


def test_cast_params_casts_floating_arrays_only(target):
  cfg, params, _ = target
  drafter, dp = make_drafter("eagle", cfg, params, CORPUS)
  cast = cast_params(dp, jnp.bfloat16)
  assert cast["vocab_map"].dtype == jnp.int32  # ids stay ids
  assert {x.dtype for x in jax.tree.leaves(cast) if jnp.issubdtype(x.dtype, jnp.floating)} == {
      BF16}
  assert compute_dtype(cast_params(params, jnp.bfloat16)) == BF16
  assert compute_dtype(params) == F32


def test_cache_activations_and_features_take_the_weights_dtype_logits_stay_float32(target):
  cfg, _, p16 = target
  tokens = jnp.asarray([[1, 2, 3, 4]])
  out = forward(p16, cfg, tokens, jnp.arange(4)[None], kvc.init_cache(cfg, 1, 8, BF16),
                return_layers=(0,))
  assert out.logits.dtype == F32
  assert out.hidden.dtype == out.intermediates[0].dtype == out.cache.k[0].dtype == BF16
  cache, hidden = prefill(p16, cfg, tokens, jnp.asarray([3]), kvc.init_cache(cfg, 1, 4, BF16),
                          return_hidden=True)
  assert cache.v[0].dtype == hidden.dtype == BF16


def test_bfloat16_products_accumulate_in_float32():
  """The compiled product of bfloat16 operands is a float32 dot, rounded once at the end."""
  x = jnp.ones((2, 64), jnp.bfloat16)
  w = jnp.ones((64, 8), jnp.bfloat16)
  hlo = jax.jit(dense).lower(x, w).as_text()
  dot = next(line for line in hlo.splitlines() if "dot_general" in line)
  assert "xf32>" in dot.split("->")[-1], dot
  assert dense(x, w).dtype == BF16


def test_float32_products_ask_for_full_float32_precision():
  """float32 dots (projections and the LM head) carry precision HIGHEST, so a GPU cannot
  take them in TF32 nor a TPU in one bfloat16 pass; default precision would not say so."""
  from specjax.kernels.accumulate import einsum_f32
  x, w = jnp.ones((2, 64), jnp.float32), jnp.ones((64, 8), jnp.float32)
  for fn in (dense, lambda a, b: einsum_f32("...k,kn->...n", a, b)):
    dot = next(line for line in jax.jit(fn).lower(x, w).as_text().splitlines()
               if "dot_general" in line)
    assert "HIGHEST" in dot, dot
  default = jax.jit(lambda a, b: a @ b).lower(x, w).as_text()
  assert "HIGHEST" not in default  # the control: what plain ``@`` lowers to
  if jax.default_backend() == "cpu":  # where it changes nothing: the same bits as plain ``@``
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, (5, 64)), jax.random.normal(kw, (64, 96))
    want = np.asarray(jax.jit(lambda a, b: a @ b)(x, w))
    np.testing.assert_array_equal(np.asarray(jax.jit(dense)(x, w)), want)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda a, b: einsum_f32("mk,kn->mn", a, b))(x, w)), want)


KINDS = DRAFTER_KINDS + ("model",)


def _drafter(kind, cfg, p16):
  if kind == "model":
    dcfg, dparams = tiny_model(seed=3, num_layers=1)
    drafter = ModelDrafter(dcfg)
    return drafter, drafter.make_params(cast_params(dparams, jnp.bfloat16))
  return make_drafter(kind, cfg, p16, CORPUS)


@pytest.mark.parametrize("kind", cases(KINDS, keep=("model", "early_exit", "eagle", "medusa")))
def test_greedy_speculative_decoding_in_bfloat16_equals_plain_bfloat16(target, kind):
  cfg, _, p16 = target
  ref = generate(p16, cfg, PROMPTS, 20, Greedy(), eos_ids=()).tokens
  drafter, dp = _drafter(kind, cfg, p16)
  trees = [TreeTopology.chain(1), TreeTopology.chain(3), TreeTopology.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0)])]
  for tree in (t for t in trees if drafter.supports(t)):
    dec = SpeculativeDecoder(cfg, drafter, tree=tree, sampler=Greedy(), eos_ids=())
    out = dec.generate(p16, dp, PROMPTS, 20)
    np.testing.assert_array_equal(out.tokens[:, :ref.shape[1]], ref, err_msg=f"{kind} {tree}")


def test_a_float32_draft_beside_a_bfloat16_target_stays_lossless(target):
  cfg, _, p16 = target
  dcfg, dparams = tiny_model(seed=3, num_layers=1)
  drafter = ModelDrafter(dcfg)
  dec = SpeculativeDecoder(cfg, drafter, gamma=3, sampler=Greedy(), eos_ids=())
  out = dec.generate(p16, drafter.make_params(dparams), PROMPTS, 20)
  ref = generate(p16, cfg, PROMPTS, 20, Greedy(), eos_ids=()).tokens
  np.testing.assert_array_equal(out.tokens[:, :ref.shape[1]], ref)


def _teacher_forced(cfg, params, tokens):
  ids = jnp.asarray([tokens])
  n = ids.shape[1]
  out = forward(params, cfg, ids, jnp.arange(n)[None],
                kvc.init_cache(cfg, 1, n, compute_dtype(params)))
  return np.asarray(out.logits[0])


def assert_agrees_away_from_near_ties(cfg, p32, p16, sequences):
  """Wherever float32's top-two gap is >= NEAR_TIE, bfloat16's argmax is float32's; returns
  how many positions were checked."""
  checked = 0
  for seq in sequences:
    l32, l16 = _teacher_forced(cfg, p32, seq), _teacher_forced(cfg, p16, seq)
    top2 = np.sort(l32, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= NEAR_TIE
    np.testing.assert_array_equal(l16.argmax(-1)[clear], l32.argmax(-1)[clear])
    checked += int(clear.sum())
  return checked


def test_bfloat16_agrees_with_float32_away_from_near_ties():
  cfg, p32 = tiny_model(seed=0, scale=1.0, num_layers=4, dim=64, ffn_dim=128)
  p16 = cast_params(p32, jnp.bfloat16)
  rng = np.random.default_rng(0)
  seqs = [list(rng.integers(0, cfg.vocab_size, 24)) for _ in range(8)]
  assert assert_agrees_away_from_near_ties(cfg, p32, p16, seqs) > 50


def test_the_near_tie_rule_has_power():
  """A bfloat16 model whose weights were perturbed by more than rounding breaks the rule."""
  cfg, p32 = tiny_model(seed=0, scale=1.0, num_layers=4, dim=64, ffn_dim=128)
  noisy = jax.tree.map(lambda w: w * (1 + 0.3 * jax.random.normal(jax.random.PRNGKey(5),
                                                                   w.shape)), p32)
  rng = np.random.default_rng(0)
  seqs = [list(rng.integers(0, cfg.vocab_size, 24)) for _ in range(8)]
  with pytest.raises(AssertionError):
    assert_agrees_away_from_near_ties(cfg, p32, cast_params(noisy, jnp.bfloat16), seqs)


def top2_gap(cfg, params, seq, i):
  """The target's top-two logit gap at position ``i`` of ``seq`` (teacher-forced)."""
  top2 = np.sort(_teacher_forced(cfg, params, seq)[i])[-2:]
  return float(top2[1] - top2[0])


@pytest.mark.heavy
def test_smollm2_in_bfloat16_agrees_with_float32_and_itself_away_from_near_ties():
  """bfloat16 against float32 (the rule above), and bfloat16 speculative decoding against
  bfloat16 plain decoding: a verify forward over γ + 1 tokens rounds differently from a
  decode forward over one, so their greedy texts may part, but only at a near-tie."""
  from experiments.models import load_draft, load_target
  from experiments.prompts import default_prompts
  t32, t16 = load_target("smollm2", "float32"), load_target("smollm2", "bfloat16")
  prompts = [t32.encode(item.text) for item in default_prompts(4)]
  seqs = [p + generate(t32.params, t32.cfg, [p], 32, Greedy(), eos_ids=()).generated(0)
          for p in prompts]
  assert assert_agrees_away_from_near_ties(t32.cfg, t32.params, t16.params, seqs) > 64
  draft = load_draft("eagle", t16, lambda: [])
  dec = SpeculativeDecoder(t16.cfg, draft.drafter, gamma=3, sampler=Greedy(), eos_ids=())
  for p in prompts:
    plain = generate(t16.params, t16.cfg, [p], 32, Greedy(), eos_ids=()).generated(0)
    spec = dec.generate(t16.params, draft.params, [p], 32).generated(0)
    differs = [i for i, (a, b) in enumerate(zip(plain, spec)) if a != b]
    if differs:
      assert top2_gap(t16.cfg, t16.params, p + plain, len(p) - 1 + differs[0]) < NEAR_TIE


def test_no_recompilation_in_bfloat16(target):
  cfg, _, p16 = target
  drafter, dp = _drafter("eagle", cfg, p16)
  dec = SpeculativeDecoder(cfg, drafter, gamma=2, sampler=Greedy())
  assert new_compiles_across_batches(dec, p16, dp) == 0


@pytest.mark.parametrize("value", ["float16", "fp8", "int8", 3])
def test_unknown_compute_dtypes_are_refused_before_anything_loads(value):
  with pytest.raises(ValueError, match="must be one of auto, float32, bfloat16"):
    validation.compute_dtype(value)
  if isinstance(value, str):
    with pytest.raises(ValueError, match="--dtype"):
      ExperimentConfig(target="tiny", draft="tiny", dtype=value)


def test_auto_is_float32_on_cpu_and_bfloat16_on_accelerators(monkeypatch):
  assert validation.compute_dtype("auto") == (BF16 if jax.default_backend() in ("gpu", "tpu")
                                              else F32)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert validation.compute_dtype("auto") == BF16
  assert validation.compute_dtype("float32") == F32


def test_a_bfloat16_hf_checkpoint_loads_in_either_dtype(tmp_path):
  """A checkpoint transformers writes in bfloat16: read as float32 it is HF's model upcast
  (the same numbers), read as bfloat16 every parameter stays bfloat16 and the logits agree
  with HF's bfloat16 model away from near-ties."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  from specjax.loaders import load_hf
  torch.manual_seed(0)
  hf = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, attn_implementation="eager"))
  with torch.no_grad():  # float32 weights that bfloat16 holds exactly; peaked logits
    for name, p in hf.named_parameters():
      std = 1.0 if "lm_head" in name else 0.3
      p.copy_((torch.randn(p.shape) * std + (1.0 if p.ndim == 1 else 0.0)).bfloat16().float())
  tokens = np.random.default_rng(0).integers(0, 96, (2, 12))
  with torch.no_grad():
    ids = torch.as_tensor(tokens, dtype=torch.long)
    hf32 = hf.eval()(input_ids=ids).logits.numpy()
    hf = hf.to(torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    hf16 = hf(input_ids=ids).logits.float().numpy()

  def ours(dtype):
    cfg, params = load_hf(str(tmp_path), dtype)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
    b, t = tokens.shape
    return np.asarray(forward(params, cfg, jnp.asarray(tokens), jnp.broadcast_to(
        jnp.arange(t), (b, t)), kvc.init_cache(cfg, b, t, compute_dtype(params))).logits)

  np.testing.assert_allclose(ours(jnp.float32), hf32, atol=1e-4, rtol=0)
  o16 = ours(jnp.bfloat16)
  top2 = np.sort(hf16, axis=-1)[..., -2:]
  clear = top2[..., 1] - top2[..., 0] >= NEAR_TIE
  assert clear.sum() > 5
  np.testing.assert_array_equal(o16.argmax(-1)[clear], hf16.argmax(-1)[clear])
