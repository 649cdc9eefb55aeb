"""Greedy token-tree verification (longest accepted path): kernels (TPU, GPU), jnp reference."""

from pallas_kernels.tree_verify.gpu_kernel import tree_verify_gpu
from pallas_kernels.tree_verify.reference import (Verified, check_inputs, check_parents,
                                                  tree_verify_reference)
from pallas_kernels.tree_verify.tpu_kernel import tree_verify_tpu

__all__ = ["Verified", "check_inputs", "check_parents", "tree_verify_gpu",
           "tree_verify_reference", "tree_verify_tpu"]
