"""Runs the configured experiments end to end and writes every output file."""

from __future__ import annotations

import os
import time
from typing import Callable

from absl import logging

from experiments import figures, ngram_corpus, progress, report, sweeps
from experiments.config import DRAFT_FREE, ExperimentConfig
from experiments.machine import probe_output_dir
from experiments.measure import Bench, load_average
from experiments.models import Draft, Target, default_early_exit_layers, load_draft, load_target
from experiments.prompts import categories, load_items, make_batches
from experiments.rows import verify_cost_curve


class DraftError(ValueError):
  """A --draft, --alpha_drafts or --draft_free_drafts value that names a draft this target
  cannot use."""


def load_drafts(config: ExperimentConfig, target: Target,
                corpus: Callable[[], list]) -> tuple[Draft, list[Draft], list[Draft]]:
  """--draft; the drafts whose α drafts_alpha measures beside it (--alpha_drafts); and the
  methods draft_free times (--draft_free_drafts, and --draft when it is one of them). Each
  is loaded once, and all before anything is timed, so a bad one stops the run before it
  measures. An experiment that does not run gets no drafts."""
  def load(spec: str, flag: str) -> Draft:
    try:
      return load_draft(spec, target, corpus)
    except ValueError as e:
      raise DraftError(f"--{flag}={spec}: {e}") from None

  k = config.early_exit_layers or default_early_exit_layers(target.cfg)
  spec_of = lambda s: f"early_exit:{k}" if s == "early_exit" else s  # one key per draft
  main = spec_of(config.draft)
  loaded = {main: load(main, "draft")}

  def drafts(experiment: str, specs: tuple[str, ...], flag: str) -> list[Draft]:
    if experiment not in config.experiments:
      return []
    specs = list(dict.fromkeys(map(spec_of, specs)))
    for s in specs:
      if s not in loaded:
        loaded[s] = load(s, flag)
    return [loaded[s] for s in specs]

  table3 = drafts("drafts_alpha", tuple(s for s in config.alpha_drafts if spec_of(s) != main),
                  "alpha_drafts")
  free = drafts("draft_free", config.draft_free_drafts
                + ((config.draft,) if config.draft in DRAFT_FREE else ()), "draft_free_drafts")
  return loaded[main], table3, free


def run(config: ExperimentConfig, command: str = "") -> dict:
  """Measures what ``config`` asks (reusing a matching progress log in ``config.out``) and
  writes results.json, results.csv, tables.md and the figures there."""
  start = time.perf_counter()
  load_start = load_average()
  if config.prompts:  # fail fast on a bad prompt file, then on an --out that cannot be written
    load_items(config.prompts, config.num_prompts)
  probe_output_dir(config.out)
  items = load_items(config.prompts, config.num_prompts)
  git = report.git_revision()
  log = progress.ProgressLog(config.out, progress.header(config, git["commit"]), config.fresh)
  logging.info("loading target %s", config.target)
  target = load_target(config.target, config.dtype)
  batches = make_batches(items, target.encode, config.batch_size)
  built: dict[str, ngram_corpus.Corpus] = {}

  def corpus():
    if "corpus" not in built:
      built["corpus"] = ngram_corpus.load_or_build(target)
    return list(built["corpus"].seqs)

  draft, table3, free = load_drafts(config, target, corpus)
  logging.info("draft %s: %s", draft.name, draft.note)
  every = list({id(d): d for d in [draft] + table3 + free}.values())  # each draft once
  own_trees = [d.drafter.default_tree() for d in every]
  bench = Bench(target, batches, config, log,
                draft_nodes=max([t.num_nodes for t in own_trees if t is not None], default=0))
  rows: list[dict] = []
  timings: dict[str, float] = {}
  if "gamma_sweep" in config.experiments:
    t = time.perf_counter()
    rows += sweeps.gamma_sweep(bench, draft)
    timings["gamma_sweep"] = time.perf_counter() - t
  if "adaptive" in config.experiments:
    t = time.perf_counter()
    rows += sweeps.adaptive(bench, draft)
    timings["adaptive"] = time.perf_counter() - t
  best = sweeps.best_gamma(rows, config.temperature_gamma or config.alpha_gamma)
  if "temperature_sweep" in config.experiments:
    t = time.perf_counter()
    rows += sweeps.temperature_sweep(bench, draft, config.temperature_gamma or best)
    timings["temperature_sweep"] = time.perf_counter() - t
  notes = {draft.name: draft.note}
  if "drafts_alpha" in config.experiments:
    t = time.perf_counter()
    notes.update({d.name: d.note for d in table3})
    rows += sweeps.drafts_alpha(bench, table3 + [draft])
    timings["drafts_alpha"] = time.perf_counter() - t
  if "draft_free" in config.experiments:
    t = time.perf_counter()
    notes.update({d.name: d.note for d in free})
    rows += sweeps.draft_free(bench, free)
    timings["draft_free"] = time.perf_counter() - t
  calibration = {}
  if "tree_sweep" in config.experiments:
    t = time.perf_counter()
    tree_rows, calibration = sweeps.tree_sweep(bench, draft)
    rows += tree_rows
    timings["tree_sweep"] = time.perf_counter() - t
  temps = sorted({r["temperature"] for r in rows if r["speedup"] is not None
                  and r["tree"] is None})
  corpus_info = {}
  if "corpus" in built:
    c = built["corpus"]
    corpus_info = dict(ngram_corpus=c.describe(), ngram_corpus_tokens=c.tokens,
                       ngram_corpus_build_seconds=c.build_seconds)
  results = dict(
      command=command, config=config.to_dict(), git=git,
      # how trees were verified under --verification=block (token-wise before 2026-12-08)
      tree_verification="traversal" if config.verification == "block" else "tokenwise",
      machine=report.machine_info(target.params),
      load_average_start=load_start, load_average_end=load_average(),
      total_seconds=time.perf_counter() - start, experiment_seconds=timings,
      reused_settings=bench.reused, progress_log=log.path,
      draft=dict(name=draft.name, note=draft.note), draft_notes=notes, **corpus_info,
      num_prompts=len(items), categories=categories(batches),
      prompts=[dict(category=p.category, source=p.source, text=p.text,
                    tokens=len(target.encode(p.text))) for p in items],
      cache_size=bench.cache_size, best_gamma=best, tree_calibration=calibration,
      verify_cost_curves={f"{t:g}": verify_cost_curve(rows, t) for t in temps},
      plain_compile_seconds={f"{t:g}": s for t, s in bench.plain_compile_seconds.items()},
      runs=[report.run_summary(r) for r in bench.runs()], rows=rows)
  report.write_all(config.out, results)
  written = figures.save_all(results, config.out)
  logging.info("wrote results.json, results.csv, tables.md, %s to %s (%.0f s)",
               ", ".join(written), config.out, results["total_seconds"])
  print(f"wrote {os.path.join(config.out, 'tables.md')} ({results['total_seconds']:.0f} s)")
  return results
