"""Shared fixtures."""

import os
import pickle

import pytest

TOY_TOPK = 8


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
  """Drops a test file's compiled XLA programs (and jit caches) when the file ends. Four
  pytest-xdist workers that kept every file's programs reached 5.1-6.5 GB each, and the
  24 GB machine OOM-killed one of them mid-run."""
  yield
  import gc

  import jax
  jax.clear_caches()
  gc.collect()


@pytest.fixture
def benchmark_module():
  """Imports ``benchmarks.<name>`` for its helpers. Each benchmark defines its absl flags at
  import, and several share names (``--out``, ``--prompts``, ...): the names this one
  defines are freed first, so two benchmarks import in one process (a single-worker run)."""
  import importlib
  import re
  import sys

  from absl import flags

  def load(name: str):
    module = f"benchmarks.{name}"
    if module in sys.modules:
      return sys.modules[module]
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", f"{name}.py")
    with open(path) as f:
      for flag in re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", f.read()):
        if flag in flags.FLAGS:
          delattr(flags.FLAGS, flag)
    return importlib.import_module(module)
  return load


@pytest.fixture
def refused():
  """``refused(MODULE, (ARGS, MESSAGE), ...)`` checks that ``python -m MODULE ARGS`` fails with
  MESSAGE in its stderr, for every case: all of them in one fresh process
  (``tests/flag_refusals.py``, each from the flags' defaults), not an interpreter and its
  imports per case. ``env``: the process's environment (default: this one's)."""
  import json
  import subprocess
  import sys

  def check(module: str, *cases, env=None) -> None:
    script = os.path.join(os.path.dirname(__file__), "flag_refusals.py")
    proc = subprocess.run([sys.executable, script, module,
                           json.dumps([list(args) for args, _ in cases])],
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outs = json.loads(proc.stdout.splitlines()[-1])
    for (args, message), out in zip(cases, outs, strict=True):
      assert out["code"] != 0 and message in out["stderr"], (args, out["stderr"][-3000:])
  return check


@pytest.fixture(scope="module")
def target():
  """The tiny random target of the decoding tests (modules may define their own)."""
  from specjax.testing import tiny_model
  return tiny_model(seed=0)


@pytest.fixture(scope="module")
def draft():
  """A smaller random model of the same vocabulary, as an independent draft."""
  from specjax.testing import tiny_model
  return tiny_model(seed=1, num_layers=1, dim=16, num_heads=2, num_kv_heads=1, ffn_dim=32)


def toy_records(cfg, params, layers=None):
  """(train, held-out) self-distillation records of a toy target: 48 random prompts answered
  greedily and at T=1 (16 tokens, the target's top-TOY_TOPK), every sixth held out; with
  ``layers`` (() for the last hidden state) each record also gets the target's features."""
  import numpy as np
  from specjax.distill import features, teacher
  from specjax.sampling import Greedy, Sampling

  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, cfg.vocab_size, int(rng.integers(3, 10))).tolist()
             for _ in range(48)]
  recs = []
  for j, sampler in enumerate((Greedy(), Sampling(1.0))):
    out = teacher.generate_with_topk(params, cfg, prompts, 16, sampler, k=TOY_TOPK, seed=j,
                                     eos_ids=())
    recs += [dict(r, mode="greedy" if j == 0 else "T=1") for r in out]
  if layers is not None:
    feats = features.sequence_features(params, cfg, [features.record_sequence(r) for r in recs],
                                       layers=layers)
    recs = [dict(r, features=f) for r, f in zip(recs, feats)]
  return [r for i, r in enumerate(recs) if i % 6 != 0], recs[::6]


@pytest.fixture(scope="session")
def make_toy_records():
  """``toy_records``, for tests with a toy target of their own."""
  return toy_records


@pytest.fixture(scope="session")
def toy_corpus():
  """A tiny target and its self-distillation corpus: (cfg, params, train records, held-out).

  The target's layer is shrunk so the next token depends mostly on the current
  one, a function a one-layer draft can learn from a few hundred positions
  (``toy_records``). Tests that add fields copy the records first.
  """
  import jax
  from specjax.testing import tiny_model

  cfg, params = tiny_model(seed=3, vocab_size=64, num_layers=1)
  params = dict(params, layers=jax.tree.map(lambda w: w * 0.2, params["layers"]))
  return (cfg, params, *toy_records(cfg, params))


@pytest.fixture(scope="session")
def toy_corpus_features(toy_corpus):
  """``toy_corpus`` with each record's features (the target's last hidden state)."""
  from specjax.distill import features
  cfg, params, train_recs, held = toy_corpus

  def with_features(recs):
    feats = features.sequence_features(params, cfg, [features.record_sequence(r) for r in recs])
    return [dict(r, features=f) for r, f in zip(recs, feats)]

  return cfg, params, with_features(train_recs), with_features(held)


@pytest.fixture(scope="session")
def smoke(tmp_path_factory):
  """A full `experiments.run` on tiny random models: (results dict, output directory).

  Shared by tests/test_experiments.py (which checks its numbers) and
  tests/test_notebooks.py (results.ipynb reads it). Under pytest-xdist the two files
  may run in different workers; they still share one run: the first worker to ask
  runs it under a file lock, the others wait and read its pickled results.
  """
  if "PYTEST_XDIST_WORKER" not in os.environ:
    out = str(tmp_path_factory.mktemp("smoke"))
    return _smoke_run(out), out
  import filelock
  shared = tmp_path_factory.getbasetemp().parent  # one directory for every worker
  out, done = shared / "smoke", shared / "smoke.pkl"
  with filelock.FileLock(str(shared / "smoke.lock")):
    if not done.exists():
      out.mkdir()
      done.write_bytes(pickle.dumps(_smoke_run(str(out))))
  return pickle.loads(done.read_bytes()), str(out)


def _smoke_run(out: str) -> dict:
  # Phases timed for 0.03 s (the default is 0.1; other tests take 0.01): a draft phase timed
  # at or below zero predicts nothing, and test_predictions_follow_the_theory_from_measured_
  # alpha_and_c needs some prediction.
  from experiments import experiment
  from experiments.config import EXPERIMENTS, ExperimentConfig
  cfg = ExperimentConfig(experiments=EXPERIMENTS, target="tiny", draft="tiny", num_prompts=3,
                         gammas=(2,), temperatures=(0.0, 1.0), max_new_tokens=8, batch_size=2,
                         alpha_gamma=2, alpha_drafts=("prompt_lookup",),
                         draft_free_drafts=("prompt_lookup",), cost_steps=2,
                         phase_seconds=0.03, tree_budgets=(4,), calibration_prompts=2, out=out)
  return experiment.run(cfg, command="smoke test")
