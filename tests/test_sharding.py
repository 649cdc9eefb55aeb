"""Sharding rules (in process, one device) and decoding on 8 simulated CPU devices (in a
subprocess with --xla_force_host_platform_device_count=8, so every other test keeps one
device): the same tokens as one device on meshes 1x8, 2x4, 4x2 and 8x1, and no whole weight
matrix gathered by the compiled decode loops."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from specjax import kv_cache as kvc
from specjax import sharding
from specjax.generate import generate
from specjax.kernels.packed import PackedWeight, pack_params
from specjax.testing import tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mesh(data, model):
  auto = (jax.sharding.AxisType.Auto,) * 2
  return AbstractMesh((data, model), (sharding.DATA, sharding.MODEL), axis_types=auto)


def test_param_specs_follow_the_rules():
  cfg, params = tiny_model(dim=64, num_heads=8, num_kv_heads=4, ffn_dim=96, vocab_size=64)
  specs = sharding.param_specs(params, cfg, _mesh(2, 4))
  layer = specs["layers"][0]
  assert layer["wqkv"] == P(None, "model") and layer["wo"] == P("model", None)
  assert layer["w_gate_up"] == P(None, "model") and layer["w_down"] == P("model", None)
  assert specs["embed"] == P("model", None) and layer["attn_norm"] == P()
  assert specs["final_norm"] == P()
  # Replicated rules, and a model axis of 1, shard nothing.
  for s in jax.tree.leaves(sharding.param_specs(params, cfg, _mesh(2, 4), sharding.REPLICATED),
                           is_leaf=lambda x: isinstance(x, P)):
    assert all(a is None for a in s)
  assert sharding.param_specs(params, cfg, _mesh(8, 1))["layers"][0]["wqkv"] == P(None, None)
  # Overrides: the vocabulary whole, the rest as before.
  kept = sharding.param_specs(params, cfg, _mesh(2, 4), sharding.ShardingRules().with_axes(
      vocab=None))
  assert kept["embed"] == P(None, None) and kept["layers"][0]["wqkv"] == P(None, "model")


def test_divisibility_is_checked_in_units_before_compiling():
  # 4 kv heads (wqkv has 4·(2+2)·8 = 128 columns, divisible by 8, but its 4 groups are not).
  cfg, params = tiny_model(dim=64, num_heads=8, num_kv_heads=4, ffn_dim=96, vocab_size=64)
  with pytest.raises(ValueError, match=r"'model' mesh axis \(8\) does not divide its 4 kv heads"):
    sharding.param_specs(params, cfg, _mesh(1, 8))
  relaxed = sharding.ShardingRules(indivisible="replicate")
  specs = sharding.param_specs(params, cfg, _mesh(1, 8), relaxed)
  assert specs["layers"][0]["wqkv"] == P(None, None)       # 4 groups: replicated
  assert specs["layers"][0]["w_gate_up"] == P(None, "model")  # 96 features: split
  with pytest.raises(ValueError, match="does not divide its 96 ffn features"):
    sharding.param_specs(params, cfg, _mesh(1, 64), sharding.ShardingRules(
        axes=(("ffn", "model"),)))
  # A vocabulary of 60 rows on a model axis of 8 (every kv head and feature divides).
  cfg60, params60 = tiny_model(dim=64, num_heads=8, num_kv_heads=8, ffn_dim=64, vocab_size=60)
  with pytest.raises(ValueError, match=r"\['embed'\].*does not divide its 60 vocabulary rows"):
    sharding.param_specs(params60, cfg60, _mesh(1, 8))
  assert sharding.param_specs(params60, cfg60, _mesh(1, 8), relaxed)["embed"] == P(None, None)
  # The batch is never replicated silently: not in a state, nor at the entry points'
  # check (generate, the decoders, serve, training and the batch sweep call it first).
  cache = kvc.init_cache(cfg, 3, 8)
  with pytest.raises(ValueError, match="does not divide its 3 rows"):
    sharding.state_specs(cache, 3, {"data": 2, "model": 1}, relaxed)
  with pytest.raises(ValueError, match=r"the batch: the 'data' mesh axis \(2\) does not divide "
                     "its 3 rows"):
    sharding.check_batch(3, _mesh(2, 1), relaxed)
  sharding.check_batch(4, _mesh(2, 1))
  sharding.check_batch(3)  # no mesh given or active: nothing to divide


def test_bad_rules_and_meshes_are_refused():
  with pytest.raises(ValueError, match="unknown or repeated logical axes"):
    sharding.ShardingRules(axes=(("heads", "model"),))
  with pytest.raises(ValueError, match="indivisible must be one of"):
    sharding.ShardingRules(indivisible="pad")
  cfg, params = tiny_model()
  with pytest.raises(ValueError, match=r"mesh axes \['tensor'\], but the mesh has axes"):
    sharding.param_specs(params, cfg, _mesh(1, 1), sharding.ShardingRules().with_axes(
        ffn="tensor"))
  with pytest.raises(ValueError, match="needs 16 devices, but only 1 are present"):
    sharding.make_mesh(4, 4)
  with pytest.raises(ValueError, match="must be >= 1"):
    sharding.make_mesh(0, 1)


def test_state_specs_cover_caches_and_batch_major_leaves():
  cfg, _ = tiny_model(num_heads=4, num_kv_heads=2)
  state = {"cache": kvc.init_cache(cfg, 4, 16), "tokens": np.zeros((4, 16), np.int32),
           "steps": np.zeros((), np.int32), "key": np.zeros((2,), np.uint32)}
  specs = sharding.state_specs(state, 4, {"data": 2, "model": 2}, sharding.ShardingRules())
  assert specs["cache"].k[0] == P("data", "model", None, None)
  assert specs["cache"].lengths == P("data")
  assert specs["tokens"] == P("data") and specs["steps"] == P() and specs["key"] == P()


def test_one_device_mesh_decodes_as_without_one():
  """Inside use_mesh on one device nothing changes (the constraint is a no-op), and packed
  CPU weights are unpacked by shard_params."""
  cfg, params = tiny_model()
  packed = pack_params(params, cfg.tie_embeddings)
  assert any(isinstance(x, PackedWeight) for x in jax.tree.leaves(
      packed, is_leaf=lambda x: isinstance(x, PackedWeight)))
  want = generate(params, cfg, [[1, 2, 3], [4, 5]], 6).tokens
  mesh = sharding.make_mesh(1, 1)
  with sharding.use_mesh(mesh):
    placed = sharding.shard_params(packed, cfg, mesh)
    assert not any(isinstance(x, PackedWeight) for x in jax.tree.leaves(
        placed, is_leaf=lambda x: isinstance(x, PackedWeight)))
    np.testing.assert_array_equal(generate(placed, cfg, [[1, 2, 3], [4, 5]], 6).tokens, want)
  assert sharding.active() is None


# Eight simulated devices share this machine's cores: a device whose thread is starved waits
# at a collective. XLA:CPU ends the process after 40 s there (seen on SmolLM2's 2x4 mesh
# while another job held both cores; the same mesh passes alone); allow 10 minutes.
SIMULATED_DEVICES = ("--xla_force_host_platform_device_count=8 "
                     "--xla_cpu_collective_call_terminate_timeout_seconds=600")


def _run_simulated(model: str, meshes: str, timeout: int, check: str = "decode",
                   cases: str = "all", exact: bool = False) -> dict:
  env = dict(os.environ, XLA_FLAGS=SIMULATED_DEVICES, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "sharded_decoding.py"),
                         f"--model={model}", f"--meshes={meshes}", f"--check={check}",
                         f"--cases={cases}", *(["--exact"] if exact else [])],
                        env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout[proc.stdout.index("{"):])


# Every drafter family greedy (EAGLE also replicated beside the sharded target, and in an
# EAGLE-2 dynamic tree), and sampled plain, chain and tree decoding.
GREEDY_CASES = ("plain_greedy", "chain_greedy", "chain_replicated_drafter_greedy",
                "tree_greedy", "dynamic_tree_greedy", "model_chain_greedy", "jacobi_chain_greedy",
                "early_exit_chain_greedy", "adapter_exit_chain_greedy",
                "prompt_lookup_chain_greedy", "bigram_chain_greedy", "lookahead_greedy",
                "continuous_greedy")
SAMPLED_CASES = ("plain_sampled", "chain_sampled", "tree_sampled")


def _check(report: dict, meshes: str, sampled: bool = True, greedy=GREEDY_CASES):
  assert report["devices"] == 8
  assert report["detector_control"]  # the all-gather check finds a gathered weight
  assert sorted(report["meshes"]) == sorted(meshes.split(","))
  for name, r in report["meshes"].items():
    for case in greedy + (SAMPLED_CASES if sampled else ()):
      assert r[case], f"{name}: {case} differs from one device"
    assert not r["whole_weights_gathered"], (name, r["whole_weights_gathered"])
    if not name.startswith("1x"):  # generate and the decoder refuse an odd batch
      assert r["odd_batch_refused"], name
    if report["exact"]:
      continue  # the kernels' checks below run once, under the default rules
    # The attention kernels under shard_map: one device's output, the cache not gathered.
    kernels = r["attention_kernels"]
    assert {"cpu", "pallas_gpu_interpret"} <= set(kernels), (name, kernels)
    for impl, k in kernels.items():
      assert k["max_diff"] <= 1e-6 and not k["cache_gathered"], (name, impl, k)
    # Greedy tree verification's kernels under shard_map: the jnp rule's paths on one
    # device, exactly.
    verify = r["tree_verify_kernels"]
    assert "pallas_gpu_interpret" in verify, (name, verify)
    for impl, v in verify.items():
      assert v["equal"] and v["per_device"], (name, impl, v)


def _families(report: dict) -> tuple[str, ...]:
  """The drafter families' cases (``sharded_decoding.FAMILY_CASES``, as its report gives
  them): on the default run's mesh they are the heavy test below (each compiles its loop on
  the mesh: 850 s of an AVX2 host's suite with them)."""
  families = tuple(report["family_cases"])
  assert families and set(families) <= set(GREEDY_CASES), families
  return families


