"""The corpus Table 3's unigram and bigram drafts are fitted on, built by the run itself.

The target's own responses to NUM_PROMPTS training-split prompts (never the
evaluation prompts), NEW_TOKENS each with EOS ignored, once greedy and once
sampled at T = 1 (seed 0): NUM_PROMPTS × NEW_TOKENS × 2 tokens, so a fresh
clone fits the same drafts as any other. The corpus is cached under
``<specjax cache>/ngram/<hash>.npz``, the hash covering everything it depends
on (the target's config and weights, the prompt ids, the budget, samplers and
seed): a cached corpus is reused only where the run would rebuild it as is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time

import jax
import numpy as np

import specjax
from specjax import files
from specjax.sampling import Greedy, Sampling

from experiments.models import Target
from experiments.prompts import training_prompts

NUM_PROMPTS = 32
NEW_TOKENS = 64
SEED = 0
SAMPLERS = (Greedy(), Sampling(temperature=1.0))


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Target responses to fit n-gram drafts on.

  Attributes:
    seqs: one token array per response.
    build_seconds: what generating it took (when it was built, maybe in an earlier run).
    cached: whether this run read it from the cache.
  """

  seqs: tuple[np.ndarray, ...]
  build_seconds: float
  cached: bool

  @property
  def tokens(self) -> int:
    return int(sum(len(s) for s in self.seqs))

  def describe(self) -> str:
    how = "read from the cache" if self.cached else "built in this run"
    return (f"{self.tokens} tokens: target responses to {NUM_PROMPTS} training-split prompts, "
            f"greedy and T=1, {NEW_TOKENS} tokens each ({self.build_seconds:.0f} s to build, "
            f"{how})")


def content_hash(target: Target, prompt_ids: list[list[int]]) -> str:
  h = hashlib.sha256()
  h.update(repr((target.cfg, prompt_ids, NEW_TOKENS, SEED, SAMPLERS)).encode())
  for leaf in jax.tree.leaves(target.params):
    h.update(np.ascontiguousarray(np.asarray(leaf)).data)
  return h.hexdigest()[:16]


def load_or_build(target: Target) -> Corpus:
  """The corpus for ``target``, from the cache or generated now (then cached)."""
  from specjax.loaders.embedded import cache_dir
  ids = [target.encode(t) for t in training_prompts(NUM_PROMPTS)]
  path = os.path.join(cache_dir(), "ngram", content_hash(target, ids) + ".npz")
  if os.path.exists(path):
    with np.load(path) as f:
      n = int(f["count"])
      return Corpus(tuple(f[f"s{i}"] for i in range(n)), float(f["build_seconds"]), True)
  start = time.perf_counter()
  seqs = []
  for sampler in SAMPLERS:
    out = specjax.generate(target.params, target.cfg, ids, NEW_TOKENS, sampler, seed=SEED,
                           eos_ids=())
    seqs += [np.asarray(out.generated(r), np.int32) for r in range(len(ids))]
  corpus = Corpus(tuple(seqs), time.perf_counter() - start, False)
  with files.atomic_path(path, ".npz") as tmp:
    np.savez(tmp, count=len(seqs), build_seconds=corpus.build_seconds,
             **{f"s{i}": s for i, s in enumerate(seqs)})
  return corpus
