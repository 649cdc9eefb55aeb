"""Decoding on simulated CPU meshes against one device, run in its own process.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded_decoding.py \
      [--model=tiny|smollm2] [--meshes=1x8,2x4,4x2,8x1] [--check=decode|train] [--out=FILE.json]

(tests/test_sharding.py starts it with those flags; it is not collected by pytest.) For
each mesh, each compared token for token with the same call on one device: plain greedy
and sampled decoding; greedy and sampled chains (EAGLE drafter, sharded like the target)
and a greedy chain with the EAGLE drafter replicated beside the tensor-parallel target;
greedy chains of every other drafter family (a separate draft model, the early exits
training-free and trained with their adapter, sharing the target's cache, prompt lookup,
n-grams, Jacobi) and lookahead's tree; greedy and sampled trees (Medusa heads' own static
tree) and an EAGLE-2 dynamic tree; continuous batching (``serve``) of 12 requests over
the 8 slots. And the shapes of every all-gather in the compiled plain, chain, tree and
continuous-batching loops (admission and prefill chunks included), to show no whole weight
matrix is gathered.
``--check=train``: a few distillation steps of a token draft, an EAGLE-3 drafter and Medusa
heads on each mesh against one device.
Prints (and writes) one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from specjax import sharding, testing  # noqa: E402
from specjax.attention import attention  # noqa: E402
from specjax.drafters import JacobiDrafter, LookaheadDrafter, ModelDrafter  # noqa: E402
from specjax.generate import _decode, _prefill, generate  # noqa: E402
from specjax.kernels.packed import pack_params  # noqa: E402
from specjax.kernels.policy import KERNEL  # noqa: E402
from specjax.sampling import Greedy, Sampling  # noqa: E402
from specjax.speculative import SpeculativeDecoder, serve  # noqa: E402
from specjax.speculative.proposal import Proposal  # noqa: E402
from specjax.speculative.tree import DynamicTree  # noqa: E402
from specjax.speculative.tree_acceptance import accept_greedy  # noqa: E402
from specjax.speculative.continuous import (initial_serve_state, pack_queue,  # noqa: E402
                                            serve_loop)

BATCH = 8
NEW_TOKENS = 12
# Drafter families built by testing.make_drafter besides EAGLE and Medusa.
OTHER_DRAFTERS = ("early_exit", "adapter_exit", "prompt_lookup", "bigram")
_GATHER = re.compile(r"= (.*?) all-gather(?:-start)?\(")  # the result's shape(s)
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


def _model(name: str, exact: bool = False):
  """(cfg, params) and the rules: with ``exact``, the weights packed for the streaming
  kernel at every row count and ``ShardingRules(exact=True)``."""
  if name == "tiny":  # every mesh axis up to 8 divides its kv heads, ffn and vocabulary
    cfg, params = testing.tiny_model(dim=64, num_heads=16, num_kv_heads=8, ffn_dim=64,
                                     vocab_size=64, scale=0.5)
    if exact:
      params = pack_params(params, cfg.tie_embeddings, KERNEL)
    return (cfg, params), sharding.ShardingRules(exact=exact)
  from specjax.loaders import load_model
  # Packed on CPU by the measured policy (SPECJAX_MATMUL=xla: plain, XLA's dot).
  cfg, params = load_model(name, packed=True if exact else None)
  # SmolLM2-135M has 3 kv heads: on model axes of 2, 4, 8 its attention stays whole.
  return (cfg, params), sharding.ShardingRules(indivisible="replicate", exact=exact)


def _prompts(vocab: int) -> list[list[int]]:
  rng = np.random.default_rng(0)
  return [list(rng.integers(1, vocab, size=3 + i % 4)) for i in range(BATCH)]


def _gathered_shapes(text: str) -> list[tuple[int, ...]]:
  """Every result shape of every all-gather in an HLO text (tuple results included)."""
  return [tuple(int(d) for d in s.group(1).split(",") if d)
          for m in _GATHER.finditer(text) for s in _SHAPE.finditer(m.group(1))]


def _weight_shapes(params) -> set[tuple[int, ...]]:
  """Shapes of the matrices (and packed panels [P, K, W] or per-head stacks) of params."""
  return {tuple(x.shape) for x in jax.tree.leaves(params) if np.ndim(x) in (2, 3)}


# The cases SmolLM2's heavy check runs (--cases=core): under load, the full set deadlocked
# twice on it in XLA:CPU's in-process collectives (docs/sharding.md, "Not yet").
CORE_CASES = ("plain_greedy", "plain_sampled", "chain_greedy", "chain_sampled", "tree_greedy",
              "tree_sampled", "continuous_greedy")
# Every other drafter family's chain (and lookahead's own tree): --cases=families, which the
# default suite leaves to a heavy test (each family compiles its loop on every mesh: the
# whole set made the tiny model's 2x4 check 850 s of an AVX2 host's suite), and
# --cases=no_families, the rest.
FAMILY_CASES = tuple(f"{kind}_chain_greedy" for kind in ("model", "jacobi") + OTHER_DRAFTERS) + (
    "lookahead_greedy",)


def run(model: str, meshes: list[tuple[int, int]], only=None, exclude=(),
        exact: bool = False) -> dict:
  """The report of every case (or of the cases named in ``only``), less those named in
  ``exclude``, on each mesh; ``exact``: under ``ShardingRules(exact=True)``."""
  (cfg, params), rules = _model(model, exact)
  prompts = _prompts(min(cfg.vocab_size, 2000))
  eagle, eagle_params = testing.make_drafter("eagle", cfg, params, [])
  medusa, medusa_params = testing.make_drafter("medusa", cfg, params, [])
  drafters = {"eagle": eagle, "medusa": medusa}
  drafts = {"eagle": eagle_params, "medusa": medusa_params}
  for kind in OTHER_DRAFTERS:
    drafters[kind], drafts[kind] = testing.make_drafter(kind, cfg, params, prompts)
  # A separate draft model: one layer, the target's vocabulary (8 kv heads split on every
  # model axis of the tiny target's meshes).
  small_cfg, small = testing.tiny_model(seed=5, dim=32, num_heads=8, num_kv_heads=8, ffn_dim=32,
                                        num_layers=1, vocab_size=cfg.vocab_size)
  drafters["model"] = ModelDrafter(small_cfg)
  drafts["model"] = drafters["model"].make_params(small)
  drafters["jacobi"], drafts["jacobi"] = JacobiDrafter(cfg.vocab_size), ()
  lookahead = LookaheadDrafter(cfg.vocab_size, window=3, ngram=3, guesses=2)
  drafters["lookahead"], drafts["lookahead"] = lookahead, ()

  def chain(kind):
    return lambda t, d: SpeculativeDecoder(cfg, drafters[kind], gamma=3, eos_ids=()).generate(
        t, d[kind], prompts, NEW_TOKENS).tokens

  cases = {
      "plain_greedy": lambda t, d: generate(t, cfg, prompts, NEW_TOKENS, eos_ids=()).tokens,
      "plain_sampled": lambda t, d: generate(t, cfg, prompts, NEW_TOKENS, Sampling(1.0),
                                             seed=3, eos_ids=()).tokens,
      "chain_greedy": lambda t, d: SpeculativeDecoder(cfg, eagle, gamma=3, eos_ids=()).generate(
          t, d["eagle"], prompts, NEW_TOKENS).tokens,
      "chain_sampled": lambda t, d: SpeculativeDecoder(
          cfg, eagle, gamma=3, sampler=Sampling(1.0), eos_ids=()).generate(
              t, d["eagle"], prompts, NEW_TOKENS, seed=3).tokens,
      "tree_greedy": lambda t, d: SpeculativeDecoder(cfg, medusa, eos_ids=()).generate(
          t, d["medusa"], prompts, NEW_TOKENS).tokens,
      "tree_sampled": lambda t, d: SpeculativeDecoder(
          cfg, medusa, sampler=Sampling(1.0), eos_ids=()).generate(
              t, d["medusa"], prompts, NEW_TOKENS, seed=3).tokens,
      "dynamic_tree_greedy": lambda t, d: SpeculativeDecoder(
          cfg, eagle, tree=DynamicTree(top_k=2, depth=3, num_nodes=5), eos_ids=()).generate(
              t, d["eagle"], prompts, NEW_TOKENS).tokens,
      # The EAGLE drafter replicated on every device beside the tensor-parallel target.
      "chain_replicated_drafter_greedy": lambda t, d: SpeculativeDecoder(
          cfg, eagle, gamma=3, eos_ids=()).generate(
              t, d["eagle_replicated"], prompts, NEW_TOKENS).tokens,
      **{f"{kind}_chain_greedy": chain(kind) for kind in ("model", "jacobi") + OTHER_DRAFTERS},
      "lookahead_greedy": lambda t, d: SpeculativeDecoder(cfg, lookahead, eos_ids=()).generate(
          t, d["lookahead"], prompts, NEW_TOKENS).tokens,  # its default tree
      # Continuous batching: 12 requests of different budgets through the 8 slots.
      "continuous_greedy": lambda t, d: serve(
          SpeculativeDecoder(cfg, eagle, gamma=3, eos_ids=()), t, d["eagle"],
          prompts + prompts[:4], [NEW_TOKENS - i % 5 for i in range(BATCH + 4)],
          slots=BATCH).tokens,
  }
  unknown = (set(only or ()) | set(exclude)) - set(cases)
  assert not unknown, f"no such cases: {sorted(unknown)}"
  cases = {name: f for name, f in cases.items()
           if (only is None or name in only) and name not in exclude}
  single = {name: np.asarray(f(params, dict(drafts, eagle_replicated=eagle_params)))
            for name, f in cases.items()}
  # The kernels' own checks do not depend on the rules' products: once, without ``exact``.
  if not exact:
    kernels_single = {impl: np.asarray(_attend(impl)(*_attention_operands()))
                      for impl in ATTENTION_KERNELS}
    verify_single = [np.asarray(x) for x in _verify("reference")(*_tree_verify_operands())]
  weights = _weight_shapes(sharding.shard_params(params, cfg, sharding.make_mesh(1, 1))) | (
      _weight_shapes(eagle.plain_params(eagle_params))) | _weight_shapes(
          medusa.plain_params(medusa_params))
  report = {"model": model, "devices": len(jax.devices()), "meshes": {},
            "family_cases": list(FAMILY_CASES)}
  for data, model_axis in meshes:
    mesh = sharding.make_mesh(data, model_axis)
    with sharding.use_mesh(mesh, rules):
      t = sharding.shard_params(params, cfg, mesh, rules)
      d = {k: sharding.shard_params(v, small_cfg if k == "model" else cfg, mesh, rules,
                                    drafter=drafters[k])
           for k, v in drafts.items()}
      d["eagle_replicated"] = sharding.shard_params(eagle_params, cfg, mesh,
                                                    sharding.REPLICATED, drafter=eagle)
      result = {}
      for name, f in cases.items():
        print(f"{data}x{model_axis}: {name}", file=sys.stderr, flush=True)  # where a hang is
        result[name] = bool(np.array_equal(np.asarray(f(t, d)), single[name]))
      if data > 1:  # a batch the data axis does not divide: refused before compiling
        odd = (prompts * 2)[:data + 1]
        result["odd_batch_refused"] = _refused(lambda: generate(t, cfg, odd, 4)) and _refused(
            lambda: SpeculativeDecoder(cfg, eagle, gamma=3).generate(t, d["eagle"], odd, 4))
      # What the compiled loops gather: the plain decode loop and the chain's.
      toks = np.zeros((BATCH, 32), np.int32)
      lens = np.full((BATCH,), 4, np.int32)
      toks[:, :4] = 1
      state = _prefill(t, cfg, toks, lens, np.full((BATCH,), 8, np.int32), jax.random.PRNGKey(0))
      plain_hlo = _decode.lower(t, cfg, state, Greedy(), ()).compile().as_text()
      dec = SpeculativeDecoder(cfg, eagle, gamma=3, eos_ids=())
      spec_state, _ = dec.prepare(t, d["eagle"], [[1, 2, 3, 4]] * BATCH, 8, cache_size=32)
      chain_hlo = SpeculativeDecoder.run.lower(dec, t, d["eagle"], spec_state).compile().as_text()
      # and a tree's (Medusa's static tree)
      tree_dec = SpeculativeDecoder(cfg, medusa, eos_ids=())
      tree_state, _ = tree_dec.prepare(t, d["medusa"], [[1, 2, 3, 4]] * BATCH, 8, cache_size=32)
      tree_hlo = SpeculativeDecoder.run.lower(tree_dec, t, d["medusa"],
                                              tree_state).compile().as_text()
      # and the continuous-batching loop, admission and chunked prefill included
      queue, _ = pack_queue(dec, [[1, 2, 3, 4, 5]] * (BATCH + 2), 8, BATCH)
      serve_state = initial_serve_state(dec, t, d["eagle"], queue, BATCH)
      serve_hlo = serve_loop.lower(dec, t, d["eagle"], queue, serve_state,
                                   chunk=4).compile().as_text()
      # and as placed here (exact rules: packed panels), of the target and the drafts used
      weights |= _weight_shapes(t) | _weight_shapes([d["eagle"], d["medusa"]])
      gathered = sorted(set().union(*(_gathered_shapes(h)
                                      for h in (plain_hlo, chain_hlo, tree_hlo, serve_hlo))))
      result["all_gather_shapes"] = [list(s) for s in gathered]
      result["whole_weights_gathered"] = [list(s) for s in gathered if s in weights]
      result["params_sharded"] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(t)})
      if not exact:
        result["attention_kernels"] = _attention_kernels(mesh, kernels_single)
        result["tree_verify_kernels"] = _tree_verify_kernels(mesh, verify_single)
    report["meshes"][f"{data}x{model_axis}"] = result
  report["exact"] = exact
  report["detector_control"] = _control(cfg, params, dataclasses.replace(rules, exact=False))
  return report


def _refused(call) -> bool:
  """Whether ``call`` raises the mesh's "does not divide its N rows" error."""
  try:
    call()
  except ValueError as e:
    return "does not divide" in str(e)
  return False


