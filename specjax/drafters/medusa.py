"""Medusa-1 heads: K small heads on the target's last hidden state (Cai et al. 2024).

Head k (0-based) is ``num_layers`` residual blocks x ← x + SiLU(W x + b)
followed by a linear map to the vocabulary, applied to the target's last
hidden state *after* its final norm (FasterDecoding's ``outputs[0]`` of the
base ``LlamaModel``). With the target predicting token t + 1 from h_t, head k
is trained to predict token t + k + 2.

Mapping onto specjax's step. After a step the committed sequence x_0 … x_{s−1}
ends with the target's own token x_{s−1} (the accepted drafts' correction or
bonus), whose distribution came from h_{s−2}; the first draft is x_s. So
head k applied to h_{s−2} proposes the drafts at depth k + 1::

    h_{s−2} ─ target head → x_{s−1} (committed)
            ─ head 0      → depth 1 (x_s)
            ─ head 1      → depth 2 (x_{s+1}) …

FasterDecoding does the same: its tree's root is the target's argmax at the
last hidden state and head 0 proposes the token after it; specjax's verify
block already starts from that token, committed. After the prompt (its last
token not sampled by the target) the heads read h_{P−2}; a one-token prompt
has no feature yet and its first step drafts from a zero feature (lossless
either way, only slower).

Drafts are deterministic: the node of depth d and sibling rank r takes head
(d − 1)'s r-th ranked token, whatever its parent (the tree is a Cartesian
product of the heads' top-k, as Medusa's ``tree_indices``). Every node is a
point mass, verified by ``tree_acceptance``: the longest matching path under
greedy decoding, recursive rejection with q = 1 when sampling, so the output
law is the target's. Chains take each head's top-1.

Static trees (Medusa's) fix which ranks are drafted from accuracies averaged
over a corpus. A ``DynamicTree`` (k, D, N) instead keeps, per row and step,
the N paths of the Cartesian product of the first D heads' top-k with the
highest product of the heads' own probabilities (``best_product_paths``):
the same independence model as ``medusa_tree``, priced by this context's
confidences instead of their average, as EAGLE-2 does for a draft model. The
candidates are every path, not EAGLE-2's frontier of k per depth (the heads'
children do not depend on the parent, so all Σ k^d paths cost one top-k per
head); a departure from Medusa-1, whose trees are static.

The drafter is stateless but for the feature it reads: ``observe`` keeps the
last verified path's features (at most K + 1 entries, a window [B, K + 1, D])
and where they start; ``propose`` reads the one at position s − 2. So plain
decoding steps (an adaptive γ = 0) need nothing from it.

Draft params (``medusa_params``): ``final_norm`` [D] (the target's), ``res_w``
[K, L, D, D] ([in, out], specjax's layout), ``res_b`` [K, L, D], ``head``
[K, Vd, D] (each head's own rows, as published) or [Vd, D] (one head shared
by all, e.g. the target's LM head), and ``vocab_map`` [Vd] when the heads
cover a reduced vocabulary (FR-Spec style: their tokens are mapped back to
target ids; tokens outside are never drafted).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.drafters.residual_head import head_logits, target_head, zero_blocks
from specjax.drafters.tree_draft import keep_best
from specjax.model import Params, compute_dtype
from specjax.sampling import Sampler
from specjax.speculative.drafter import Drafter
from specjax.speculative.proposal import Proposal
from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.speculative.tree_builders import best_static_tree
from specjax import validation

TOP_K = 10  # FasterDecoding's TOPK: the most children any node may have
MAX_PRODUCT_PATHS = 1 << 17  # a DynamicTree's candidates Σ_{d<=D} k^d, scored every step

PARAM_KEYS = frozenset({"final_norm", "res_w", "res_b", "head"})


@flax.struct.dataclass(kw_only=True)
class MedusaState:
  """Per-row drafter state.

  Attributes:
    window: [B, K + 1, D] the target's features of the last verified path (of a
      plain step: one feature; after the prompt: h_{P−2}), zero past its end.
    start: [B] the position of ``window[:, 0]``.
  """

  window: jax.Array
  start: jax.Array


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(Drafter):
  """Medusa-1 heads on a target of config ``cfg``.

  Attributes:
    cfg: the target's config (width, vocabulary, final-norm epsilon).
    num_heads: K, the heads; drafts reach depth K at most.
    num_layers: L, residual blocks per head (FasterDecoding's medusa_num_layers).
    top_k: the most children a node may have (sibling ranks < top_k).
    shared_head: all heads share one [Vd, D] head (e.g. the target's LM head)
      instead of each having its own.
    accuracy: the heads' measured a_k^(r) ([K][R] nested tuples, e.g. from the trained
      heads' model card), which ``default_tree`` builds from; None: ``prior_accuracy``.
  """

  cfg: ModelConfig
  num_heads: int
  num_layers: int = 1
  top_k: int = TOP_K
  shared_head: bool = False
  accuracy: Optional[tuple[tuple[float, ...], ...]] = None

  def __post_init__(self):
    for name, minimum in (("num_heads", 1), ("num_layers", 0), ("top_k", 1)):
      object.__setattr__(self, name, validation.as_int(getattr(self, name), name, minimum))
    if self.accuracy is not None:
      acc = np.asarray(self.accuracy, np.float64)
      if (acc.ndim != 2 or acc.shape[0] != self.num_heads or not np.all(np.isfinite(acc))
          or acc.min() < 0 or acc.max() > 1):
        raise ValueError(f"accuracy must be a [{self.num_heads} heads, ranks] table of "
                         f"probabilities, got shape {acc.shape}")
      object.__setattr__(self, "accuracy", tuple(tuple(float(a) for a in row) for row in acc))

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  # --- capabilities ------------------------------------------------------------

  def tree_error(self, topology) -> Optional[str]:
    """Why the heads cannot draft ``topology`` (None: they can)."""
    if not isinstance(topology, (TreeTopology, DynamicTree)):
      return f"{topology} is neither a TreeTopology nor a DynamicTree"
    if topology.max_depth > self.num_heads:
      return (f"{topology} is {topology.max_depth} deep, but {self.num_heads} heads draft "
              f"{self.num_heads} tokens at most")
    if isinstance(topology, DynamicTree):
      if topology.top_k > self.top_k:
        return f"{topology} ranks top_k={topology.top_k} tokens, beyond the heads' {self.top_k}"
      paths = num_paths(topology.top_k, topology.depth)
      if paths > MAX_PRODUCT_PATHS:
        return (f"{topology} scores {paths} candidate paths a step, more than "
                f"{MAX_PRODUCT_PATHS}: use a smaller top_k or depth")
    elif max(topology.ranks) >= self.top_k:
      return (f"{topology} asks for sibling rank {max(topology.ranks)}, beyond the heads' "
              f"top_k={self.top_k}")
    return None

  def supports(self, topology) -> bool:
    return self.tree_error(topology) is None

  def buildable(self) -> str:
    return (f"static trees (chains included) of depth <= {self.num_heads} (the heads) with "
            f"sibling ranks < {self.top_k} (top_k), e.g. TreeTopology.from_choices(...), and "
            f"DynamicTree(top_k <= {self.top_k}, depth <= {self.num_heads}, num_nodes) of at "
            f"most {MAX_PRODUCT_PATHS} paths Σ_d top_k^d")

  def choices_tree(self, choices: Sequence[Sequence[int]]) -> TreeTopology:
    """A Medusa choice list (paths of per-head ranks, e.g. FasterDecoding's mc_sim_7b_63) as
    the topology these heads verify.

    Raises:
      ValueError: not a tree (a path without its prefix, a skipped rank, empty), deeper
        than the heads, or a rank beyond top_k.
    """
    topology = TreeTopology.from_choices(choices)
    error = self.tree_error(topology)
    if error is not None:
      raise ValueError(f"Medusa choices cannot be drafted: {error}")
    return topology

  def default_tree(self) -> TreeTopology:
    """The best tree of 4·K nodes (at most 64, and at most what K heads of top_k ranks can
    hold) under the heads' measured ``accuracy``, or under ``prior_accuracy`` (a prior, not
    a measurement) when they have none."""
    return self.tree(min(4 * self.num_heads, 64))

  def tree(self, num_nodes: int) -> TreeTopology:
    """The best static tree of ``num_nodes`` nodes (fewer when the heads' top_k ranks hold
    fewer) under the measured ``accuracy`` or, without one, ``prior_accuracy``."""
    room = num_paths(self.top_k, self.num_heads)
    acc = (prior_accuracy(self.num_heads, self.top_k) if self.accuracy is None
           else np.asarray(self.accuracy)[:, :self.top_k])
    return medusa_tree(acc, min(validation.as_int(num_nodes, "num_nodes", 1), room),
                       top_k=self.top_k)

  def dynamic_tree(self, num_nodes: int) -> DynamicTree:
    """The per-step best tree of ``num_nodes`` nodes over the K heads' top_k ranks
    (``best_product_paths``): depth K and k = top_k, both cut to N (a deeper path or a
    lower rank could never be kept), the depth further until at most
    ``MAX_PRODUCT_PATHS`` paths are scored, and N to what ``DynamicTree`` admits,
    k + (D − 1) k² (310 for 4 heads of 10 ranks)."""
    n = validation.as_int(num_nodes, "num_nodes", 1)
    k, depth = min(self.top_k, n), min(self.num_heads, n)
    while depth > 1 and num_paths(k, depth) > MAX_PRODUCT_PATHS:
      depth -= 1
    return DynamicTree(top_k=k, depth=depth,
                       num_nodes=min(n, DynamicTree.candidates(k, depth)))

  def tolerates_skipped_steps(self) -> bool:
    return True  # a plain step's feature arrives by ``observe``; nothing else is kept

  def reads_target_features(self) -> bool:
    return True

  def check_params(self, draft_params) -> None:
    have = set(draft_params)
    missing, extra = sorted(PARAM_KEYS - have), sorted(have - PARAM_KEYS - {"vocab_map"})
    if missing or extra:
      raise ValueError(f"Medusa draft params: missing {missing}, unexpected {extra}")
    k, l, d = self.num_heads, self.num_layers, self.cfg.dim
    head = np.shape(draft_params["head"])
    want = {"final_norm": (d,), "res_w": (k, l, d, d), "res_b": (k, l, d)}
    for name, shape in want.items():
      if tuple(np.shape(draft_params[name])) != shape:
        raise ValueError(f"Medusa draft param {name!r} has shape "
                         f"{tuple(np.shape(draft_params[name]))}, {k} heads of {l} blocks of "
                         f"width {d} need {shape}")
    if len(head) != (2 if self.shared_head else 3) or head[-1] != d or (
        not self.shared_head and head[0] != k):
      raise ValueError(f"Medusa head of shape {head}: expected "
                       f"{'[Vd, D] (shared)' if self.shared_head else '[K, Vd, D]'} with "
                       f"K = {k}, D = {d}")
    rows = head[-2]
    if "vocab_map" in draft_params:
      if tuple(np.shape(draft_params["vocab_map"])) != (rows,):
        raise ValueError(f"vocab_map of shape {np.shape(draft_params['vocab_map'])} does not "
                         f"name the head's {rows} rows")
    elif rows != self.vocab_size:
      raise ValueError(f"the Medusa head has {rows} rows but the target's vocabulary "
                       f"{self.vocab_size}: pass a vocab_map for a reduced vocabulary")
    if rows < self.top_k:
      raise ValueError(f"top_k={self.top_k} exceeds the head's {rows} rows")

  # --- the heads -----------------------------------------------------------------

  def head_logits(self, dp: Params, features: jax.Array) -> jax.Array:
    """[B, D] the target's raw (pre-final-norm) features -> [B, K, Vd] float32 logits."""
    b, d = features.shape
    return self.each_head_logits(dp, jnp.broadcast_to(features[:, None], (b, self.num_heads, d)))

  def each_head_logits(self, dp: Params, features: jax.Array) -> jax.Array:
    """[N, K, D] raw features, one per head (head k reads ``features[:, k]``) -> [N, K, Vd]
    float32 logits. Decoding gives every head the same feature; training gives head k the
    feature k + 1 positions before the token it is scored on."""
    return head_logits(dp, features, self.cfg.norm_eps)

  # --- the step ----------------------------------------------------------------

  def init(self, draft_params, tokens, prompt_lens, features=None) -> MedusaState:
    """Keeps h_{P−2}, the last prompt feature the prefill computed (zero when P = 1)."""
    b, w = tokens.shape[0], self.num_heads + 1
    pos = prompt_lens - 2
    last = jnp.take_along_axis(features, jnp.maximum(pos, 0)[:, None, None], axis=1)
    last = jnp.where((pos >= 0)[:, None, None], last, 0)
    window = jnp.zeros((b, w, features.shape[-1]), features.dtype).at[:, :1].set(last)
    return MedusaState(window=window, start=pos.astype(jnp.int32))

  def observe(self, state: MedusaState, hidden: jax.Array, start: jax.Array) -> MedusaState:
    """Keeps ``hidden`` [B, T, D], the features of positions start[b] + t (T <= K + 1)."""
    t, w = hidden.shape[1], state.window.shape[1]
    if t > w:
      raise ValueError(f"observed {t} features, more than the {w} a path of {self.num_heads} "
                       "heads has")
    window = jnp.pad(hidden.astype(state.window.dtype), ((0, 0), (0, w - t), (0, 0)))
    return state.replace(window=window, start=start.astype(jnp.int32))

  def feature(self, state: MedusaState, seq_lens: jax.Array) -> jax.Array:
    """[B, D] h_{s−2} for committed lengths s (zero where s < 2)."""
    idx = jnp.clip(seq_lens - 2 - state.start, 0, state.window.shape[1] - 1)
    f = jnp.take_along_axis(state.window, idx[:, None, None], axis=1)[:, 0]
    return jnp.where((seq_lens >= 2)[:, None], f, 0)

  def propose(self, draft_params, state: MedusaState, tokens, seq_lens, key, sampler: Sampler,
              topology: TreeTopology | DynamicTree):
    error = self.tree_error(topology)
    if error is not None:
      raise ValueError(f"MedusaDrafter cannot build {topology}: {error}")
    logits = self.head_logits(draft_params, self.feature(state, seq_lens))  # [B, K, Vd]
    if isinstance(topology, DynamicTree):
      ids, parents = best_product_paths(logits[:, :topology.depth], topology.top_k,
                                        topology.num_nodes)
    else:
      depth = np.asarray(topology.depth) - 1
      ranks = np.asarray(topology.ranks)
      ids = jax.lax.top_k(logits[:, :int(depth.max()) + 1], int(ranks.max()) + 1)[1]
      ids, parents = ids[:, depth, ranks], None  # node i: head depth_i − 1, rank_i
    if "vocab_map" in draft_params:
      ids = draft_params["vocab_map"][ids]
    return Proposal(tokens=ids.astype(jnp.int32), parents=parents, draw="point_mass"), state


# --- per-step trees from the heads' probabilities ---------------------------------------


def num_paths(top_k: int, depth: int) -> int:
  """Σ_{d<=D} k^d: the paths of sibling ranks < k of length 1…D (the nodes of the full
  Cartesian product of D heads' top-k)."""
  return sum(top_k ** d for d in range(1, depth + 1))


def best_product_paths(logits: jax.Array, top_k: int, num_nodes: int
                       ) -> tuple[jax.Array, jax.Array]:
  """The ``num_nodes`` most probable paths of the heads' Cartesian product, per row.

  The pool is every path of ranks < k, depth-major, and within a depth by parent then
  rank, so entry i·k + r of depth d is the rank-r child of entry i of depth d − 1. A
  path's score is its parent's plus its head's log-probability (raw logits, temperature
  1, as EAGLE-2's scores): its chance of acceptance if the heads were calibrated and
  independent. So a child never outscores its parent, nor a sibling the lower-ranked one
  before it, and ``tree_draft.keep_best`` keeps a tree (ties: the earlier path).

  Args:
    logits: [B, D, Vd] the first D heads' logits.
    top_k: k, the ranks of each head a path may take.
    num_nodes: N <= Σ_{d<=D} k^d.

  Returns:
    (ids [B, N], the draft-vocabulary token of each node, breadth-first; parents [B, N]
    int32, −1 at depth 1).
  """
  b, depth, _ = logits.shape
  logp, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32)), top_k)
  scores, tokens, pool_parent = [logp[:, 0]], [ids[:, 0]], [np.full(top_k, -1, np.int32)]
  offset = 0  # pool index of the parents' first entry
  for d in range(1, depth):
    width = top_k ** d  # the parents: head d − 1's entries
    scores.append((scores[-1][:, :, None] + logp[:, d, None, :]).reshape(b, width * top_k))
    tokens.append(jnp.tile(ids[:, d], (1, width)))
    pool_parent.append(np.repeat(offset + np.arange(width, dtype=np.int32), top_k))
    offset += width
  chosen, parents = keep_best(jnp.concatenate(scores, axis=1), np.concatenate(pool_parent),
                              num_nodes)
  return jnp.take_along_axis(jnp.concatenate(tokens, axis=1), chosen, axis=1), parents


