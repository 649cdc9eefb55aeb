"""results.json, results.csv and tables.md (markdown ready to paste, the paper's numbers beside)."""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
from typing import Any, Optional, Sequence

import numpy as np

from experiments import checks, paper
from experiments.machine import cpu_info, describe_cpu, matmul_path
from experiments.measure import SpecRun, as_tuple, choice_names, policy_of, setting_chain_alpha
from experiments.prompts import ALL
from specjax.attention import resolve_impl
from specjax.model import compute_dtype

CSV_COLUMNS = ("experiment", "draft", "gamma", "temperature", "category", "prompts", "alpha",
               "acceptance_rate", "tokens_per_call", "expected_tokens_per_call", "speedup",
               "speedup_spread", "decode_speedup", "ar_prefill_share", "prefill_ratio",
               "rounds", "flags", "remeasured", "c_remeasured", "predicted_speedup",
               "calibrated_speedup", "calibrated_call_speedup", "c", "verify_cost", "spec_seconds",
               "ar_seconds", "step_seconds", "target_calls", "drafted", "accepted", "emitted",
               "generated_tokens", "steps", "greedy_match", "paired_gamma", "paired_speedup")


def git_revision() -> dict[str, Any]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def run(*args):
    try:
      return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout
    except OSError:  # no git binary (a bare container): the revision is unknown, not an error
      return ""

  return {"commit": run("rev-parse", "HEAD").strip() or None,
          "dirty": bool(run("status", "--porcelain", "--untracked-files=no").strip())}


def machine_info(target_params=None) -> dict[str, Any]:
  """CPU, cores, versions, the attention implementation and (given the target's parameters)
  the matmul path and dtype it runs."""
  import jax
  cpu = cpu_info()
  paths = {} if target_params is None else {"matmul": matmul_path(target_params),
                                             "dtype": str(compute_dtype(target_params))}
  paths["attention"] = resolve_impl("auto")  # SPECJAX_ATTENTION or the backend's default
  return {"cpu": describe_cpu(cpu), "cpu_model": cpu["model"], **paths,
          **{f"cpu_{k}": v for k, v in cpu.items() if k != "model"},
          "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
          "python": platform.python_version(), "platform": platform.platform()}


_RULE_WORDS = {"tokenwise": "token-wise", "block": "block-wise"}  # --verification in tables


def _tree_rule_words(results: dict) -> str:
  """The header's words on trees under --verification=block: traversal verification since
  2026-12-08 (``results["tree_verification"]``); before, trees were verified token-wise
  under either rule, and runs of that time record nothing (no words)."""
  if results.get("tree_verification") != "traversal":
    return ""
  return ", trees by traversal verification (Weng et al. 2025)"


def run_summary(run: SpecRun) -> dict[str, Any]:
  """A run's timings and provenance for results.json (the token-level outputs stay in the
  progress log), with how many tokens each row generated in each method (``tokens``,
  ``plain_tokens``: per batch, per row), which the speedups' length scaling reads
  (``measure.same_length_seconds``)."""
  rec = run.to_record()
  count = lambda generated: None if generated is None else [list(map(len, b)) for b in generated]
  return dict({k: v for k, v in rec.items()
               if k not in ("counters", "generated", "plain_generated")},
              tokens=count(run.generated), plain_tokens=count(run.plain_generated))


def write_json(path: str, results: dict) -> None:
  with open(path, "w") as f:
    json.dump(results, f, indent=1, default=float)