ATTENTION_KERNELS = ("cpu", "pallas_gpu_interpret", "pallas_tpu_interpret")


def _attention_operands():
  """A tree-attention block: 8 rows, 4 new tokens under a tree mask, 8 query heads over 4
  kv heads (whole on a model axis of 8), a 64-slot cache."""
  r = np.random.default_rng(0)
  q = r.standard_normal((BATCH, 4, 8, 16), np.float32)
  k, v = (r.standard_normal((BATCH, 4, 64, 16), np.float32) for _ in range(2))
  lengths = r.integers(1, 60, BATCH).astype(np.int32)
  mask = np.tril(np.ones((4, 4), bool))
  mask[3, 2] = False  # nodes 2 and 3 are siblings
  return q, k, v, lengths, mask


def _attend(impl):
  return jax.jit(lambda *a: attention(*a, impl=impl))


def _attention_kernels(mesh, single: dict) -> dict:
  """Each attention kernel on this mesh (``jax.shard_map`` over rows and kv heads, its
  operands placed as a decode step's are: rows on data, kv heads (and their query heads) on
  model, whole where the axis does not divide them, e.g. 4 kv heads on a model axis of 8):
  its output against one device's, and whether the compiled program gathers the cache."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  q, k, v, lengths, mask = _attention_operands()
  rules = sharding.ShardingRules(indivisible="replicate")
  b, kv = sharding.spec_for(k.shape[:2], ("batch", "kv_heads"), dict(mesh.shape), rules)
  put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
  ops = (put(q, b, None, kv, None), put(k, b, kv, None, None), put(v, b, kv, None, None),
         put(lengths, b), mask)
  out = {}
  for impl in ATTENTION_KERNELS:
    if impl == "pallas_tpu_interpret" and b is None and kv is None:
      # Nothing split (1x8 here): eight replicated copies of the TPU interpreter's kernel
      # hang in a rendezvous on simulated CPU devices (its simulated shared memory; not
      # diagnosed further). The CPU and GPU-interpret kernels run there.
      continue
    f = _attend(impl)
    text = f.lower(*ops).compile().as_text()
    out[impl] = {"max_diff": float(np.max(np.abs(np.asarray(f(*ops)) - single[impl]))),
                 "cache_gathered": (BATCH, 4, 64, 16) in _gathered_shapes(text)}
  return out


TREE_VERIFY_KERNELS = ("pallas_gpu_interpret", "pallas_tpu_interpret")
VERIFY_TREE = DynamicTree(top_k=3, depth=4, num_nodes=10)


def _tree_verify_operands():
  """An EAGLE-2 block: each of 8 rows its own tree of 10 nodes (depth <= 4), drafted tokens
  mostly the target's argmax after their parent (row 0's never), so paths of several lengths
  occur."""
  r = np.random.default_rng(0)
  n, depth = VERIFY_TREE.num_nodes, VERIFY_TREE.depth
  parents = np.zeros((BATCH, n), np.int32)
  node_depth = np.zeros((BATCH, n), np.int32)
  for row in range(BATCH):
    for i in range(n):
      parents[row, i] = r.choice([-1] + [j for j in range(i) if node_depth[row, j] < depth])
      node_depth[row, i] = 1 + (node_depth[row, parents[row, i]] if parents[row, i] >= 0 else 0)
  p = r.random((BATCH, n + 1, 6)).astype(np.float32)
  planted = np.take_along_axis(p.argmax(-1), parents + 1, axis=1)
  tokens = np.where(r.random((BATCH, n)) < 0.8, planted, r.integers(0, 6, (BATCH, n)))
  tokens[0] = (planted[0] + 1) % 6  # a row that accepts nothing
  return tokens.astype(np.int32), parents, p


def _verify(impl):
  def run(tokens, parents, p):
    prop = Proposal(tokens=tokens, draw="point_mass", parents=parents)
    out = accept_greedy(prop, p, VERIFY_TREE, impl=impl)
    return out.path, out.num_accepted, out.next_token
  return jax.jit(run)


def _tree_verify_kernels(mesh, single: list) -> dict:
  """Each greedy tree-verification kernel on this mesh (``jax.shard_map`` over the rows, on
  data; whole where data is 1): whether it gives the path, lengths and tokens of the jnp
  rule on one device (``single``), and whether it runs under ``shard_map`` (the lowered
  program holds a ``manual_computation``; without it GSPMD runs the kernel on whole rows)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  tokens, parents, p = _tree_verify_operands()
  (b,) = sharding.spec_for((BATCH,), ("batch",), dict(mesh.shape), sharding.ShardingRules())
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P(b, *([None] * (a.ndim - 1)))))
  ops = (put(tokens), put(parents), put(p))
  out = {}
  for impl in TREE_VERIFY_KERNELS:
    if impl == "pallas_tpu_interpret" and dict(mesh.shape)["model"] > 1:
      continue  # replicated copies of the TPU interpreter's kernel (see _attention_kernels)
    f = _verify(impl)
    out[impl] = {"equal": all(np.array_equal(np.asarray(g), w) for g, w in zip(f(*ops), single)),
                 "per_device": "manual_computation" in f.lower(*ops).as_text()}
  return out