# --- trees from the heads' accuracies ------------------------------------------------


def prior_accuracy(num_heads: int, top_k: int = TOP_K) -> np.ndarray:
  """[K, top_k] a prior head accuracy for the default tree: 0.6·0.8^k for head k's top-1,
  each lower rank 0.4 times the one above. Shaped like the Medusa paper's measured heads
  (accuracy falls with the head's distance and with rank); not a measurement."""
  k, r = np.arange(num_heads)[:, None], np.arange(top_k)[None, :]
  return 0.6 * 0.8 ** k * 0.4 ** r


def medusa_tree(head_accuracy, num_nodes: int, top_k: Optional[int] = None) -> TreeTopology:
  """The best static tree of ``num_nodes`` nodes for heads of measured accuracy (Medusa §3.1.2).

  ``head_accuracy[k, r]`` is the probability that head k's r-th ranked token is
  the true token (Medusa's a_k^(r)); a node's chance of being accepted is the
  product over its path, as ``tree_builders``' independence model, whose
  greedy construction is Medusa's and exactly optimal (``best_static_tree``).

  Args:
    head_accuracy: [K, R] probabilities; K bounds the depth.
    num_nodes: N >= 1.
    top_k: optional bound on sibling ranks (default R).

  Raises:
    ValueError: a malformed table, or a budget larger than the table can fill with
      nodes of rank < top_k.
  """
  a = np.asarray(head_accuracy, dtype=np.float64)
  if a.ndim != 2:
    raise ValueError(f"head_accuracy must be a [heads, ranks] table, got shape {a.shape}")
  top_k = a.shape[1] if top_k is None else validation.as_int(top_k, "top_k", 1)
  tree = best_static_tree(a[:, :top_k], num_nodes, max_depth=a.shape[0])
  if max(tree.ranks) >= top_k:
    raise ValueError(f"a tree of {num_nodes} nodes needs sibling ranks beyond top_k={top_k} "
                     f"under these accuracies (the table's nonzero entries run out): use fewer "
                     "nodes or a wider top_k")
  return tree


