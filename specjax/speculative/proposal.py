"""What a drafter hands the verifier: a tree of draft tokens and how they were drawn.

A chain of γ drafts is the tree ``TreeTopology.chain(γ)``; its proposal is
``Proposal(tokens=[B, γ], q=[B, γ, V])`` exactly as before trees existed (q as
``SubsetProbs`` [B, γ, K] for a reduced-vocabulary drafter).

``draw`` (static) says how the drafter chose sibling tokens, which fixes the
lossless acceptance rule (``tree_acceptance``):

  "sampled"              each node's token is an independent draw from ``q``
                         (chains; SpecInfer trees sampled with replacement).
  "without_replacement"  siblings are successive draws from their parent's
                         ``q`` with earlier siblings' tokens removed
                         (Gumbel-top-k); ``q`` holds the parent's distribution
                         *before* removal, the rule renormalises.
  "point_mass"           tokens are deterministic functions of the context
                         (top-k children, prompt lookup): ``q`` is None and
                         each node counts as a point mass on its token.

Example: a top-2 tree of depth 1 for one row proposing tokens 7 and 3::

    Proposal(tokens=jnp.array([[7, 3]]), q=None, draw="point_mass")
    # topology TreeTopology((-1, -1)); per-row parents None (static tree)
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from specjax.sampling import SubsetProbs

DRAWS = ("sampled", "without_replacement", "point_mass")


@flax.struct.dataclass(kw_only=True)
class Proposal:
  """Draft nodes of one speculative step.

  Attributes:
    tokens: [B, N] int32 draft token of each node (breadth-first node order).
    q: [B, N, V] float32, the distribution node i's token was drawn from, over
      the target vocabulary, or ``SubsetProbs`` [B, N, K] where the drafter's vocabulary
      is a subset of the target's (zero elsewhere); None for point-mass drafts.
    parents: [B, N] int32 per-row parents (dynamic trees, each row
      breadth-first with parents[b, i] < i), or None: the static topology's.
    draw: static, one of ``DRAWS``.
  """

  tokens: jax.Array
  q: Optional[jax.Array | SubsetProbs] = None
  parents: Optional[jax.Array] = None
  draw: str = flax.struct.field(pytree_node=False, default="sampled")

  def __post_init__(self):
    if self.draw not in DRAWS:
      raise ValueError(f"unknown draw {self.draw!r}; expected one of {DRAWS}")
    if (self.q is None) != (self.draw == "point_mass"):
      raise ValueError(f"draw={self.draw!r} {'needs' if self.q is None else 'takes no'} q")

  @classmethod
  def chain(cls, drafts: jax.Array, q: jax.Array | SubsetProbs) -> "Proposal":
    """A chain of sampled drafts [B, γ] with their distributions [B, γ, V] (or
    ``SubsetProbs`` [B, γ, K])."""
    return cls(tokens=drafts.astype(jnp.int32), q=q, draw="sampled")
