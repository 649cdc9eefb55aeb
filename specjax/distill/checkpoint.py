"""Orbax checkpointing of the training state, with clear errors for missing or corrupt steps,
and which parts of a run's setup make it another draft."""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from specjax.loaders.hf import CheckpointError


def manager(directory: str, max_to_keep: int = 2) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))


def save(mngr: ocp.CheckpointManager, step: int, state: Any) -> None:
  """Saves ``state`` at ``step`` and waits, so a kill right after leaves a complete step."""
  mngr.save(step, args=ocp.args.StandardSave(state), force=True)
  mngr.wait_until_finished()


def restore(mngr: ocp.CheckpointManager, like: Any, step: Optional[int] = None) -> Any:
  """Restores ``step`` (default: the latest) into the structure of ``like``.

  Raises:
    CheckpointError: the requested step does not exist, or its files are
      corrupt / do not match the structure of ``like``.
  """
  steps = sorted(mngr.all_steps(read=True))
  if step is None:
    if not steps:
      raise CheckpointError(f"no checkpoint in {mngr.directory}")
    step = steps[-1]
  if step not in steps:
    raise CheckpointError(f"no checkpoint for step {step} in {mngr.directory}; "
                          f"available steps: {steps or 'none'}")
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  try:
    return mngr.restore(step, args=ocp.args.StandardRestore(abstract))
  except Exception as e:  # orbax/tensorstore raise many types for damaged files
    raise CheckpointError(f"checkpoint step {step} in {mngr.directory} is corrupt or does not "
                          f"match the training state: {type(e).__name__}: {e}") from None


def latest_step(mngr: ocp.CheckpointManager) -> Optional[int]:
  return mngr.latest_step()


# What a run's setup.json records about its data rather than its draft: a warm start
# (experiments.train_draft --init_from) may change these and still continue the same draft.
CORPUS_SETUP_KEYS = ("corpus", "train_responses", "train_tokens", "corpus_kind", "text_corpus",
                     "teacher", "teacher_topk", "adaspec_keep", "adaspec_reference", "init_from",
                     "also_corpora", "length_group")


def draft_mismatch(theirs: dict, ours: dict) -> dict:
  """{key: (theirs, ours)} for the setup keys on which two runs train different drafts
  (kind, layers, exit layer, adapter, head, vocabulary size...); a key one setup lacks
  counts as different. The corpus keys (``CORPUS_SETUP_KEYS``) are ignored."""
  keys = (set(theirs) | set(ours)) - set(CORPUS_SETUP_KEYS)
  return {k: (theirs.get(k), ours.get(k)) for k in sorted(keys) if theirs.get(k) != ours.get(k)}
