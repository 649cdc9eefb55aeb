"""How an EAGLE drafter is wired: specjax's own architecture and the published EAGLE-1/3.

Every EAGLE drafter builds pairs (g, x) of a feature and a token, runs them
through its layers to ĥ, and turns ĥ into logits; true features come from the
target, later draft steps feed ĥ in g's place. Three wirings of the same
skeleton (e token embedding, n(·) an RMS norm with its own weights, f_p the
target's feature at position p)::

                  specjax (default)        EAGLE-1/2 (cnets1.py)   EAGLE-3 (cnets.py)
  true feature g  f_p, or norms + ``fuse`` n_T(f_p): the target's  ``fuse``·f_p, f_p the
                  over layer outputs       final norm applied      inputs of 3 layers
  layer input     fc·[n(e); n(g)] + b      fc·[e; g] (+ b)         g itself; layer 0
                                                                   attends over [n(e); n(g)]
  layer 0         Llama layer              no input norm           Llama layer, q/k/v 2D wide
  head            n(ĥ) · target's rows     ĥ · target's head       n(ĥ) · own head [Vd, D]
  first pair      (0, x_0)                 (f_0, x_1)              (f_0, x_1)

Only what the arrays cannot say is here: the draft params carry the rest
(EAGLE-1's layer 0 simply has no ``attn_norm``, ``model._layer``; ``fc_bias`` is
optional; EAGLE-3's own norm and head sit where specjax keeps the target's).
``param_keys`` lists the arrays each wiring needs, so ``EagleDrafter.check_params``
refuses params of another wiring.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

INPUTS = ("normed_fc", "fc", "attention")


@dataclasses.dataclass(frozen=True)
class EagleArch:
  """An EAGLE drafter's wiring (static, hashable). The default is specjax's own.

  Attributes:
    input: how a pair enters the layers. "normed_fc": ``fc`` over [n(e); n(g)]
      (``embed_norm``, ``feature_norm``); "fc": ``fc`` over the raw [e; g]
      (EAGLE-1); "attention": g is the residual stream and layer 0's attention
      reads [n(e); n(g)] (``embed_norm``, layer 0's ``attn_norm``; EAGLE-3).
    fusion_norms: fused target layers are RMS-normalised (``fuse_norms``) before
      ``fuse`` (specjax) or not (EAGLE-3). Only with ``feature_layers``.
    target_norm_eps: None: true features are read as the target hands them over
      (pre final norm); a number: through the target's final norm first
      (``target_norm``, with this epsilon), as EAGLE-1 reads the post-norm hidden
      state. Predicted features ĥ are fed as they are either way.
    head_norm: ĥ goes through ``final_norm`` before ``head`` (False: EAGLE-1,
      whose drafter output meets the target's LM head directly).
    pair_zero: the first token is fed as the pair (0, x_0) (specjax); False: the
      first pair is (f_0, x_1), as in the published drafters, which start after
      the target's first token. Pair p then sits in draft-cache slot p − 1.
  """

  input: str = "normed_fc"
  fusion_norms: bool = True
  target_norm_eps: Optional[float] = None
  head_norm: bool = True
  pair_zero: bool = True

  def __post_init__(self):
    if self.input not in INPUTS:
      raise ValueError(f"EagleArch.input must be one of {INPUTS}, got {self.input!r}")

  @property
  def first_pair(self) -> int:
    """The position of the first pair, and so the offset from a pair to its cache slot."""
    return 0 if self.pair_zero else 1

  def param_keys(self, fused: bool) -> tuple[frozenset, frozenset]:
    """(required, optional) top-level draft-param keys of this wiring; ``fused``: with
    ``feature_layers``."""
    required = {"embed", "layers", "head"}
    optional = {"vocab_map"}
    if self.input == "attention":
      required.add("embed_norm")
    else:
      required.add("fc")
      optional.add("fc_bias")
      if self.input == "normed_fc":
        required |= {"embed_norm", "feature_norm"}
    if self.head_norm:
      required.add("final_norm")
    if self.target_norm_eps is not None:
      required.add("target_norm")
    if fused:
      required |= {"fuse", "fuse_norms"} if self.fusion_norms else {"fuse"}
    return frozenset(required), frozenset(optional)


SPECJAX = EagleArch()
EAGLE3 = EagleArch(input="attention", fusion_norms=False, pair_zero=False)


def eagle1(target_norm_eps: float) -> EagleArch:
  """EAGLE-1/2's wiring for a target whose final norm has epsilon ``target_norm_eps``."""
  return EagleArch(input="fc", target_norm_eps=float(target_norm_eps), head_norm=False,
                   pair_zero=False)
