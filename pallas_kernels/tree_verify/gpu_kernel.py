"""Greedy token-tree verification, Pallas GPU (Triton) kernel.

Grid (B,), one program per tree. Triton has no scalar scratch memory, so each
program loads its row's parents, tokens and argmax as [N_pad] vectors and
keeps the per-node depths (-1 = not accepted) in a vector carry; reading node
i's value is a one-hot ``where`` + ``sum`` (O(N) per node, O(N^2) per tree,
which is nothing at tree sizes of a few dozen nodes). The loops and tie rule
are those of the TPU kernel.

Triton block shapes are powers of two: N is padded with padding nodes
(parent -1, never accepted) and the path with -1. The Triton backend is
selected by passing ``plgpu.CompilerParams`` explicitly.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_verify.reference import Verified, check_inputs


def _next_pow2(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _kernel(parents_ref,  # [N_pad] int32 of row b
            tokens_ref,   # [N_pad] int32
            argmax_ref,   # [N_pad] int32
            path_ref,     # [D_pad] int32 path of row b, -1 past its end
            stats_ref,    # [2] int32 (length, next_token) of row b
            *, num_nodes: int, max_depth: int):
  parents, tokens, target_argmax = parents_ref[...], tokens_ref[...], argmax_ref[...]
  node = jnp.arange(parents.shape[0], dtype=jnp.int32)
  at = lambda vec, i: jnp.sum(jnp.where(node == i, vec, 0))  # vec[i] for a traced scalar i

  def visit(c, carry):
    depth, best_node, best_depth = carry
    p = at(parents, c)
    valid = (p >= 0) & (p < c)
    p = jnp.where(valid, p, 0)
    at_parent = at(depth, p)
    ok = (valid & (at_parent >= 0) & (at_parent < max_depth)
          & (at(tokens, c) == at(target_argmax, p)))
    d = jnp.where(ok, at_parent + 1, -1)
    deeper = d > best_depth  # strict: the smallest index wins ties
    return (jnp.where(node == c, d, depth), jnp.where(deeper, c, best_node),
            jnp.where(deeper, d, best_depth))

  depth0 = jnp.where(node == 0, 0, -1).astype(jnp.int32)
  _, best, length = jax.lax.fori_loop(1, num_nodes, visit,
                                      (depth0, jnp.int32(0), jnp.int32(0)))

  col = jnp.arange(path_ref.shape[0], dtype=jnp.int32)

  def back(j, carry):  # step j fills path[length - j] (nothing once < 0)
    path, cur = carry
    path = jnp.where(col == length - j, cur, path)
    return path, jnp.where(cur > 0, at(parents, cur), 0)

  path, _ = jax.lax.fori_loop(0, max_depth + 1, back,
                              (jnp.full(col.shape, -1, jnp.int32), best))
  path_ref[...] = path
  stats_ref[...] = jnp.where(jnp.arange(2) == 0, length, at(target_argmax, best))


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def _tree_verify_gpu(parents, tokens, target_argmax, *, max_depth: int, interpret) -> Verified:
  b, n = parents.shape
  n_pad, d_pad = _next_pow2(n), _next_pow2(max_depth + 1)
  pad = lambda x, value: jnp.pad(x.astype(jnp.int32), ((0, 0), (0, n_pad - n)),
                                 constant_values=value)
  row = pl.BlockSpec((None, n_pad), lambda bi: (bi, 0))
  path, stats = pl.pallas_call(
      functools.partial(_kernel, num_nodes=n, max_depth=max_depth),
      grid=(b,),
      in_specs=[row, row, row],
      out_specs=[pl.BlockSpec((None, d_pad), lambda bi: (bi, 0)),
                 pl.BlockSpec((None, 2), lambda bi: (bi, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, d_pad), jnp.int32),
                 jax.ShapeDtypeStruct((b, 2), jnp.int32)],
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret,
      name="tree_verify_gpu",
  )(pad(parents, -1), pad(tokens, -1), pad(target_argmax, 0))
  return Verified(path=path[:, :max_depth + 1], length=stats[:, 0], next_token=stats[:, 1])


def tree_verify_gpu(parents, tokens, target_argmax, *, max_depth: int | None = None,
                    interpret: bool = False) -> Verified:
  """Greedy tree verification (semantics in ``reference.py``) as a Pallas Triton kernel.

  Args: as ``tree_verify_tpu``; ``interpret=True`` runs it on CPU.

  Returns:
    ``Verified(path [B, D+1], length [B], next_token [B])``, all int32.
  """
  max_depth = check_inputs(parents, tokens, target_argmax, max_depth)
  return _tree_verify_gpu(jnp.asarray(parents), jnp.asarray(tokens),
                          jnp.asarray(target_argmax), max_depth=max_depth, interpret=interpret)
