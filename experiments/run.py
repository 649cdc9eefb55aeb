"""Reproduce the speedup-vs-γ and speedup-vs-temperature tables of Leviathan et al. (2023),
and compare token trees with chains.

  python -m experiments.run                       # everything, embedded target + default draft
  python -m experiments.run --experiment=gamma_sweep --gammas=1,4 --max_new_tokens=32
  python -m experiments.run --experiment=tree_sweep --tree_budgets=4,8,16,32,64
  python -m experiments.run --target=tiny --draft=tiny --out=/tmp/smoke   # seconds, for tests

Writes results.json, results.csv, tables.md and PNG figures to --out.
"""

from __future__ import annotations

import shlex
import sys

from absl import app, flags, logging

from experiments import config as config_lib

FLAGS = flags.FLAGS
DEFAULT = config_lib.ExperimentConfig()  # the flags' defaults are the config's own
_ints = lambda values: ",".join(str(v) for v in values)
flags.DEFINE_string("experiment", "default", f"{', '.join(config_lib.EXPERIMENTS)}, default ("
                    f"{', '.join(config_lib.DEFAULT_EXPERIMENTS)}) or all, or a comma-separated "
                    "list (draft_free times the methods of --draft_free_drafts).")
flags.DEFINE_string("target", "smollm2", "smollm2 | tiny | .gguf path | HF directory.")
flags.DEFINE_string("draft", "eagle", "eagle (the shipped EAGLE-3 feature drafter) | default "
                    "(the shipped distilled token draft) | early_exit:K | trained_exit | "
                    "adapter_exit (the shipped trained early exits, the second through an "
                    "attention adapter) | bigram | unigram | "
                    "prompt_lookup | lookahead | medusa (the shipped Medusa-1 heads; these two "
                    "bring their own tree: drafts_alpha and draft_free only) "
                    "| jacobi | jacobi_random (Jacobi decoding, prompt-lookup or random fill) | "
                    "tiny | path of a draft directory (token, EAGLE or Medusa), .gguf or HF dir; "
                    "any draft model + '+lookup' (eagle+lookup: prompt lookup where the "
                    "context repeats, that draft elsewhere).")
flags.DEFINE_string("prompts", None, 'JSONL file: one {"prompt": ..., "category": ...} per '
                    "line, or Spec-Bench's question.jsonl ({\"category\": ..., \"turns\": [...]}; "
                    "each question is measured on its first turn only) (default: built-in "
                    "held-out prompts over code, summarise, qa, math, chat).")
flags.DEFINE_integer("num_prompts", DEFAULT.num_prompts, "Prompts taken from the built-in set "
                     "(round-robin over the 5 categories; 5 = one each, 10 = two each).")
flags.DEFINE_string("gammas", _ints(DEFAULT.gammas), "Draft lengths of the γ sweep.")
flags.DEFINE_string("temperatures", ",".join(f"{t:g}" for t in DEFAULT.temperatures),
                    "Temperatures of the sweep (finite, >= 0).")
flags.DEFINE_integer("max_new_tokens", DEFAULT.max_new_tokens, "Tokens generated per prompt.")
flags.DEFINE_integer("batch_size", DEFAULT.batch_size, "Prompts per call (batches never mix "
                     "categories); 1 is the paper's setting, 4 the old batched one.")
flags.DEFINE_integer("seed", 0, "PRNG seed.")
flags.DEFINE_string("out", "out", "Output directory; created and probed for writing before "
                    "anything loads. Finished settings are logged to OUT/progress.jsonl; a run "
                    "of the same config and commit resumes from it.")
flags.DEFINE_integer("temperature_gamma", 0, "γ of the temperature sweep (0: best of the γ "
                     "sweep).")
flags.DEFINE_integer("alpha_gamma", DEFAULT.alpha_gamma, "γ at which the drafts' α is measured.")
flags.DEFINE_integer("early_exit_layers", 0, "K of the early-exit draft in drafts_alpha "
                     "(0: num_layers // 5).")
flags.DEFINE_string("alpha_drafts", ",".join(DEFAULT.alpha_drafts),
                    "Drafts whose α is measured beside --draft in drafts_alpha (lookahead, "
                    "slow to run, is not among the defaults; draft_free times it).")
flags.DEFINE_string("draft_free_drafts", ",".join(DEFAULT.draft_free_drafts),
                    "Methods without a draft model that draft_free times (any of "
                    f"{', '.join(config_lib.DRAFT_FREE)}; and --draft when it is one).")
flags.DEFINE_integer("cost_steps", DEFAULT.cost_steps,
                     "Steps timed phase by phase (bookkeeping; c is timed in a fused loop).")
flags.DEFINE_float("phase_seconds", DEFAULT.phase_seconds,
                   "Least seconds one fused draft- or verify-phase timing loop runs (the draft "
                   "phase behind c is a median of 7 slopes); shorter is faster and noisier.")
flags.DEFINE_integer("repeats", DEFAULT.repeats,
                     "Interleaved timing rounds per setting (plain then "
                     "speculative on every batch); the median round is reported with the "
                     "spread.")
flags.DEFINE_integer("workers", DEFAULT.workers,
                     "Programs compiled (before anything is timed), or untimed α runs made, "
                     "at a time; 1: one after another. Changes no measured figure.")
flags.DEFINE_integer("extra_rounds", DEFAULT.extra_rounds,
                     "Up to this many rounds are added, one at a time, "
                     "while a setting's speedup (overall or one category's) spreads > 10% "
                     "(timing just that setting on just those batches).")
