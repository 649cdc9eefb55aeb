"""Prompt sets: the built-in held-out set, ``--prompts FILE.jsonl`` validation, batching.

A prompt file has one JSON object per line, in either of two shapes (lines may mix them):

* ours: ``{"prompt": "...", "category": "..."}``;
* Spec-Bench's ``data/spec_bench/question.jsonl`` (Xia et al. 2024):
  ``{"question_id": 81, "category": "writing", "turns": ["turn 1", "turn 2"]}``.
  Each question becomes one prompt, its FIRST turn, with the question's category.
  Spec-Bench runs a multi-turn question (its 80 MT-bench ones have two turns) as a
  conversation: turn 2 is asked after the model's own answer to turn 1, and its
  speed sums both turns. specjax measures one fixed-length generation per prompt,
  known before the run, so later turns are validated but not measured; the prompt's
  ``source`` says "turn 1 of 2" so results.json records what was left out. (Turn 2
  without the model's answer to turn 1 would be a conversation Spec-Bench never has.)

``category`` is optional (default "uncategorised"), blank lines are skipped.
Every error names the file and the 1-based line number.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
from typing import Callable, Optional, Sequence

from specjax import files

DEFAULT_CATEGORY = "uncategorised"

# Used only when specjax.distill.data is unavailable; one per category.
FALLBACK_PROMPTS = (
    ("code", "Write a Python function that returns the n-th Fibonacci number."),
    ("summarise", "Summarize in one sentence: The library lends books, films and music, and "
                  "offers free courses on computing and languages to everyone in town."),
    ("qa", "What is the capital of France, and what river flows through it?"),
    ("math", "Tom has 12 apples and buys 7 more. How many apples does Tom have now?"),
    ("chat", "Give me three tips about gardening."),
)


class PromptFileError(ValueError):
  """A --prompts file that cannot be used; the message names the line."""


@dataclasses.dataclass(frozen=True)
class PromptItem:
  text: str
  category: str = DEFAULT_CATEGORY
  source: str = ""


def load_prompt_file(path: str) -> list[PromptItem]:
  """Reads and validates a .jsonl prompt file: ours, Spec-Bench's, or lines of both.

  Raises:
    PromptFileError: missing file, malformed JSON, a line that is not an
      object, a bad "prompt" or "turns" (see ``_prompt_text``), a bad
      category, or no prompts at all.
  """
  if not os.path.isfile(path):
    raise PromptFileError(f"prompts file {path!r} does not exist")
  items = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f"{path}, line {lineno}"
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise PromptFileError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: expected a JSON object like "
                              f'{{"prompt": ..., "category": ...}} or Spec-Bench\'s '
                              f'{{"turns": [...], "category": ...}}, got {type(obj).__name__}')
      text, turns = _prompt_text(obj, where)
      category = obj.get("category", DEFAULT_CATEGORY)
      if not isinstance(category, str) or not category.strip():
        raise PromptFileError(f'{where}: "category" must be a non-empty string')
      source = f"{path}:{lineno}" + (f" (turn 1 of {turns})" if turns > 1 else "")
      items.append(PromptItem(text=text, category=category.strip(), source=source))
  if not items:
    raise PromptFileError(f"prompts file {path!r} has no prompts")
  return items


def _prompt_text(obj: dict, where: str) -> tuple[str, int]:
  """The prompt of one line and how many turns it has: its "prompt" (1 turn), or the
  first of Spec-Bench's "turns" (every turn must be a non-empty string).

  Raises:
    PromptFileError: neither key or both, a "turns" that is not a non-empty list of
      non-empty strings, a non-string or empty "prompt".
  """
  if "prompt" in obj and "turns" in obj:
    raise PromptFileError(f'{where}: has both "prompt" and "turns"; give one')
  if "turns" in obj:
    turns = obj["turns"]
    if not isinstance(turns, list):
      raise PromptFileError(f'{where}: "turns" must be a list of strings, '
                            f"got {type(turns).__name__}")
    if not turns:
      raise PromptFileError(f'{where}: "turns" is empty')
    for k, turn in enumerate(turns, start=1):
      if not isinstance(turn, str):
        raise PromptFileError(f'{where}: turn {k} of "turns" must be a string, '
                              f"got {type(turn).__name__}")
      if not turn.strip():
        raise PromptFileError(f'{where}: turn {k} of "turns" is empty')
    return turns[0], len(turns)
  if "prompt" not in obj:
    raise PromptFileError(f'{where}: missing required key "prompt" (or Spec-Bench\'s '
                          f'"turns"; keys: {sorted(obj)})')
  text = obj["prompt"]
  if not isinstance(text, str):
    raise PromptFileError(f'{where}: "prompt" must be a string, got {type(text).__name__}')
  if not text.strip():
    raise PromptFileError(f"{where}: empty prompt")
  return text, 1


def default_prompts(num: int) -> list[PromptItem]:
  """The first ``num`` held-out distillation prompts, round-robin over categories.

  Held out by source from the draft's training prompts (``specjax.distill.data``).
  """
  try:
    from specjax.distill import data
  except ImportError:
    return [PromptItem(t, c, "builtin") for c, t in FALLBACK_PROMPTS][:num]
  held = data.interleave_categories(_split()[1])[:num]
  return [PromptItem(p.text, p.category, p.source) for p in held]


def calibration_prompts(num: int, timed: int) -> list[str]:
  """``num`` prompts that calibrate a policy's prices or a tree's shape: the held-out prompts
  after the first ``timed`` (``default_prompts``' order). They are text the draft never
  trained on, as the timed prompts are, and never one of them. Training-side prompts are
  not: the draft learned their answers (SmolLM2's EAGLE-3 drafter at T = 0, answers stopped
  at EOS: α_c 0.73 on 8 of them against 0.58 on 8 held-out ones, and 0.59 on the 5 prompts
  the default run times; benchmarks/results/batch_sweep_eos_trainside_4cf1b41.md)."""
  pool = default_prompts(timed + num)
  held = pool[timed:]
  if len(held) < num:
    raise ValueError(f"{num} calibration prompts after the {timed} timed ones need "
                     f"{timed + num} held-out prompts; there are {len(pool)}")
  return [p.text for p in held]


def training_prompts(num: int) -> list[str]:
  """Prompts from the draft's training side (never in the default evaluation set)."""
  try:
    from specjax.distill import data
  except ImportError:
    return [t for _, t in FALLBACK_PROMPTS][:num]
  return [p.text for p in data.interleave_categories(_split()[0])[:num]]


@functools.lru_cache(maxsize=1)
def _split():
  """(train, held-out) distillation prompts, from the disk cache (``_split_cache_path``) or
  built now and cached: building reads the source of ~1,200 stdlib objects (15-35 s on 2
  cores), which every ``experiments.run`` and each test worker would otherwise repeat."""
  from specjax.distill import data
  path = _split_cache_path()
  try:
    with open(path) as f:
      return tuple([data.Prompt(**p) for p in side] for side in json.load(f))
  except (OSError, ValueError, TypeError):
    pass  # absent or unreadable (a cut-off write): build it
  split = data.split_by_source(data.build_prompts(seed=0))
  files.write_text(path, json.dumps([[dataclasses.asdict(p) for p in side] for side in split]))
  return split


def _split_cache_path() -> str:
  """``<specjax cache>/prompts/<hash>.json``. The prompts are read from this Python's
  stdlib by the code of ``specjax.distill.data``, so the hash covers both: the Python
  build (version and install prefix) and that module's source."""
  from specjax.distill import data
  from specjax.loaders.embedded import cache_dir
  h = hashlib.sha256(repr((sys.version, sys.prefix)).encode())
  with open(data.__file__, "rb") as f:
    h.update(f.read())
  return os.path.join(cache_dir(), "prompts", h.hexdigest()[:16] + ".json")


@dataclasses.dataclass(frozen=True)
class Batch:
  """Prompts of one category decoded together.

  Attributes:
    category: the category of every row ("mixed" for an untimed batch).
    index: position of each real row in the prompt list.
    ids: token ids per row; rows past ``len(index)`` repeat the first prompt
      so every batch has the same shape (one compile) and are left out of
      every statistic.
    row_categories: the category of each real row.
  """

  category: str
  index: tuple[int, ...]
  ids: tuple[tuple[int, ...], ...]
  row_categories: tuple[str, ...] = ()

  @property
  def num_real(self) -> int:
    return len(self.index)


def make_batches(items: Sequence[PromptItem], encode: Callable[[str], list[int]],
                 batch_size: int) -> list[Batch]:
  """Category-pure batches of exactly ``batch_size`` rows (padded by repetition)."""
  ids = [tuple(encode(p.text)) for p in items]
  categories = list(dict.fromkeys(p.category for p in items))
  batches = []
  for cat in categories:
    rows = [i for i, p in enumerate(items) if p.category == cat]
    for k in range(0, len(rows), batch_size):
      chunk = rows[k:k + batch_size]
      padded = [ids[i] for i in chunk] + [ids[chunk[0]]] * (batch_size - len(chunk))
      batches.append(Batch(category=cat, index=tuple(chunk), ids=tuple(padded),
                           row_categories=(cat,) * len(chunk)))
  return batches


def merge_batches(batches: Sequence[Batch], max_rows: int = 16) -> list[Batch]:
  """Mixed-category batches of up to ``max_rows`` real rows, for untimed α measurements
  (fewer sequential steps than category-pure batches; per-row counters keep categories).

  Rows are grouped by prompt length (shortest first), since a batch's prefill costs
  rows × its longest prompt: e.g. lengths 5, 90, 6, 80 in batches of two become
  (5, 6) and (80, 90), not (5, 90) and (6, 80).
  """
  rows = sorted(((i, ids, c) for b in batches
                 for i, ids, c in zip(b.index, b.ids, b.row_categories)),
                key=lambda r: len(r[1]))
  chunks = math.ceil(len(rows) / max_rows)
  size = math.ceil(len(rows) / chunks)  # balanced: 20 rows -> 2 x 10, not 16 + 4
  out = []
  for k in range(0, len(rows), size):
    chunk = rows[k:k + size]
    ids = [r[1] for r in chunk] + [chunk[0][1]] * (size - len(chunk))
    out.append(Batch(category="mixed", index=tuple(r[0] for r in chunk), ids=tuple(ids),
                     row_categories=tuple(r[2] for r in chunk)))
  return out


ALL = "all"  # the category of the rows over every batch


def batch_indices(batches: Sequence[Batch], category: str) -> list[int]:
  """Batches holding rows of ``category`` (timed batches are category-pure)."""
  return [i for i, b in enumerate(batches) if category == ALL or category in b.row_categories]


def categories(batches: Sequence[Batch]) -> list[str]:
  return list(dict.fromkeys(b.category for b in batches))


def load_items(path: Optional[str], num: int) -> list[PromptItem]:
  """The --prompts file, or the first ``num`` built-in prompts (all of them must exist)."""
  if path:
    return load_prompt_file(path)
  items = default_prompts(num)
  if len(items) < num:
    raise PromptFileError(f"--num_prompts={num}: the built-in held-out set has only "
                          f"{len(items)} prompts")
  return items
