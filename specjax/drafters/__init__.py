"""Drafters: anything that proposes γ tokens with their distributions."""

from specjax.drafters.base import Drafter
from specjax.drafters.eagle import EagleDrafter, eagle_drafter
from specjax.drafters.early_exit import early_exit_drafter
from specjax.drafters.jacobi import JacobiDrafter
from specjax.drafters.model_drafter import ModelDrafter
from specjax.drafters.ngram import NgramDrafter, fit_ngram
from specjax.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Drafter", "EagleDrafter", "JacobiDrafter", "ModelDrafter", "NgramDrafter",
           "PromptLookupDrafter", "eagle_drafter", "early_exit_drafter", "fit_ngram"]
