"""Targets and drafts by name: what ``--target`` and ``--draft`` resolve to."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np
from absl import logging

from specjax import drafters
from specjax.config import ModelConfig
from specjax import validation
from specjax.model import Params, cast_params, compute_dtype
from specjax.drafters.eagle import head_rows

from experiments.config import DRAFT_NAMES, LOOKUP_SUFFIX

TINY = "tiny"


@dataclasses.dataclass
class Target:
  """The model being accelerated.

  Attributes:
    name: the --target value.
    cfg, params: the model.
    encode: prompt text -> token ids (chat template for real models).
    tokenizer: the tokenizer, or None for the tiny random model.
  """

  name: str
  cfg: ModelConfig
  params: Params
  encode: Callable[[str], list[int]]
  tokenizer: Any = None


@dataclasses.dataclass
class Draft:
  """A drafter with its parameters.

  Attributes:
    name: label in tables ("default", "bigram", "early_exit:6", ...).
    drafter, params: what SpeculativeDecoder and its methods take.
    note: provenance (e.g. why a fallback was used).
  """

  name: str
  drafter: Any
  params: Any
  note: str = ""


def load_target(source: str, dtype: str = "auto") -> Target:
  """The target named by --target, its weights in ``dtype`` (``validation.compute_dtype``)."""
  if source == TINY:
    from specjax.testing import tiny_model
    cfg, params = tiny_model(seed=0)
    params = cast_params(params, validation.compute_dtype(dtype))
    # Bytes folded into the tiny vocabulary: deterministic and prompt-dependent.
    encode = lambda text: [b % cfg.vocab_size for b in text.encode("utf-8")][:48] or [1]
    return Target(TINY, cfg, params, encode)
  from specjax.loaders import chat_prompt, load_model, load_model_tokenizer
  cfg, params = load_model(source, dtype)
  tok = load_model_tokenizer(source)
  return Target(source, cfg, params, lambda text: chat_prompt(tok, text), tok)


def default_early_exit_layers(cfg: ModelConfig) -> int:
  return max(1, cfg.num_layers // 5)


def load_draft(spec: str, target: Target,
               ngram_corpus: Callable[[], Sequence[Sequence[int]]]) -> Draft:
  """Resolves a --draft value; ``ngram_corpus`` is called only for n-gram drafts. A draft
  model computes in the target's dtype (an EAGLE drafter's weights are cast by
  ``eagle_params``, early exit shares the target's)."""
  d = _resolve_draft(spec, target, ngram_corpus)
  if isinstance(d.drafter, drafters.ModelDrafter):
    d = dataclasses.replace(d, params=cast_params(d.params, compute_dtype(target.params)))
  return d


def _resolve_draft(spec: str, target: Target,
                   ngram_corpus: Callable[[], Sequence[Sequence[int]]]) -> Draft:
  cfg = target.cfg
  if spec.endswith(LOOKUP_SUFFIX):
    base = load_draft(spec[:-len(LOOKUP_SUFFIX)], target, ngram_corpus)
    return Draft(spec, drafters.hybrid_drafter(base.drafter), base.params,
                 f"prompt lookup where the last 3-4 tokens recur, else {base.name}")
  if spec == "default":
    return _default_draft(target)
  if spec == "eagle":
    return _default_eagle(target)
  if spec == "medusa":
    return _default_medusa(target)
  if spec in ("trained_exit", "adapter_exit"):
    return _default_exit(target, adapter=spec == "adapter_exit")
  if spec.startswith("early_exit"):
    k = int(spec.split(":", 1)[1]) if ":" in spec else default_early_exit_layers(cfg)
    drafter, params = drafters.early_exit_drafter(cfg, target.params, k)
    return Draft(f"early_exit:{k}", drafter, params, f"first {k} of {cfg.num_layers} layers")
  if spec in ("unigram", "bigram"):
    corpus = ngram_corpus()
    order = 1 if spec == "unigram" else 2
    params = drafters.fit_ngram(corpus, cfg.vocab_size)
    n = sum(len(s) for s in corpus)
    return Draft(spec, drafters.NgramDrafter(cfg.vocab_size, order=order), params,
                 f"fitted on {n} target-generated tokens")
  if spec == "prompt_lookup":
    return Draft(spec, drafters.PromptLookupDrafter(cfg.vocab_size, max_ngram=3), ())
  if spec in ("jacobi", "jacobi_random"):
    fill = "random" if spec == "jacobi_random" else "prompt_lookup"
    return Draft(spec, drafters.JacobiDrafter(cfg.vocab_size, fill=fill), (),
                 f"Jacobi iteration, no draft model; fresh slots: {fill.replace('_', ' ')}")
  if spec == "lookahead":
    d = drafters.LookaheadDrafter(cfg.vocab_size)
    return Draft(spec, d, (), f"lookahead decoding, no draft model: window W={d.window}, "
                 f"n-grams N={d.ngram}, guess set G={d.guesses} ({d.default_tree().num_nodes} "
                 "nodes a step)")
  if spec == TINY:
    return _random_tiny_draft(cfg)
  if os.path.exists(spec):
    return _draft_from_path(spec, target)
  raise ValueError(f"unknown --draft {spec!r}: use {', '.join(DRAFT_NAMES)}, early_exit:K, "
                   "or the path of a draft directory (token, EAGLE, Medusa or trained exit), "
                   ".gguf file or HF dir")