def write_csv(path: str, rows: Sequence[dict]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(dict(r, flags="; ".join(r["flags"])) for r in rows)


def _f(x, fmt="{:.2f}", suffix="") -> str:
  return "–" if x is None else fmt.format(x) + suffix


def _speed_table(rows: Sequence[dict], key: str, key_name: str) -> list[str]:
  out = [f"| {key_name} | α | accept rate | tokens/call | c | verify T(γ+1)/T(1) | "
         "measured speedup | spread | decode-only speedup | plain prefill share | "
         "predicted (paper) | predicted (calibrated) | calibrated, whole call | check |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    label = f"{r[key]:g}" if r.get("tree") is None else _shape(r)
    out.append(f"| {label} | {_f(r['alpha'])} | {_f(r['acceptance_rate'])} | "
               f"{_f(r['tokens_per_call'])} | {_f(r['c'], '{:.3f}')} | "
               f"{_f(r['verify_cost'])} | **{_f(r['speedup'], suffix='×')}** | "
               f"{_f(r['speedup_spread'], '{:.0%}')} | "
               f"{_f(r.get('decode_speedup'), suffix='×')} | "
               f"{_f(r.get('ar_prefill_share'), '{:.0%}')} | "
               f"{_f(r['predicted_speedup'], suffix='×')} | "
               f"{_f(r['calibrated_speedup'], suffix='×')} | "
               f"{_f(r.get('calibrated_call_speedup'), suffix='×')} | {_check(r)} |")
  return out


def _check(row: dict) -> str:
  """"ok", or ⚠ and what ``checks`` found; "(re-measured)" when its rounds took a second
  try, "(c re-measured)" when the draft phase behind c did."""
  again = (" (re-measured)" if row.get("remeasured") else "") + (
      " (c re-measured)" if row.get("c_remeasured") else "")
  return ("⚠ " + "; ".join(row["flags"]) if row["flags"] else "ok") + again


def _category_table(rows: Sequence[dict], key: str, key_name: str) -> list[str]:
  out = [f"| category | {key_name} | prompts | α | accept rate | tokens/call | "
         "measured speedup | spread | predicted (paper) | predicted (calibrated) | "
         "calibrated, whole call | check |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted((r for r in rows if r["category"] != ALL),
                  key=lambda r: (r["category"], r[key])):
    out.append(f"| {r['category']} | {r[key]:g} | {r['prompts']} | {_f(r['alpha'])} | "
               f"{_f(r['acceptance_rate'])} | {_f(r['tokens_per_call'])} | "
               f"{_f(r['speedup'], suffix='×')} | {_f(r['speedup_spread'], '{:.0%}')} | "
               f"{_f(r['predicted_speedup'], suffix='×')} | "
               f"{_f(r['calibrated_speedup'], suffix='×')} | "
               f"{_f(r.get('calibrated_call_speedup'), suffix='×')} | {_check(r)} |")
  return out


def _paper_table2() -> list[str]:
  out = ["| task | draft | T | γ | α | speedup |", "|---|---|---|---|---|---|"]
  out += [f"| {t} | {d} | {T} | {g} | {a:.2f} | {s}× |" for t, d, T, g, a, s in paper.TABLE2]
  return out


def _timing_note(repeats: int, extra: int) -> str:
  if repeats == 1 and not extra:
    return "one round: each batch timed once with each method, plain then speculative"
  rounds = f"{repeats} interleaved round{'s' if repeats > 1 else ''}"
  if extra:
    rounds += (f", up to {repeats + extra} for a setting whose speedup (overall or one "
               f"category's) spread more than {checks.SPREAD_BOUND:.0%} over its rounds before: "
               "an added round times plain decoding and those settings only (with every setting "
               "of their group: the adaptive policy and the γ timed beside it), on the batches "
               "that spread only")
  return (f"{rounds}; each round times its batches with plain then speculative decoding; the "
          "median round (of those that timed all the row's batches) is reported, spread = "
          "(max − min) / median of the per-round speedups")


def _load_line(results: dict) -> str:
  """The load average before the run and the 1-minute load sampled around every setting."""
  during = [x[0] for r in results["runs"] for x in (r.get("load_average") or []) if x]
  line = f"load average before the run {_f3(results['load_average_start'])}"
  if during:
    line += (f", 1-minute load around the timed settings {min(during):.2f}–{max(during):.2f} "
             "(this run included)")
  start = results["load_average_start"]
  if start and start[0] >= checks.IDLE_LOAD:
    line += (f" — ⚠ the machine was not idle at the start (1-minute load {start[0]:.2f} >= "
             f"{checks.IDLE_LOAD})")
  return line


def _f3(load: Optional[Sequence[float]]) -> str:
  return "unknown" if not load else "/".join(f"{x:.2f}" for x in load)


def _shape(row: dict) -> str:
  """"γ = 4" for a chain, "tree N = 8, D = 3" for a tree."""
  if row.get("tree") is None:
    return f"γ = {row['gamma']}"
  return f"{row['shape']} N = {row['num_nodes']}, D = {row['gamma']}"


def _flag_section(rows: Sequence[dict]) -> list[str]:
  """Every setting still flagged after its re-measurement, with the rule."""
  def setting(r: dict) -> tuple:  # one measurement, whichever experiments reuse its rows
    return r["draft"], r["gamma"], r["temperature"], r["tree"] and as_tuple(r["tree"])

  timed = [r for r in rows if r["speedup"] is not None]
  settings = {}
  for r in timed:
    if r["category"] == ALL:
      settings.setdefault(setting(r), r)
  flagged = [r for r in settings.values() if r["flags"]]
  groups = {(*setting(r), r["category"]) for r in timed if r["category"] != ALL and r["flags"]}
  lines = ["## Checks", "",
           f"A setting is flagged when its verify cost T(γ+1)/T(1) lies outside (0, γ+1] "
           f"(impossible), when its speedup varies by more than {checks.SPREAD_BOUND:.0%} "
           "((max − min) / median) over the interleaved rounds, or when the draft-phase "
           f"timings behind c vary by more than {checks.DRAFT_SPREAD_BOUND:.0%} ((q75 − q25) / "
           "median over the fused loop's timed slopes). A setting flagged for its rounds "
           "(speedup spread, verify cost) is measured a second time, and a draft phase flagged "
           "for its spread is timed a second time (c is shared by the settings of one draft "
           "and temperature); the second measurement is reported.", ""]
  remeasured = sum(r["remeasured"] for r in settings.values())
  c_again = len({(r["draft"], r["temperature"]) for r in settings.values()
                 if r.get("c_remeasured")})
  again = f"{remeasured} re-measured, c re-measured for {c_again} draft/temperature pair(s)"
  by_category = ([f"{len(groups)} per-category figure(s) of the measured settings still "
                  "flagged (those of the best γ and of the temperature sweep are marked ⚠ in "
                  "the per-category tables): a category's speedup rests on its own prompts' "
                  "calls alone, so it spreads more than its setting's.", ""] if groups else [])
  if not flagged:
    return lines + [f"No setting is flagged ({again}).", ""] + by_category
  lines += [f"**{len(flagged)} setting(s) flagged** ({again}); treat their "
            "timing figures with caution:", ""]
  lines += [f"- draft {r['draft']}, {_shape(r)}, T = "
            f"{r['temperature']:g}: {'; '.join(r['flags'])}" for r in flagged]
  return lines + [""] + by_category


def _phase_minutes(results: dict) -> str:
  """" (gamma sweep 6.4, adaptive 2.6, …; start-up, loading and writing 1.0)": where the
  run's minutes went, each experiment's from ``experiment_seconds``."""
  phases = results.get("experiment_seconds") or {}
  if not phases:
    return ""
  rest = results["total_seconds"] - sum(phases.values())
  parts = [f"{name.replace('_', ' ')} {seconds / 60:.1f}" for name, seconds in phases.items()]
  return f" ({', '.join(parts)}; start-up, loading and writing {rest / 60:.1f})"


def tables_markdown(results: dict) -> str:
  rows, cfg = results["rows"], results["config"]
  draft = results["draft"]
  lines = [
      "# Speculative decoding: measured speedups (specjax)", "",
      f"Command: `{results['command']}`  ",
      f"git {results['git']['commit'] or '?'}{' (dirty)' if results['git']['dirty'] else ''}; "
      f"{results['machine']['cpu']}, {results['machine']['cores']} cores, "
      f"jax {results['machine']['jax']} ({results['machine']['backend']}); "
      f"matmul: {results['machine'].get('matmul', 'not recorded')}; "
      f"weights, activations and KV cache in {results['machine'].get('dtype', 'float32')}; "
      f"attention: {results['machine'].get('attention', 'not recorded')}; "
      f"{_load_line(results)}; total {results['total_seconds'] / 60:.1f} min"
      f"{_phase_minutes(results)}{_resumed(results)}.  ",
      f"Target `{cfg['target']}`; draft `{draft['name']}` ({draft['note']}); "
      f"{results['num_prompts']} prompts ({', '.join(results['categories'])}), "
      f"{cfg['max_new_tokens']} new tokens each, batches of {cfg['batch_size']} "
      f"(one category per batch), {'stopping at EOS' if cfg['stop_at_eos'] else 'EOS ignored'}; "
      f"chains verified {_RULE_WORDS[cfg.get('verification', 'tokenwise')]}"
      f"{' (Sun et al. 2024)' if cfg.get('verification') == 'block' else ''}"
      f"{_tree_rule_words(results)}"
      f"{_draft_temperature_words(cfg.get('draft_temperature', 1.0))}.",
      "",
      "Conventions: α = E[β] with β = Σₓ min(p, q) over positions up to the first rejection; "
      "accept rate = accepted / drafted; tokens/call = emitted tokens (accepted + corrected or "
      "bonus, cut at the budget) per target call. Measured speedup = warm wall time of "
      "`specjax.generate` / warm wall time of speculative decoding on the same batches "
      "(where rows stop at EOS at T > 0, each speculative decode loop scaled to the length "
      "plain decoding's call ran for, its prefill as measured) "
      f"({_timing_note(cfg.get('repeats', 1), cfg.get('extra_rounds', 0))}). "
      "Decode-only speedup = the same with each "
      "call's prefill taken out (plain / speculative decode-loop time); plain prefill share = "
      "the share of plain decoding's wall time spent prefilling the prompts. The measured "
      "speedup lies between the decode-only one and the prefill ratio (plain / speculative "
      "prefill time, below 1 where the draft has a prefill of its own), nearer the latter "
      "the larger the prefill share. "
      "t₁ = one step of plain decoding (fused loop, prefill excluded, pooled over the round's "
      "batches); c = draft time per draft "
      f"token / t₁ (the draft phase at γ = {cfg['alpha_gamma']} timed in a fused loop, "
      "`experiments/phase_timing.py`); verify T(γ+1)/T(1) = "
      "measured speculative step / t₁ − γc (target forward over γ+1 tokens + acceptance and "
      "bookkeeping). Predicted (paper) = (1 − α^{γ+1}) / ((1 − α)(γc + 1)); calibrated "
      "replaces the 1 in the denominator with the measured verify cost and the numerator "
      "with what batches that wait for their slowest row make (each row at its own α; "
      "`theory.batched_expected_tokens`; at batch 1, about the same): a prediction of the "
      "decode loop, to be read against the decode-only speedup. Calibrated, whole call = "
      "that prediction with the prefill as measured, 1 / (s / r_p + (1 − s) / calibrated) "
      "with s the plain prefill share and r_p the prefill ratio "
      "(`theory.whole_call_improvement`): what the measured speedup is to be read against.",
      ""]
  if any(r["speedup"] is not None for r in rows):
    lines += _flag_section(rows)
  sweep = [r for r in rows if r["experiment"] == "gamma_sweep"]
  if sweep:
    lines += ["## Speedup vs γ (Table 2 analogue)", ""]
    for t in sorted({r["temperature"] for r in sweep}):
      lines += [f"### T = {t:g}", ""]
      lines += _speed_table([r for r in sweep if r["temperature"] == t and r["category"] == ALL],
                            "gamma", "γ") + [""]
    best = results.get("best_gamma")
    if any(r["tree"] is not None for r in sweep):
      lines += ["Dynamic tree rows (`--sweep_trees`: EAGLE-2's top-k children, or sampled "
                "dynamic trees' drawn children, w = nodes per depth): timed in the same rounds "
                "as the chains; N nodes verified per step, D deep, accept rate = accepted / N "
                "per step. Their α, c, verify and predicted columns stay empty: β = Σ min(p, q) "
                "is defined for chains of sampled drafts, a tree's draft phase is not γ "
                "single-token forwards, and the paper's formula is a chain's.", ""]
    lines += [f"### Per category at the best γ = {best}", ""]
    lines += _category_table([r for r in sweep if r["gamma"] == best and r["tree"] is None],
                             "temperature", "T") + [""]
  lines += _adaptive_section(rows)
  temp = [r for r in rows if r["experiment"] == "temperature_sweep"]
  if temp:
    g = temp[0]["gamma"]
    lines += [f"## Speedup vs temperature at γ = {g}", ""]
    lines += _speed_table([r for r in temp if r["category"] == ALL], "temperature", "T") + [""]
    lines += ["### Per category", ""] + _category_table(temp, "temperature", "T") + [""]
  alpha = [r for r in rows if r["experiment"] == "drafts_alpha" and r["category"] == ALL]
  if alpha:
    g = alpha[0]["gamma"]
    corpus = results.get("ngram_corpus")
    lines += [f"## α of each draft (Table 3 analogue, γ = {g})", "",
              *([f"unigram / bigram fitted on {corpus}.", ""] if corpus else []),
              *(["Untimed T = 0 runs are replayed against the target's greedy continuations "
                 "(`specjax.speculative.replay`): a real greedy run's tokens and counters, "
                 "exactly (tests/test_replay.py), at the draft's cost alone.", ""]
                if any(r.get("replayed") for r in alpha) else []),
              "| draft | α T=0 | α T=1 | accept rate T=0 | accept rate T=1 | tokens/call T=0 | "
              "tokens/call T=1 | note |", "|---|---|---|---|---|---|---|---|"]
    notes = results.get("draft_notes", {})
    for name in dict.fromkeys(r["draft"] for r in alpha):
      by_t = {r["temperature"]: r for r in alpha if r["draft"] == name}
      get = lambda t, k: by_t[t][k] if t in by_t else None
      lines.append(f"| {name} | {_f(get(0.0, 'alpha'))} | {_f(get(1.0, 'alpha'))} | "
                   f"{_f(get(0.0, 'acceptance_rate'))} | {_f(get(1.0, 'acceptance_rate'))} | "
                   f"{_f(get(0.0, 'tokens_per_call'))} | {_f(get(1.0, 'tokens_per_call'))} | "
                   f"{notes.get(name, '')} |")
    lines.append("")
    lines += _depth_acceptance(alpha)
  lines += _tree_section(results)
  lines += _draft_free_section(results)
  lines += ["## The paper's numbers, for reference", "", paper.SETUP, "",
            "Table 2 (empirical speedups):", ""] + _paper_table2() + [
            "", "Table 3 (α, T=0 / T=1):", "", "| target | draft | α T=0 | α T=1 |",
            "|---|---|---|---|"]
  lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in paper.TABLE3]
  lines += ["", "Table 4 (T=0, expected from Thm 3.8 with measured c vs empirical):", "",
            "| task | draft | c | expected | empirical |", "|---|---|---|---|---|"]
  lines += [f"| {a} | {b} | {c} | {e}× | {m}× |" for a, b, c, e, m in paper.TABLE4]
  return "\n".join(lines) + "\n"


def depth_acceptance(accept_len_hist: Sequence[int]) -> list[Optional[float]]:
  """P(a node at depth d is accepted | one at depth d − 1 was), d = 1 … D, from a run's
  histogram of accepted lengths: for Medusa's tree, head d − 1's acceptance in real
  decoding (Table 3 of the Medusa paper). Example: [2, 1, 1] → [0.5, 0.5]."""
  h = np.asarray(accept_len_hist, dtype=np.float64)
  at_least = h[::-1].cumsum()[::-1]  # steps that accepted >= d drafts
  return [None if at_least[d - 1] == 0 else float(at_least[d] / at_least[d - 1])
          for d in range(1, len(h))]


def _depth_acceptance(alpha: Sequence[dict]) -> list[str]:
  """Per-depth acceptance of the Table-3 drafts measured on their own trees."""
  own = [r for r in alpha if r["shape"] == "own tree" and len(r["accept_len_hist"]) > 2]
  if not own:
    return []
  lines = ["Per-depth acceptance on a draft's own tree: P(depth d accepted | depth d − 1 "
           "accepted); for Medusa, head d − 1's acceptance in real decoding (the Medusa "
           "paper's Table 3).", "", "| draft | T | nodes | depth 1, 2, … |", "|---|---|---|---|"]
  for r in own:
    lines.append(f"| {r['draft']} | {r['temperature']:g} | {r['num_nodes']} | "
                 + ", ".join(_f(a) for a in depth_acceptance(r["accept_len_hist"])) + " |")
  return lines + [""]


def margin_words(gains) -> str:
  """Words for adaptive policies' ``min_gain`` values (None: not recorded, from before it
  existed, when the policy took the formula's argmax); empty when every one is 0."""
  gains = sorted({g or 0.0 for g in gains})
  if gains == [0.0]:
    return ""
  return ("a draft taken only when it promises more than "
          + " or ".join(f"{g:.0%}" for g in gains) + " over plain decoding (`min_gain`)")


EVIDENCE_WORDS = {
    "expected": "a sampled step adds its drafts' βs, their chances of acceptance, not the "
                "outcomes (a chain's: each draft's β weighted by its chance of being scored "
                "given the drafts, under either verification rule, since 2026-12-07; before, "
                "the scored drafts' βs, and outcomes under block verification; a tree's "
                "first-ranked chain's scored nodes since d36ca86)",
    "accepted": "a sampled chain step adds its drafts' outcomes (`--evidence=accepted`)",
    None: "a sampled chain step's count not recorded (its outcomes before git 3d3668c, each "
          "scored draft's β after)"}


def evidence_words(values) -> str:
  """Words for what adaptive policies counted of a sampled chain step (their rows'
  ``evidence``; None: a record from before it was carried)."""
  return "; ".join(EVIDENCE_WORDS[v] for v in sorted(set(values), key=str))


def matmul_words(cells: list[dict]) -> str:
  """Words for the matmul paths a sweep's cells ran (``experiments.machine.matmul_path``;
  cells measured before it was recorded say so)."""
  by_path: dict[str, list[str]] = {}
  for c in cells:
    by_path.setdefault(c.get("matmul") or "not recorded", []).append(
        f"T = {c['temperature']:g} B = {c['batch']}")
  if len(by_path) == 1:
    return f"Matmul path: {next(iter(by_path))}."
  return "Matmul paths (the cells differ): " + " | ".join(
      f"{', '.join(where)}: {p}" for p, where in sorted(by_path.items())) + "."


def _adaptive_section(rows: Sequence[dict]) -> list[str]:
  """The adaptive policy against plain decoding and against the best fixed γ of the sweep."""
  adaptive = [r for r in rows if r["experiment"] == "adaptive" and r["category"] == ALL]
  if not adaptive:
    return []
  margin = margin_words(r.get("min_gain") for r in adaptive)
  margin = margin and ", " + margin
  lines = ["## Adaptive γ", "",
           "`AdaptiveGamma` (specjax/speculative/adaptive.py) picks each step's γ inside the "
           "jitted loop: the choice with the most expected tokens (1 + α̂ + … + α̂^γ, α̂ a "
           "running per-row estimate; "
           + evidence_words(r.get("evidence") for r in adaptive)
           + ") per unit of step cost, γ = 0 being a "
           "plain decoding "
           f"step{margin}. Its step costs are those the γ sweep measured above "
           "(step / t₁ on these batches), made non-decreasing in γ. Steps at γ counts the "
           "steps it took at each of its choices (0 = plain decoding), with the mean α̂ it "
           "chose them on. It is timed in the same rounds as the sweep's best γ, measured "
           "again beside it: adaptive / best fixed compares the two in those rounds (the "
           "host's state moves every ratio between rounds).", "",
           "| T | choices | step costs | steps at γ | tokens/call | measured speedup | spread | "
           "decode-only speedup | best fixed γ: in the sweep, beside the policy | "
           "adaptive / best fixed | check |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(adaptive, key=lambda r: r["temperature"]):
    policy = policy_of(as_tuple(r["tree"]))
    choices, step_costs = policy.gammas, policy.step_costs
    if r.get("choice_steps"):
      steps = " / ".join(f"{g}: {n}" + (f" (α̂ {e:.2f})" if n else "") for g, n, e
                         in zip(choices, r["choice_steps"], r["choice_estimate"]))
    else:  # records before the per-choice counters: a chain's depth is its γ
      hist = r.get("depth_hist") or []
      steps = " / ".join(f"{g}: {hist[g]}" for g in choices if g < len(hist))
    fixed = [f for f in rows if f["experiment"] == "gamma_sweep" and f["category"] == ALL
             and f["temperature"] == r["temperature"] and f["speedup"] and f["tree"] is None]
    if r.get("paired_speedup"):  # the sweep's best γ timed again in the policy's rounds
      best = next((f for f in fixed if f["gamma"] == r["paired_gamma"]), None)
      paired = r["paired_speedup"]
      best_cell = (f"γ = {r['paired_gamma']}: "
                   + (f"{best['speedup']:.2f}×, " if best else "")
                   + f"**{paired:.2f}×**")
    else:  # records before the pairing: the sweep's rounds only
      best = max(fixed, key=lambda f: f["speedup"]) if fixed else None
      paired = best and best["speedup"]
      best_cell = f"γ = {best['gamma']} ({best['speedup']:.2f}×), sweep only" if best else "–"
    ratio = r["speedup"] / paired if paired and r["speedup"] else None
    lines.append(
        f"| {r['temperature']:g} | {', '.join(map(str, choices))} | "
        f"{', '.join(f'{c:.2f}' for c in step_costs)} | {steps} | "
        f"{_f(r['tokens_per_call'])} | **{_f(r['speedup'], suffix='×')}** | "
        f"{_f(r['speedup_spread'], '{:.0%}')} | {_f(r.get('decode_speedup'), suffix='×')} | "
        f"{best_cell} | {_f(ratio, '{:.0%}')} | {_check(r)} |")
  spread = [(r["temperature"], policy) for r in sorted(adaptive, key=lambda r: r["temperature"])
            if (policy := policy_of(as_tuple(r["tree"]))).prompt_ease]
  if spread:
    lines += ["", "Its batches are priced for the row they wait on: each choice's expected "
              "tokens are scaled by η(b), the share of the rows' mean that b rows' slowest "
              "makes, from the chains' rate α_c and each calibration prompt's own (held-out "
              "prompts after the evaluated ones, each decoded alone; training-side ones in "
              "records before 2026-12-06): "
              + "; ".join(f"T = {t:g}: α_c {p.prior_alpha:.2f}, by prompt "
                          f"{min(p.prompt_ease) * p.prior_alpha:.2f}–"
                          f"{max(p.prompt_ease) * p.prior_alpha:.2f}" for t, p in spread)
              + "."]
  return lines + [""]


def _tree_section(results: dict) -> list[str]:
  """The tree sweep: chains and the best static trees, tokens per call and speedup."""
  rows = [r for r in results["rows"] if r["experiment"] == "tree_sweep" and r["category"] == ALL]
  if not rows:
    return []
  lines = ["## Token trees vs chains (tree sweep)", "",
           "Trees: `tree_builders.best_static_tree` for each node budget N, from the per-depth, "
           "per-rank acceptance measured with a full tree on calibration prompts "
           "(below); dynamic: EAGLE-2 trees (frontier k, the static tree's depth, "
           "N nodes kept by cumulative draft log-probability). Tokens/call counts the +1 "
           "correction or bonus token.", ""]
  for t in sorted({r["temperature"] for r in rows}):
    sub = [r for r in rows if r["temperature"] == t]
    chains = [r["tokens_per_call"] for r in sub if r["tree"] is None and r["tokens_per_call"]]
    best_chain = max(chains) if chains else None
    lines += [f"### T = {t:g}", "",
              "| shape | N | D | tokens/call | × best chain | measured speedup | spread | "
              "decode-only speedup | check |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(sub, key=lambda r: (r["shape"], r["num_nodes"])):
      shape = f"chain γ={r['gamma']}" if r["tree"] is None else r["shape"]
      nodes = "mixed" if r["shape"] == "adaptive" else r["num_nodes"]
      ratio = (r["tokens_per_call"] / best_chain) if best_chain and r["tokens_per_call"] else None
      lines.append(f"| {shape} | {nodes} | {r['gamma']} | {_f(r['tokens_per_call'])} "
                   f"| {_f(ratio)} | **{_f(r['speedup'], suffix='×')}** | "
                   f"{_f(r['speedup_spread'], '{:.0%}')} | "
                   f"{_f(r.get('decode_speedup'), suffix='×')} | {_check(r)} |")
    cal = results.get("tree_calibration", {}).get(f"{t:g}")
    if cal:
      # records before 2026-12-06 calibrated on training-side prompts
      lines += ["", f"Calibration: full tree {tuple(cal['branching'])} on {cal['prompts']} "
                f"{cal.get('side', 'training-side prompts')}; P(rank r accepted | parent "
                "accepted), rows = depth 1…:",
                "", "```"] + ["  ".join(f"{x:.3f}" for x in row) for row in cal["table"]] + ["```"]
      if "chain_alpha" in cal:  # records before it have the table only
        lines += ["", f"The chains' rate on the same prompts (a chain of "
                  f"{len(cal['branching'])}): α_c = {cal['chain_alpha']:.3f}."]
    trees = [r for r in sub if r["shape"] == "best tree"]
    lines += [""] + [f"- N={r['num_nodes']}: parents {tuple(r['tree'])}" for r in trees]
    lines += [_adaptive_tree_line(r) for r in sub if r["shape"] == "adaptive"] + [""]
  return lines


def _adaptive_tree_line(row: dict) -> str:
  """What the tree sweep's adaptive policy chose from, at which costs and prices, and how
  often it took each choice (records before the per-choice counters: each depth)."""
  setting = as_tuple(row["tree"])
  policy = policy_of(setting)
  names = choice_names(policy)
  choices = ", ".join(f"{n} ({c:.2f})" for n, c in zip(names, policy.costs))
  shared = setting_chain_alpha(setting) is not None  # older records priced them apart
  line = (f"- adaptive: each step one of {choices} (in brackets its step cost / t₁), priced "
          + ("by the calibration table and α_c above, from one running ease shared by "
             "chains and trees; " if shared else
             "by the calibration table above, chains and trees on separate estimates; "))
  if row.get("choice_steps"):  # records before the per-choice counters have depths only
    taken = [f"{name}: {n} (α̂ {e:.2f})" for name, n, e
             in zip(names, row["choice_steps"], row["choice_estimate"]) if n]
    return line + ("steps taken, with the mean running estimate they were chosen on (the "
                   "chains' for chains and plain steps, the trees' for trees): "
                   + ", ".join(taken))
  steps = ", ".join(f"{d}: {n}" for d, n in enumerate(row.get("depth_hist") or []) if n)
  return line + f"steps taken at depth {steps}"


def _draft_free_section(results: dict) -> list[str]:
  """The methods without a draft model, timed: tokens per call against speedup."""
  rows = [r for r in results["rows"] if r["experiment"] == "draft_free"]
  if not rows:
    return []
  lines = ["## Methods without a draft model (draft_free)", "",
           "Prompt lookup and Jacobi on chains, lookahead decoding on its own tree (window, "
           "n-gram and guess nodes verified in one forward). Chains: verify and calibrated as "
           "in the γ sweep (from α, c and the measured step). Lookahead's tree has no single "
           "α: its verify T(N+1)/T(1) is the target's forward over its block and calibrated = "
           "tokens/call ÷ (verify + draft phase / t₁), both phases timed in a fused loop "
           "(`experiments/phase_timing.py`).", ""]
  for t in sorted({r["temperature"] for r in rows}):
    lines += [f"### T = {t:g}", "",
              "| method | shape | tokens/call | verify T(N+1)/T(1) | measured speedup | spread | "
              "decode-only speedup | calibrated | calibrated, whole call | check |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["temperature"] == t and r["category"] == ALL):
      lines.append(f"| {r['draft']} | {_shape(r)} | {_f(r['tokens_per_call'])} | "
                   f"{_f(r['verify_cost'])} | **{_f(r['speedup'], suffix='×')}** | "
                   f"{_f(r['speedup_spread'], '{:.0%}')} | "
                   f"{_f(r.get('decode_speedup'), suffix='×')} | "
                   f"{_f(r['calibrated_speedup'], suffix='×')} | "
                   f"{_f(r.get('calibrated_call_speedup'), suffix='×')} | {_check(r)} |")
    lines += ["", "Per category (tokens/call, measured speedup):", "",
              "| category | " + " | ".join(dict.fromkeys(r["draft"] for r in rows)) + " |",
              "|---|" + "---|" * len(dict.fromkeys(r["draft"] for r in rows))]
    for c in sorted({r["category"] for r in rows if r["category"] != ALL}):
      cells = {r["draft"]: r for r in rows if r["temperature"] == t and r["category"] == c}
      lines.append(f"| {c} | " + " | ".join(
          f"{_f(cells[d]['tokens_per_call'])}, {_f(cells[d]['speedup'], suffix='×')}"
          if d in cells else "–" for d in dict.fromkeys(r["draft"] for r in rows)) + " |")
    lines.append("")
  return lines


def _draft_temperature_words(ratio: float) -> str:
  """How sampled runs drew their drafts, when not at the target's temperature."""
  if ratio == 1:
    return ""
  law = "at the drafter's argmax" if ratio == 0 else f"at {ratio:g} × the target's temperature"
  return f"; sampled runs draw their drafts {law} (lossless)"


def _resumed(results: dict) -> str:
  n = results.get("reused_settings")
  return f" in this session ({n} settings reused from {results['progress_log']})" if n else ""


def write_all(out_dir: str, results: dict) -> None:
  os.makedirs(out_dir, exist_ok=True)
  write_json(os.path.join(out_dir, "results.json"), results)
  write_csv(os.path.join(out_dir, "results.csv"), results["rows"])
  with open(os.path.join(out_dir, "tables.md"), "w") as f:
    f.write(tables_markdown(results))