def test_simulated_meshes_tiny_model():
  """One of the four meshes, both axes split (the default run), every case but the other
  drafter families' (their heavy test follows); the other three meshes are heavy too."""
  report = _run_simulated("tiny", "2x4", timeout=900, cases="no_families")
  families = _families(report)
  _check(report, "2x4", greedy=tuple(c for c in GREEDY_CASES if c not in families))
  assert not set(families) & set(report["meshes"]["2x4"])
  # the TPU interpreter's kernel runs wherever the mesh splits the block (see
  # sharded_decoding._attention_kernels for 1x8)
  assert "pallas_tpu_interpret" in report["meshes"]["2x4"]["attention_kernels"]
  # The model axis really splits the weights where it is > 1.
  assert "P(None, 'model')" in report["meshes"]["2x4"]["params_sharded"]


@pytest.mark.heavy
def test_simulated_meshes_tiny_model_drafter_families():
  report = _run_simulated("tiny", "2x4", timeout=900, cases="families")
  _check(report, "2x4", sampled=False, greedy=_families(report))


@pytest.mark.heavy
def test_simulated_meshes_tiny_model_other_meshes():
  report = _run_simulated("tiny", "1x8,4x2,8x1", timeout=1500)
  _check(report, "1x8,4x2,8x1")
  for mesh in ("4x2", "8x1"):
    assert "pallas_tpu_interpret" in report["meshes"][mesh]["attention_kernels"]
  assert "pallas_tpu_interpret" in report["meshes"]["8x1"]["tree_verify_kernels"]
  assert "P(None, 'model')" in report["meshes"]["1x8"]["params_sharded"]


