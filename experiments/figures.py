"""PNG figures from a results dict (the content of results.json); used by run.py and
notebooks/results.ipynb."""

from __future__ import annotations

import json
import os
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np

ALL = "all"


def load_results(path: str) -> dict:
  """Loads results.json (a file or the directory holding it)."""
  if os.path.isdir(path):
    path = os.path.join(path, "results.json")
  with open(path) as f:
    return json.load(f)


def _rows(results, experiment, **match):
  return [r for r in results["rows"] if r["experiment"] == experiment and r["category"] == ALL
          and all(r[k] == v for k, v in match.items())]


def _series(rows, key, field):
  pts = sorted((r[key], r[field]) for r in rows if r.get(field) is not None)
  return [p[0] for p in pts], [p[1] for p in pts]


def speedup_vs_gamma(results: dict) -> Optional[plt.Figure]:
  rows = _rows(results, "gamma_sweep")
  if not rows:
    return None
  temps = sorted({r["temperature"] for r in rows})
  fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.8), squeeze=False)
  for ax, t in zip(axes[0], temps):
    sub = [r for r in rows if r["temperature"] == t and r["tree"] is None]
    for r in rows:  # the dynamic trees timed beside the chains: one measured level each
      if r["temperature"] == t and r["tree"] is not None and r["speedup"] is not None:
        ax.axhline(r["speedup"], ls="-.", lw=1.0, color="tab:purple",
                   label=f"{r['shape']} tree, N = {r['num_nodes']}, D = {r['gamma']} (measured)")
    for field, label, style in (("speedup", "measured", "o-"),
                                ("predicted_speedup", "predicted (paper, Thm 3.8)", "s--"),
                                ("calibrated_speedup", "predicted (measured verify cost)", "^:"),
                                ("calibrated_call_speedup", "the same, whole call", "v:")):
      ax.plot(*_series(sub, "gamma", field), style, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="γ (draft tokens per step)", ylabel="speedup over plain decoding",
           title=f"T = {t:g}")
    ax.legend(fontsize=8)
  fig.suptitle(f"draft {results['draft']['name']}")
  fig.tight_layout()
  return fig


def temperature_figure(results: dict) -> Optional[plt.Figure]:
  rows = _rows(results, "temperature_sweep")
  if not rows:
    return None
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
  for field, label, style in (("speedup", "measured", "o-"),
                              ("predicted_speedup", "predicted (paper)", "s--"),
                              ("calibrated_speedup", "predicted (calibrated)", "^:"),
                              ("calibrated_call_speedup", "the same, whole call", "v:")):
    a1.plot(*_series(rows, "temperature", field), style, label=label)
  a1.axhline(1.0, color="grey", lw=0.8)
  a1.set(xlabel="temperature", ylabel="speedup", title=f"speedup at γ = {rows[0]['gamma']}")
  a1.legend(fontsize=8)
  for field, label, style in (("alpha", "α = E[β]", "o-"),
                              ("acceptance_rate", "acceptance rate", "s--")):
    a2.plot(*_series(rows, "temperature", field), style, label=label)
  a2.set(xlabel="temperature", ylim=(0, 1), title="acceptance")
  a2.legend(fontsize=8)
  fig.tight_layout()
  return fig


def accept_len_histogram(results: dict) -> Optional[plt.Figure]:
  """Accepted draft tokens per step at the largest γ of the sweep (where the shape shows best),
  with the i.i.d. prediction from α: P(n) = α^n (1 − α) for n < γ, α^γ for n = γ."""
  sweep = [r for r in _rows(results, "gamma_sweep") if r["tree"] is None]
  rows = ([r for r in sweep if r["gamma"] == max(r["gamma"] for r in sweep)] if sweep
          else _rows(results, "temperature_sweep"))
  if not rows:
    return None
  fig, ax = plt.subplots(figsize=(6, 3.8))
  width = 0.8 / len(rows)
  for i, r in enumerate(sorted(rows, key=lambda r: r["temperature"])):
    hist = np.asarray(r["accept_len_hist"], float)
    n = np.arange(len(hist))
    x = n - 0.4 + (i + 0.5) * width
    ax.bar(x, hist / max(hist.sum(), 1), width, label=f"T = {r['temperature']:g}")
    if r["alpha"] is not None:
      a, gam = r["alpha"], len(hist) - 1
      pred = np.where(n < gam, a ** n * (1 - a), a ** gam)
      ax.plot(x, pred, "k.", ms=8, label="i.i.d. prediction from α" if i == 0 else None)
  ax.set_xticks(np.arange(len(rows[0]["accept_len_hist"])))
  ax.set(xlabel="accepted draft tokens in a step", ylabel="fraction of steps",
         title=f"accepted lengths, γ = {rows[0]['gamma']}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def verify_cost_figure(results: dict) -> Optional[plt.Figure]:
  curves = results.get("verify_cost_curves") or {}
  if not curves:
    return None
  fig, ax = plt.subplots(figsize=(6, 3.8))
  for t, pts in sorted(curves.items()):
    xs = sorted(int(k) for k in pts)
    ax.plot(xs, [pts[str(x)] if str(x) in pts else pts[x] for x in xs], "o-", label=f"T = {t}")
  ax.set(xlabel="tokens in one target forward (γ + 1)", ylabel="time / single-token step",
         title="measured verify cost")
  ax.legend(fontsize=8)
  fig.tight_layout()
  return fig


def tree_figure(results: dict) -> Optional[plt.Figure]:
  """Speedup and tokens per call vs the number of draft nodes: chains against best trees."""
  rows = _rows(results, "tree_sweep")
  if not rows:
    return None
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for t in sorted({r["temperature"] for r in rows}):
    for shape in sorted({r["shape"] for r in rows}):
      style = "o-" if shape == "chain" else "s--" if shape == "best tree" else "^:"
      sub = [r for r in rows if r["temperature"] == t and r["shape"] == shape]
      label = f"{shape} T={t:g}"
      for ax, field in zip(axes, ("speedup", "tokens_per_call")):
        ax.plot(*_series(sub, "num_nodes", field), style, label=label)
  axes[0].axhline(1.0, color="grey", lw=0.8)
  axes[0].set(xlabel="draft nodes per step (N; γ for a chain)", ylabel="speedup over plain")
  axes[1].set(xlabel="draft nodes per step (N; γ for a chain)", ylabel="tokens per target call")
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
  fig.suptitle(f"token trees vs chains, draft {results['draft']['name']}")
  fig.tight_layout()
  return fig


FIGURES = {"speedup_vs_gamma.png": speedup_vs_gamma, "trees.png": tree_figure, "temperature.png": temperature_figure,
           "accept_len_hist.png": accept_len_histogram, "verify_cost.png": verify_cost_figure}


def save_all(results: dict, out_dir: str) -> list[str]:
  written = []
  for name, fn in FIGURES.items():
    fig = fn(results)
    if fig is not None:
      fig.savefig(os.path.join(out_dir, name), dpi=110)
      plt.close(fig)
      written.append(name)
  return written
