"""Tokenizers from GGUF metadata or a local HF tokenizer directory, with chat templates."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Sequence

from specjax.loaders.hf import CheckpointError


def load_tokenizer(path: str, use_cache: bool = True):
  """Returns a transformers tokenizer for a ``.gguf`` file or a local HF directory.

  For GGUF, the vocabulary, merges, special tokens and chat template are read
  from the file's ``tokenizer.*`` metadata (12–14 s here: transformers parses all of
  the file's metadata and converts it), then saved as an HF tokenizer directory
  under the specjax cache, keyed by the file's name, size and mtime and the
  transformers version, so a later process loads it in 3.6 s, most of it importing
  transformers (``python -m benchmarks.cold_start``). Never touches the network.
  """
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  from transformers import AutoTokenizer

  if not os.path.exists(path):
    raise CheckpointError(f"tokenizer source {path!r} does not exist")
  try:
    if not path.endswith(".gguf"):
      return AutoTokenizer.from_pretrained(path, local_files_only=True)
    cached = _cache_path(path) if use_cache else None
    if cached and os.path.isdir(cached):
      try:
        return AutoTokenizer.from_pretrained(cached, local_files_only=True)
      except Exception:  # pylint: disable=broad-except
        shutil.rmtree(cached, ignore_errors=True)  # a corrupt entry is rebuilt below
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                              gguf_file=os.path.basename(path),
                                              local_files_only=True)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"cannot build a tokenizer from {path!r}: {e}") from None
  if cached:
    _save(tokenizer, cached)
  return tokenizer


def _cache_path(gguf_path: str) -> str:
  import transformers
  from specjax.loaders.embedded import cache_dir, file_stamp

  stem = os.path.splitext(os.path.basename(gguf_path))[0]
  return os.path.join(cache_dir(), f"tokenizer-{stem}-{file_stamp(gguf_path)}"
                                   f"-transformers{transformers.__version__}")


def _save(tokenizer, cached: str) -> None:
  """Writes the tokenizer to ``cached`` atomically (a rename of a finished directory);
  another process that got there first wins, and an unwritable cache is skipped."""
  parent = os.path.dirname(cached)
  try:
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
  except OSError:
    return
  try:
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, cached)
  except OSError:
    pass
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def chat_prompt(tokenizer, messages: Sequence[dict[str, Any]] | str) -> list[int]:
  """Token ids of a chat conversation ending in the assistant's turn.

  A plain string is taken as one user message.
  """
  if isinstance(messages, str):
    messages = [{"role": "user", "content": messages}]
  if getattr(tokenizer, "chat_template", None):
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
      ids = ids["input_ids"]
    return list(ids)
  return tokenizer.encode("\n".join(m["content"] for m in messages))