CORE_GREEDY = ("plain_greedy", "chain_greedy", "tree_greedy", "continuous_greedy")


@pytest.mark.heavy  # 231 s of the default run's four workers; the default rules' mesh stays
def test_simulated_meshes_exact_rules():
  """ShardingRules(exact=True) on the tiny model packed for the kernel: every core case,
  sampled plain, chain and tree decoding included, gives one device's tokens on 2x4, with
  every packed weight split by its column panels (two panels of wqkv padded to four), no
  whole weight (nor panel stack) gathered."""
  report = _run_simulated("tiny", "2x4", timeout=900, cases="core", exact=True)
  assert report["exact"]
  _check(report, "2x4", greedy=CORE_GREEDY)
  assert "P('model', None, None)" in report["meshes"]["2x4"]["params_sharded"]


def test_exact_rules_refuse_weights_they_cannot_split_exactly():
  """Before anything compiles: a weight packed under a policy that takes XLA's dot at some
  row count, and a plain target projection; packed KERNEL weights stay packed."""
  from specjax.kernels.policy import KERNEL, MatmulPolicy
  cfg, params = tiny_model()
  mesh, exact = sharding.make_mesh(1, 1), sharding.ShardingRules(exact=True)
  placed = sharding.shard_params(pack_params(params, cfg.tie_embeddings, KERNEL), cfg, mesh,
                                 exact)
  assert isinstance(placed["layers"][0]["wqkv"], PackedWeight)
  mixed = MatmulPolicy(grid=(1, 8), kernel=(True, False), source="test")
  with pytest.raises(ValueError, match="every row count"):
    sharding.shard_params(pack_params(params, cfg.tie_embeddings, mixed), cfg, mesh, exact)
  with pytest.raises(ValueError, match="plain matrix"):
    sharding.shard_params(params, cfg, mesh, exact)