# --- params ------------------------------------------------------------------------------


def random_medusa_weights(cfg: ModelConfig, num_heads: int, num_layers: int, key: jax.Array,
                          scale: float = 0.5, head_rows: Optional[int] = None,
                          own_head: bool = True) -> Params:
  """Random trained weights (tests): ``res_w`` [K, L, D, D], ``res_b``, and with
  ``own_head`` each head's [head_rows (default V), D] rows."""
  k1, k2, k3 = jax.random.split(key, 3)
  d = cfg.dim
  w = {"res_w": scale * jax.random.normal(k1, (num_heads, num_layers, d, d)) / np.sqrt(d),
       "res_b": 0.1 * jax.random.normal(k2, (num_heads, num_layers, d))}
  if own_head:
    rows = cfg.vocab_size if head_rows is None else head_rows
    w["head"] = jax.random.normal(k3, (num_heads, rows, d)) / np.sqrt(d)
  return w


def init_medusa_weights(cfg: ModelConfig, num_heads: int, num_layers: int = 1) -> Params:
  """Untrained heads: every residual block zero (SiLU(0) = 0), so each head starts as the
  target's own next-token prediction, as FasterDecoding's zero-initialised ``ResBlock``
  (its bias is zeroed too here: the start is exact, not approximate)."""
  return zero_blocks(num_heads, num_layers, cfg.dim)


