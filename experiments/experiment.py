"""Runs the configured experiments end to end and writes every output file."""

from __future__ import annotations

import functools
import os
import time

from absl import logging

import specjax
from specjax.sampling import Greedy, Sampling

from experiments import figures, report, sweeps
from experiments.config import ExperimentConfig
from experiments.measure import Bench
from experiments.models import (Target, cached_corpus, default_early_exit_layers, load_draft,
                                load_target)
from experiments.prompts import categories, load_items, make_batches, training_prompts
from experiments.rows import verify_cost_curve

NGRAM_PROMPTS = 8


def ngram_corpus(target: Target, config: ExperimentConfig) -> tuple[list, str]:
  """Target generations to fit the unigram/bigram drafts on (never the evaluation prompts)."""
  if target.name == "smollm2":
    seqs = cached_corpus(target.cfg.vocab_size)
    if seqs:
      return seqs, f"{len(seqs)} cached target responses (distillation corpus, train split)"
  ids = [target.encode(t) for t in training_prompts(NGRAM_PROMPTS)]
  seqs = []
  for sampler in (Greedy(), Sampling(temperature=1.0)):
    out = specjax.generate(target.params, target.cfg, ids, config.max_new_tokens, sampler,
                           seed=config.seed)
    seqs += [out.generated(r) for r in range(len(ids))]
  return seqs, (f"{len(seqs)} target responses to {len(ids)} training-split prompts "
                "(greedy and T=1), generated in this run")


def run(config: ExperimentConfig, command: str = "") -> dict:
  start = time.perf_counter()
  load_start = report.load_average()
  items = load_items(config.prompts, config.num_prompts)  # fail fast on a bad file
  logging.info("loading target %s", config.target)
  target = load_target(config.target)
  batches = make_batches(items, target.encode, config.batch_size)
  bench = Bench(target, batches, config)
  corpus_info = {}

  @functools.lru_cache(maxsize=None)
  def corpus():
    seqs, info = ngram_corpus(target, config)
    corpus_info["ngram_corpus"] = info
    return seqs

  draft = load_draft(config.draft, target, corpus)
  logging.info("draft %s: %s", draft.name, draft.note)
  rows: list[dict] = []
  timings: dict[str, float] = {}
  if "gamma_sweep" in config.experiments:
    t = time.perf_counter()
    rows += sweeps.gamma_sweep(bench, draft)
    timings["gamma_sweep"] = time.perf_counter() - t
  best = sweeps.best_gamma(rows, config.temperature_gamma or config.alpha_gamma)
  if "temperature_sweep" in config.experiments:
    t = time.perf_counter()
    rows += sweeps.temperature_sweep(bench, draft, config.temperature_gamma or best)
    timings["temperature_sweep"] = time.perf_counter() - t
  notes = {draft.name: draft.note}
  if "drafts_alpha" in config.experiments:
    t = time.perf_counter()
    k = config.early_exit_layers or default_early_exit_layers(target.cfg)
    others = [load_draft(f"early_exit:{k}" if s == "early_exit" else s, target, corpus)
              for s in config.alpha_drafts]
    drafts = list({d.name: d for d in others + [draft]}.values())
    notes.update({d.name: d.note for d in drafts if d.name != draft.name})
    rows += sweeps.drafts_alpha(bench, drafts)
    timings["drafts_alpha"] = time.perf_counter() - t
  temps = sorted({r["temperature"] for r in rows if r["speedup"] is not None})
  results = dict(
      command=command, config=config.to_dict(), git=report.git_revision(),
      machine=report.machine_info(), load_average_start=load_start,
      load_average_end=report.load_average(), total_seconds=time.perf_counter() - start,
      experiment_seconds=timings, draft=dict(name=draft.name, note=draft.note),
      draft_notes=notes, **corpus_info, num_prompts=len(items), categories=categories(batches),
      prompts=[dict(category=p.category, source=p.source, text=p.text,
                    tokens=len(target.encode(p.text))) for p in items],
      cache_size=bench.cache_size, best_gamma=best,
      verify_cost_curves={f"{t:g}": verify_cost_curve(rows, t) for t in temps},
      baselines=[dict(temperature=b.temperature, seconds=b.seconds, step_seconds=b.step_seconds,
                      compile_seconds=b.compile_seconds) for b in bench.baselines()],
      runs=[dict(draft=r.draft, gamma=r.gamma, temperature=r.temperature, seconds=r.seconds,
                 steps=r.steps, step_seconds=r.step_seconds, draft_costs=r.costs,
                 compile_seconds=r.compile_seconds)
            for r in bench.runs()],
      rows=rows)
  report.write_all(config.out, results)
  written = figures.save_all(results, config.out)
  logging.info("wrote results.json, results.csv, tables.md, %s to %s (%.0f s)",
               ", ".join(written), config.out, results["total_seconds"])
  print(f"wrote {os.path.join(config.out, 'tables.md')} ({results['total_seconds']:.0f} s)")
  return results
