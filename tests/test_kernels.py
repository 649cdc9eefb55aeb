"""The CPU streaming matmul against its jnp reference, and packed weights in the model."""

import json
import os
import platform
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import kv_cache as kvc
from specjax.drafters import ModelDrafter
from specjax.kernels import packed as pk
from specjax.kernels import policy as pol
from specjax.kernels import streaming_matmul as sm
from specjax.model import forward
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology
from specjax.testing import tiny_model

pytestmark = pytest.mark.skipif(not sm.available(), reason=str(sm.unavailable_reason()))


def _rand(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# Every build variant this CPU runs: "native" (its best path) and the forced AVX2
# path (so an AVX-512 machine tests that path too).
VARIANTS = [v for v in sm.VARIANTS if sm.available(v)]


def test_native_variant_reports_its_instruction_set():
  assert sm.isa() in ("avx512", "avx2", "portable")
  flags = sm.cpu_flags()
  if "avx512f" in flags:
    assert sm.isa() == "avx512"
  elif {"avx2", "fma"} <= flags:
    assert sm.isa() == "avx2" and sm.isa("avx2") == "avx2"
  # Panels of four vectors on AVX-512 and the portable path, one cache line (two ymm) on AVX2.
  widths = {"avx512": 64, "portable": 64, "avx2": 16}
  for variant in VARIANTS:
    assert sm.panel_width(variant) == widths[sm.isa(variant)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13, 24, 31, 64])
@pytest.mark.parametrize("k,n", [(3, 64), (64, 192), (100, 100), (576, 960)])
def test_kernel_matches_reference_and_numpy(m, k, n, variant):
  x, w = _rand((m, k), 0), _rand((k, n), 1)
  panels = jnp.asarray(sm.to_panels(w, variant))
  got = np.asarray(jax.jit(sm.streaming_matmul, static_argnums=2)(jnp.asarray(x), panels,
                                                                  variant))
  ref = np.asarray(sm.reference(jnp.asarray(x), panels))
  assert got.shape == (m, panels.shape[0] * sm.panel_width(variant))
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.sqrt(k))
  np.testing.assert_allclose(got[:, :n], x.astype(np.float64) @ w, rtol=1e-5,
                             atol=1e-5 * np.sqrt(k))
  assert np.all(got[:, n:] == 0)  # zero padding columns stay zero


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_row_is_bit_identical_whatever_else_is_in_the_call(variant):
  """What makes a verify step agree exactly with decode steps on the same rows (every
  register-block shape: 1-6 rows and the large-M blocks from 24 rows on)."""
  x, w = _rand((30, 576), 2), _rand((576, 256), 3)
  panels = jnp.asarray(sm.to_panels(w, variant))
  f = jax.jit(sm.streaming_matmul, static_argnums=2)
  full = np.asarray(f(jnp.asarray(x), panels, variant))
  for r in range(13):
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[r:r + 1]), panels, variant))[0],
                                  full[r])
  for lo, hi in ((5, 12), (0, 4), (3, 27)):
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[lo:hi]), panels, variant)),
                                  full[lo:hi])


# Every finite float16 value (both zeros, subnormals, normals up to ±65504), as uint16 bits.
_HALF_BITS = np.arange(1 << 16, dtype=np.uint16)
FINITE_HALVES = _HALF_BITS.view(np.float16)[np.isfinite(_HALF_BITS.view(np.float16))]


def _half_identity(call) -> None:
  """``call(x, panels)`` of x = [[1]] and float16 panels holding every finite half gives each
  value back exactly (1 · w + 0 = w: the widening is exact)."""
  w = FINITE_HALVES.reshape(1, -1)
  got = np.asarray(call(jnp.ones((1, 1), jnp.float32), w))[0, :w.shape[1]]
  np.testing.assert_array_equal(got, w[0].astype(np.float32))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 30])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_half_panels_give_the_float32_kernels_bits_on_the_same_values(m, prefetch, variant):
  """Float16 panels are widened as they load: the result is, bit for bit, the float32
  kernel's on panels holding the same values (every register block, every prefetch mode,
  a partial k-block)."""
  x, w = _rand((m, 200), m), _rand((200, 64 * 5 + 9), m + 1).astype(np.float16)
  f = jax.jit(sm.streaming_matmul, static_argnums=(2, 3))
  half = f(jnp.asarray(x), jnp.asarray(sm.to_panels(w, variant)), variant, prefetch)
  full = f(jnp.asarray(x), jnp.asarray(sm.to_panels(w.astype(np.float32), variant)), variant,
           prefetch)
  np.testing.assert_array_equal(np.asarray(half), np.asarray(full))
  _half_identity(lambda x, w: sm.streaming_matmul(x, jnp.asarray(sm.to_panels(w, variant)),
                                                  variant, prefetch))


