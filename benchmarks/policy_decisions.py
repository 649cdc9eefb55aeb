"""How well the adaptive policy chooses, without timing noise: its modelled speedup against
each of its choices held fixed, on held-out prompts over several seeds.

Usage:
  python -m benchmarks.policy_decisions [--results <tree sweep dir>/results.json]
      [--temperatures 1] [--prompts 10] [--seeds 3] [--new_tokens 128]
      [--out benchmarks/results/policy_decisions.md]

The policy is the adaptive row of each temperature in ``--results``: a tree sweep's (its
choices, the step costs measured on this machine in that run, the calibration table and the
chains' rate α_c beside it) or the default run's adaptive γ row (chains and plain decoding,
its step costs; at batch 1 it starts from the policy's default prior, as it ran). A tree
sweep's row that predates α_c gets it measured here as the sweep's calibration measures it
(``Bench.calibrate``: a chain as deep as the calibration tree, on the same training-side
prompts, seed and length), so an old sweep is judged with today's pricing. Every
setting decodes each prompt alone (batch 1, as the sweep), to exactly ``new_tokens`` tokens
(no EOS stop), once per seed, chains verified as that run verified them (trees token-wise):

  * each choice held fixed: a chain of γ or a tree, as a plain ``SpeculativeDecoder``;
  * the policy, the policy counting its sampled chains' accept/reject outcomes in place of
    their βs (``AdaptiveGamma.evidence="accepted"``, how the policy counted before it
    weighed βs; at T > 0 only: greedy βs are the outcomes), and the policy over its chains only
    (its trees taken out), with the steps each took of every choice and the mean running
    estimate it chose them on;

and the table gives each one's **modelled speedup**: generated tokens over the sum of its
steps' costs in plain decoding steps (a fixed setting: steps × its cost; the policy: the
per-choice step counts ``choice_steps`` times their costs), prefill excluded. That is the
speedup the run would measure if every step took its calibrated time; it isolates the
quality of the choices from the machine's timing noise and from the loop's overhead, which
the tree sweep's timed row includes. Sampled texts differ between settings at T > 0, so the
per-seed ratios show the noise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import tqdm
from absl import app, flags

from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.measure import as_tuple, choice_names, policy_of, setting_chain_alpha
from experiments.models import load_draft, load_target
from experiments.prompts import default_prompts, training_prompts
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.adaptive import AdaptiveGamma
from specjax.speculative.calibration import measure_chain_alpha
from specjax.speculative.metrics import mean_estimates

RESULTS = flags.DEFINE_string(
    "results", "experiments/results/avx2_zen3/trees_adaptive_batch1/results.json",
    "results.json with adaptive rows: a tree sweep's (python -m experiments.run "
    "--experiment=tree_sweep) or the default run's (its adaptive γ rows)")
TEMPS = flags.DEFINE_list("temperatures", ["1"], "temperatures of the sweep's adaptive rows")
PROMPTS = flags.DEFINE_integer("prompts", 10, "held-out prompts (round-robin over categories)")
SEEDS = flags.DEFINE_integer("seeds", 3, "seeds per prompt (>= 1)")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens generated per prompt")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
OUT = flags.DEFINE_string("out", "benchmarks/results/policy_decisions.md", "markdown output")


def sweep_policies(path: str, temperatures: list[float], chain_rate=None
                   ) -> dict[float, AdaptiveGamma]:
  """The adaptive policy of each temperature's tree-sweep or adaptive-γ row in a
  results.json (a tree sweep's, where both are present); a tree-sweep row that predates α_c
  gets ``chain_rate(results, T)`` as its ``prior_alpha``."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--results {path}: no such file (a results.json with adaptive rows)")
  with open(path) as f:
    results = json.load(f)
  rows = results["rows"]
  found, kind = {}, {}
  for r in sorted(rows, key=lambda r: r["experiment"] == "tree_sweep"):  # tree sweeps win
    if (r["experiment"] in ("tree_sweep", "adaptive") and r["shape"] == "adaptive"
        and r["category"] == "all"):
      found[r["temperature"]], kind[r["temperature"]] = as_tuple(r["tree"]), r["experiment"]
  missing = [t for t in temperatures if t not in found]
  if missing:
    raise ValueError(f"--results {path} has no adaptive row at T = {missing} "
                     f"(it has T = {sorted(found)})")
  policies = {t: policy_of(found[t]) for t in temperatures}
  if chain_rate is None:
    return policies
  return {t: p if setting_chain_alpha(found[t]) is not None or kind[t] != "tree_sweep"
          else dataclasses.replace(p, prior_alpha=round(chain_rate(results, t), 4))
          for t, p in policies.items()}


