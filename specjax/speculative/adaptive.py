"""Adaptive draft shape: each step picks a chain length or a token tree from a static set,
inside the jitted loop.

The best fixed γ depends on the acceptance rate α, which varies by prompt and
along a generation, and on what a step costs on this machine at this batch
size, which grows with γ (and grows faster at large batches, where a verify
forward is compute-bound). ``AdaptiveGamma`` holds a small static set of draft
lengths, and optionally token trees (static ``TreeTopology`` or EAGLE-2
``DynamicTree``), with the measured cost of a step of each, relative to one
plain decoding step, and chooses per step the choice of the highest expected
speedup

    score = E[tokens | α̂] / cost,   for a chain of γ: E = 1 + α̂ + … + α̂^γ

(the calibrated formula of ``theory``; γ = 0 is plain decoding: one token at
cost 1). α̂ is a running per-row estimate: discounted counts of accepted drafts
(successes) and of steps that stopped short of γ (failures), with a prior of
``prior_weight`` pseudo-steps at ``prior_alpha``. While plain decoding is
chosen the counts only decay, so α̂ drifts back to the prior and a draft is
tried again: the policy keeps exploring at a cost of one short step every
few dozen.

A batch shares each step's choice, and a fixed batch runs until its slowest
row is done: rows' acceptance differs by prompt, so the batch advances at its
hardest row's rate, not at the rows' mean (at batch 8 on an Intel Xeon, γ = 1
gave the rows 1.54 tokens a step on average and the last one 1.38). Given
``prompt_ease``, how the calibration prompts' rates spread around α_c, the
policy scales each choice's mean expected tokens by η_k(b) =
E[min_i E_k] / E[mean_i E_k] over b rows drawn from those prompts
(``batch_factors``; b the active rows; 1 at one row), which makes the
deeper drafts pay less at large batches, and plain decoding, which every row
takes at the same pace, relatively more. The rows' own running estimates are
not used to find the slowest one: ten steps of evidence each, the least of
eight is biased low, and scoring it drafted worse
(``benchmarks/results/batch_policy_variants.md``).

A draft is taken over plain decoding only when it promises more than ``min_gain``
(default 5%): its price rests on estimates (the step costs of one measured batch,
α_c and its spread from a few calibration prompts), and near break-even their
error, not the draft, decides the sign of the outcome. On an AVX2 host (Zen 3) at
batch 4, γ = 1 was priced at +3.9% and measured 0.88–1.03× over three rounds (the
timed prompts' rate was 0.53 against the calibration's 0.58), and a policy drafting
it on a third of its steps lost 3% (``benchmarks/results/batch_sweep_avx2_29c3654.md``).
Where drafting pays the margin hardly matters (at batch 1 the best draft promises
30–50%); at the prior it is what sends a batch size whose drafts are within their
prices' error to plain decoding (``never_drafts``).

Trees need a price, so a policy with trees takes the drafter's per-depth,
per-rank acceptance table (``rank_accept``, as ``tree_builders`` defines it and
``estimate_rank_accept`` measures it; the experiments' calibration) and prices
each tree from that table scaled to the trees' estimate α̂_tree:
A(α̂_tree) = min(1, A · α̂_tree / α_A), where α_A (``table_alpha``) is what
that estimate converges to when acceptance follows the table. A static tree is
worth ``tree_builders.expected_tokens_per_step`` under A; a dynamic tree that
of the best static tree of its budget, depth and width, which it can always
build (its per-step choice usually does better, so it is priced
conservatively). The curves are tabulated over α at construction and
interpolated in the loop. A tree step counts the drafts accepted along the
tree's first-ranked chain (the root's rank-0 child, its rank-0 child, …) and a
failure when that run stopped before the chain's end (for a dynamic tree,
before its depth).

Chains and trees accept at different rates, because when sampling they draw
differently: a chain samples its drafts from q and accepts them with
probability min(1, p/q), while a tree's children are the draft's top-k as
point masses, accepted with probability p(x), less often (for the shipped
EAGLE-3 drafter at T = 1, on the same calibration prompts: 0.28 at depth 1
against a sampled chain's 0.50). But both rise and fall with the same text: a
passage the draft finds easy is easy for its trees too. So the two kinds share
one running estimate of that ease,

    ρ̂ = (s_c + s_t + w·α_c) / (α_c·(s_c + f_c) + α_A·(s_t + f_t) + w·α_c),

the drafts accepted (s, discounted) over those the calibrated rates predict
for the drafts offered (s + f), with a prior of ``prior_weight`` (w) chain
pseudo-steps at ρ = 1; each kind is priced at its calibrated rate times it:
α̂ = min(1, α_c·ρ̂) for the chains, min(1, α_A·ρ̂) for the trees, where α_c
is ``prior_alpha`` (the chains' rate at the calibration). Evidence from a
chain step then moves the trees' price too: a tree is no longer taken in a
dip of the chains' acceptance on a price that saw none of it. Without trees
this is the chains' own estimate, (s_c + w·α_c) / (s_c + f_c + w). Every step
decays all counts, so while plain decoding is chosen ρ̂ drifts back to 1 and
the drafts are tried again.

What a sampled chain step counts (``evidence``). Token-wise verification reaches draft i
once every earlier draft is kept, keeps it with probability min(1, p_i(d_i)/q_i(d_i)), and
β_i = Σₓ min(p_i(x), q_i(x)) is its chance of acceptance before it was drawn (the target's
p and the draft's q are both in the verification). Counting the flips' outcomes (accepted
drafts as successes, one failure at a rejection: ``"accepted"``) estimates α = E[β], the
tables' α, with the flips' own noise, which in a window of about ten steps sent the policy
into dips it did not need: at T = 1, priced with Zen 3's costs, it took 135 plain steps of
2,310 for 96.1% of the best fixed γ's modelled speedup, where counting the βs of the
positions the flips scored (up to the first rejected draft: the same expectation, since
whether a position is scored is decided before its flip) took 1 of 2,234 for 98.9%
(``benchmarks/results/policy_evidence_avx2.md``). By default (``"expected"``) a step goes
one step further and takes the expectation over the flips themselves: every draft position
i counts with weight
w_i = Π_{j<i} min(1, p_j(d_j)/q_j(d_j)), its chance of being scored given the drafts
(``acceptance.scoring_chances``), as w_i·β_i successes and w_i·(1 − β_i) failures. That
is the scored-β count's conditional expectation given the drafts (Rao–Blackwell: the same
expectation, no more variance), and since no flip enters it, it is the same under block
verification, whose flips (Sun et al. 2024) keep other prefixes than token-wise's: the
block-verified chains of the default run are priced from the same evidence as token-wise
ones, not from their outcomes. A sampled tree step (and a token-wise chain of
point-mass drafts), verified by recursive rejection, counts along its first-ranked chain,
the path its estimate follows: each of that chain's nodes is its parent's first child
tried, so once the walk reaches the parent it is accepted with probability β = min(1, p(x)
/ q(x)) (p(x) for point-mass drafts), fixed before its flip
(``tree_acceptance.first_chain_beta``); the step counts Σβ over the chain's nodes up to its
first rejected one (or its end) and the rest of those nodes as failures. A step that cannot
weigh its flips counts outcomes either way: a greedy step (at T = 0 β is 0 or 1, the flip
itself; the weighted count is then the outcomes' too), a block-verified chain of point-mass
drafts, and typical acceptance, which draws none.

The decoder (``SpeculativeDecoder(policy=...)``) runs each choice's steps in
an inner while loop of its own, inside the one jitted loop: no recompilation
and no host round trip. The choice depends only on steps already taken, never
on the draft or the target's scores of the step it sizes, so every step is an
ordinary lossless step: greedy output equals plain decoding and sampled
output is distributed as the target's (``tests/test_adaptive.py`` pins both,
with chains and trees, and rejects a policy that chooses after seeing the
verification).

Example (costs measured by ``calibration.measure_step_costs`` at batch 1)::

    policy = AdaptiveGamma(gammas=(0, 1, 2, 4), step_costs=(1.0, 1.15, 1.27, 1.52))
    dec = SpeculativeDecoder(cfg, drafter, policy=policy)
    # α̂ = 0.7: E = 1, 1.7, 2.19, 2.77 → scores 1, 1.48, 1.72, 1.82: γ = 4.
    # α̂ = 0.3: scores 1, 1.13, 1.09, 0.94: γ = 1.

    # With a 4-node dynamic tree, priced from a measured table (rows: depth 1…4):
    policy = AdaptiveGamma(gammas=(0, 2), step_costs=(1.0, 1.27),
                           trees=(DynamicTree(top_k=4, depth=4, num_nodes=4),),
                           tree_costs=(1.35,), rank_accept=table)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specjax.speculative.tree import DynamicTree, TreeTopology
from specjax.speculative.tree_builders import (_check_rank_accept, best_static_tree,
                                               expected_tokens_per_step)
from specjax.theory import VerifyCost, VerifyCostCurve

Tree = Union[TreeTopology, DynamicTree]

ALPHA_GRID = 101  # points in [0, 1] at which a table-priced policy tabulates E[tokens | α]
BATCH_ROWS = 1024  # batch sizes up to which ``batch_factors`` are tabulated (larger: the last)
MIN_GAIN = 0.05  # default ``min_gain``: the margin a draft's expected gain must clear (below)
EVIDENCE = ("expected", "accepted")  # what a sampled chain step counts (``evidence``)


@flax.struct.dataclass(kw_only=True)
class PolicyState:
  """The policy's running counts (``AdaptiveGamma.ease`` turns them into estimates).

  Attributes:
    successes: [B] discounted count of drafts accepted by chain steps.
    failures: [B] discounted count of chain steps that rejected a draft (stopped before γ).
    tree_successes: [B] the same for tree steps, counting the drafts accepted along the
      tree's first-ranked chain.
    tree_failures: [B] tree steps that stopped before the first-ranked chain's end.
  """

  successes: jax.Array
  failures: jax.Array
  tree_successes: jax.Array
  tree_failures: jax.Array


def check_min_gain(value, name: str = "min_gain") -> None:
  """Refuses a ``min_gain`` that is not a finite number >= 0 (a bool is not a number here),
  naming it ``name`` (a flag's callers pass ``--min_gain``)."""
  if not (isinstance(value, (int, float, np.floating, np.integer))
          and not isinstance(value, bool) and math.isfinite(value) and value >= 0):
    raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_evidence(value, name: str = "evidence") -> None:
  """Refuses an ``evidence`` (``AdaptiveGamma.evidence``) not in ``EVIDENCE``, naming it
  ``name`` (a flag's callers pass ``--evidence``)."""
  if value not in EVIDENCE:
    raise ValueError(f"{name} must be one of {', '.join(EVIDENCE)}, got {value!r}")


def _costs(costs: Sequence[float], name: str) -> tuple[float, ...]:
  costs = tuple(costs)
  if not all(isinstance(c, (int, float, np.floating, np.integer)) and not isinstance(c, bool)
             and math.isfinite(c) and c > 0 for c in costs):
    raise ValueError(f"{name} must be finite and > 0, got {costs}")
  return tuple(float(c) for c in costs)


@dataclasses.dataclass(frozen=True)
class AdaptiveGamma:
  """Chooses each step's draft length (or tree) from a static set by expected speedup.

  Choices are indexed in the order ``gammas`` (sorted), then ``trees``.

  Attributes:
    gammas: the chain lengths it may choose (distinct integers >= 0; 0 is a plain
      decoding step, which needs a drafter that ``tolerates_skipped_steps``). Stored
      sorted. Without trees, at least one must be >= 1.
    step_costs: the time of a step at each γ over one plain decoding step's,
      measured on this machine at this batch size (``calibration``), in the order of
      ``gammas``; γ = 0 costs 1 by definition.
    trees: token trees it may choose (distinct ``TreeTopology`` or ``DynamicTree``).
    tree_costs: the time of a step of each tree over one plain step's, in order.
    rank_accept: the drafter's [D, K] per-depth, per-rank acceptance table
      (``tree_builders``), measured with the trees' own draw (the decoder's sampler) and
      at least as deep as the deepest tree; it prices the trees, and is required with
      them (only with them). Stored as nested tuples.
    prior_alpha: α_c, the chains' acceptance rate at the calibration: their estimate
      starts from it and returns to it while nothing drafts, and with trees it is the
      chains' rate when the trees' is the table's ``table_alpha`` (the module
      docstring). ``calibration.measure_chain_alphas`` measures it.
    prior_weight: how many chain steps' worth of evidence the prior counts as (> 0).
    decay: the weight each step's evidence keeps per later step, in (0, 1]; memory
      of about 1 / (1 − decay) steps.
    prompt_ease: how the chains' acceptance varies by prompt: each calibration prompt's
      rate over ``prior_alpha`` (``calibration.measure_chain_alphas``). With it, a step
      of a batch is priced for the row the batch waits on (``batch_factors``); empty:
      for the rows' mean. Stored as a tuple.
    min_gain: the expected gain over plain decoding a draft must promise before the
      policy leaves plain decoding for it (``choose``): a draft wins only when its score
      exceeds 1 + min_gain, plain decoding's score. Its prices are estimates, and near
      break-even an estimate's error decides the sign of the outcome (the module
      docstring); the default is ``MIN_GAIN``. Only with plain decoding among the
      choices; 0 takes the calibrated formula's argmax.
    evidence: what a sampled chain step counts (the module docstring): ``"expected"``
      (default), each draft position's β weighted by its chance of being scored given the
      drafts; ``"accepted"``, its accept/reject outcomes. Greedy chains count outcomes under
      both; sampled trees their first chain's βs up to its first rejection.
  """

  gammas: tuple[int, ...]
  step_costs: tuple[float, ...]
  trees: tuple[Tree, ...] = ()
  tree_costs: tuple[float, ...] = ()
  rank_accept: Optional[tuple[tuple[float, ...], ...]] = None
  prior_alpha: float = 0.5
  prior_weight: float = 1.0
  decay: float = 0.9
  prompt_ease: tuple[float, ...] = ()
  min_gain: float = MIN_GAIN
  evidence: str = "expected"

  def __post_init__(self):
    gammas, trees = tuple(self.gammas), tuple(self.trees)
    if not all(isinstance(g, (int, np.integer)) and not isinstance(g, bool) for g in gammas):
      raise ValueError(f"gammas must be a sequence of integers, got {self.gammas!r}")
    if not gammas and not trees:
      raise ValueError("the policy needs choices: gammas must be non-empty (or give trees)")
    if gammas and (min(gammas) < 0 or len(set(gammas)) != len(gammas)):
      raise ValueError(f"gammas must be distinct and >= 0, got {gammas}")
    if not trees and max(gammas) < 1:
      raise ValueError(f"gammas must include a draft length >= 1 (or give trees), got {gammas}")
    costs = _costs(self.step_costs, "step_costs")
    if len(costs) != len(gammas):
      raise ValueError(f"{len(costs)} step_costs for {len(gammas)} gammas {gammas}")
    order = sorted(range(len(gammas)), key=lambda i: gammas[i])
    gammas = tuple(int(gammas[i]) for i in order)
    costs = tuple(costs[i] for i in order)
    if gammas and gammas[0] == 0 and costs[0] != 1.0:
      raise ValueError(f"a plain decoding step (γ = 0) costs 1 by definition, got {costs[0]}: "
                       "give every cost relative to one plain step")
    if not all(isinstance(t, (TreeTopology, DynamicTree)) for t in trees):
      raise ValueError(f"trees must be TreeTopology or DynamicTree instances, got {trees!r}")
    if len(set(trees)) != len(trees):
      raise ValueError(f"trees must be distinct, got {trees}")
    tree_costs = _costs(self.tree_costs, "tree_costs")
    if len(tree_costs) != len(trees):
      raise ValueError(f"{len(tree_costs)} tree_costs for {len(trees)} trees")
    table = self.rank_accept
    if table is not None and not trees:
      raise ValueError("rank_accept prices trees, and the policy has none: leave it out")
    if table is not None:
      table = _check_rank_accept(table)
      depth = max(t.max_depth for t in trees)
      if table.shape[0] < depth:
        raise ValueError(f"rank_accept covers depths 1…{table.shape[0]}, but the policy's "
                         f"deepest tree drafts {depth} levels: measure a deeper table")
      if table[0, 0] <= 0.0:
        raise ValueError("rank_accept's rank-0 acceptance at depth 1 must be > 0: the table "
                         "is scaled by the running estimate of it (a drafter whose first "
                         "draft was never accepted cannot price trees; measure on more "
                         "prompts or leave the trees out)")
      table = tuple(tuple(float(x) for x in row) for row in table)
    elif trees:
      raise ValueError("a policy with trees needs rank_accept, the drafter's per-depth, "
                       "per-rank acceptance table (tree_builders.estimate_rank_accept), to "
                       "price them")
    if not 0.0 < self.prior_alpha < 1.0:
      raise ValueError(f"prior_alpha must be in (0, 1), got {self.prior_alpha}")
    if not (math.isfinite(self.prior_weight) and self.prior_weight > 0):
      raise ValueError(f"prior_weight must be > 0, got {self.prior_weight}")
    if not 0.0 < self.decay <= 1.0:
      raise ValueError(f"decay must be in (0, 1], got {self.decay}")
    check_min_gain(self.min_gain)
    check_evidence(self.evidence)
    ease = tuple(self.prompt_ease)
    if not all(isinstance(e, (int, float, np.floating, np.integer)) and not isinstance(e, bool)
               and math.isfinite(e) and e >= 0 for e in ease):
      raise ValueError(f"prompt_ease must be finite numbers >= 0, got {self.prompt_ease!r}")
    for name, value in (("gammas", gammas), ("step_costs", costs), ("trees", trees),
                        ("tree_costs", tree_costs), ("rank_accept", table),
                        ("prompt_ease", tuple(float(e) for e in ease)),
                        ("min_gain", float(self.min_gain))):
      object.__setattr__(self, name, value)

  @classmethod
  def from_theory(cls, gammas: Sequence[int], draft_cost: float, verify_cost: VerifyCost,
                  trees: Sequence[Tree] = (), **kwargs) -> "AdaptiveGamma":
    """Step costs from the calibrated formula: γc + T(γ + 1) for a chain (1 for γ = 0) and
    Dc + T(N + 1) for a tree of depth D and N nodes, with ``c`` the draft's cost per
    forward and ``verify_cost`` a ``VerifyCostCurve`` or its points."""
    curve = verify_cost if callable(verify_cost) else VerifyCostCurve(verify_cost)
    if not (math.isfinite(draft_cost) and draft_cost >= 0):
      raise ValueError(f"draft_cost must be a finite number >= 0, got {draft_cost}")
    cost = lambda depth, nodes: depth * draft_cost + float(curve(nodes + 1))
    return cls(gammas=tuple(gammas), step_costs=tuple(1.0 if g == 0 else cost(g, g)
                                                      for g in gammas),
               trees=tuple(trees),
               tree_costs=tuple(cost(t.max_depth, t.num_nodes) for t in trees), **kwargs)

  # --- the static set ----------------------------------------------------------------

  @property
  def num_choices(self) -> int:
    return len(self.gammas) + len(self.trees)

  @property
  def costs(self) -> tuple[float, ...]:
    """Every choice's step cost, in choice order."""
    return self.step_costs + self.tree_costs

  def shape(self, index: int) -> Optional[Tree]:
    """Choice ``index``'s topology: the chain of its γ, its tree, or None (plain decoding)."""
    if index < len(self.gammas):
      return TreeTopology.chain(self.gammas[index]) if self.gammas[index] else None
    return self.trees[index - len(self.gammas)]

  @property
  def shapes(self) -> tuple[Optional[Tree], ...]:
    return tuple(self.shape(i) for i in range(self.num_choices))

  @property
  def max_depth(self) -> int:
    """The deepest choice's depth: the most drafts one step can accept."""
    return max(s.max_depth for s in self.shapes if s is not None)

  @property
  def max_children(self) -> int:
    """The most children any choice gives a node."""
    return max(s.max_children for s in self.shapes if s is not None)

  @property
  def cache_headroom(self) -> int:
    """Slots past the committed prefix the largest choice writes."""
    return max(s.cache_headroom for s in self.shapes if s is not None)

  @property
  def plain(self) -> bool:
    """Whether plain decoding (γ = 0) is one of the choices."""
    return bool(self.gammas) and self.gammas[0] == 0

  def never_drafts(self, batch_size: int = 1) -> bool:
    """Whether every step of this policy is a plain decoding step for a batch of
    ``batch_size`` rows that stay active together to the end, which is known before the
    first: plain decoding is chosen at the prior (no evidence yet, ρ̂ = 1; no draft promises
    more than ``min_gain``), and a plain step accepts and rejects nothing, so the counts
    stay at zero (they only decay), ρ̂ at 1 and the choice where it was.
    ``SpeculativeDecoder.generate`` then decodes plainly. (A row that ends early, at EOS,
    leaves fewer rows to wait on, which can only favour drafting: the decoder then asks at
    one row.)"""
    if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
      raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not self.plain:
      return False
    # Answers are kept on the instance (not in a cache that would keep policies alive);
    # the frozen dataclass's fields, hence its hash and equality, are untouched.
    answers = self.__dict__.setdefault("_never_drafts", {})
    rows = int(batch_size)
    if rows not in answers:
      answers[rows] = int(self.choose(self.init(rows), jnp.ones((rows,), bool))) == 0
    return answers[rows]

  @property
  def first_chain_depths(self) -> tuple[int, ...]:
    """Per choice, the length of its first-ranked chain (``first_chain_depth``): a step
    that accepts fewer of those drafts counts as a failure. Plain decoding's is 0."""
    return tuple(0 if s is None else s.first_chain_depth for s in self.shapes)

  # --- pricing -----------------------------------------------------------------------

  @functools.cached_property
  def table_alpha(self) -> float:
    """α_A: what the estimate converges to when the rank-0 drafts are accepted at the
    table's rates a_1 … a_D along a chain of the table's depth: with P_d = a_1 ⋯ a_d,
    Σ P_d successes per step against 1 − P_D failures. A table whose rank-0 column is a
    constant α gives α."""
    reach = np.cumprod(np.asarray(self.rank_accept)[:, 0])
    return float(reach.sum() / (reach.sum() + 1.0 - reach[-1]))

  @property
  def tree_rate(self) -> float:
    """The trees' calibrated rate α_A (``table_alpha``); without trees, the chains'."""
    return self.table_alpha if self.trees else self.prior_alpha

  @functools.cached_property
  def token_curves(self) -> Optional[np.ndarray]:
    """[trees, ALPHA_GRID] E[tokens per step] of each tree at α on
    ``np.linspace(0, 1, ALPHA_GRID)``, from the table scaled to α (the module docstring);
    None without trees."""
    if not self.trees:
      return None
    table, ref = np.asarray(self.rank_accept), self.table_alpha
    out = np.ones((len(self.trees), ALPHA_GRID))
    for j, alpha in enumerate(np.linspace(0.0, 1.0, ALPHA_GRID)):
      scaled = np.minimum(table * (alpha / ref), 1.0)
      for k, t in enumerate(self.trees):
        if isinstance(t, DynamicTree):
          t = best_static_tree(scaled[:, :t.top_k], t.num_nodes, max_depth=t.depth)
        out[k, j] = expected_tokens_per_step(t, scaled)
    return out

  @functools.cached_property
  def batch_factors(self) -> Optional[np.ndarray]:
    """[BATCH_ROWS, K] η_k(b): the share of its rows' mean expected tokens a step of choice
    k makes for the row a batch of b rows waits on (the module docstring). With the
    calibration prompts' rates α_i = α_c·ρ_i (``prompt_ease`` ρ_i; the trees' α_A·ρ_i)
    and b rows drawn from them at random, E[min_i E_k(α_i)] / mean_i E_k(α_i): 1 at one
    row, falling with b towards the hardest prompt's share. None without ``prompt_ease``."""
    if not self.prompt_ease:
      return None
    ease = np.sort(np.asarray(self.prompt_ease, np.float64))
    n = len(ease)
    rates = lambda a: jnp.asarray(np.minimum(a * ease, 1.0), jnp.float32)
    tokens = np.asarray(self.expected_tokens(
        rates(self.prior_alpha), rates(self.tree_rate) if self.trees else None), np.float64)
    # each column rises with the ease: the least of b draws is the j-th easiest prompt with
    # probability ((n − j) / n)^b − ((n − j − 1) / n)^b
    b = np.arange(1, BATCH_ROWS + 1, dtype=np.float64)[:, None]
    j = np.arange(n, dtype=np.float64)[None, :]
    weights = ((n - j) / n) ** b - ((n - j - 1) / n) ** b  # [BATCH_ROWS, n]
    return (weights @ tokens) / tokens.mean(axis=0)

  def expected_tokens(self, alpha: jax.Array, tree_alpha: Optional[jax.Array] = None
                      ) -> jax.Array:
    """[B, K] E[tokens per step] of each choice: the chains' at the rows' estimates
    ``alpha`` [B] (closed form), the trees' at ``tree_alpha`` [B] (needed with trees)."""
    powers = alpha[:, None] ** jnp.arange(max(self.gammas, default=0) + 1,
                                          dtype=jnp.float32)[None, :]
    chains = jnp.cumsum(powers, axis=1)[:, jnp.asarray(self.gammas, jnp.int32)]  # [B, G]
    if not self.trees:
      return chains
    grid = jnp.linspace(0.0, 1.0, ALPHA_GRID, dtype=jnp.float32)
    curves = jnp.asarray(self.token_curves, jnp.float32)
    trees = jnp.stack([jnp.interp(tree_alpha, grid, c) for c in curves], axis=1)
    return jnp.concatenate([chains, trees], axis=1)

  # --- the running estimate ----------------------------------------------------------

  def init(self, batch_size: int) -> PolicyState:
    z = lambda: jnp.zeros((batch_size,), jnp.float32)  # one buffer each: the state is donated
    return PolicyState(successes=z(), failures=z(), tree_successes=z(), tree_failures=z())

  def ease(self, state: PolicyState) -> jax.Array:
    """[B] ρ̂, the running ease of the rows' text: accepted drafts over those the
    calibrated rates predict (the module docstring); 1 with no evidence."""
    w = self.prior_weight * self.prior_alpha
    return ((state.successes + state.tree_successes + w)
            / (self.prior_alpha * (state.successes + state.failures)
               + self.tree_rate * (state.tree_successes + state.tree_failures) + w))

  def alpha(self, state: PolicyState) -> jax.Array:
    """[B] the chains' running acceptance estimate, α_c·ρ̂."""
    return jnp.minimum(self.prior_alpha * self.ease(state), 1.0)

  def tree_alpha(self, state: PolicyState) -> jax.Array:
    """[B] the trees' running estimate of their rank-0 acceptance, α_A·ρ̂."""
    return jnp.minimum(self.tree_rate * self.ease(state), 1.0)

  def estimate(self, state: PolicyState, index: jax.Array) -> jax.Array:
    """[B] the running estimate that prices choice ``index``: the trees' for a tree, else
    the chains'."""
    return jnp.where(index >= len(self.gammas), self.tree_alpha(state), self.alpha(state))

  def scores(self, state: PolicyState, active: jax.Array) -> jax.Array:
    """[K] expected tokens per step over step cost, per choice: the active rows' mean, times
    ``batch_factors`` at the number of active rows when the policy has them."""
    expected = self.expected_tokens(self.alpha(state), self.tree_alpha(state))  # [B, K]
    weight = active.astype(jnp.float32)[:, None]
    mean = jnp.sum(expected * weight, axis=0) / jnp.maximum(jnp.sum(weight), 1.0)
    if self.batch_factors is not None:
      rows = jnp.clip(jnp.sum(active.astype(jnp.int32)), 1, BATCH_ROWS)
      mean = mean * jnp.asarray(self.batch_factors, jnp.float32)[rows - 1]
    return mean / jnp.asarray(self.costs, jnp.float32)

  def choose(self, state: PolicyState, active: jax.Array) -> jax.Array:
    """The index (into the choices) of this step's draft: int32 scalar. The highest score,
    with plain decoding's (choice 0, when it is one) raised by ``min_gain``: a draft must
    promise more than that margin over plain decoding to be taken."""
    scores = self.scores(state, active)
    if self.plain:
      scores = scores.at[0].add(self.min_gain)
    return jnp.argmax(scores).astype(jnp.int32)

  def observe(self, state: PolicyState, index: jax.Array, num_accepted: jax.Array,
              active: jax.Array, beta_sum: Optional[jax.Array] = None,
              beta_count: Optional[jax.Array] = None) -> PolicyState:
    """Folds in a step of choice ``index`` that accepted ``num_accepted`` [B] drafts along
    its first-ranked chain (a chain's: all it accepted) into its kind's counts (chains or
    trees; both feed ``ease``); every count decays. Rows not ``active`` keep their counts.

    ``beta_sum`` and ``beta_count`` [B]: a sampled chain step's Σ wᵢβᵢ and Σ wᵢ (the module
    docstring), or recursive rejection's first-ranked chain's Σβ over the nodes it scored and
    their number (0 where the step weighed none: plain steps). Under
    ``evidence="expected"`` a row with a count takes Σβ successes and count − Σβ failures
    in place of its outcomes (the module docstring)."""
    if (beta_sum is None) != (beta_count is None):
      raise ValueError("give beta_sum and beta_count together")
    length = jnp.asarray(self.first_chain_depths, jnp.int32)[index]
    tree = index >= len(self.gammas)
    accepted = num_accepted.astype(jnp.float32)
    rejected = (num_accepted < length).astype(jnp.float32)
    if self.evidence == "expected" and beta_sum is not None:
      weighed = beta_count > 0
      accepted = jnp.where(weighed, beta_sum.astype(jnp.float32), accepted)
      rejected = jnp.where(weighed, (beta_count - beta_sum).astype(jnp.float32), rejected)
    d = self.decay
    new = PolicyState(successes=d * state.successes + jnp.where(tree, 0.0, accepted),
                      failures=d * state.failures + jnp.where(tree, 0.0, rejected),
                      tree_successes=d * state.tree_successes + jnp.where(tree, accepted, 0.0),
                      tree_failures=d * state.tree_failures + jnp.where(tree, rejected, 0.0))
    return jax.tree.map(lambda n, o: jnp.where(active, n, o), new, state)