@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds x86-64 baseline code")
def test_the_portable_path_widens_every_half_exactly(tmp_path):
  """The portable build (no AVX2: GCC vector code, its own half -> float conversion) on
  every finite float16 value, built here as x86-64 baseline code."""
  import ctypes
  flags = ("-march=x86-64", "-mtune=generic")
  path = str(tmp_path / "portable.so")
  sm.build.build_library(path, flags, sm._SOURCE)
  lib = ctypes.cdll.LoadLibrary(path)
  lib.SpecjaxStreamingMatmulIsa.restype = ctypes.c_char_p
  assert lib.SpecjaxStreamingMatmulIsa() == b"portable"
  jax.ffi.register_ffi_target("specjax_test_portable_f16",
                              jax.ffi.pycapsule(lib.SpecjaxStreamingMatmulF16), platform="cpu")

  def call(x, w, mode=0):
    panels = jnp.asarray(sm.to_panels(w, width=lib.SpecjaxStreamingMatmulPanel()))
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * panels.shape[2]), jnp.float32)
    return jax.ffi.ffi_call("specjax_test_portable_f16", out)(x, panels, prefetch=np.int32(mode))

  _half_identity(call)
  for rows in (5, 9):  # one pass; two, where the prefetch modes differ
    x, w = _rand((rows, 70), 0), _rand((70, 130), 1).astype(np.float16)
    want = x.astype(np.float64) @ w.astype(np.float64)
    got = [np.asarray(call(jnp.asarray(x), w, mode))[:, :130] for mode in sm.PREFETCH_MODES]
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-4)
    for g in got[1:]:
      np.testing.assert_array_equal(g, got[0])


def test_half_packed_weights_round_once_and_keep_float32_products():
  w = _rand((40, 130), 4)
  rounded = w.astype(np.float16).astype(np.float32)
  mixed = pol.MatmulPolicy(grid=(3, 4), kernel=(True, False))  # the kernel to 3 rows, XLA beyond
  pw = pk.pack(w, mixed, dtype=jnp.float16)
  assert pw.panels.dtype == jnp.float16 and pw.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(pw.unpack()), rounded)
  np.testing.assert_array_equal(np.asarray(pw.plain), rounded)  # XLA's rows: the same values
  for rows in (1, 3, 8):
    x = _rand((rows, 40), rows)
    got = np.asarray(pk.dense(jnp.asarray(x), pw))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, x @ rounded, rtol=1e-5, atol=1e-5)
  assert pk.pack_under(pw, mixed, jnp.float16) is pw
  again = pk.pack_under(pw, mixed)  # float32 panels asked for: repacked from the values
  assert again.panels.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(again.unpack()), rounded)
  with pytest.raises(ValueError, match="panels are float32 or float16, not bfloat16"):
    pk.pack(w, dtype=jnp.bfloat16)


def test_a_weight_beyond_float16s_range_stays_float32(caplog):
  w = _rand((8, 70), 5)
  w[3, 7] = 1e5
  pw = pk.pack(w, dtype=jnp.float16)
  assert pw.panels.dtype == jnp.float32 and "exceeds float16's range" in caplog.text
  np.testing.assert_array_equal(np.asarray(pw.unpack()), w)


def test_pack_unpack_round_trip_and_dense():
  w = _rand((40, 130), 4)
  pw = pk.pack(w)
  width = sm.panel_width()
  assert pw.shape == (40, 130) and pw.panels.shape == (-(-130 // width), 40, width)
  np.testing.assert_array_equal(np.asarray(pw.unpack()), w)
  np.testing.assert_array_equal(np.asarray(pk.unpacked(pw)), w)
  for rows in (1, 3 * 7, 200):
    x = _rand((rows, 40), rows).reshape(1, rows, 40)
    got = np.asarray(pk.dense(jnp.asarray(x), pw))
    assert got.shape == (1, rows, 130)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(pk.dense(jnp.asarray(x), jnp.asarray(w))),
                                np.asarray(jnp.asarray(x) @ jnp.asarray(w)))


def test_bad_inputs_are_refused():
  panels = jnp.asarray(sm.to_panels(_rand((8, 64), 0)))
  with pytest.raises(ValueError, match="panels"):
    sm.streaming_matmul(jnp.ones((2, 9)), panels)
  other = 32 if sm.panel_width() != 32 else 16  # packed for another kernel's width
  with pytest.raises(ValueError, match="panel width"):
    sm.streaming_matmul(jnp.ones((2, 8)), jnp.asarray(sm.to_panels(_rand((8, 64), 0),
                                                                   width=other)))
  with pytest.raises(ValueError, match="float32"):
    sm.streaming_matmul(jnp.ones((2, 8), jnp.bfloat16), panels)
  with pytest.raises(ValueError, match="float32 or float16 panels"):
    sm.streaming_matmul(jnp.ones((2, 8)), panels.astype(jnp.bfloat16))


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_forward_matches_plain(tied):
  cfg, params = tiny_model(seed=0, tie_embeddings=tied)
  if not tied:
    params = dict(params, lm_head=jnp.asarray(_rand((cfg.dim, cfg.vocab_size), 5)))
  packed = pk.pack_params(params, cfg.tie_embeddings)
  assert pk.pack_params(packed, cfg.tie_embeddings)["lm_head"] is packed["lm_head"]  # idempotent
  assert isinstance(packed["layers"][0]["wqkv"], pk.PackedWeight)
  tokens = jnp.asarray([[1, 5, 9, 2, 7], [3, 3, 4, 0, 1]])
  pos = jnp.broadcast_to(jnp.arange(5), (2, 5))
  a = forward(params, cfg, tokens, pos, kvc.init_cache(cfg, 2, 8))
  b = forward(packed, cfg, tokens, pos, kvc.init_cache(cfg, 2, 8))
  np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(b.cache.k[1]), np.asarray(a.cache.k[1]), atol=1e-5)


