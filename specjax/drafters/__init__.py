"""Drafters: anything that proposes γ tokens with their distributions."""

from specjax.drafters.base import Drafter
from specjax.drafters.early_exit import early_exit_drafter
from specjax.drafters.model_drafter import ModelDrafter
from specjax.drafters.ngram import NgramDrafter, fit_ngram
from specjax.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "PromptLookupDrafter", "early_exit_drafter",
           "fit_ngram"]