def calibration_chain_rate(target, draft):
  """``chain_rate`` for ``sweep_policies``: α_c measured as the sweep's ``Bench.calibrate``
  does, from its recorded configuration."""
  def rate(results: dict, temperature: float) -> float:
    cfg = results["config"]
    template = SpeculativeDecoder(target.cfg, draft.drafter, eos_ids=(
        None if cfg["stop_at_eos"] else ()), sampler=make_sampler(temperature))
    prompts = [target.encode(t) for t in training_prompts(cfg["calibration_prompts"])]
    print(f"T={temperature:g}: measuring α_c on {len(prompts)} calibration prompts", flush=True)
    return measure_chain_alpha(template, target.params, draft.params, prompts,
                               len(cfg["calibration_tree"]), cfg["max_new_tokens"],
                               seed=cfg["seed"], cache_size=results["cache_size"])
  return rate


RULE_WORDS = {"tokenwise": "token-wise", "block": "block-wise (Sun et al. 2024)"}


def run_verification(path: str) -> str:
  """How the run behind ``path`` verified its chains (``SpeculativeDecoder.verification``;
  its trees, and a policy with trees, token-wise): "tokenwise" for runs that predate the
  choice."""
  with open(path) as f:
    return json.load(f)["config"].get("verification", "tokenwise")


def settings(policy: AdaptiveGamma, temperature: float
             ) -> dict[str, tuple[AdaptiveGamma | None, dict, float]]:
  """name -> (policy or None, the decoder's shape keywords, a fixed setting's step cost)."""
  out = {name: (None, dict(tree=policy.shape(i)), cost)
         for i, (name, cost) in enumerate(zip(choice_names(policy), policy.costs))
         if policy.shape(i) is not None}
  out["adaptive"] = (policy, {}, 0.0)
  if temperature > 0:  # greedy βs are the outcomes: the same policy
    out["adaptive, outcomes counted"] = (dataclasses.replace(policy, evidence="accepted"),
                                         {}, 0.0)
  if policy.trees:
    chains = dataclasses.replace(policy, trees=(), tree_costs=(), rank_accept=None)
    out["adaptive, chains only"] = (chains, {}, 0.0)
  return out