def medusa_params(target_cfg: ModelConfig, target_params: Params, weights: Params,
                  vocab_map: Optional[np.ndarray] = None) -> Params:
  """Draft params from trained ``weights`` (``res_w``, ``res_b``, optionally ``head``).

  Without a ``head`` the heads share the target's LM head (its ``vocab_map`` rows when
  given). An own head of V rows is cut to the ``vocab_map`` rows; one of len(vocab_map)
  rows is taken as it is. Weights are cast to the target's compute dtype.
  """
  dtype = compute_dtype(target_params)
  dp = {"final_norm": target_params["final_norm"],
        "res_w": jnp.asarray(weights["res_w"], dtype),
        "res_b": jnp.asarray(weights["res_b"], dtype)}
  vm = None if vocab_map is None else jnp.asarray(np.asarray(vocab_map), jnp.int32)
  if "head" in weights:
    head = jnp.asarray(weights["head"], dtype)
    if vm is not None and head.shape[1] == target_cfg.vocab_size:
      head = head[:, vm]
  else:
    head = target_head(target_cfg, target_params)
    head = head if vm is None else head[vm]
  dp["head"] = head
  if vm is not None:
    dp["vocab_map"] = vm
  return dp


def medusa_drafter(target_cfg: ModelConfig, target_params: Params, weights: Params,
                   vocab_map: Optional[np.ndarray] = None, top_k: int = TOP_K,
                   accuracy=None) -> tuple[MedusaDrafter, Params]:
  """(MedusaDrafter, draft_params) for trained heads ``weights`` on this target (checked);
  ``accuracy``: their measured [K, R] a_k^(r), which the default tree is built from."""
  num_heads, num_layers, d = np.shape(weights["res_w"])[:3]
  if d != target_cfg.dim:
    raise ValueError(f"Medusa heads of width {d} do not fit a target of width {target_cfg.dim}")
  drafter = MedusaDrafter(target_cfg, int(num_heads), int(num_layers), top_k=top_k,
                          shared_head="head" not in weights,
                          accuracy=None if accuracy is None else tuple(map(tuple, accuracy)))
  dp = medusa_params(target_cfg, target_params, weights, vocab_map)
  drafter.check_params(dp)
  return drafter, dp
