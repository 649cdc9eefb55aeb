"""Greedy token-tree verification, Pallas TPU (Mosaic) kernel, scalar-prefetch style.

Grid (B,), one tree per step ("parallel"). The three int arrays are flattened
to [B * N] and scalar-prefetched into SMEM (row b's node c at b * N + c), so
the kernel is pure scalar work: one ``fori_loop`` over nodes in topological
order keeps each node's accepted depth in an SMEM scratch [N] (-1 = not
accepted) and the deepest node so far, then a second loop of D + 1 steps walks
parents back from it.

The path is assembled as a [1, D+1] vector (``where`` on a lane iota, no
dynamic vector stores) and written to a VMEM block of a [B, 1, D+1] output;
length and next token go to [B, 1, 1] VMEM blocks. Blocks whose last two dims
equal the array's keep Mosaic's (8, 128) tiling rule satisfied for any D.

SMEM budget: the prefetch holds 3 * B * N int32 words (12 KiB at B=64, N=16);
split very large batches before calling.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_verify.reference import Verified, check_inputs


def _kernel(parents_ref,  # [B * N] int32, SMEM (scalar prefetch)
            tokens_ref,   # [B * N] int32, SMEM (scalar prefetch)
            argmax_ref,   # [B * N] int32, SMEM (scalar prefetch)
            path_ref,     # [1, D+1] int32, VMEM block of row b
            length_ref,   # [1, 1] int32
            next_ref,     # [1, 1] int32
            depth_scr,    # [N] int32, SMEM: depth of each accepted node, -1 otherwise
            *, num_nodes: int, max_depth: int):
  base = pl.program_id(0) * num_nodes
  depth_scr[0] = jnp.int32(0)

  def visit(c, best):
    best_node, best_depth = best
    p = parents_ref[base + c]
    valid = (p >= 0) & (p < c)
    p = jnp.where(valid, p, 0)  # keep the reads in bounds
    at_parent = depth_scr[p]
    ok = (valid & (at_parent >= 0) & (at_parent < max_depth)
          & (tokens_ref[base + c] == argmax_ref[base + p]))
    depth = jnp.where(ok, at_parent + 1, -1)
    depth_scr[c] = depth
    deeper = depth > best_depth  # strict: the smallest index wins ties
    return jnp.where(deeper, c, best_node), jnp.where(deeper, depth, best_depth)

  best, length = jax.lax.fori_loop(1, num_nodes, visit, (jnp.int32(0), jnp.int32(0)))

  # Walk back from the best node; step j fills path[length - j] (nothing once < 0).
  col = jax.lax.broadcasted_iota(jnp.int32, (1, max_depth + 1), 1)

  def back(j, carry):
    path, cur = carry
    path = jnp.where(col == length - j, cur, path)
    # An accepted non-root node has a valid parent; the root reads index 0 and stays.
    parent = parents_ref[base + cur]
    return path, jnp.where(cur > 0, parent, 0)

  path, _ = jax.lax.fori_loop(0, max_depth + 1, back,
                              (jnp.full((1, max_depth + 1), -1, jnp.int32), best))
  path_ref[...] = path
  length_ref[...] = jnp.full((1, 1), length, jnp.int32)
  next_ref[...] = jnp.full((1, 1), argmax_ref[base + best], jnp.int32)


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def _tree_verify_tpu(parents, tokens, target_argmax, *, max_depth: int, interpret) -> Verified:
  b, n = parents.shape
  row = lambda bi, *_: (bi, 0, 0)
  path, length, next_token = pl.pallas_call(
      functools.partial(_kernel, num_nodes=n, max_depth=max_depth),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=3,
          grid=(b,),
          in_specs=[],
          out_specs=[pl.BlockSpec((None, 1, max_depth + 1), row),
                     pl.BlockSpec((None, 1, 1), row),
                     pl.BlockSpec((None, 1, 1), row)],
          scratch_shapes=[pltpu.SMEM((n,), jnp.int32)],
      ),
      out_shape=[jax.ShapeDtypeStruct((b, 1, max_depth + 1), jnp.int32),
                 jax.ShapeDtypeStruct((b, 1, 1), jnp.int32),
                 jax.ShapeDtypeStruct((b, 1, 1), jnp.int32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
      name="tree_verify_tpu",
  )(*(x.astype(jnp.int32).reshape(b * n) for x in (parents, tokens, target_argmax)))
  return Verified(path=path[:, 0], length=length[:, 0, 0], next_token=next_token[:, 0, 0])


def tree_verify_tpu(parents, tokens, target_argmax, *, max_depth: int | None = None,
                    interpret=False) -> Verified:
  """Greedy tree verification (semantics in ``reference.py``) as a Pallas TPU kernel.

  Inputs are checked here, before tracing; the parent values only when concrete
  (under an outer jit invalid parents just make nodes unaccepted).

  Args:
    parents: [B, N] int parent of each node (parents[:, 0] = -1, parents[:, c] < c,
      -1 for padding).
    tokens: [B, N] int token of each node.
    target_argmax: [B, N] int the target's greedy token at each node.
    max_depth: static D, the path budget; None for N - 1.
    interpret: False on TPU; ``pltpu.InterpretParams()`` (or True) on CPU.

  Returns:
    ``Verified(path [B, D+1], length [B], next_token [B])``, all int32.
  """
  max_depth = check_inputs(parents, tokens, target_argmax, max_depth)
  return _tree_verify_tpu(jnp.asarray(parents), jnp.asarray(tokens),
                          jnp.asarray(target_argmax), max_depth=max_depth, interpret=interpret)
