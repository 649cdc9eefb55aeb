"""Tokenizers from GGUF metadata or a local HF tokenizer directory, with chat templates."""

from __future__ import annotations

import os
from typing import Any, Sequence

from specjax.loaders.hf import CheckpointError


def load_tokenizer(path: str):
  """Returns a transformers tokenizer for a ``.gguf`` file or a local HF directory.

  For GGUF, the vocabulary, merges, special tokens and chat template are read
  from the file's ``tokenizer.*`` metadata. Never touches the network.
  """
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  from transformers import AutoTokenizer

  if not os.path.exists(path):
    raise CheckpointError(f"tokenizer source {path!r} does not exist")
  try:
    if path.endswith(".gguf"):
      return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                           gguf_file=os.path.basename(path),
                                           local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
  except (OSError, ValueError) as e:
    raise CheckpointError(f"cannot build a tokenizer from {path!r}: {e}") from None


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
