"""Static block sizes of the tree-attention kernels."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiling of the cache and of the query rows (all static, hashable).

  Attributes:
    block_kv: cache slots per grid step of the TPU kernel. A multiple of 128
      (the lane width) on real hardware; any size in interpret mode.
    block_kv_gpu: cache slots per inner-loop step of the GPU kernel (a power
      of two, >= 16 for the tensor-core dot).
    num_kv_splits: cache splits the GPU kernel processes in parallel, combined
      with a log-sum-exp reduction (flash-decoding).
    block_q_gpu: query rows (tokens x query heads per kv head) per GPU program,
      a power of two >= 16.
    max_tree_tokens: the largest T accepted, i.e. the budget of the ancestor
      bitmask (ceil(T / 32) int32 words per token) and of the query rows.
  """

  block_kv: int = 512
  block_kv_gpu: int = 64
  num_kv_splits: int = 16
  block_q_gpu: int = 64
  max_tree_tokens: int = 128

  def __post_init__(self):
    for name in ("block_kv", "block_kv_gpu", "num_kv_splits", "block_q_gpu", "max_tree_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"BlockSizes.{name} must be positive, got {getattr(self, name)}")
    for name in ("block_kv_gpu", "block_q_gpu"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"BlockSizes.{name} must be a power of two >= 16 (Triton), got {v}")

  @classmethod
  def get_default(cls) -> "BlockSizes":
    return cls()
