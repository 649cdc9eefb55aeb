"""Drafters: anything that proposes γ tokens with their distributions."""

from specjax.drafters.base import Drafter
from specjax.drafters.model_drafter import ModelDrafter

__all__ = ["Drafter", "ModelDrafter"]
