"""Lossless speculative decoding (Leviathan et al. 2023; Chen et al. 2023)."""

from specjax.speculative.acceptance import Acceptance, accept
from specjax.speculative.decoder import SpeculativeDecoder
from specjax.speculative.metrics import SpecResult
from specjax.speculative.state import SpecCounters, SpecState

__all__ = ["Acceptance", "SpecCounters", "SpecResult", "SpecState", "SpeculativeDecoder", "accept"]