def _control(cfg, params, rules) -> bool:
  """Whether the all-gather check sees a whole weight matrix when one IS gathered (a product
  with ``w_gate_up`` forced replicated): the check above can fail."""
  from jax.sharding import PartitionSpec as P
  mesh = sharding.make_mesh(1, len(jax.devices()))
  with sharding.use_mesh(mesh, rules):
    w = sharding.shard_params(params, cfg, mesh, rules)["layers"][0]["w_gate_up"]
    gather = jax.jit(lambda w, x: x @ jax.lax.with_sharding_constraint(w, P()))
    text = gather.lower(w, np.ones((2, w.shape[0]), np.float32)).compile().as_text()
  return tuple(w.shape) in _gathered_shapes(text)


TRAIN_KINDS = ("token", "eagle", "medusa")


def _train_setup(kind: str, cfg, params):
  """(draft, initial weights, objective, frozen arrays, online teacher) of a small draft of
  ``kind`` as experiments.train_draft builds it: a one-layer token draft, a one-layer EAGLE-3
  drafter (fused features of layer 0 and the last, 2 training-time-test steps) or two
  Medusa heads, the last two over half the vocabulary; the teacher is the target."""
  import dataclasses
  from specjax.distill import eagle, heads, train
  from specjax.drafters.eagle import EagleDrafter, eagle_config, init_eagle_weights
  from specjax.drafters.medusa import init_medusa_weights
  from specjax.model import init_params

  vm = np.arange(0, cfg.vocab_size, 2)
  if kind == "token":
    dcfg = dataclasses.replace(cfg, num_layers=1, name="draft")
    return (train.Draft(cfg=dcfg, target_vocab_size=cfg.vocab_size),
            init_params(dcfg, jax.random.PRNGKey(0), scale=0.1), None, None,
            (train.Teacher(cfg, k=8), params))
  if kind == "eagle":
    drafter = EagleDrafter(eagle_config(cfg, 1), feature_layers=(0,))
    return (train.Draft(cfg=dataclasses.replace(drafter.cfg, vocab_size=len(vm)),
                        target_vocab_size=cfg.vocab_size, vocab_map=vm),
            init_eagle_weights(cfg, params, 1, feature_layers=(0,)),
            eagle.EagleObjective(drafter, feature_weight=0.1, noise=0.05, ttt_steps=2),
            eagle.frozen_arrays(cfg, params, vm), (train.Teacher(cfg, 8, (0,)), params))
  if kind == "medusa":
    return (train.Draft(cfg=dataclasses.replace(cfg, vocab_size=len(vm)),
                        target_vocab_size=cfg.vocab_size, vocab_map=vm),
            init_medusa_weights(cfg, 2, 1), heads.medusa_objective(cfg, 2),
            heads.frozen_arrays(cfg, params, vm), (train.Teacher(cfg, 8, ()), params))
  raise ValueError(f"unknown draft kind {kind!r}")


