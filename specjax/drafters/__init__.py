"""Drafters: anything that proposes γ tokens with their distributions.

Each implements ``Drafter``, the interface the speculative step calls, which lives with
the step (``specjax.speculative.drafter``) so that the step never imports a drafter.
"""

from specjax.drafters.eagle import EagleDrafter, eagle_drafter
from specjax.drafters.eagle_arch import EagleArch
from specjax.drafters.early_exit import EarlyExitDrafter, early_exit_drafter, trained_exit_drafter
from specjax.drafters.hybrid import HybridDrafter, hybrid_drafter
from specjax.drafters.jacobi import JacobiDrafter
from specjax.drafters.lookahead import LookaheadDrafter
from specjax.drafters.medusa import MedusaDrafter, medusa_drafter, medusa_tree
from specjax.drafters.model_drafter import ModelDrafter
from specjax.drafters.ngram import NgramDrafter, fit_ngram
from specjax.drafters.prompt_lookup import PromptLookupDrafter
from specjax.speculative.drafter import Drafter

__all__ = ["Drafter", "EagleArch", "EagleDrafter", "EarlyExitDrafter", "HybridDrafter",
           "JacobiDrafter", "LookaheadDrafter", "MedusaDrafter", "ModelDrafter", "NgramDrafter",
           "PromptLookupDrafter", "eagle_drafter", "early_exit_drafter", "fit_ngram",
           "hybrid_drafter", "medusa_drafter", "medusa_tree", "trained_exit_drafter"]
