"""Speedup versus batch size: plain decoding, fixed chains, a dynamic tree and the adaptive policy.

Usage:
  python -m benchmarks.batch_sweep [--batch_sizes 1,2,4,8,16,32] [--temperatures 0]
      [--gammas 1,2,3,4] [--trees 3:3:4] [--nopolicy_trees] [--new_tokens 128] [--rounds 3]
      [--draft eagle] [--target smollm2] [--min_gain 0.05] [--evidence expected]
      [--nostop_at_eos] [--out benchmarks/results/batch_sweep.md]

For each batch size B and temperature, on batches of B held-out prompts (the
``--prompts`` prompts split into batches of B, or cycled to fill one batch when B
exceeds them), in one process:

  1. the step costs: a speculative step at each γ and each tree over a plain decoding
     step, decode loop only (``specjax.speculative.calibration.measure_step_costs``,
     on the first batch, over ``--new_tokens`` as the timed calls: at batch 8 on an Intel
     Xeon a 48-token loop priced γ = 1 at 1.40 plain steps, 1.44 over 128 tokens, and that
     was the difference between a loss and a gain, ``batch_policy_variants.md``);
  2. ``AdaptiveGamma`` over {0} ∪ gammas and the trees with those costs, the trees priced
     by the drafter's per-depth, per-rank acceptance and the chains' rate, and a batch's
     steps by how that rate varies by prompt (``prompt_ease``), measured once per
     temperature on held-out prompts that are never timed (the 8 after the timed ones,
     ``experiments.prompts.calibration_prompts``; ``calibration.measure_tree_prices``,
     prompts alone, so batch-independent); ``--nopolicy_trees`` leaves the trees out of the policy
     (the chains' rate and its spread are still measured, ``measure_chain_alphas``); it
     drafts only when a draft promises more than ``--min_gain`` over plain decoding, and
     the policy and its calibration count a sampled chain step's ``--evidence`` (each
     draft's β weighted by its chance of being scored, or the outcomes:
     ``AdaptiveGamma.evidence``);
  3. ``--rounds`` interleaved rounds timing plain decoding, every fixed chain, each
     EAGLE-2 dynamic tree (``k:D:N``) and the adaptive policy (in an order rotated by
     one per batch and round, as in ``experiments``), whole generations
     (prefill included); speedup = plain time / method time per round, both summed over
     the batches, the median round reported. Each round also times plain decoding a
     second time right beside the policy (before it in even rounds, after it in odd
     ones; an even ``--rounds`` balances the two): the policy's speedup against that
     call, ``paired_plain_speedup``, meant to spare it the host's slower drifts. In its
     first runs (Zen 5, B = 16 and 32, 5 rounds, the policy running plain decoding's own
     code) calls of the same code side by side still differed by up to 25%, and the
     paired rounds spread about as widely as the unpaired ones (0.95–1.25 against
     0.85–1.16).

Rows stop at their EOS, as in ``experiments.run`` (``--nostop_at_eos``: every row runs
to ``--new_tokens``, as cells before this flag did); a batch's call runs until its last
row stops. At T > 0 the two methods' samples end at different lengths, so each method's
call has its decode loop (time after prefill) scaled to the length plain decoding's call
on that batch ran for (longest rows), its prefill kept as measured (as
``experiments.measure.scale_loops``); at T = 0 both emit the same greedy tokens.

Results go to ``--out`` (markdown, with a figure beside it) and to a JSON file
beside it that a rerun resumes from (delete it to start over; its cells of another
``--data_parallel``, ``--min_gain`` or ``--evidence`` are measured again, and so are cells
that do not record their evidence: their policies counted outcomes before git 3d3668c,
their calibrations before d2cc146).

With ``--data_parallel=N`` every batch's rows are sharded over N devices (an N x 1 mesh,
``specjax.sharding``; the batch sizes must be multiples of N) and tokens/s are also given
per device; the calibration (2.) decodes its prompts one at a time, so it runs first, on
one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Optional

import jax
import numpy as np
from absl import app, flags

import specjax
from specjax import files
from specjax import sharding
from benchmarks.common import provenance, write_markdown
from experiments.machine import matmul_path, probe_output_dir
from experiments.models import load_draft, load_target
from experiments.measure import longest_row, scale_loops
from experiments.prompts import calibration_prompts, default_prompts
from experiments.sweeps import CALIBRATION_SIDE
from experiments.report import evidence_words, margin_words, matmul_words
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import EVIDENCE, MIN_GAIN, AdaptiveGamma, check_min_gain
from specjax.speculative.calibration import (default_branching, measure_chain_alphas,
                                             measure_step_costs, measure_tree_prices)
from specjax.speculative.tree import DynamicTree

BATCHES = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16", "32"], "batch sizes")
TEMPS = flags.DEFINE_list("temperatures", ["0"], "temperatures")
GAMMAS = flags.DEFINE_list("gammas", ["1", "2", "3", "4"], "fixed chains (and the policy's set)")
TREES = flags.DEFINE_list("trees", ["3:3:4"], "EAGLE-2 dynamic trees as top_k:depth:nodes")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens generated per prompt")
ROUNDS = flags.DEFINE_integer("rounds", 3, "interleaved timed rounds")
PROMPTS = flags.DEFINE_integer("prompts", 8, "distinct held-out prompts (cycled to fill a batch)")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
TARGET = flags.DEFINE_string("target", "smollm2", "target (experiments.models.load_target "
                             "spec; 'tiny' for a seconds-long smoke run)")
OUT = flags.DEFINE_string("out", "benchmarks/results/batch_sweep.md", "markdown output")
POLICY_TREES = flags.DEFINE_bool("policy_trees", True, "the adaptive policy also chooses the "
                                  "--trees (priced by an acceptance table measured on "
                                  "held-out prompts never timed), not only the chains")
MARGIN = flags.DEFINE_float("min_gain", MIN_GAIN, "the adaptive policy drafts only when a draft "
                            "promises more than this over plain decoding "
                            "(AdaptiveGamma.min_gain; 0: the formula's argmax)")
EVIDENCE_FLAG = flags.DEFINE_enum("evidence", EVIDENCE[0], list(EVIDENCE),
                                  "what the adaptive policy and its calibration count of a "
                                  "sampled chain step (AdaptiveGamma.evidence): each draft's "
                                  "acceptance chance β weighted by its chance of being "
                                  "scored, or the outcomes")
DATA = flags.DEFINE_integer("data_parallel", 1, "rows sharded over this many devices (an N x 1 "
                            "('data', 'model') mesh, docs/sharding.md; on CPU simulate devices "
                            "with XLA_FLAGS=--xla_force_host_platform_device_count=N); the "
                            "report then also gives tokens/s per device")
EOS = flags.DEFINE_bool("stop_at_eos", True, "rows stop at their EOS (experiments.run's "
                        "default); --nostop_at_eos runs every row to --new_tokens")

CALIBRATION_PROMPTS = 8  # held-out prompts after the timed ones: the policy's prices
HELD_OUT = "held-out"  # a cell's ``calibration`` when priced on those prompts
BESIDE = "plain beside"  # a round's second plain decoding call, next to the policy's


def _log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _check_flags() -> tuple[list[int], list[float], list[int], list[DynamicTree]]:
  """Parsed flags; bad values fail here, before any model loads."""
  try:
    batches = [int(b) for b in BATCHES.value]
    temps = [float(t) for t in TEMPS.value]
    gammas = [int(g) for g in GAMMAS.value]
    trees = [DynamicTree(*(int(x) for x in t.split(":"))) for t in TREES.value if t]
  except (ValueError, TypeError) as e:
    raise app.UsageError(f"bad flag value: {e}")
  if not batches or min(batches) < 1:
    raise app.UsageError(f"batch sizes must be >= 1, got {batches}")
  if not gammas or min(gammas) < 1:
    raise app.UsageError(f"gammas must be >= 1, got {gammas}")
  if NEW.value < 1 or ROUNDS.value < 1 or PROMPTS.value < 1:
    raise app.UsageError("new_tokens, rounds and prompts must be >= 1")
  try:
    calibration_prompts(CALIBRATION_PROMPTS, PROMPTS.value)
  except ValueError as e:
    raise app.UsageError(f"--prompts={PROMPTS.value}: {e}")
  try:
    check_min_gain(MARGIN.value, "--min_gain")
  except ValueError as e:
    raise app.UsageError(str(e))
  return batches, temps, gammas, trees


def _mesh(batches: list[int]):
  """The data-parallel mesh (None for one device); a mesh too large for the devices, or a
  batch size its data axis does not divide, is refused before any model loads."""
  if DATA.value == 1:
    return None
  try:
    mesh = sharding.make_mesh(data=DATA.value)
    for b in batches:
      sharding.check_batch(b, mesh)
  except ValueError as e:
    raise app.UsageError(f"--data_parallel={DATA.value}: {e}") from None
  return mesh


def _tree_name(t: DynamicTree) -> str:
  return f"tree k={t.top_k} D={t.depth} N={t.num_nodes}"


def _template(target, draft, temp: float) -> SpeculativeDecoder:
  """The decoder every method of a temperature is a variant of."""
  return SpeculativeDecoder(target.cfg, draft.drafter, sampler=make_sampler(temp),
                            eos_ids=_eos_ids())


def _eos_ids() -> Optional[tuple]:
  """The EOS ids every call takes: the target's own (None) or none, by ``--stop_at_eos``."""
  return None if EOS.value else ()