def test_unpack_inverts_pack_and_consumers_of_raw_weights_accept_packed_models(tmp_path):
  from specjax.distill.vocab import DraftSpec, init_from_target
  from specjax.loaders import load_hf, save_hf
  cfg, params = tiny_model(seed=0, tie_embeddings=False)
  params = dict(params, lm_head=jnp.asarray(_rand((cfg.dim, cfg.vocab_size), 5)))
  packed = pk.pack_params(params, cfg.tie_embeddings)
  for a, b in zip(jax.tree.leaves(pk.unpack_params(packed, False)), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  save_hf(str(tmp_path), cfg, packed)
  _, loaded = load_hf(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(loaded["layers"][1]["w_down"]),
                                np.asarray(params["layers"][1]["w_down"]))
  _, draft = init_from_target(cfg, packed, DraftSpec(layers=(1,)), None)
  assert not any(isinstance(w, pk.PackedWeight) for w in draft["layers"][0].values())


@pytest.mark.parametrize("gamma", [1, 4])
def test_speculative_greedy_on_packed_models_equals_plain_greedy(gamma):
  cfg, params = tiny_model(seed=0)
  dcfg, dparams = tiny_model(seed=1, num_layers=1)
  params = pk.pack_params(params, cfg.tie_embeddings)
  prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10, 11, 12, 13]]
  ref = specjax.generate(params, cfg, prompts, 24, eos_ids=())
  for drafter, draft in ((ModelDrafter(dcfg), pk.pack_params(dparams, dcfg.tie_embeddings)),
                         (ModelDrafter(cfg), params)):
    dec = SpeculativeDecoder(cfg, drafter, gamma=gamma, eos_ids=())
    out = dec.generate(params, drafter.make_params(draft), prompts, 24)
    for row in range(len(prompts)):
      assert out.generated(row) == ref.generated(row)


def test_load_model_follows_the_policy_and_falls_back_without_the_kernel(tmp_path, monkeypatch,
                                                                          caplog):
  from specjax.loaders import load_model, save_hf
  cfg, params = tiny_model(seed=0)
  save_hf(str(tmp_path / "m"), cfg, params)
  src = str(tmp_path / "m")
  monkeypatch.setattr(sm, "cache_dir", lambda: str(tmp_path / "cache"))
  monkeypatch.setattr(pol, "other_work", lambda: 0.0)  # a quiet machine: final decisions
  wqkv = lambda p: p["layers"][0]["wqkv"]
  measured = load_model(src)[1]  # auto: measured on the tiny shapes, cached
  assert len(list((tmp_path / "cache").glob("matmul-policy-*.json"))) == 2  # layers, head
  policy, head = (pol.policy_for(pk.unpack_params(measured, cfg.tie_embeddings),
                                 cfg.tie_embeddings, measure_fn=None, part=p)
                  for p in pol.PARTS)  # read back from the cache (measure_fn is not called)
  assert isinstance(wqkv(measured), pk.PackedWeight) == (not policy.never)
  if not policy.never:
    assert wqkv(measured).policy == policy
  assert isinstance(measured.get("lm_head"), pk.PackedWeight) == (not head.never)
  monkeypatch.setenv(pol.ENV, "kernel")
  assert isinstance(wqkv(load_model(src)[1]), pk.PackedWeight)
  monkeypatch.setenv(pol.ENV, "xla")
  assert not isinstance(wqkv(load_model(src)[1]), pk.PackedWeight)
  monkeypatch.setenv(pol.ENV, "fastest")
  with pytest.raises(ValueError, match="SPECJAX_MATMUL"):
    load_model(src)
  monkeypatch.delenv(pol.ENV)
  assert isinstance(wqkv(load_model(src, packed=True)[1]), pk.PackedWeight)
  assert not isinstance(wqkv(load_model(src, packed=False)[1]), pk.PackedWeight)
  monkeypatch.setattr(sm, "_register", lambda variant="native": "no C++ compiler (test)")
  with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
    load_model(src, packed=True)
  _, fallback = load_model(src)
  assert not isinstance(wqkv(fallback), pk.PackedWeight)
  assert "no C++ compiler" in caplog.text


# --- the matmul policy (kernels/policy.py) -------------------------------------------------


def test_policy_never_chooses_the_slower_path():
  timings = {1: (20.0, 14.0), 4: (45.0, 23.0), 16: (70.0, 80.0), 64: (130.0, 120.0),
             256: (450.0, 470.0)}
  p = pol.choose(timings)
  for m, (xla, kernel) in timings.items():
    assert p.use_kernel(m) == (kernel < xla)
  assert [p.use_kernel(m) for m in (2, 3, 5, 9, 17, 100, 1000)] == [
      True, True, False, False, True, False, False]  # the next grid point's decision
  assert p.ratios[0] == pytest.approx(0.7)
  assert "kernel for M 1-4" in p.describe() and "XLA for M >= 65" in p.describe()
  assert pol.choose({1: (1.0, 2.0), 8: (1.0, 3.0)}).never
  assert pol.choose({1: (2.0, 1.0), 8: (3.0, 1.0)}).always


