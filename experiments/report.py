"""results.json, results.csv and tables.md (markdown ready to paste, the paper's numbers beside)."""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
from typing import Any, Optional, Sequence

from experiments import paper
from experiments.rows import ALL

CSV_COLUMNS = ("experiment", "draft", "gamma", "temperature", "category", "prompts", "alpha",
               "acceptance_rate", "tokens_per_call", "expected_tokens_per_call", "speedup",
               "predicted_speedup", "calibrated_speedup", "c", "verify_cost", "spec_seconds",
               "ar_seconds", "step_seconds", "target_calls", "drafted", "accepted", "emitted",
               "generated_tokens", "steps", "greedy_match")


def git_revision() -> dict[str, Any]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  run = lambda *a: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout
  return {"commit": run("rev-parse", "HEAD").strip() or None,
          "dirty": bool(run("status", "--porcelain", "--untracked-files=no").strip())}


def machine_info() -> dict[str, Any]:
  import jax
  cpu = platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
  except OSError:
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
          "backend": jax.default_backend(), "python": platform.python_version(),
          "platform": platform.platform()}


def load_average() -> Optional[list[float]]:
  try:
    return list(os.getloadavg())
  except OSError:
    return None


def write_json(path: str, results: dict) -> None:
  with open(path, "w") as f:
    json.dump(results, f, indent=1, default=float)


def write_csv(path: str, rows: Sequence[dict]) -> None:
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)


def _f(x, fmt="{:.2f}", suffix="") -> str:
  return "–" if x is None else fmt.format(x) + suffix


def _speed_table(rows: Sequence[dict], key: str, key_name: str) -> list[str]:
  out = [f"| {key_name} | α | accept rate | tokens/call | c | verify T(γ+1)/T(1) | "
         "measured speedup | predicted (paper) | predicted (calibrated) |",
         "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    out.append(f"| {r[key]:g} | {_f(r['alpha'])} | {_f(r['acceptance_rate'])} | "
               f"{_f(r['tokens_per_call'])} | {_f(r['c'], '{:.3f}')} | "
               f"{_f(r['verify_cost'])} | **{_f(r['speedup'], suffix='×')}** | "
               f"{_f(r['predicted_speedup'], suffix='×')} | "
               f"{_f(r['calibrated_speedup'], suffix='×')} |")
  return out


def _category_table(rows: Sequence[dict], key: str, key_name: str) -> list[str]:
  out = [f"| category | {key_name} | prompts | α | accept rate | tokens/call | "
         "measured speedup | predicted (paper) | predicted (calibrated) |",
         "|---|---|---|---|---|---|---|---|---|"]
  for r in sorted((r for r in rows if r["category"] != ALL),
                  key=lambda r: (r["category"], r[key])):
    out.append(f"| {r['category']} | {r[key]:g} | {r['prompts']} | {_f(r['alpha'])} | "
               f"{_f(r['acceptance_rate'])} | {_f(r['tokens_per_call'])} | "
               f"{_f(r['speedup'], suffix='×')} | {_f(r['predicted_speedup'], suffix='×')} | "
               f"{_f(r['calibrated_speedup'], suffix='×')} |")
  return out


def _paper_table2() -> list[str]:
  out = ["| task | draft | T | γ | α | speedup |", "|---|---|---|---|---|---|"]
  out += [f"| {t} | {d} | {T} | {g} | {a:.2f} | {s}× |" for t, d, T, g, a, s in paper.TABLE2]
  return out


def _timing_note(repeats: int) -> str:
  if repeats == 1:
    return "each batch timed once"
  return f"each batch timed {repeats} times, the fastest kept"


