"""Exact versus Megatron tensor parallelism on simulated CPU devices: time and tokens.

Usage:
  python -m benchmarks.exact_sharding [--meshes=1x2,2x1,4x2] [--batch=8] [--new_tokens=32]
      [--sampled_tokens=24] [--repeats=3] [--out=benchmarks/results/exact_sharding.md]

Runs on 8 simulated CPU devices (it adds
``--xla_force_host_platform_device_count=8`` to ``XLA_FLAGS`` before jax loads, so run it in a
process of its own). SmolLM2 packed for the streaming kernel at every row count
(``load_model(packed=True)``), on one device and on each mesh under the default rules
(Megatron: unpacked weights, XLA's dot, partial sums across devices) and under
``ShardingRules(exact=True)`` (``docs/sharding.md``): the median wall time of warm plain
greedy decoding (every setting timed in turn within each repeat), and whether greedy and
sampled (T = 1, seed 3) tokens equal one device's. Simulated devices share this machine's
cores: the times say what a mesh costs on one CPU, not how a real mesh scales.
"""

from __future__ import annotations

import contextlib
import os
import sys

if "jax" not in sys.modules:  # the device count is read when jax initialises its backend
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from benchmarks.common import interleaved_times, provenance, write_markdown  # noqa: E402
from experiments.machine import probe_output_dir  # noqa: E402
from specjax import sharding  # noqa: E402
from specjax.generate import generate  # noqa: E402
from specjax.loaders import load_model  # noqa: E402
from specjax.sampling import Sampling  # noqa: E402

MESHES = flags.DEFINE_list("meshes", ["1x2", "2x1", "4x2"], "data x model meshes")
BATCH = flags.DEFINE_integer("batch", 8, "rows per call (the data axes must divide it)")
PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 16, "tokens per (random) prompt")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "new tokens per timed call")
SAMPLED_TOKENS = flags.DEFINE_integer("sampled_tokens", 24, "new tokens of the compared calls")
REPEATS = flags.DEFINE_integer("repeats", 3, "timed calls per setting (median)")
OUT = flags.DEFINE_string("out", "benchmarks/results/exact_sharding.md", "markdown output")

RULES = {"Megatron (default)": sharding.ShardingRules(indivisible="replicate"),
         "exact": sharding.ShardingRules(indivisible="replicate", exact=True)}


def _mesh_shape(text: str) -> tuple[int, int]:
  try:
    data, model = (int(v) for v in text.split("x"))
  except ValueError:
    raise SystemExit(f"--meshes: want DATAxMODEL, got {text!r}") from None
  return data, model


def main(_):
  meshes = [_mesh_shape(m) for m in MESHES.value]
  for flag in (BATCH, PROMPT_TOKENS, NEW_TOKENS, SAMPLED_TOKENS, REPEATS):
    if flag.value < 1:
      raise SystemExit(f"--{flag.name} must be >= 1, got {flag.value}")
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  for data, model in meshes:
    try:
      sharding.make_mesh(data, model)  # a mesh larger than the devices, before loading
    except ValueError as e:
      raise SystemExit(f"--meshes: {e}") from None
    if BATCH.value % data:
      raise SystemExit(f"--batch={BATCH.value}: the data axis {data} does not divide it")
  cfg, params = load_model(packed=True)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(1, 2000, size=PROMPT_TOKENS.value)) for _ in range(BATCH.value)]

  def decode(setting, n, sampler=None):
    """Tokens of ``n`` new ones per prompt under a (mesh, rules, params) setting."""
    mesh, rules, p = setting
    kw = dict(sampler=sampler, seed=3) if sampler else {}
    with contextlib.ExitStack() as stack:
      if mesh is not None:
        stack.enter_context(sharding.use_mesh(mesh, rules))
      return np.asarray(generate(p, cfg, prompts, n, eos_ids=(), **kw).tokens)

  def compared(setting):
    return {"greedy": decode(setting, SAMPLED_TOKENS.value),
            "sampled": decode(setting, SAMPLED_TOKENS.value, Sampling(1.0))}

  one_device = ("one device", "–")
  settings = {one_device: (None, None, params)}
  for (data, model) in meshes:
    mesh = sharding.make_mesh(data, model)
    for name, rules in RULES.items():
      settings[(name, f"{data}x{model}")] = (mesh, rules,
                                             sharding.shard_params(params, cfg, mesh, rules))
  reference = compared(settings[one_device])
  rows = [(key, {k: int((v != reference[k]).sum()) for k, v in compared(s).items()})
          for key, s in settings.items() if key != one_device]
  times = interleaved_times({key: (lambda s=s: decode(s, NEW_TOKENS.value))
                             for key, s in settings.items()}, REPEATS.value)
  median = {key: float(np.median(t)) for key, t in times.items()}
  one = median[one_device]
  tokens = BATCH.value * SAMPLED_TOKENS.value
  write_markdown(OUT.value, [
      "# Exact versus Megatron tensor parallelism on simulated CPU devices (SmolLM2-135M)",
      "",
      f"Command: `{' '.join(['python -m benchmarks.exact_sharding', *sys.argv[1:]])}` "
      f"({provenance()}). Weights packed for the streaming kernel at every row count; batch "
      f"{BATCH.value}, {PROMPT_TOKENS.value}-token random prompts. Time: warm plain greedy "
      f"decoding of {NEW_TOKENS.value} new tokens, median of {REPEATS.value} calls, every "
      "setting in turn within each repeat. Tokens: greedy and sampled (T = 1, seed 3) "
      f"decoding of {SAMPLED_TOKENS.value} new tokens against one device's "
      f"({tokens} tokens each). The simulated devices share this machine's cores: the times "
      "say what a mesh costs on one CPU, not how a real mesh scales.",
      "",
      "| rules | mesh | time (s) | / one device | greedy tokens differing | sampled tokens "
      "differing |",
      "|---|---|---|---|---|---|",
      f"| one device | – | {one:.2f} | 1.00 | – | – |",
      *(f"| {name} | {mesh} | {median[(name, mesh)]:.2f} | {median[(name, mesh)] / one:.2f} | "
        f"{diff['greedy']} of {tokens} | {diff['sampled']} of {tokens} |"
        for (name, mesh), diff in rows),
  ])


if __name__ == "__main__":
  app.run(main)
