"""Self-speculative early exit: the target's first k layers + its final norm and LM head.

Training-free and sharing the target's weights: the draft is an ordinary
``ModelDrafter`` over a truncated config whose params are the target's own
arrays (no copy). Its KV entries for layers < k equal the target's for the
same committed tokens; it keeps its own cache of those k layers rather than
aliasing the target's, because the target overwrites draft slots during
verification — the cost is k/L of the target's cache memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specjax.config import ModelConfig
from specjax.drafters.model_drafter import ModelDrafter
from specjax.model import Params


def early_exit_drafter(cfg: ModelConfig, params: Params,
                       num_layers: int) -> tuple[ModelDrafter, dict[str, Any]]:
  """Returns (drafter, draft_params) exiting after ``num_layers`` of the target."""
  if not 1 <= num_layers <= cfg.num_layers:
    raise ValueError(f"num_layers must be in [1, {cfg.num_layers}], got {num_layers}")
  drafter = ModelDrafter(dataclasses.replace(cfg, num_layers=num_layers,
                                             name=f"{cfg.name}-exit{num_layers}"))
  truncated = dict(params, layers=params["layers"][:num_layers])
  return drafter, drafter.make_params(truncated)