def test_policy_prefetches_only_where_the_prefetching_kernel_was_faster():
  # (XLA, kernel, kernel prefetching into L2, non-temporally): into L2 wins at 8 by a hair,
  # the non-temporal hint at 16 and 64 clearly, so the non-temporal hint is taken (pooled
  # over M >= 7), and where it beats no prefetch; at 64 XLA is faster than every mode, so no
  # kernel there; at 4 rows (one pass over each panel, where prefetch does nothing) a mode's
  # faster time is noise and not taken. A grid point timed without the prefetching modes
  # (below ``prefetch_rows``, ``measure``) runs without.
  timings = {1: (20.0, 14.0, 15.0, 16.0), 4: (40.0, 30.0, 25.0, 24.0),
             8: (60.0, 40.0, 33.0, 34.0), 16: (70.0, 50.0, 45.0, 41.0),
             64: (100.0, 120.0, 110.0, 105.0)}
  assert pol.pooled_hint(timings, 7) == 2 and pol.pooled_hint(timings, 100) == 1
  p = pol.choose(timings)
  assert [p.use_kernel(m) for m in (1, 4, 8, 16, 64)] == [True, True, True, True, False]
  assert [p.prefetch_at(m) for m in (1, 4, 7, 8, 16)] == [0, 0, 2, 2, 2]
  assert p.ratios[1] == pytest.approx(30.0 / 40.0)  # the mode that runs
  assert p.ratios[2] == pytest.approx(34.0 / 60.0)  # the pooled hint's, not the faster L2's
  assert p.ratios[3] == pytest.approx(41.0 / 70.0)
  assert "prefetching non-temporal at M = 8, 16" in p.describe()
  slower = {m: t[:3] + (t[2] * 1.1,) for m, t in timings.items()}  # into L2 everywhere
  assert [pol.choose(slower).prefetch_at(m) for m in (4, 8, 16)] == [0, 1, 1]
  assert "prefetching into L2 at M = 8, 16" in pol.choose(slower).describe()
  no_gain = {**timings, 16: (70.0, 40.0, 45.0, 41.0)}  # the hint, but not prefetching at 16
  assert [pol.choose(no_gain).prefetch_at(m) for m in (8, 16)] == [2, 0]
  assert pol.MatmulPolicy.from_json(json.loads(json.dumps(p.to_json()))) == p
  assert pol.choose({1: (2.0, 1.0, 1.5, 1.2)}).prefetch == ()  # never: no per-M list kept
  assert pol.choose({1: (2.0, 1.0), 8: (3.0, 2.0, 1.0, 1.5)}).prefetch == (0, 1)
  with pytest.raises(ValueError, match="prefetch"):
    pol.MatmulPolicy(grid=(1, 2), kernel=(True, True), prefetch=(1,))
  with pytest.raises(ValueError, match="prefetch"):
    pol.MatmulPolicy(grid=(1,), kernel=(True,), prefetch=(3,))


def test_one_pass_rows_is_read_from_the_kernels_row_block(tmp_path):
  # The policy's no-prefetch bound is the C++ Panel's row block itself, not a copy of it.
  assert sm.ONE_PASS_ROWS == sm._one_pass_rows()
  edited = tmp_path / "kernel.cc"
  edited.write_text(open(sm._SOURCE).read().replace("constexpr int B = 6;",
                                                    "constexpr int B = 4;"))
  assert sm._one_pass_rows(str(edited)) == 4
  edited.write_text("void Panel() {}")
  with pytest.raises(RuntimeError, match="found 0"):
    sm._one_pass_rows(str(edited))


def test_prefetch_rows_says_from_which_m_the_flag_changes_the_kernel():
  # AVX-512's flag also drives the streaming pass's prefetch (any M); elsewhere only the
  # passes from cache prefetch, past one pass. The policy measures from there on.
  first = {"avx512": 1, "avx2": sm.ONE_PASS_ROWS + 1, "portable": sm.ONE_PASS_ROWS + 1}
  for variant in VARIANTS:
    assert sm.prefetch_rows(variant) == first[sm.isa(variant)]
  timings = {1: (20.0, 14.0, 13.0), 4: (40.0, 30.0, 25.0), 8: (60.0, 40.0, 33.0)}
  assert [pol.choose(timings, prefetch_rows=2).prefetch_at(m) for m in (1, 2, 4, 8)] == [
      0, 1, 1, 1]
  assert [pol.choose(timings, prefetch_rows=1).prefetch_at(m) for m in (1, 8)] == [1, 1]
  assert [pol.choose(timings).prefetch_at(m) for m in (1, 4, 8)] == [0, 0, 1]


@pytest.mark.parametrize("variant", VARIANTS)
# One pass over each panel up to 6 rows (AVX-512's flag then prefetches the streamed panel
# ahead), then one per block of 6 rows: 2 passes at 7, 9 and 12 rows, 3 at 17, 5 at 30 (on
# AVX-512 taking turns over k-blocks of 32 panel rows: K = 200 ends in a partial block, 64
# in whole ones, 20 is less than one).
@pytest.mark.parametrize("k", [200, 64, 20])
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 9, 12, 17, 30])
def test_prefetching_kernel_is_bit_identical_to_the_plain_kernel(rows, k, variant):
  w = _rand((k, 64 * 9 + 5), rows)
  panels = jnp.asarray(sm.to_panels(w, variant))
  x = jnp.asarray(_rand((rows, k), rows + 1))
  a = np.asarray(sm.streaming_matmul(x, panels, variant))
  for mode in (1, 2):  # into L2, non-temporal
    b = np.asarray(sm.streaming_matmul(x, panels, variant, prefetch=mode))
    np.testing.assert_array_equal(a, b)
  np.testing.assert_allclose(a, np.asarray(sm.reference(x, panels)), rtol=1e-5, atol=1e-4)