def tables_markdown(results: dict) -> str:
  rows, cfg = results["rows"], results["config"]
  draft = results["draft"]
  lines = [
      "# Speculative decoding: measured speedups (specjax)", "",
      f"Command: `{results['command']}`  ",
      f"git {results['git']['commit'] or '?'}{' (dirty)' if results['git']['dirty'] else ''}; "
      f"{results['machine']['cpu']}, {results['machine']['cores']} cores, "
      f"jax {results['machine']['jax']} ({results['machine']['backend']}); "
      f"load average at start {results['load_average_start']}; "
      f"total {results['total_seconds'] / 60:.1f} min.  ",
      f"Target `{cfg['target']}`; draft `{draft['name']}` ({draft['note']}); "
      f"{results['num_prompts']} prompts ({', '.join(results['categories'])}), "
      f"{cfg['max_new_tokens']} new tokens each, batches of {cfg['batch_size']} "
      f"(one category per batch), {'stopping at EOS' if cfg['stop_at_eos'] else 'EOS ignored'}.",
      "",
      "Conventions: α = E[β] with β = Σₓ min(p, q) over positions up to the first rejection; "
      "accept rate = accepted / drafted; tokens/call = emitted tokens (accepted + corrected or "
      "bonus, cut at the budget) per target call. Measured speedup = warm wall time of "
      "`specjax.generate` / warm wall time of speculative decoding on the same batches "
      f"({_timing_note(cfg.get('repeats', 1))}). "
      "t₁ = one step of plain decoding (fused loop, prefill excluded); c = draft time per draft "
      f"token / t₁ (phase timings of `stream` at γ = {cfg['alpha_gamma']}); verify T(γ+1)/T(1) = "
      "measured speculative step / t₁ − γc (target forward over γ+1 tokens + acceptance and "
      "bookkeeping). Predicted (paper) = (1 − α^{γ+1}) / ((1 − α)(γc + 1)); calibrated "
      "replaces the 1 in the denominator with the measured verify cost.", ""]
  sweep = [r for r in rows if r["experiment"] == "gamma_sweep"]
  if sweep:
    lines += ["## Speedup vs γ (Table 2 analogue)", ""]
    for t in sorted({r["temperature"] for r in sweep}):
      lines += [f"### T = {t:g}", ""]
      lines += _speed_table([r for r in sweep if r["temperature"] == t and r["category"] == ALL],
                            "gamma", "γ") + [""]
    best = results.get("best_gamma")
    lines += [f"### Per category at the best γ = {best}", ""]
    lines += _category_table([r for r in sweep if r["gamma"] == best], "temperature", "T") + [""]
  temp = [r for r in rows if r["experiment"] == "temperature_sweep"]
  if temp:
    g = temp[0]["gamma"]
    lines += [f"## Speedup vs temperature at γ = {g}", ""]
    lines += _speed_table([r for r in temp if r["category"] == ALL], "temperature", "T") + [""]
    lines += ["### Per category", ""] + _category_table(temp, "temperature", "T") + [""]
  alpha = [r for r in rows if r["experiment"] == "drafts_alpha" and r["category"] == ALL]
  if alpha:
    g = alpha[0]["gamma"]
    lines += [f"## α of each draft (Table 3 analogue, γ = {g})", "",
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
  lines += ["## The paper's numbers, for reference", "", paper.SETUP, "",
            "Table 2 (empirical speedups):", ""] + _paper_table2() + [
            "", "Table 3 (α, T=0 / T=1):", "", "| target | draft | α T=0 | α T=1 |",
            "|---|---|---|---|"]
  lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in paper.TABLE3]
  lines += ["", "Table 4 (T=0, expected from Thm 3.8 with measured c vs empirical):", "",
            "| task | draft | c | expected | empirical |", "|---|---|---|---|---|"]
  lines += [f"| {a} | {b} | {c} | {e}× | {m}× |" for a, b, c, e, m in paper.TABLE4]
  return "\n".join(lines) + "\n"


def write_all(out_dir: str, results: dict) -> None:
  os.makedirs(out_dir, exist_ok=True)
  write_json(os.path.join(out_dir, "results.json"), results)
  write_csv(os.path.join(out_dir, "results.csv"), results["rows"])
  with open(os.path.join(out_dir, "tables.md"), "w") as f:
    f.write(tables_markdown(results))