flags.DEFINE_bool("stop_at_eos", DEFAULT.stop_at_eos, "Stop rows at EOS (speedups at equal "
                  "lengths); --nostop_at_eos: every row generates exactly max_new_tokens.")
flags.DEFINE_string("sweep_trees", ",".join(DEFAULT.sweep_trees),
                    "Dynamic trees timed in the γ sweep's rounds beside its chains where the "
                    "drafter builds them: EAGLE-2 trees as top_k:depth:nodes, sampled dynamic "
                    "trees as sampled:w1:w2:... (nodes per depth), each at T = 0 and 1 or, "
                    "with a suffix @0 or @1, at that one; '' for chains only.")
flags.DEFINE_string("tree_budgets", _ints(DEFAULT.tree_budgets),
                    "Node budgets N of the tree sweep's best static "
                    "trees.")
flags.DEFINE_string("calibration_tree", _ints(DEFAULT.calibration_tree),
                    "Branching of the full tree that measures the "
                    "per-depth, per-rank acceptance the best trees are built from.")
flags.DEFINE_integer("calibration_prompts", DEFAULT.calibration_prompts,
                     "Held-out prompts after the evaluated ones that calibrate the trees "
                     "and, at batches above 1, the adaptive policy (never evaluated).")
flags.DEFINE_enum("verification", DEFAULT.verification, ["tokenwise", "block"],
                  "Acceptance of the chains' drafts: block verification (Sun et al. 2024) or "
                  "token-wise modified rejection sampling; trees are always token-wise.")
flags.DEFINE_enum("dtype", DEFAULT.dtype, ["auto", "float32", "bfloat16"],
                  "Weights, activations and KV cache of the target and its drafts; auto is "
                  "bfloat16 on GPU/TPU and float32 on CPU. Products accumulate, and logits "
                  "and acceptance compute, in float32 either way.")
flags.DEFINE_float("min_gain", DEFAULT.min_gain, "The adaptive policies draft only when a "
                   "draft promises more than this gain over plain decoding (0.05: 5%; 0 takes "
                   "the calibrated formula's argmax).")
flags.DEFINE_enum("evidence", DEFAULT.evidence, ["expected", "accepted"], "What the "
                  "adaptive policies and their calibrations count of a sampled chain step: "
                  "each draft's acceptance chance β weighted by its chance of being "
                  "scored (expected) or the outcomes "
                  "(accepted).")
flags.DEFINE_float("draft_temperature", DEFAULT.draft_temperature, "The drafts' temperature "
                   "as a multiple of the target's in sampled runs (same top-k / top-p; 0: the "
                   "drafter's argmax; 1: the usual rule). Lossless at any value.")
flags.DEFINE_bool("compilation_cache", True, "Keep compiled XLA programs on disk "
                  "(specjax.compile_cache: $SPECJAX_CACHE/xla) so a rerun or a resumed run "
                  "skips most compiling; outputs are unchanged.")
flags.DEFINE_bool("fresh", False, "Start over even if OUT/progress.jsonl holds a partial run "
                  "of the same config (the old log is kept, renamed).")


def config_from_flags() -> config_lib.ExperimentConfig:
  return config_lib.ExperimentConfig(
      experiments=config_lib.parse_experiments(FLAGS.experiment), target=FLAGS.target,
      draft=FLAGS.draft, prompts=FLAGS.prompts, num_prompts=FLAGS.num_prompts,
      gammas=config_lib.parse_ints(FLAGS.gammas, "gammas"),
      temperatures=config_lib.parse_floats(FLAGS.temperatures, "temperatures"),
      max_new_tokens=FLAGS.max_new_tokens, batch_size=FLAGS.batch_size, seed=FLAGS.seed,
      out=FLAGS.out, temperature_gamma=FLAGS.temperature_gamma, alpha_gamma=FLAGS.alpha_gamma,
      early_exit_layers=FLAGS.early_exit_layers,
      alpha_drafts=config_lib.parse_names(FLAGS.alpha_drafts),
      draft_free_drafts=config_lib.parse_names(FLAGS.draft_free_drafts),
      cost_steps=FLAGS.cost_steps, phase_seconds=FLAGS.phase_seconds, repeats=FLAGS.repeats,
      extra_rounds=FLAGS.extra_rounds, workers=FLAGS.workers,
      stop_at_eos=FLAGS.stop_at_eos, fresh=FLAGS.fresh,
      sweep_trees=config_lib.parse_trees(FLAGS.sweep_trees, "sweep_trees"),
      tree_budgets=config_lib.parse_ints(FLAGS.tree_budgets, "tree_budgets"),
      calibration_tree=config_lib.parse_ints(FLAGS.calibration_tree, "calibration_tree"),
      calibration_prompts=FLAGS.calibration_prompts, verification=FLAGS.verification,
      dtype=FLAGS.dtype, min_gain=FLAGS.min_gain, evidence=FLAGS.evidence,
      draft_temperature=FLAGS.draft_temperature)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    cfg = config_from_flags()
  except ValueError as e:
    raise app.UsageError(str(e))
  if FLAGS.compilation_cache:
    from specjax import compile_cache
    logging.info("persistent compilation cache: %s", compile_cache.enable())
  from experiments.machine import OutputError
  from experiments import experiment
  from experiments.prompts import PromptFileError
  try:
    experiment.run(cfg, command="python -m experiments.run " + shlex.join(sys.argv[1:]))
  except (PromptFileError, OutputError, experiment.DraftError) as e:
    logging.error("%s", e)
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