def test_the_kernel_itself_refuses_an_unknown_prefetch_mode():
  # Below the Python check: the FFI handler's own range check.
  sm.available()  # builds and registers the native target
  panels = jnp.asarray(sm.to_panels(_rand((16, 64), 0)))
  out = jax.ShapeDtypeStruct((1, panels.shape[0] * panels.shape[2]), jnp.float32)
  with pytest.raises(Exception, match="prefetch must be 0"):
    jax.ffi.ffi_call(sm._target("native"), out)(jnp.ones((1, 16), jnp.float32), panels,
                                                prefetch=np.int32(3)).block_until_ready()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="x86-64 disassembly with objdump")
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_prefetch_mode_emits_its_own_hint(variant):
  """Every mode gives the same bits, so only the code shows a hint wired to the wrong mode:
  both attribute hints (prefetcht1, prefetchnta) are in every path that prefetches; AVX2's
  always-on streaming-pass prefetch keeps prefetcht0 (into L1); AVX-512's follows the mode,
  so it has no prefetcht0."""
  sm.available(variant)
  text = subprocess.run(["objdump", "-d", sm._library_path(variant)], capture_output=True,
                        text=True, check=True).stdout
  assert "prefetcht1" in text and "prefetchnta" in text
  assert ("prefetcht0" in text) == (sm.isa(variant) == "avx2")


@pytest.mark.parametrize("bad", [3, -1, 1.5, "2", None, "a"])
def test_unknown_prefetch_modes_are_refused(bad):
  panels = jnp.asarray(sm.to_panels(_rand((16, 64), 0)))
  with pytest.raises((ValueError, TypeError), match="prefetch"):
    sm.streaming_matmul(jnp.zeros((1, 16), jnp.float32), panels, prefetch=bad)


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_rows_give_an_empty_result(variant):
  panels = jnp.asarray(sm.to_panels(_rand((16, 64), 0), variant))
  out = sm.streaming_matmul(jnp.zeros((0, 16), jnp.float32), panels, variant, prefetch=True)
  assert out.shape == (0, 64)


def test_policy_cache_key_changes_with_cpu_flags_and_shapes():
  shapes = [(576, 960), (576, 49152)]
  base = pol.cache_key(shapes, cpu="x86_64|EPYC|avx avx2 fma")
  assert pol.cache_key(shapes, cpu="x86_64|EPYC|avx avx2 fma") == base
  assert pol.cache_key(shapes, cpu="x86_64|EPYC|avx avx2 avx512f fma") != base
  assert pol.cache_key(shapes, cpu="x86_64|Xeon|avx avx2 fma") != base
  assert pol.cache_key([(576, 960)], cpu="x86_64|EPYC|avx avx2 fma") != base


def test_policy_cache_key_is_the_same_in_every_process_and_follows_the_rule(monkeypatch):
  """A cached decision is found again by the next process (a key holding a code object's
  repr, with its memory address, never was), and a new decision rule gets a new key."""
  shapes, cpu = [(576, 960)], "x86_64|EPYC|avx avx2 fma"
  code = ("from specjax.kernels import policy; "
          f"print(policy.cache_key({shapes!r}, cpu={cpu!r}))")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  keys = {subprocess.run([sys.executable, "-c", code], cwd=root, check=True, text=True,
                         capture_output=True).stdout.strip() for _ in range(2)}
  assert keys == {pol.cache_key(shapes, cpu=cpu)}
  monkeypatch.setattr(pol, "choose", lambda timings, source="": pol.XLA)
  assert pol.cache_key(shapes, cpu=cpu) not in keys


def test_source_hash_covers_the_local_headers_a_kernel_includes(tmp_path):
  from specjax.kernels import build
  src, header = tmp_path / "k.cc", tmp_path / "shared.h"
  src.write_text('#include "shared.h"\n#include "xla/ffi/api/ffi.h"\nint f() { return g(); }\n')
  header.write_text("inline int g() { return 1; }\n")
  base = build.source_hash(str(src))
  assert build.source_hash(str(src)) == base
  header.write_text("inline int g() { return 2; }\n")
  assert build.source_hash(str(src)) != base  # a changed header rebuilds the kernel
  # The real kernels include the shared header from the kernels folder.
  kernel = build.os.path.join(build.KERNELS_DIR, "streaming_matmul.cc")
  with open(kernel, "rb") as f:
    text = f.read()
  assert build._local_headers(text, kernel) == [
      build.os.path.join(build.KERNELS_DIR, "parallel_for.h")]


def test_policy_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
  monkeypatch.setattr(sm, "cache_dir", lambda: str(tmp_path))
  monkeypatch.delenv(pol.ENV, raising=False)
  cfg, params = tiny_model(seed=0)
  calls = []

  def fake_measure(weights, xla_transposed):
    calls.append(len(weights))
    return {1: (2.0, 1.0), 8: (1.0, 2.0)}  # kernel faster for one row only

  quiet = lambda: 0.0
  first = pol.policy_for(params, cfg.tie_embeddings, measure_fn=fake_measure, load_fn=quiet)
  second = pol.policy_for(params, cfg.tie_embeddings, measure_fn=fake_measure, load_fn=quiet)
  assert calls == [cfg.num_layers * 4] and first == second and not first.contended
  assert first.use_kernel(1) and not first.use_kernel(2)
  monkeypatch.setenv(pol.ENV, "xla")
  assert pol.policy_for(params, cfg.tie_embeddings, measure_fn=fake_measure).never