def _pricing(target, draft, temp: float, gammas, trees) -> dict:
  """What prices the policy's choices at this temperature: the chains' rate α_c and how it
  varies by prompt (``prompt_ease``), and, when the policy takes the trees, the drafter's
  per-depth, per-rank acceptance (a full tree as deep as the deepest tree, the chain as
  deep); each prompt decoded alone, on the held-out prompts after the timed ones
  (``calibration_prompts``: unseen by the draft, as the timed ones, and never timed), over
  ``--new_tokens`` as the timed calls (the rate depends on the length: over 48 tokens it
  read 0.68 at T = 0 where 128 gave 0.58, and that prior made the policy draft at
  batch 16, where every draft loses). ``rank_accept`` is None for chains only."""
  template = _template(target, draft, temp)
  prompts = [target.encode(t) for t in calibration_prompts(CALIBRATION_PROMPTS, PROMPTS.value)]
  t0 = time.perf_counter()
  prices = None
  if POLICY_TREES.value and trees:
    depth = max(t.max_depth for t in trees)
    prices = measure_tree_prices(template, target.params, draft.params, prompts,
                                 default_branching(depth), NEW.value,
                                 evidence=EVIDENCE_FLAG.value)
    if prices["table"][0][0] <= 0.0:  # nothing scales the trees' prices (AdaptiveGamma refuses it)
      _log(f"T={temp:g}: no rank-0 draft accepted at depth 1 in calibration; the policy takes "
           "chains only")
      prices["table"] = None  # the chains' rate and spread, measured beside it, still price
  if prices is None:
    depth = max(gammas)
    alpha, ease = measure_chain_alphas(template, target.params, draft.params, prompts, depth,
                                       NEW.value, evidence=EVIDENCE_FLAG.value)
    prices = {"table": None, "chain_alpha": alpha, "prompt_ease": ease}
  alpha, ease = prices["chain_alpha"], prices["prompt_ease"]
  _log(f"T={temp:g}: " + ("chains only" if prices["table"] is None else
                          f"trees priced by a {depth}-deep acceptance table")
       + f", chains' α_c = {alpha:.3f} (γ = {depth}), by prompt "
       f"{min(ease) * alpha:.2f}–{max(ease) * alpha:.2f} ({time.perf_counter() - t0:.0f} s, "
       f"{len(prompts)} {CALIBRATION_SIDE})")
  return {"rank_accept": None if prices["table"] is None else np.asarray(prices["table"]).tolist(),
          "chain_alpha": alpha, "prompt_ease": list(ease)}


