"""The configuration of one ``python -m experiments.run`` invocation (a frozen dataclass).

absl flags are parsed into an ``ExperimentConfig`` in ``run.py``; everything
below reads the dataclass only, so tests build configs directly.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

EXPERIMENTS = ("gamma_sweep", "adaptive", "temperature_sweep", "drafts_alpha", "tree_sweep",
               "draft_free")
# The default run: the paper's tables and the adaptive policy. The tree sweep and the timed
# draft-free methods are opt-in (--experiment=tree_sweep, draft_free or all): they do not fit
# the default run's time budget (experiments/README.md, Sizing).
DEFAULT_EXPERIMENTS = EXPERIMENTS[:4]
DRAFT_NAMES = ("default", "eagle", "medusa", "trained_exit", "adapter_exit", "bigram",
               "unigram", "prompt_lookup", "jacobi", "jacobi_random", "lookahead", "tiny")
# The methods that need no draft model, which the draft_free experiment times.
DRAFT_FREE = ("prompt_lookup", "jacobi", "jacobi_random", "lookahead")
# ``<draft>+lookup``: the draft with prompt lookup on rows whose context repeats
# (``drafters.hybrid``).
LOOKUP_SUFFIX = "+lookup"
# Drafts whose drafter brings its own tree (``Drafter.default_tree``): no γ to sweep.
OWN_TREE_DRAFTS = ("lookahead", "medusa")
# The tag of a sampled dynamic tree in --sweep_trees (sampled:w1:w2:..., nodes per depth)
# and in a run's recorded setting; DYNAMIC tags an EAGLE-2 tree's setting (``tree_setting``).
SAMPLED = "sampled"
DYNAMIC = "dynamic"
# The γ sweep's temperatures: the paper's T = 0 (argmax) and T = 1 (standard sampling).
SWEEP_TEMPERATURES = (0.0, 1.0)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """What to run and at which sizes.

  Attributes:
    experiments: subset of EXPERIMENTS, run in that order (default DEFAULT_EXPERIMENTS).
    target: "smollm2" (embedded), "tiny" (random tiny model, for tests), a
      .gguf path or an HF directory.
    draft: "eagle" (the shipped EAGLE-3 feature drafter, the default) |
      "default" (the shipped distilled token draft) | "early_exit:K" (training-free) |
      "trained_exit" | "adapter_exit" (the shipped trained early exits, the second through
      an attention adapter) | "bigram" | "unigram" |
      "prompt_lookup" | "jacobi" | "jacobi_random" (Jacobi decoding, no draft model) |
      "lookahead" (lookahead decoding, its own tree) | "medusa" (the shipped Medusa-1
      heads, their own tree) | "tiny" | path of a specjax draft directory (token, EAGLE or
      Medusa), a .gguf file or HF dir; any draft model followed by "+lookup" (e.g.
      "eagle+lookup"): prompt lookup where the context repeats, that draft elsewhere.
    prompts: a .jsonl prompt file (ours or Spec-Bench's question.jsonl, first turns), or
      None for the built-in held-out set.
    num_prompts: prompts taken from the built-in set (default 5: one per category; with
      batch 1 and 128 new tokens that fits the run in a quarter of an hour on an AVX-512
      host; 10 took 20 min there, experiments/results/ten_prompts/).
    gammas: draft lengths of the γ sweep (at T=0 and T=1), distinct.
    temperatures: temperatures of the temperature sweep (0 = greedy), finite
      and distinct.
    max_new_tokens: tokens generated per prompt.
    batch_size: prompts per call; batches never mix categories, so every
      category gets its own measured time (default 1, the paper's setting; the
      old batched setting is ``batch_size=4, max_new_tokens=32, num_prompts=20``).
    seed: PRNG seed (batch i uses seed + i, for plain and speculative decoding).
    out: output directory.
    temperature_gamma: γ of the temperature sweep; 0 = the γ with the best
      measured speedup (mean of T=0 and T=1) in the γ sweep.
    alpha_gamma: γ used to measure α of the Table-3 drafts.
    early_exit_layers: K of the early-exit row of Table 3 (0 = num_layers // 5).
    alpha_drafts: the other drafts whose α drafts_alpha measures beside --draft
      ("early_exit" means early_exit:K with K = early_exit_layers). A drafter with its own
      tree (lookahead, Medusa) is measured on that tree, not on a chain of alpha_gamma.
      Lookahead is not among the defaults (draft_free times it): with it the α runs of the
      committed Zen 4 default run took 4.2 min (git dff762d), without it 3.0 (b7d5b81, on
      another machine and prompt set; experiments/results/avx512_zen4/ and its history).
    draft_free_drafts: the methods without a draft model that the draft_free experiment
      times (each in DRAFT_FREE; default prompt lookup, Jacobi and lookahead: jacobi_random
      on request), and --draft too when it is one.
    cost_steps: speculative steps timed phase by phase (after one warm step)
      for the bookkeeping phase and the per-call figures; c and the verify phase
      are timed in a fused loop (``phase_timing``).
    phase_seconds: the least time one run of that fused loop lasts: its trip count n
      grows until n repeats of a phase take this long, and the draft phase behind c is the
      median of 7 slopes (t(2n) − t(n)) / n. Shorter is faster and noisier.
    repeats: interleaved timing rounds per setting; each round times plain then
      speculative decoding on every batch, and figures are medians over rounds.
    extra_rounds: up to this many rounds are added, one at a time, while some
      setting's speedup (over all batches or one category's) spreads more than
      10% over the rounds so far (``checks.unsteady``); such a round times just
      those settings on just those groups' batches. 0 turns this off.
    workers: programs compiled, or untimed runs made, at a time (threads): the first calls
      of a group of timed settings, before any is timed, and the Table-3 drafts' untimed α
      runs, whose compiling then overlaps another's decoding. Changes no measured figure
      (a resumed run may change it); 1 runs them one after another.
    stop_at_eos: stop rows at EOS (the default: what a user receives, and how Spec-Bench,
      EAGLE and Medusa time their methods; a row runs on past the end of its answer only
      to its budget otherwise, into text no user reads and no draft was trained on). At
      T > 0 the two methods' samples then end at different lengths, and each speculative
      decode loop is scaled to the length plain decoding's call ran for
      (``measure.same_length_seconds``). False: every row generates exactly
      max_new_tokens with both methods.
    fresh: ignore a partial run of the same config in ``out`` and start over
      (the old log is kept beside, renamed; see ``progress.py``).
    sweep_trees: dynamic trees timed in the γ sweep's rounds beside its chains, where the
      drafter builds them, as ``sweep_tree`` entries: EAGLE-2 trees as "top_k:depth:nodes",
      sampled dynamic trees as "sampled:w1:w2:..." (nodes per depth), each at every sweep
      temperature or, with "@T", at that one. Default: EAGLE-2's tree of 4 nodes, 4 deep,
      frontier 4 at T = 0 and the 3-node sampled tree (2, 1) at T = 1, the best tree of
      each in benchmarks/results/sampled_trees.md and experiments/results/sampled_trees/
      (a sampled tree's drawn children pay at T > 0; at T = 0 EAGLE-2's top-k children
      accept 4–6% more). () for chains only. They need no calibration; the tree sweep
      compares trees in depth.
    tree_budgets: node budgets N of the tree sweep's best static trees.
    calibration_tree: branching of the full tree whose counters, on the
      calibration prompts (held-out, never the evaluated ones), give the per-depth,
      per-rank acceptance the tree sweep builds its best trees from.
    calibration_prompts: how many prompts calibrate: held-out ones after the evaluated
      ones (``prompts.calibration_prompts``).
    dtype: the target's (and its drafts') weights, activations and KV cache: "auto"
      (bfloat16 on GPU and TPU, float32 on CPU), "float32" or "bfloat16". Products
      accumulate and logits and acceptance compute in float32 either way.
    verification: how the chains' sampled drafts are accepted: "block" (the default; Sun et
      al. 2024, ``SpeculativeDecoder.verification``: as lossless as token-wise and never
      fewer tokens per call in expectation, +0.3–9% at T > 0 in
      benchmarks/results/block_verification.md; the same at T = 0) or "tokenwise" (modified
      rejection sampling, the papers' and the library's default). Trees are always
      verified token-wise.
    min_gain: the adaptive policies draft only when a draft promises more than this over
      plain decoding (``AdaptiveGamma.min_gain``, default its ``MIN_GAIN``; 0 takes the
      formula's argmax); their settings carry it.
    evidence: what the adaptive policies, and the calibrations that price them, count of a
      sampled chain step (``AdaptiveGamma.evidence``): "expected" (each draft's acceptance
      chance β, weighted by its chance of being scored; the default) or "accepted" (the outcomes); their settings carry
      it.
    draft_temperature: the drafts' temperature as a multiple of the target's in sampled runs
      (``sampling.scale_temperature``: the same top-k and top-p; 0 drafts the drafter's
      argmax): 1, the default, is the usual rule; lossless at any value
      (``SpeculativeDecoder.draft_sampler``; benchmarks/results/draft_temperature.md).
  """

  experiments: tuple[str, ...] = DEFAULT_EXPERIMENTS
  target: str = "smollm2"
  draft: str = "eagle"
  prompts: Optional[str] = None
  num_prompts: int = 5
  gammas: tuple[int, ...] = (1, 2, 3, 4)
  temperatures: tuple[float, ...] = (0.0, 0.5, 1.0)
  max_new_tokens: int = 128
  batch_size: int = 1
  seed: int = 0
  out: str = "out"
  temperature_gamma: int = 0
  alpha_gamma: int = 4
  early_exit_layers: int = 0
  alpha_drafts: tuple[str, ...] = ("default", "medusa", "unigram", "bigram", "early_exit",
                                   "trained_exit", "prompt_lookup", "jacobi")
  draft_free_drafts: tuple[str, ...] = ("prompt_lookup", "jacobi", "lookahead")
  cost_steps: int = 8
  phase_seconds: float = 0.1
  repeats: int = 2
  extra_rounds: int = 1
  workers: int = 2
  stop_at_eos: bool = True
  fresh: bool = False
  sweep_trees: tuple[str, ...] = ("4:4:4@0", "sampled:2:1@1")
  tree_budgets: tuple[int, ...] = (4, 8, 16)
  calibration_tree: tuple[int, ...] = (6, 3, 2, 1)
  calibration_prompts: int = 8
  verification: str = "block"
  dtype: str = "auto"
  min_gain: float = 0.05  # specjax.speculative.adaptive.MIN_GAIN (a test holds them equal)
  evidence: str = "expected"  # AdaptiveGamma.evidence's default (a test holds them equal)
  draft_temperature: float = 1.0

  def __post_init__(self):
    unknown = [e for e in self.experiments if e not in EXPERIMENTS]
    if unknown or not self.experiments:
      raise ValueError(f"unknown experiments {unknown}; choose from {EXPERIMENTS}, 'default' or "
                       "'all'")
    if not self.gammas or any(int(g) != g or g < 1 for g in self.gammas):
      raise ValueError(f"--gammas must be integers >= 1, got {self.gammas}")
    bad = [t for t in self.temperatures if not (math.isfinite(t) and t >= 0)]
    if not self.temperatures or bad:
      raise ValueError(f"--temperatures must be finite numbers >= 0, got {bad or 'none'}")
    from specjax.sampling import make_sampler  # the library's own range rule, if any
    for t in self.temperatures:
      try:
        make_sampler(t)
      except ValueError as e:
        raise ValueError(f"--temperatures: {t:g}: {e}") from None
    for name in ("tree_budgets", "calibration_tree"):
      values = getattr(self, name)
      if not values or any(int(v) != v or v < 1 for v in values):
        raise ValueError(f"--{name} must be integers >= 1, got {values}")
    timed = []
    for spec in self.sweep_trees:
      try:
        tree, temperatures = sweep_tree(spec)
      except ValueError as e:
        raise ValueError(f"--sweep_trees: {spec}: {e}") from None
      for t in temperatures:
        if (tree, t) in timed:
          raise ValueError(f"--sweep_trees: {spec} times the same tree twice at T = {t:g}")
        timed.append((tree, t))
    for name in ("gammas", "temperatures", "tree_budgets", "alpha_drafts", "draft_free_drafts"):
      values = getattr(self, name)
      if len(set(values)) != len(values):
        raise ValueError(f"--{name} lists a value twice: {values}")
    check_draft(self.draft, "draft")
    sweeps = sorted(set(self.experiments) & {"gamma_sweep", "adaptive", "temperature_sweep",
                                             "tree_sweep"})
    if self.draft in OWN_TREE_DRAFTS and sweeps:
      raise ValueError(f"--draft={self.draft} verifies its own tree, so it has no γ for "
                       f"{', '.join(sweeps)}; measure it with --experiment=drafts_alpha,draft_free")
    for spec in self.alpha_drafts:
      check_draft(spec, "alpha_drafts")
    not_free = [s for s in self.draft_free_drafts if s not in DRAFT_FREE]
    if not_free:
      raise ValueError(f"--draft_free_drafts: {', '.join(map(repr, not_free))} "
                       f"{'is' if len(not_free) == 1 else 'are'} not among the methods without "
                       f"a draft model ({', '.join(DRAFT_FREE)}); measure a draft's α with "
                       "--alpha_drafts")
    if ("draft_free" in self.experiments and not self.draft_free_drafts
        and self.draft not in DRAFT_FREE):
      raise ValueError("--experiment=draft_free has nothing to time: --draft_free_drafts is "
                       f"empty and --draft={self.draft} has a draft model")
    for name in ("num_prompts", "max_new_tokens", "batch_size", "alpha_gamma", "cost_steps",
                 "repeats", "calibration_prompts", "workers"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
    if "tree_sweep" in self.experiments or ("adaptive" in self.experiments
                                            and self.batch_size > 1):
      from experiments.prompts import calibration_prompts  # what calibrates them
      try:
        calibration_prompts(self.calibration_prompts, self.num_prompts)
      except ValueError as e:
        raise ValueError(f"--calibration_prompts={self.calibration_prompts}: {e}") from None
    from specjax.speculative.block_verification import VERIFICATIONS
    if self.verification not in VERIFICATIONS:
      raise ValueError(f"--verification must be one of {VERIFICATIONS}, got "
                       f"{self.verification!r}")
    from specjax.validation import COMPUTE_DTYPES
    if self.dtype not in COMPUTE_DTYPES:
      raise ValueError(f"--dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {self.dtype!r}")
    if not (math.isfinite(self.phase_seconds) and self.phase_seconds > 0):
      raise ValueError(f"--phase_seconds must be a finite number > 0, got {self.phase_seconds}")
    from specjax.speculative.adaptive import check_min_gain  # the policy's own rule
    check_min_gain(self.min_gain, "--min_gain")
    from specjax.speculative.adaptive import check_evidence
    check_evidence(self.evidence, "--evidence")
    if not (math.isfinite(self.draft_temperature) and self.draft_temperature >= 0):
      raise ValueError(f"--draft_temperature must be a finite number >= 0 (a multiple of the "
                       f"target's temperature), got {self.draft_temperature}")
    from specjax.sampling import scale_temperature
    for t in self.temperatures:
      try:
        scale_temperature(make_sampler(t), self.draft_temperature)
      except ValueError as e:
        raise ValueError(f"--draft_temperature={self.draft_temperature:g} at T = {t:g}: "
                         f"{e}") from None
    if self.extra_rounds < 0:
      raise ValueError(f"--extra_rounds must be >= 0, got {self.extra_rounds}")
    if self.max_new_tokens < 2:
      raise ValueError("--max_new_tokens must be >= 2 (the step time is measured from it)")
    if self.temperature_gamma < 0 or self.early_exit_layers < 0:
      raise ValueError("--temperature_gamma and --early_exit_layers must be >= 0")

  @property
  def all_gammas(self) -> tuple[int, ...]:
    """Every γ any experiment may use (sizes the shared KV cache)."""
    return tuple(sorted(set(self.gammas) | {self.alpha_gamma, self.temperature_gamma or 1}))

  @property
  def max_draft_nodes(self) -> int:
    """The most draft nodes one step may verify (sizes the shared KV cache)."""
    nodes = max(self.all_gammas)
    if "gamma_sweep" in self.experiments and self.sweep_trees:
      nodes = max(nodes, *(sweep_tree(t)[0].cache_headroom for t in self.sweep_trees))
    if "tree_sweep" in self.experiments:
      calibration = sum(math.prod(self.calibration_tree[:d + 1])
                        for d in range(len(self.calibration_tree)))
      nodes = max(nodes, max(self.tree_budgets), calibration)
    return nodes

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def check_draft(spec: str, flag: str) -> None:
  """Rejects a draft spec that names nothing: not a known name, ``early_exit[:K]`` with an
  integer K >= 1, nor an existing path. (K <= the target's layers is checked on load.)"""
  if spec.endswith(LOOKUP_SUFFIX):
    base = spec[:-len(LOOKUP_SUFFIX)]
    if base in DRAFT_FREE or base.endswith(LOOKUP_SUFFIX) or not base:
      raise ValueError(f"--{flag}: {spec!r}: {LOOKUP_SUFFIX} adds prompt lookup to a draft "
                       f"model; {base or 'nothing'!r} is not one")
    return check_draft(base, flag)
  if spec in DRAFT_NAMES:
    return
  if spec.startswith("early_exit"):
    _, sep, k = spec.partition(":")
    if spec == "early_exit" or (sep and k.isdigit() and int(k) >= 1):
      return
    raise ValueError(f"--{flag}: {spec!r}: K of early_exit:K must be an integer >= 1")
  if not os.path.exists(spec):
    raise ValueError(f"--{flag}: {spec!r} is neither a draft name ({', '.join(DRAFT_NAMES)}, "
                     "early_exit:K) nor an existing draft directory or file")


def parse_experiments(value: str) -> tuple[str, ...]:
  names = list(parse_names(value))
  if names == ["all"]:
    return EXPERIMENTS
  if names == ["default"]:
    return DEFAULT_EXPERIMENTS
  return tuple(names)


def parse_names(value: str) -> tuple[str, ...]:
  return tuple(v.strip() for v in value.split(",") if v.strip())


def parse_ints(value: str, name: str) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in value.split(",") if v.strip())
  except ValueError:
    raise ValueError(f"--{name} must be a comma-separated list of integers, got {value!r}") from None


def parse_trees(value: str, name: str) -> tuple[str, ...]:
  """"4:4:4@0, sampled:3:3:2" -> ("4:4:4@0", "sampled:3:3:2"): the comma-separated entries,
  stripped, each checked against the grammar of ``sweep_tree`` (a ValueError naming the
  flag otherwise)."""
  trees = tuple("".join(v.split()) for v in value.split(",") if v.strip())
  for v in trees:
    try:
      sweep_tree(v)
    except _SpecError:
      raise ValueError(f"--{name} must be a comma-separated list of top_k:depth:nodes "
                       f"(EAGLE-2) or sampled:w1:w2:... (widths per depth), each optionally "
                       f"@T for one temperature of {_temperatures()}, got {v!r}") from None
    except ValueError:
      pass  # a well-formed entry the tree itself refuses: the config names it
  return trees


class _SpecError(ValueError):
  """A ``sweep_trees`` entry that does not follow its grammar."""


def _temperatures() -> str:
  return " or ".join(f"{t:g}" for t in SWEEP_TEMPERATURES)


def sweep_tree(spec: str) -> tuple[Any, tuple[float, ...]]:
  """A ``sweep_trees`` entry -> (the decoder's tree, the sweep temperatures it is timed at):
  "k:D:N" -> ``DynamicTree(k, D, N)`` (EAGLE-2), "sampled:w₁:w₂:…" ->
  ``SampledDynamicTree((w₁, w₂, …))``; a suffix "@T" times it at that one temperature of
  ``SWEEP_TEMPERATURES``, else at each. ValueError on anything else (the tree's own
  message where the grammar holds but the tree is invalid)."""
  from specjax.speculative.tree import DynamicTree, SampledDynamicTree
  body, at, temperature = spec.partition("@")
  temperatures = SWEEP_TEMPERATURES
  if at:
    try:
      temperatures = (float(temperature),)
    except ValueError:
      temperatures = ()
    if not temperatures or temperatures[0] not in SWEEP_TEMPERATURES:
      raise _SpecError(f"{spec!r}: @T must be one of the sweep's temperatures, "
                       f"{_temperatures()}")
  parts = body.split(":")
  sampled = parts[0] == SAMPLED
  try:
    ints = tuple(int(x) for x in parts[sampled:])
  except ValueError:
    ints = ()
  if not ints or (not sampled and len(ints) != 3):
    raise _SpecError(f"{spec!r} is neither top_k:depth:nodes nor sampled:widths")
  tree = SampledDynamicTree(ints) if sampled else DynamicTree(*ints)
  return tree, temperatures


def tree_setting(tree) -> tuple:
  """A dynamic tree as ``SpecRun.tree`` records it (JSON-friendly): ("dynamic", k, D, N)
  for EAGLE-2's, ("sampled", w₁, …) for a sampled one; ``setting_tree`` inverts it."""
  from specjax.speculative.tree import DynamicTree
  if isinstance(tree, DynamicTree):
    return (DYNAMIC, tree.top_k, tree.depth, tree.num_nodes)
  return (SAMPLED,) + tuple(tree.widths)


def setting_tree(setting: tuple):
  """``tree_setting``'s inverse: ("dynamic", k, D, N) or ("sampled", w₁, …) -> the tree."""
  from specjax.speculative.tree import DynamicTree, SampledDynamicTree
  if setting[0] == DYNAMIC:
    return DynamicTree(*setting[1:])
  if setting[0] == SAMPLED:
    return SampledDynamicTree(tuple(setting[1:]))
  raise ValueError(f"{setting} is no dynamic tree's setting")


def parse_floats(value: str, name: str) -> tuple[float, ...]:
  try:
    return tuple(float(v) for v in value.split(",") if v.strip())
  except ValueError:
    raise ValueError(f"--{name} must be a comma-separated list of numbers, got {value!r}") from None