def train_check(meshes: list[tuple[int, int]]) -> dict:
  """A few distillation steps of each kind of draft (``TRAIN_KINDS``) with the target as
  online teacher (sharded over "model"), batch rows over "data": parameters and losses on
  each mesh against one device."""
  import tempfile
  from specjax.distill import train

  (cfg, params), _ = _model("tiny")
  rng = np.random.default_rng(1)
  recs = [dict(prompt=rng.integers(1, cfg.vocab_size, 5).astype(np.int32),
               response=rng.integers(1, cfg.vocab_size, 11).astype(np.int32)) for _ in range(32)]
  # (lr 1e-3: at 1e-2 Adam's normalised steps magnify an EAGLE gradient's last-bit rounding
  # differences to 3e-4 in four steps; a wrong shard's gradient moves a weight by ~lr)
  tc = train.TrainConfig(steps=4, batch_size=8, seq_len=16, lr=1e-3, warmup_steps=1,
                         eval_every=2, checkpoint_every=4)
  report = {}
  for kind in TRAIN_KINDS:
    draft, dparams, objective, frozen, teacher = _train_setup(kind, cfg, params)

    def run_on(mesh):
      with tempfile.TemporaryDirectory() as work:
        out, hist = train.train(draft, dparams, recs, [], tc, work, k=8, teacher=teacher,
                                objective=objective, frozen=frozen, log=lambda m: 0,
                                progress=False, mesh=mesh)
      return jax.tree.map(sharding.to_host, out), [h["loss"] for h in hist]

    single, single_loss = run_on(None)
    report[kind] = {"single_loss": single_loss}
    for data, model_axis in meshes:
      out, loss = run_on(sharding.make_mesh(data, model_axis))
      diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(out),
                                                              jax.tree.leaves(single)))
      report[kind][f"{data}x{model_axis}"] = {"loss": loss, "max_param_diff": diff}
  return report


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--model", default="tiny")
  ap.add_argument("--meshes", default="1x8,2x4,4x2,8x1")
  ap.add_argument("--check", default="decode", choices=("decode", "train"))
  ap.add_argument("--cases", default="all", choices=("all", "core", "families", "no_families"))
  ap.add_argument("--exact", action="store_true",
                  help="ShardingRules(exact=True) on weights packed for the kernel")
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  meshes = [tuple(int(x) for x in m.split("x")) for m in a.meshes.split(",")]
  only, exclude = {"all": (None, ()), "core": (CORE_CASES, ()), "families": (FAMILY_CASES, ()),
                   "no_families": (None, FAMILY_CASES)}[a.cases]
  report = (run(a.model, meshes, only, exclude, a.exact) if a.check == "decode"
            else train_check(meshes))
  text = json.dumps(report, indent=1)
  if a.out:
    with open(a.out, "w") as f:
      f.write(text)
  print(text)


if __name__ == "__main__":
  main()