@pytest.mark.heavy  # 123 s of the default run's workers; decoding on the mesh stays
def test_training_on_simulated_meshes_matches_one_device():
  """Distillation of a token draft, an EAGLE-3 drafter and Medusa heads with the teacher
  target sharded over "model" and batch rows over "data" gives one device's parameters and
  losses up to rounding."""
  report = _run_simulated("tiny", "2x4,4x2", timeout=900, check="train")
  assert sorted(report) == ["eagle", "medusa", "token"]  # the draft kinds train_draft trains
  for kind, r in report.items():
    for mesh in ("2x4", "4x2"):
      assert r[mesh]["max_param_diff"] < 1e-4, (kind, mesh, r[mesh])
      np.testing.assert_allclose(r[mesh]["loss"], r["single_loss"], rtol=1e-5)


@pytest.mark.heavy
def test_simulated_meshes_embedded_model():
  """SmolLM2 against one device: greedy tokens of plain, chain and tree decoding and
  continuous batching equal on every mesh (the core cases: every drafter family deadlocked
  twice in XLA:CPU's collectives under load, docs/sharding.md). Sampled ones are not
  compared: a mesh's logits differ from one device's in their last bits (XLA's dot instead
  of the CPU streaming kernel, sharded partial sums), and a draw near a CDF boundary may part
  (docs/sharding.md has what was measured)."""
  report = _run_simulated("smollm2", "1x8,2x4,4x2,8x1", timeout=3000, cases="core")
  _check(report, "1x8,2x4,4x2,8x1", sampled=False, greedy=CORE_GREEDY)


@pytest.mark.heavy
def test_simulated_meshes_embedded_model_exact():
  """SmolLM2 under ShardingRules(exact=True) (the kernel at every row count, weights split by
  column panels): sampled plain, chain and tree decoding with a fixed seed give one device's
  tokens on every mesh, as greedy decoding does (the core cases)."""
  report = _run_simulated("smollm2", "1x8,2x4,4x2,8x1", timeout=3000, cases="core", exact=True)
  _check(report, "1x8,2x4,4x2,8x1", greedy=CORE_GREEDY)


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_agree_with_one_device():
  """jax.distributed on the loopback: two processes of 4 simulated devices each form one 2x4
  mesh; both print the tokens of one device."""
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from multiprocess_decoding import decode
  want = decode(lambda p, cfg: p)
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests",
                                                          "multiprocess_decoding.py"),
                             f"--process_id={i}", f"--port={port}"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      stdout, stderr = p.communicate(timeout=600)
      assert p.returncode == 0, stderr[-4000:]
      outs.append(json.loads(stdout.strip().splitlines()[-1]))
  finally:
    for p in procs:
      p.kill()
  assert [o["process"] for o in outs] == [0, 1]
  for o in outs:
    assert (o["processes"], o["global_devices"], o["local_devices"]) == (2, 8, 4)
    assert o["plain"] == want["plain"] and o["chain"] == want["chain"]


def test_packed_draft_weights_are_unpacked_by_their_drafter():
  """EAGLE packs its head transposed ([D, Vd] panels): shard_params refuses to guess and
  takes the drafter's own plain_params."""
  from specjax.drafters.eagle import pack_eagle_params
  from specjax.kernels.policy import KERNEL
  from specjax.testing import make_drafter
  cfg, params = tiny_model()
  drafter, dp = make_drafter("eagle", cfg, params, [])
  packed = pack_eagle_params(drafter.plain_params(dp), KERNEL, panel_dtype=jnp.float32)
  assert isinstance(packed["head"], PackedWeight)
  mesh = sharding.make_mesh(1, 1)
  with pytest.raises(ValueError, match="drafter=drafter"):
    sharding.shard_params(packed, cfg, mesh)
  placed = sharding.shard_params(packed, cfg, mesh, drafter=drafter)
  np.testing.assert_allclose(placed["head"], drafter.plain_params(dp)["head"])