def test_policy_times_every_layer_a_forward_streams():
  # Four layers fit a large last-level cache; a forward streams all of them from memory.
  cfg, params = tiny_model(seed=0, num_layers=6)
  weights = pol.projection_weights(params, cfg.tie_embeddings, part="layers")
  names = ("wqkv", "wo", "w_gate_up", "w_down")
  assert len(weights) == 6 * 4
  for w, (layer, name) in zip(weights, [(i, n) for i in range(6) for n in names]):
    np.testing.assert_array_equal(w, params["layers"][layer][name])
  assert len(pol.projection_weights(params, cfg.tie_embeddings, num_layers=2, part="layers")) == 8


def test_a_policy_timed_under_load_is_provisional_and_timed_again_on_a_quiet_machine(
    tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(sm, "cache_dir", lambda: str(tmp_path))
  monkeypatch.delenv(pol.ENV, raising=False)
  cfg, params = tiny_model(seed=0)
  calls, loads = [], []

  def fake_measure(weights, xla_transposed):
    calls.append(len(weights))  # under load the kernel reads slower than it is
    return {1: (2.0, 3.0)} if loads[-1] >= pol.BUSY else {1: (2.0, 1.0)}

  def load_fn():
    return loads[-1]

  def policy(load):
    loads.append(load)
    return pol.policy_for(params, cfg.tie_embeddings, measure_fn=fake_measure, load_fn=load_fn)

  busy = policy(1.0)
  assert busy.contended and busy.never and "provisional" in busy.describe()
  assert "kept provisionally" in caplog.text
  assert policy(pol.BUSY) == busy and len(calls) == 1  # still busy: the cached one serves
  quiet = policy(0.0)
  assert len(calls) == 2 and quiet.always and not quiet.contended
  assert policy(1.0) == quiet and len(calls) == 2  # a quiet timing is final
  json_back = pol.MatmulPolicy.from_json(json.loads(json.dumps(busy.to_json())))
  assert json_back == busy
  assert pol.BUSY <= 0.5  # one other busy thread on 2 cores counts


def test_other_work_counts_other_processes_runnable_threads(monkeypatch):
  monkeypatch.setattr(pol.os, "cpu_count", lambda: 2)
  readings = iter([2, 0, 2, 3, 2])
  assert pol.other_work(interval_s=0.0, runnable=lambda: next(readings)) == pytest.approx(1.0)
  assert pol.other_work(interval_s=0.0, runnable=lambda: None) == 0.0  # no /proc: unknown
  # The real reading: a spinning child process counts, this process's own threads do not.
  child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    import time
    time.sleep(0.3)
    assert pol._runnable_elsewhere() >= 1
  finally:
    child.kill()
    child.wait()


@pytest.mark.parametrize("tied", [True, False])
def test_layers_and_head_are_measured_apart_the_head_as_the_model_multiplies_by_it(
    tmp_path, monkeypatch, tied):
  """One chain of both weighed 4 layers against the head (a model runs all of its layers) and
  timed a tied head's XLA path against embed.T, where the model contracts against embed."""
  monkeypatch.setattr(sm, "cache_dir", lambda: str(tmp_path))
  monkeypatch.setattr(pol, "other_work", lambda: 0.0)  # a quiet machine: final decisions
  monkeypatch.delenv(pol.ENV, raising=False)
  cfg, params = tiny_model(seed=0, tie_embeddings=tied)
  if not tied:
    params = dict(params, lm_head=jnp.asarray(_rand((cfg.dim, cfg.vocab_size), 5)))
  calls = []

  def fake_measure(weights, xla_transposed):
    calls.append(([w.shape for w in weights], xla_transposed))
    head = len(weights) == 1
    return {1: (2.0, 1.0) if head else (1.0, 2.0)}  # the kernel only on the head

  layers, head = (pol.policy_for(params, cfg.tie_embeddings, measure_fn=fake_measure, part=p)
                  for p in pol.PARTS)
  assert calls == [([w.shape for w in pol.projection_weights(params, tied, part="layers")],
                    False), ([(cfg.dim, cfg.vocab_size)], tied)]
  assert layers.never and head.always
  assert pol.policy_for(params, tied, measure_fn=fake_measure, part="head") == head  # cached
  assert len(calls) == 2
  both = pol.projection_weights(params, tied)
  parts = sum((pol.projection_weights(params, tied, part=p) for p in pol.PARTS), [])
  assert [w.shape for w in both] == [w.shape for w in parts]
  with pytest.raises(ValueError, match="part"):
    pol.policy_for(params, tied, measure_fn=fake_measure, part="embed")
  with pytest.raises(ValueError, match="part"):
    pol.projection_weights(params, tied, part="all")


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("layers_kernel", [True, False])
def test_layers_and_head_packed_under_their_own_policies_match_the_plain_model(tied,
                                                                              layers_kernel):
  cfg, params = tiny_model(seed=0, tie_embeddings=tied)
  if not tied:
    params = dict(params, lm_head=jnp.asarray(_rand((cfg.dim, cfg.vocab_size), 5)))
  policy, head = (pol.KERNEL, pol.XLA) if layers_kernel else (pol.XLA, pol.KERNEL)
  packed = pk.pack_params(params, cfg.tie_embeddings, policy, head_policy=head)
  assert isinstance(packed["layers"][0]["wqkv"], pk.PackedWeight) == layers_kernel
  if layers_kernel:  # the head stays plain: absent when tied (it contracts against embed)
    assert ("lm_head" in packed) == (not tied)
    assert not isinstance(packed.get("lm_head"), pk.PackedWeight)
  else:
    assert isinstance(packed["lm_head"], pk.PackedWeight) and packed["lm_head"].policy.always
  assert pk.policy_of(packed) == policy
  for t in (1, 3):
    tokens = jnp.asarray([[1, 5, 9][:t]])
    pos = jnp.arange(t)[None]
    a = forward(params, cfg, tokens, pos, kvc.init_cache(cfg, 1, 8))
    b = forward(packed, cfg, tokens, pos, kvc.init_cache(cfg, 1, 8))
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), rtol=1e-4, atol=1e-4)
  again = pk.pack_params(packed, cfg.tie_embeddings, policy, head_policy=head)  # idempotent
  assert again["layers"][0]["wqkv"] is packed["layers"][0]["wqkv"]
  assert again.get("lm_head") is packed.get("lm_head")


