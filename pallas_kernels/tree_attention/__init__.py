"""Tree-masked attention over a KV cache: kernels (TPU, GPU), reference, block sizes."""

from pallas_kernels.tree_attention.block_sizes import BlockSizes
from pallas_kernels.tree_attention.gpu_kernel import tree_attention_gpu
from pallas_kernels.tree_attention.reference import (ancestor_mask, check_inputs, pack_mask,
                                                     tree_attention_reference)
from pallas_kernels.tree_attention.tpu_kernel import tree_attention_tpu

__all__ = ["BlockSizes", "ancestor_mask", "check_inputs", "pack_mask", "tree_attention_gpu",
           "tree_attention_reference", "tree_attention_tpu"]
