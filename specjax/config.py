"""Static model configuration for the Llama family.

Axis glossary used in shape annotations across specjax:
  B batch, T new (query) tokens, S cache slots, L layers, D model width,
  N query heads, K key/value heads, G = N // K query heads per kv head,
  H head dim, F feed-forward width, V vocabulary, γ (gamma) draft length.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2).

  Frozen and hashable, so it is a static argument of every jitted function.
  """

  vocab_size: int
  dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  ffn_dim: int
  head_dim: Optional[int] = None
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling] = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  qkv_bias: bool = False
  max_position_embeddings: int = 8192
  sliding_window: Optional[int] = None
  bos_token_id: Optional[int] = None
  eos_token_ids: tuple[int, ...] = ()
  name: str = "llama"

  def __post_init__(self):
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.dim // self.num_heads)
    for field in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim"):
      if getattr(self, field) < 1:
        raise ValueError(f"ModelConfig.{field} must be >= 1, got {getattr(self, field)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

  @property
  def max_cache_size(self) -> Optional[int]:
    """Attention is full (no window) only up to this many cached tokens."""
    return self.sliding_window

  @property
  def group_size(self) -> int:
    return self.num_heads // self.num_kv_heads

  @property
  def num_params(self) -> int:
    h = self.head_dim
    attn = self.dim * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    mlp = 3 * self.dim * self.ffn_dim
    per_layer = attn + mlp + 2 * self.dim
    embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
    return self.num_layers * per_layer + embed + self.dim