def test_close_calls_are_the_row_counts_the_kernel_neither_clearly_wins_nor_loses():
  timings = {1: (20.0, 21.0, 22.0), 2: (20.0, 14.0, 15.0), 4: (20.0, 25.0, 17.5),
             8: (20.0, 30.0, 24.0), 16: (20.0, 10.0, 20.0)}
  # 1: 1.05 (the Xeon's flip); 4: the prefetching mode at 0.875; 8: 1.2, a clear loss
  assert pol.close_calls(timings) == [1, 4]
  assert pol.close_calls({1: (2.0, 1.0)}) == [] and pol.close_calls({1: (1.0, 1.1)}) == [1]


@pytest.mark.parametrize("xla_transposed", [False, True])
def test_real_measurement_covers_the_grid(xla_transposed):
  w = [_rand((64, 128), 0), _rand((128, 64), 1)]
  t = pol.measure(w, grid=(1, 3), repeats=1, xla_transposed=xla_transposed)
  # XLA and the kernel everywhere; its prefetching modes from ``prefetch_rows`` on.
  first = sm.prefetch_rows()
  assert set(t) == {1, 3} and all(min(v) > 0 for v in t.values())
  assert [len(t[m]) for m in (1, 3)] == [4 if m >= first else 2 for m in (1, 3)]


@pytest.mark.parametrize("tied", [True, False])
def test_mixed_policy_model_matches_plain_on_both_sides_of_the_split(tied):
  """Kernel for up to 2 rows, XLA's dot (on the plain copy, or ``embed`` for a tied head)
  beyond: decode-sized and verify-sized forwards agree with the plain model."""
  cfg, params = tiny_model(seed=0, tie_embeddings=tied)
  if not tied:
    params = dict(params, lm_head=jnp.asarray(_rand((cfg.dim, cfg.vocab_size), 5)))
  mixed = pol.MatmulPolicy(grid=(2, 3), kernel=(True, False))
  packed = pk.pack_params(params, cfg.tie_embeddings, mixed)
  w = packed["layers"][0]["wqkv"]
  assert w.plain is not None and pk.uses_kernel(w, 2) and not pk.uses_kernel(w, 5)
  assert packed["lm_head"].plain is None if tied else packed["lm_head"].plain is not None
  for t in (1, 2, 5):
    tokens = jnp.asarray([[1, 5, 9, 2, 7][:t]])
    pos = jnp.arange(t)[None]
    a = forward(params, cfg, tokens, pos, kvc.init_cache(cfg, 1, 8))
    b = forward(packed, cfg, tokens, pos, kvc.init_cache(cfg, 1, 8))
    np.testing.assert_allclose(np.asarray(b.logits), np.asarray(a.logits), rtol=1e-4, atol=1e-4)
  assert pk.pack_params(packed, cfg.tie_embeddings, mixed)["layers"][0]["wqkv"] is w
  plain = pk.pack_params(packed, cfg.tie_embeddings, pol.XLA)
  assert not isinstance(plain["layers"][0]["wqkv"], pk.PackedWeight)


