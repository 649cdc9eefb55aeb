"""Validation and packing of a batch of prompts into one static-shape token buffer."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from specjax import validation


def pack_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 cache_size: Optional[int] = None, *, headroom: int = 0,
                 vocab_size: Optional[int] = None, round_to: int = 64,
                 max_cache_size: Optional[int] = None, max_positions: Optional[int] = None,
                 cache_bytes_per_slot: int = 0,
                 cache_rows: Optional[int] = None) -> tuple[np.ndarray, np.ndarray, int]:
  """Right-pads prompts into a [B, S] buffer.

  Args:
    prompts: B lists of token ids, each non-empty.
    max_new_tokens: tokens to generate per row (>= 0).
    cache_size: S, slots per row; default: the smallest multiple of
      ``round_to`` that fits the longest prompt + max_new_tokens + headroom.
    headroom: extra slots a method writes past the output (e.g. γ for
      speculative verification).
    vocab_size: when given, token ids must lie in [0, vocab_size).
    max_cache_size: largest cache the model supports (e.g. a sliding window).
    max_positions: the model's maximum positions; the longest prompt +
      max_new_tokens must not exceed it.
    cache_bytes_per_slot: KV-cache bytes per row and slot (see
      ``kv_cache.bytes_per_slot``); when given, a cache larger than the free
      memory of the device is refused before it is allocated.
    cache_rows: rows of that cache (default: one per prompt; continuous batching's slots).

  Returns:
    (tokens [B, S] int32, prompt_lengths [B] int32, S).

  Raises:
    ValueError naming the offending prompt.
  """
  max_new_tokens = validation.as_int(max_new_tokens, "max_new_tokens", 0)
  if cache_size is not None:
    cache_size = validation.as_int(cache_size, "cache_size", 1)
  if isinstance(prompts, np.ndarray) and prompts.ndim == 1 or (
      len(prompts) and isinstance(prompts[0], (int, np.integer))):
    raise ValueError("prompts must be a batch: a list of token-id lists")
  if len(prompts) == 0:
    raise ValueError("no prompts given")
  lengths = np.array([len(p) for p in prompts], np.int32)
  for i, n in enumerate(lengths):
    if n == 0:
      raise ValueError(f"prompt {i} is empty")
    ids = np.asarray(prompts[i])
    if not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"prompt {i} must hold integer token ids, got dtype {ids.dtype}")
    if vocab_size is not None:
      if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
  if max_positions is not None and int(lengths.max()) + max_new_tokens > max_positions:
    i = int(lengths.argmax())
    raise ValueError(f"prompt {i} has {lengths[i]} tokens; with max_new_tokens={max_new_tokens} "
                     f"it needs {lengths[i] + max_new_tokens} positions, more than the model's "
                     f"maximum of {max_positions} positions")
  need = int(lengths.max()) + max_new_tokens + headroom
  if cache_size is None:
    cache_size = -(-need // round_to) * round_to
  if need > cache_size:
    i = int(lengths.argmax())
    raise ValueError(
        f"prompt {i} has {lengths[i]} tokens; with max_new_tokens={max_new_tokens}"
        f"{f' and {headroom} slots of headroom' if headroom else ''} it needs {need} cache "
        f"slots but the cache has {cache_size}")
  if max_cache_size is not None and cache_size > max_cache_size:
    raise ValueError(f"a cache of {cache_size} slots exceeds this model's limit of "
                     f"{max_cache_size} (sliding-window attention is not implemented)")
  rows = len(prompts) if cache_rows is None else cache_rows
  cache_bytes = rows * cache_size * cache_bytes_per_slot
  free = validation.available_memory_bytes() if cache_bytes else None
  if free is not None and cache_bytes > free:
    raise ValueError(f"a KV cache of {rows} rows x {cache_size} slots needs "
                     f"{cache_bytes / 2**30:.2f} GiB but the device has {free / 2**30:.2f} GiB "
                     f"free: use fewer {'prompts' if cache_rows is None else 'slots'} or a "
                     "smaller max_new_tokens")
  tokens = np.zeros((len(prompts), cache_size), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  return tokens, lengths, cache_size