def _measure(target, draft, prompts, batch: int, temp: float, gammas, trees,
             pricing: dict) -> dict:
  """One (batch size, temperature) cell: costs, then interleaved timed rounds. With
  ``pricing["rank_accept"]`` (``_pricing``) the policy also chooses the trees."""
  if batch < len(prompts):
    batches = [prompts[i:i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
  else:
    batches = [[prompts[i % len(prompts)] for i in range(batch)]]
  new = NEW.value
  cache = max(len(p) for p in prompts) + new + 16
  template = _template(target, draft, temp)
  t0 = time.perf_counter()
  costs = measure_step_costs(template, target.params, draft.params, batches[0], (0, *gammas),
                             NEW.value, trees=trees)
  chain_costs, tree_costs = costs[:len(gammas) + 1], costs[len(gammas) + 1:]
  _log(f"B={batch} T={temp:g}: step costs "
       + ", ".join(f"{n}: {c:.3f}" for n, c in zip(
           [f"γ={g}" for g in (0, *gammas)] + [_tree_name(t) for t in trees], costs))
       + f" ({time.perf_counter() - t0:.0f} s)")
  with_trees = {} if pricing["rank_accept"] is None else dict(
      trees=tuple(trees), tree_costs=tree_costs, rank_accept=pricing["rank_accept"])
  policy = AdaptiveGamma(gammas=(0, *gammas), step_costs=chain_costs,
                         prior_alpha=pricing["chain_alpha"], prompt_ease=pricing["prompt_ease"],
                         min_gain=MARGIN.value, evidence=EVIDENCE_FLAG.value, **with_trees)
  methods = {f"γ={g}": dataclasses.replace(template, gamma=g, tree=None) for g in gammas}
  methods.update({_tree_name(t): dataclasses.replace(template, gamma=None, tree=t)
                  for t in trees})
  methods["adaptive"] = template.with_policy(policy)
  plain = lambda b: specjax.generate(target.params, target.cfg, b, new, template.sampler,
                                     cache_size=cache, eos_ids=_eos_ids())
  run = lambda dec, b: dec.generate(target.params, draft.params, b, new, cache_size=cache)
  plain(batches[0])
  for dec in methods.values():
    run(dec, batches[0])
  speedups = {name: [] for name in methods}
  paired = []  # per round: the policy against the plain decoding call beside it
  plain_seconds, plain_tokens, stats = [], [], {}
  order = [None, *methods]  # None: plain decoding
  for r in range(ROUNDS.value):
    base, tokens, seconds, counts = 0.0, 0, {name: 0.0 for name in methods}, {}
    beside, adaptive_beside = 0.0, 0.0  # that call's time; the policy's, scaled to its length
    for i, b in enumerate(batches):
      shift = (r * len(batches) + i) % len(order)  # rotated: no method always runs first
      names = round_order(order[shift:] + order[:shift], r)
      outs = {name: plain(b) if name in (None, BESIDE) else run(methods[name], b)
              for name in names}
      base += outs[None].seconds
      beside += outs[BESIDE].seconds
      adaptive_beside += _same_length_seconds(outs["adaptive"], outs[BESIDE])
      tokens += int(outs[None].num_generated.sum())
      for name in methods:
        out = outs[name]
        seconds[name] += _same_length_seconds(out, outs[None])
        c = counts.setdefault(name, [0, 0, 0, 0])
        c[0] += int(out.per_row["emitted"].sum())
        c[1] += int(out.per_row["target_calls"].sum())
        c[2] = np.add(c[2], out.per_row["depth_hist"].sum(axis=0))
        c[3] = np.add(c[3], out.per_row["choice_steps"].sum(axis=0))
    plain_seconds.append(base)
    plain_tokens.append(tokens)
    paired.append(beside / adaptive_beside)
    for name in methods:
      speedups[name].append(base / seconds[name])
      emitted, calls, hist, choices = counts[name]
      stats[name] = {"tokens_per_call": emitted / calls, "depth_hist": hist.tolist(),
                     "choice_steps": np.asarray(choices).tolist()}
    _log(f"B={batch} T={temp:g} round {r + 1}: " + ", ".join(
        f"{k} {v[-1]:.2f}×" for k, v in speedups.items()) + f" ({paired[-1]:.2f}× beside)")
  # plain decoding's tokens are its calls' own every round (the same seeds): the first round's
  plain_tps = plain_tokens[0] / float(np.median(plain_seconds))
  return {"batch": batch, "temperature": temp, "batches": len(batches), "devices": DATA.value,
          "stop_at_eos": EOS.value, "plain_tokens": plain_tokens[0], "calibration": HELD_OUT,
          "gammas": [0, *gammas], "step_costs": list(chain_costs),
          "trees": [_tree_name(t) for t in trees], "tree_costs": list(tree_costs),
          "policy_trees": pricing["rank_accept"] is not None, **pricing,
          "min_gain": policy.min_gain, "evidence": policy.evidence,
          "matmul": matmul_path(target.params),
          "plain_tokens_per_second": plain_tps,
          # whether the policy's calls ran plain decoding's own loop (it never drafts here)
          "plain_only": methods["adaptive"].plain_only(batch),
          "methods": {name: dict(stats[name], speedup=float(np.median(v)), rounds=v,
                                 tokens_per_second=plain_tps * float(np.median(v)),
                                 **({"paired_plain_speedup": float(np.median(paired)),
                                     "paired_plain_rounds": paired}
                                    if name == "adaptive" else {}))
                      for name, v in speedups.items()}}


def round_order(names: list, r: int) -> list:
  """One round's calls on a batch: ``names`` (the rotated methods, None for plain decoding)
  with plain decoding once more (``BESIDE``) right before the policy in even rounds, right
  after it in odd ones."""
  names = list(names)
  names.insert(names.index("adaptive") + r % 2, BESIDE)
  return names


def _same_length_seconds(out, plain_out) -> float:
  """A method's call time with its decode loop scaled to the length plain decoding's call
  on the same batch ran for (each call's longest row: the loop runs until its last row
  stops), its prefill as measured (``experiments.measure.scale_loops``); the time as
  measured where the lengths agree (EOS ignored, or T = 0)."""
  scale = longest_row(plain_out) / longest_row(out)
  return scale_loops([[out.seconds]], [[out.prefill_seconds]], [scale])[0][0]


def resumable(cell: dict, devices: int, min_gain: float, evidence: str,
              stop_at_eos: bool) -> bool:
  """Whether a stored cell was measured as this invocation measures: on as many devices,
  with the same margin, the same evidence and EOS stopping rows or not. The others stay in
  the store, neither resumed nor reported (cells from before the margin existed took the
  formula's argmax, 0; cells that do not record their evidence are measured again:
  outcomes before git 3d3668c; cells that do not record ``stop_at_eos`` ignored EOS; cells
  that do not record their ``calibration`` were priced on training-side prompts, before
  0fe06c6)."""
  return (cell.get("devices", 1) == devices and cell.get("min_gain", 0.0) == min_gain
          and cell.get("evidence") == evidence
          and cell.get("stop_at_eos", False) == stop_at_eos
          and cell.get("calibration") == HELD_OUT)


def _report(cells: list[dict], gammas, command: str, minutes: float) -> list[str]:
  margin = margin_words(c.get("min_gain") for c in cells)
  name = "SmolLM2-135M-Instruct" if TARGET.value == "smollm2" else f"`{TARGET.value}`"
  lines = [f"# Speedup versus batch size ({name} target)", "",
           f"Command: `{command}`  ", f"{provenance()}; draft `{DRAFT.value}`; "
           f"{NEW.value} new tokens per row ({_eos_words()}), {PROMPTS.value} held-out prompts in "
           "batches of B (cycled to fill one batch when B is larger); whole generations (prefill "
           f"included); median of {ROUNDS.value} interleaved rounds; {minutes:.1f} min (this "
           "invocation; a rerun resumes from the JSON beside this file).", "",
           matmul_words(cells), "",
           "Adaptive's per-round speedups are in brackets; paired = against a second plain "
           "decoding call run right beside it in each round (before it in even rounds, after "
           "it in odd ones), two measures of the same calls with equal standing; \"plain "
           "decoding's loop\": the policy never drafts at that batch, "
           "so `generate` ran plain decoding's own code (`plain_only`). "
           "Step cost = a speculative step's decode-loop time over a plain decoding step's, "
           "at that batch, for each γ and then each tree (what the adaptive policy is given). "
           f"Adaptive = `AdaptiveGamma` over γ ∈ {{0, {', '.join(map(str, gammas))}}} with "
           "those costs, the chains' rate α_c and its range by prompt (in brackets: a batch's "
           "steps are priced for the row the batch waits on) and, unless `--nopolicy_trees`, "
           "the trees too, priced by the drafter's per-rank acceptance, all measured on "
           f"{CALIBRATION_PROMPTS} held-out prompts after the timed ones (never timed; "
           "`calibration_prompts`); its mix "
           "counts steps of each choice (γ = 0 is plain decoding, then the chains, then the "
           "trees)" + (margin and "; " + margin) + "; "
           + evidence_words(c.get("evidence") for c in cells) + ".", ""]
  if DATA.value > 1:
    lines[5:5] = [f"Data parallel: every batch's rows sharded over {DATA.value} devices "
                  "(`--data_parallel`, docs/sharding.md); tokens/s per device = tok/s / "
                  f"{DATA.value}.", ""]
  for temp in sorted({c["temperature"] for c in cells}):
    rows = sorted((c for c in cells if c["temperature"] == temp), key=lambda c: c["batch"])
    fixed = [n for n in rows[0]["methods"] if n != "adaptive"]
    trees = rows[0].get("trees", [])
    lines += [f"## T = {temp:g}", "",
              "| batch | plain tok/s | step cost " + " / ".join(
                  [f"γ={g}" for g in gammas] + ["tree"] * len(trees))
              + " | " + " | ".join(fixed) + " | best fixed | **adaptive** | adaptive, paired "
              "| adaptive / best | adaptive tok/s | adaptive tok/s per device | α_c | "
              "adaptive mix (0…" + str(max(gammas)) + "".join(", tree" for _ in trees) + ") |",
              "|---" * (11 + len(fixed)) + "|"]
    for c in rows:
      m = c["methods"]
      best = max(fixed, key=lambda n: m[n]["speedup"])
      a = m["adaptive"]
      cost = dict(zip(c["gammas"], c["step_costs"]))
      costs = " / ".join([f"{cost[g]:.2f}" for g in gammas]
                         + [f"{x:.2f}" for x in c.get("tree_costs", [])])
      alpha = f"{c['chain_alpha']:.2f}" if c.get("chain_alpha") is not None else "–"
      if c.get("prompt_ease"):
        alpha += (f" ({min(c['prompt_ease']) * c['chain_alpha']:.2f}–"
                  f"{max(c['prompt_ease']) * c['chain_alpha']:.2f})")
      mix = "/".join(str(x) for x in a.get("choice_steps", a["depth_hist"]))
      if c.get("plain_only"):
        mix += " (plain decoding's loop)"
      rounds = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
      pair = (f"{a['paired_plain_speedup']:.2f}× ({rounds(a['paired_plain_rounds'])})"
              if "paired_plain_speedup" in a else "–")  # cells from before the paired call
      lines.append(
          f"| {c['batch']} | {c['plain_tokens_per_second']:.0f} | {costs} | "
          + " | ".join(f"{m[n]['speedup']:.2f}×" for n in fixed)
          + f" | {best} ({m[best]['speedup']:.2f}×) | **{a['speedup']:.2f}×** "
          f"({rounds(a['rounds'])}) | {pair} | "
          f"{a['speedup'] / m[best]['speedup']:.0%} | {a['tokens_per_second']:.0f} | "
          f"{a['tokens_per_second'] / c.get('devices', 1):.0f} | {alpha} | {mix} |")
    lines.append("")
  return lines


def _eos_words() -> str:
  if not EOS.value:
    return "EOS ignored"
  return ("rows stopping at EOS, a batch's call running until its last row stops; at T > 0 "
          "each method's decode loop scaled to the length plain decoding's call ran for, its "
          "prefill as measured")


def _figure(cells: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for temp in sorted({c["temperature"] for c in cells}):
    rows = sorted((c for c in cells if c["temperature"] == temp), key=lambda c: c["batch"])
    bs = [c["batch"] for c in rows]
    best = [max(v["speedup"] for n, v in c["methods"].items() if n != "adaptive") for c in rows]
    ax.plot(bs, best, "o--", label=f"best fixed, T={temp:g}")
    ax.plot(bs, [c["methods"]["adaptive"]["speedup"] for c in rows], "s-",
            label=f"adaptive, T={temp:g}")
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("batch size")
  ax.set_ylabel("speedup over plain decoding")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(_):
  batches, temps, gammas, trees = _check_flags()
  mesh = _mesh(batches)
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  store = os.path.splitext(OUT.value)[0] + ".json"
  stored = json.load(open(store)) if os.path.exists(store) else []
  ours = lambda c: resumable(c, DATA.value, MARGIN.value, EVIDENCE_FLAG.value, EOS.value)
  cells, others = [c for c in stored if ours(c)], [c for c in stored if not ours(c)]
  done = {(c["batch"], c["temperature"]) for c in cells}
  target = load_target(TARGET.value)
  draft = load_draft(DRAFT.value, target, lambda: [])
  unserved = [t for t in trees if not draft.drafter.supports(t)]
  if unserved:
    raise app.UsageError(f"draft {DRAFT.value!r} cannot build the trees {unserved}: "
                         "pass --trees= (empty) for chains only")
  todo = {temp: [b for b in batches if (b, temp) not in done] for temp in temps}
  for temp, left in todo.items():
    if len(left) < len(batches):
      _log(f"T={temp:g}: B={[b for b in batches if b not in left]} done before, kept")
  # Calibration decodes each prompt alone (batch 1, which no data axis > 1 divides), so it
  # runs first, on one device: the acceptance it measures does not depend on the mesh.
  start = time.perf_counter()
  pricing = {temp: _pricing(target, draft, temp, gammas, trees) for temp in temps if todo[temp]}
  with contextlib.ExitStack() as stack:
    if mesh is not None:
      stack.enter_context(sharding.use_mesh(mesh))
      target = dataclasses.replace(target, params=sharding.shard_params(target.params,
                                                                         target.cfg, mesh))
      draft = dataclasses.replace(draft, params=sharding.shard_params(
          draft.params, target.cfg, mesh, drafter=draft.drafter))
    _sweep(cells, others, store, todo, pricing, target, draft, batches, temps, gammas, trees,
           start)


def _sweep(cells, others, store, todo, pricing, target, draft, batches, temps, gammas, trees,
           start: float):
  """Measures the cells ``todo`` lists ({temperature: batch sizes}) with each temperature's
  ``pricing``, saving the store (``others``, then ``cells``) after each, then writes the
  report of ``cells`` and its figure (with the minutes since ``start``)."""
  prompts = [target.encode(p.text) for p in default_prompts(PROMPTS.value)]
  for temp in temps:
    for batch in todo[temp]:
      cells.append(_measure(target, draft, prompts, batch, temp, gammas, trees, pricing[temp]))
      files.write_text(store, json.dumps(others + cells, indent=1))
      # No later cell runs these programs (another batch size or temperature): free them,
      # or a long sweep reaches the process's mapping limit (specjax.compile_cache: B = 1-8
      # at T = 0 and then T = 1 did, at T = 1's second cell).
      jax.clear_caches()
  cells = [c for c in cells if c["batch"] in batches and c["temperature"] in temps]
  command = " ".join(["python -m benchmarks.batch_sweep", *sys.argv[1:]])
  write_markdown(OUT.value, _report(cells, gammas, command,
                                    (time.perf_counter() - start) / 60))
  _figure(cells, os.path.splitext(OUT.value)[0] + ".png")


if __name__ == "__main__":
  app.run(main)