def test_eagle_drafter_of_a_packed_target_is_packed_and_decodes_like_the_plain_one():
  """``eagle_drafter`` packs the draft like its target, in ``draft_panel_dtype()`` by default;
  in float32 panels its proposals match the plain draft's logits to float tolerance and
  ``split_params`` (training, teacher-forced eval) gets the plain arrays back; greedy
  decoding stays plain greedy either way."""
  from specjax.drafters.eagle import (draft_panel_dtype, eagle_drafter, head_rows,
                                      random_eagle_weights, split_params)
  cfg, params = tiny_model(seed=0)
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(5), num_fused=2)
  vocab_map = np.arange(0, cfg.vocab_size, 2)
  layers = (0, cfg.num_layers - 1)
  drafter, plain_dp = eagle_drafter(cfg, params, weights, vocab_map, layers)
  packed_target = pk.pack_params(params, cfg.tie_embeddings)
  _, default_dp = eagle_drafter(cfg, packed_target, weights, vocab_map, layers)
  assert all(isinstance(default_dp[k], pk.PackedWeight) for k in ("fc", "fuse", "head"))
  assert isinstance(default_dp["layers"][0]["wqkv"], pk.PackedWeight)
  assert default_dp["head"].panels.dtype == draft_panel_dtype()
  assert not isinstance(plain_dp["head"], pk.PackedWeight)
  _, dp = eagle_drafter(cfg, packed_target, weights, vocab_map, layers, jnp.float32)
  assert dp["head"].panels.dtype == jnp.float32
  assert head_rows(dp) == head_rows(default_dp) == head_rows(plain_dp) == len(vocab_map)
  for a, b in zip(jax.tree.leaves(split_params(dp)), jax.tree.leaves(split_params(plain_dp))):
    np.testing.assert_array_equal(a, b)
  h = jax.random.normal(jax.random.PRNGKey(1), (2, 3, cfg.dim))
  np.testing.assert_allclose(drafter.head_logits(dp, h), drafter.head_logits(plain_dp, h),
                             rtol=1e-5, atol=1e-5)
  feats = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 2 * cfg.dim))
  np.testing.assert_allclose(drafter.fuse(dp, feats), drafter.fuse(plain_dp, feats),
                             rtol=1e-5, atol=1e-5)
  prompts = [[1, 2, 3, 1, 2], [4, 5], [7, 8, 9, 10, 7, 8, 9]]
  want = specjax.generate(packed_target, cfg, prompts, 12, eos_ids=())
  for tree in (TreeTopology.chain(3), DynamicTree(depth=3, top_k=2, num_nodes=5)):
    for params_ in (dp, default_dp):
      out = SpeculativeDecoder(cfg, drafter, tree=tree, eos_ids=()).generate(
          packed_target, params_, prompts, 12)
      for row in range(len(prompts)):
        assert out.generated(row) == want.generated(row)


def test_draft_panels_are_float16_only_where_the_kernel_widens_halves_in_hardware(monkeypatch):
  from specjax.drafters.eagle import draft_panel_dtype
  assert (draft_panel_dtype() == jnp.float16) == (sm.isa() in ("avx512", "avx2"))
  monkeypatch.setattr(sm, "widens_halves_in_hardware", lambda variant="native": False)
  assert draft_panel_dtype() == jnp.float32


def test_eagle_drafter_in_half_panels_is_the_float32_drafter_on_rounded_weights():
  """``pack_eagle_params(..., panel_dtype=float16)`` streams every packed matrix in float16;
  its draft is, bit for bit, the float32-panel draft of the same weights rounded to float16,
  and greedy decoding with it stays plain greedy (chains, EAGLE-2 and sampled trees)."""
  from specjax.drafters.eagle import eagle_drafter, pack_eagle_params, random_eagle_weights
  cfg, params = tiny_model(seed=0)
  weights = random_eagle_weights(cfg, 1, jax.random.PRNGKey(5), num_fused=2)
  packed_target = pk.pack_params(params, cfg.tie_embeddings)
  layers = (0, cfg.num_layers - 1)
  vocab_map = np.arange(0, cfg.vocab_size, 2)
  drafter, dp32 = eagle_drafter(cfg, packed_target, weights, vocab_map, layers, jnp.float32)
  _, dp16 = eagle_drafter(cfg, packed_target, weights, vocab_map, layers, jnp.float16)
  policies = pk.policy_of(packed_target), pk.head_policy_of(packed_target)
  packed = [w for w in jax.tree.leaves(dp16, is_leaf=lambda w: isinstance(w, pk.PackedWeight))
            if isinstance(w, pk.PackedWeight)]
  assert len(packed) == 7 and all(w.panels.dtype == jnp.float16 for w in packed)
  # The same values in float32 panels: repacking the float16 draft's weights.
  rounded = pack_eagle_params(dp16, *policies, panel_dtype=jnp.float32)
  assert all(w.panels.dtype == jnp.float32 for w in jax.tree.leaves(
      rounded, is_leaf=lambda w: isinstance(w, pk.PackedWeight)) if isinstance(w, pk.PackedWeight))
  h = jax.random.normal(jax.random.PRNGKey(1), (2, 3, cfg.dim))
  np.testing.assert_array_equal(drafter.head_logits(dp16, h), drafter.head_logits(rounded, h))
  np.testing.assert_allclose(drafter.head_logits(dp16, h), drafter.head_logits(dp32, h),
                             rtol=1e-2, atol=1e-2)
  assert not np.array_equal(drafter.head_logits(dp16, h), drafter.head_logits(dp32, h))
  feats = jax.random.normal(jax.random.PRNGKey(2), (2, 3, 2 * cfg.dim))
  np.testing.assert_array_equal(drafter.fuse(dp16, feats), drafter.fuse(rounded, feats))
  prompts = [[1, 2, 3, 1, 2], [4, 5], [7, 8, 9, 10, 7, 8, 9]]
  want = specjax.generate(packed_target, cfg, prompts, 12, eos_ids=())
  for tree in (TreeTopology.chain(3), DynamicTree(depth=3, top_k=2, num_nodes=5),
               SampledDynamicTree((2, 2, 1))):
    out = SpeculativeDecoder(cfg, drafter, tree=tree, eos_ids=()).generate(
        packed_target, dp16, prompts, 12)
    for row in range(len(prompts)):
      assert out.generated(row) == want.generated(row)
