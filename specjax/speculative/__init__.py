"""Lossless speculative decoding (Leviathan et al. 2023; Chen et al. 2023), over chains and trees."""

from specjax.speculative.acceptance import Acceptance, accept
from specjax.speculative.block_verification import accept_block
from specjax.speculative.continuous import ServeResult, serve
from specjax.speculative.decoder import SpeculativeDecoder
from specjax.speculative.metrics import SpecResult
from specjax.speculative.proposal import Proposal
from specjax.speculative.state import SpecCounters, SpecState
from specjax.speculative.tree import DynamicTree, SampledDynamicTree, TreeTopology
from specjax.speculative.tree_acceptance import TreeAcceptance, accept_tree

__all__ = ["Acceptance", "DynamicTree", "Proposal", "SampledDynamicTree", "ServeResult",
           "SpecCounters", "SpecResult", "SpecState", "SpeculativeDecoder", "TreeAcceptance",
           "TreeTopology", "accept", "accept_block", "accept_tree", "serve"]