def main(_):
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  temps = [float(t) for t in TEMPS.value]
  if not temps or min(temps) < 0 or SEEDS.value < 1 or PROMPTS.value < 1 or NEW.value < 1:
    raise ValueError("--temperatures must be >= 0; --seeds, --prompts, --new_tokens >= 1")
  target = load_target("smollm2")
  draft = load_draft(DRAFT.value, target, lambda: [])
  policies = sweep_policies(RESULTS.value, temps, calibration_chain_rate(target, draft))
  verification = run_verification(RESULTS.value)
  evals = default_prompts(PROMPTS.value)
  prompts = [target.encode(p.text) for p in evals]
  start = time.perf_counter()
  lines = ["# The adaptive policy's choices, modelled: tokens per unit of calibrated step cost",
           "", f"{provenance()}; draft `{draft.name}` ({draft.note}); policies and step costs "
           f"from `{RESULTS.value}`; {len(prompts)} held-out prompts "
           f"({', '.join(sorted({p.category for p in evals}))}), each alone (batch 1), "
           f"{NEW.value} new tokens, no EOS stop, seeds 0…{SEEDS.value - 1} (one at T = 0: "
           f"greedy decoding draws nothing); chains verified {RULE_WORDS[verification]} (as in "
           "that run; trees token-wise).", "",
           "Modelled speedup = generated tokens / Σ step costs (in plain decoding steps, as "
           "measured in the sweep), prefill excluded: what a timed run would give if every "
           "step took its calibrated time. Per seed: the policy's over the best fixed "
           "setting's, seed by seed (sampled texts differ between settings at T > 0).", ""]
  for t, policy in policies.items():
    sampler = make_sampler(t)
    table = settings(policy, t)
    seeds = SEEDS.value if t > 0 else 1  # greedy decoding draws nothing
    # One buffer length for every prompt and setting (the policy's headroom covers each
    # choice's): one compiled loop per setting, not one per prompt length.
    size = max(map(len, prompts)) + NEW.value + policy.cache_headroom
    tokens = {k: np.zeros(seeds) for k in table}
    cost = {k: np.zeros(seeds) for k in table}
    steps = {k: np.zeros(policy.num_choices, np.int64) for k in table}
    estimate = {k: np.zeros(policy.num_choices) for k in table}  # Σ α̂ behind each choice
    jobs = [(s, p, k) for s in range(seeds) for p in prompts for k in table]
    for seed, prompt, name in tqdm.tqdm(jobs, desc=f"T={t:g}", unit="run"):
      pol, shape, step_cost = table[name]
      chains = (pol is None and shape["tree"].is_chain) or (pol is not None and not pol.trees)
      dec = SpeculativeDecoder(target.cfg, draft.drafter, sampler=sampler, eos_ids=(),
                               policy=pol, verification=verification if chains else "tokenwise",
                               **shape)
      out = dec.generate(target.params, draft.params, [prompt], NEW.value, seed=seed,
                         cache_size=size)
      tokens[name][seed] += out.num_generated.sum()
      if pol is None:
        cost[name][seed] += out.steps * step_cost
      else:
        taken = out.per_row["choice_steps"].sum(axis=0)
        cost[name][seed] += float(np.dot(taken, pol.costs))
        steps[name][:len(taken)] += taken
        estimate[name][:len(taken)] += out.per_row["choice_estimate"].sum(axis=0)
    speedup = {k: tokens[k].sum() / cost[k].sum() for k in table}
    fixed = [k for k in table if table[k][0] is None]
    best = max(fixed, key=speedup.get)
    per_seed = lambda k: tokens[k] / cost[k] / (tokens[best] / cost[best])
    names = choice_names(policy)
    rates = (f"chains α_c = {policy.prior_alpha:.3f}, trees α_A = {policy.table_alpha:.3f} "
             "(rank-0 drafts of the table)" if policy.trees
             else f"chains α_c = {policy.prior_alpha:.3f} (the prior the policy starts from)")
    lines += [f"## T = {t:g}", "", f"Calibrated rates: {rates}.", "",
              "| setting | step cost | steps by choice (mean α̂ behind them) | modelled speedup "
              "| / best fixed | per seed |", "|---|---|---|---|---|---|"]
    for k, (pol, _, step_cost) in table.items():
      taken = (", ".join(f"{names[i]}: {n} ({e:.2f})" for i, (n, e) in enumerate(
          zip(steps[k], mean_estimates(estimate[k], steps[k]))) if n)
               if pol is not None else "–")
      lines.append(f"| {k} | {'mixed' if pol is not None else f'{step_cost:.2f}'} | {taken} | "
                   f"**{speedup[k]:.3f}×** | {speedup[k] / speedup[best]:.1%} | "
                   f"{', '.join(f'{x:.0%}' for x in per_seed(k))} |")
    lines.append("")
    print(f"T={t:g} done ({time.perf_counter() - start:.0f} s)", flush=True)
  lines.append(f"{time.perf_counter() - start:.0f} s in all.")
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