def _model_draft(name: str, dcfg: ModelConfig, dparams: Params, vocab_map: Optional[np.ndarray],
                 target_vocab: int, note: str, input_map: Optional[np.ndarray] = None) -> Draft:
  if vocab_map is not None:
    drafter = drafters.ModelDrafter(dcfg, target_vocab_size=target_vocab)
    return Draft(name, drafter, drafter.make_params(dparams, vocab_map, input_map), note)
  if dcfg.vocab_size != target_vocab:
    raise ValueError(f"draft {name!r} has a vocabulary of {dcfg.vocab_size} tokens but the "
                     f"target has {target_vocab}")
  drafter = drafters.ModelDrafter(dcfg)
  return Draft(name, drafter, drafter.make_params(dparams), note)


def _random_tiny_draft(cfg: ModelConfig) -> Draft:
  from specjax.testing import tiny_model
  dcfg, dparams = tiny_model(seed=1, vocab_size=cfg.vocab_size, num_layers=1, dim=16,
                             num_heads=2, num_kv_heads=1, ffn_dim=32)
  return _model_draft(TINY, dcfg, dparams, None, cfg.vocab_size, "random tiny model")


def _random_feature_draft(kind: str, target: Target, note: str) -> Draft:
  """The tiny target's stand-in for a shipped feature drafter: the random one the tests use."""
  from specjax.testing import make_drafter
  drafter, dp = make_drafter(kind, target.cfg, target.params, ())
  return Draft(kind, drafter, dp, note)


def _default_draft(target: Target) -> Draft:
  """The shipped distilled draft; falls back (loudly) when it is not available."""
  if target.name == TINY:
    return _random_tiny_draft(target.cfg)
  try:
    from specjax.drafts import default_drafter
    drafter, dp = default_drafter(target.tokenizer, target.cfg.vocab_size,
                                  target_embed=target.params["embed"])
  except (ImportError, OSError, ValueError) as e:
    k = default_early_exit_layers(target.cfg)
    logging.warning("default draft unavailable (%s); falling back to early_exit:%d", e, k)
    d = load_draft(f"early_exit:{k}", target, lambda: [])
    return dataclasses.replace(d, note=f"FALLBACK, default draft unavailable: {e}")
  dcfg = drafter.cfg
  return Draft("default", drafter, dp, f"distilled draft ({dcfg.num_layers} layers, "
                                       f"d={dcfg.dim}, vocab {dcfg.vocab_size})")


def _default_eagle(target: Target) -> Draft:
  """The shipped EAGLE drafter (a random one for the tiny target)."""
  if target.name == TINY:
    return _random_feature_draft("eagle", target, "random EAGLE weights")
  from specjax.drafts import default_eagle_drafter
  drafter, dp = default_eagle_drafter(target.cfg, target.params, target.tokenizer)
  return Draft("eagle", drafter, dp, f"EAGLE feature drafter ({drafter.cfg.num_layers} layer, "
                                     f"{head_rows(dp)}-row head)")


def _default_medusa(target: Target) -> Draft:
  """The shipped Medusa-1 heads on their own tree (random heads for the tiny target)."""
  if target.name == TINY:
    return _random_feature_draft("medusa", target, "random Medusa heads")
  from specjax.drafts import default_medusa_drafter
  drafter, dp = default_medusa_drafter(target.cfg, target.params, target.tokenizer)
  rows = (f"{head_rows(dp)}-row shared head" if drafter.shared_head
          else f"own {head_rows(dp)}-row heads")
  return Draft("medusa", drafter, dp,
               f"Medusa-1 heads ({drafter.num_heads} heads of {drafter.num_layers} blocks, "
               f"{rows}), their {drafter.default_tree().num_nodes}-node tree from held-out "
               "accuracies")


def _default_exit(target: Target, adapter: bool = False) -> Draft:
  """A shipped trained early exit, with or without its attention adapter (for the tiny
  target: a random exit head after layer 1, and a perturbed copy of layer 1 as the adapter)."""
  name = "adapter_exit" if adapter else "trained_exit"
  if target.name == TINY:
    return _random_feature_draft(name, target, "random exit head after layer 1")
  from specjax.drafts import default_exit_drafter
  drafter, dp = default_exit_drafter(target.cfg, target.params, target.tokenizer, adapter)
  rows = dp["exit"]["head"].shape[0]
  return Draft(name, drafter, dp,
               f"first {drafter.cfg.num_layers} of {target.cfg.num_layers} layers + "
               f"{'an attention adapter and ' if adapter else ''}a trained exit head "
               f"({rows} rows)")


def _draft_from_path(path: str, target: Target) -> Draft:
  from specjax.drafts import drafter_from_path  # checks the tokenizer fingerprint
  drafter, dp, note = drafter_from_path(path, target.cfg, target.params, target.tokenizer)
  return Draft(os.path.basename(os.path.normpath(path)), drafter, dp, note)

