"""Closed-form speedup theory of speculative decoding (Leviathan et al., 2023).

Pure numpy: these formulas predict what a run *should* give, so benchmarks can
put measured speedups beside them. Notation follows the paper (arXiv 2211.17192):

  alpha   expected acceptance rate, E[beta], with beta = sum_x min(p(x), q(x)).
  gamma   number of draft tokens proposed per iteration (an integer >= 1).
  c       draft forward time / target forward time (walltime cost ratio).
  c_hat   draft / target arithmetic operations per token.

Worked example (Table 1, alpha = 0.8, gamma = 2, c = 0): one iteration yields
E = (1 - 0.8**3) / (1 - 0.8) = 2.44 tokens for one target step, hence a 2.44x
walltime improvement, and spends (2 + 1) / 2.44 = 1.23x the target operations.

The paper assumes verifying gamma + 1 tokens costs exactly one target step. The
``calibrated_*`` variant replaces that with a measured cost curve
``verify_cost(T)`` = time(target forward over T new tokens) / time(over 1 token),
which matters on hardware where a T-token forward is not free (e.g. CPU).

All functions broadcast over numpy arrays and return a Python float when every
input is a scalar.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Mapping, Sequence, Union

import numpy as np

ArrayLike = Union[float, int, np.ndarray]
VerifyCost = Union[Callable[[int], float], Mapping[int, float]]


def _as_result(x: np.ndarray) -> ArrayLike:
  """Returns a Python float for 0-d results, the array otherwise."""
  return float(x) if np.ndim(x) == 0 else x


def _check_alpha(alpha: ArrayLike) -> np.ndarray:
  a = np.asarray(alpha, dtype=np.float64)
  if not np.all((a >= 0.0) & (a <= 1.0)):  # Also rejects NaN.
    raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
  return a


def _check_gamma(gamma: ArrayLike) -> np.ndarray:
  g = np.asarray(gamma)
  # bool is an integer dtype in numpy; a True gamma is almost surely a bug.
  if g.dtype == np.bool_ or not np.issubdtype(g.dtype, np.integer):
    raise ValueError(f"gamma must be an integer (number of draft tokens), got {gamma!r}")
  if not np.all(g >= 1):
    raise ValueError(f"gamma must be >= 1, got {gamma!r}")
  return g.astype(np.int64)


def _check_nonneg(value: ArrayLike, name: str) -> np.ndarray:
  v = np.asarray(value, dtype=np.float64)
  if not np.all(np.isfinite(v) & (v >= 0.0)):
    raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
  return v


def _expected_tokens(a: np.ndarray, g: np.ndarray) -> np.ndarray:
  """(1 - a^(g+1)) / (1 - a) on validated arrays, exact at a = 1."""
  n = g + 1
  # -expm1(n log a) is 1 - a^n without cancellation as a -> 1; 1 - a itself is
  # exact in floating point for a in [0.5, 1]. At a = 0, log gives -inf and
  # expm1(-inf) = -1, so the quotient is 1 as it should be.
  with np.errstate(divide="ignore", invalid="ignore"):
    series = -np.expm1(n * np.log(a)) / (1.0 - a)
  return np.where(a == 1.0, n.astype(np.float64), series)


def expected_tokens_per_step(alpha: ArrayLike, gamma: ArrayLike) -> ArrayLike:
  """Expected tokens generated per speculative iteration (paper Eq. 1).

  E = (1 - alpha^(gamma+1)) / (1 - alpha): the accepted prefix of the gamma
  drafts plus the one token the target always contributes. At alpha = 1 the
  limit gamma + 1 is returned exactly.

  Args:
    alpha: acceptance rate(s) in [0, 1].
    gamma: integer number(s) of draft tokens, >= 1.

  Returns:
    The expected token count, broadcast over the inputs.

  Raises:
    ValueError: alpha outside [0, 1] or gamma not an integer >= 1.
  """
  return _as_result(_expected_tokens(_check_alpha(alpha), _check_gamma(gamma)))


def slowest_row_tokens(batch_tokens: Sequence[ArrayLike]) -> float:
  """Tokens per step of a run over batches that each decode until their slowest row is done.

  A batch shares its steps, so with N tokens a row it takes about N / min_r E_r steps (E_r a
  row's tokens per step); over several batches of N tokens a row the run makes, per step,
  the harmonic mean over batches of min_r E_r.

  Args:
    batch_tokens: per batch, its rows' tokens per step, each >= 1 (a non-empty array each).

  Returns:
    The tokens per step.

  Raises:
    ValueError: no batch, an empty batch, or a rate below one token a step (or NaN).
  """
  if len(batch_tokens) == 0 or any(np.size(t) == 0 for t in batch_tokens):
    raise ValueError("batch_tokens must hold at least one batch, each with at least one row")
  slowest = [float(np.min(np.asarray(t, np.float64))) for t in batch_tokens]
  if not all(e >= 1.0 for e in slowest):  # also rejects NaN
    raise ValueError(f"every row makes at least one token a step, got {batch_tokens!r}")
  return len(slowest) / sum(1.0 / e for e in slowest)


def batched_expected_tokens(batch_alphas: Sequence[ArrayLike], gamma: int) -> float:
  """``slowest_row_tokens`` with each row's E = ``expected_tokens_per_step`` at its own rate.

  At one row a batch that is the harmonic mean of the rows' E, close to E at the pooled rate
  when the rates are alike; at batch 4 on the Intel Xeon (rows' α 0.38–0.85) E at the pooled
  rate over-predicted the measured speedup by 7–18%, this by 2–4%
  (``benchmarks/results/calibrated_batches.md``).

  Args:
    batch_alphas: per batch, its rows' acceptance rates in [0, 1] (a non-empty array each).
    gamma: integer number of draft tokens, >= 1.

  Raises:
    ValueError: no batch, an empty batch, or out-of-range rates.
  """
  g = _check_gamma(gamma)
  return slowest_row_tokens([_expected_tokens(_check_alpha(a), g) for a in batch_alphas])


def walltime_improvement(alpha: ArrayLike, gamma: ArrayLike, c: ArrayLike) -> ArrayLike:
  """Expected walltime improvement factor over plain decoding (paper Thm 3.8).

  (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)): an iteration costs
  gamma draft steps plus one target step, the latter assumed independent of
  the number of tokens verified.

  Args:
    alpha: acceptance rate(s) in [0, 1].
    gamma: integer number(s) of draft tokens, >= 1.
    c: draft step time / target step time, >= 0.

  Returns:
    The improvement factor (> 1 means faster than plain decoding).

  Raises:
    ValueError: on out-of-range inputs.
  """
  a, g, c = _check_alpha(alpha), _check_gamma(gamma), _check_nonneg(c, "c")
  return _as_result(_expected_tokens(a, g) / (g * c + 1.0))


def operations_factor(alpha: ArrayLike, gamma: ArrayLike, c_hat: ArrayLike) -> ArrayLike:
  """Expected factor by which total arithmetic operations grow (paper Thm 3.11).

  (1 - alpha)(gamma c_hat + gamma + 1) / (1 - alpha^(gamma+1)): every
  iteration runs the target over gamma + 1 tokens and the draft gamma times,
  whatever is accepted.

  Args:
    alpha: acceptance rate(s) in [0, 1].
    gamma: integer number(s) of draft tokens, >= 1.
    c_hat: draft / target operations per token, >= 0.

  Returns:
    The operations factor (>= 1 whenever alpha < 1).

  Raises:
    ValueError: on out-of-range inputs.
  """
  a, g = _check_alpha(alpha), _check_gamma(gamma)
  c_hat = _check_nonneg(c_hat, "c_hat")
  return _as_result((g * c_hat + g + 1.0) / _expected_tokens(a, g))


def min_speedup_gamma1(alpha: ArrayLike, c: ArrayLike) -> ArrayLike:
  """The improvement (1 + alpha) / (1 + c) that gamma = 1 achieves (paper Cor. 3.9).

  This is exactly ``walltime_improvement(alpha, 1, c)``; it exceeds 1 iff
  alpha > c, so the optimal gamma then gives at least this much.

  Args:
    alpha: acceptance rate(s) in [0, 1].
    c: draft step time / target step time, >= 0.

  Returns:
    (1 + alpha) / (1 + c).
  """
  a, c = _check_alpha(alpha), _check_nonneg(c, "c")
  return _as_result((1.0 + a) / (1.0 + c))


@dataclasses.dataclass(frozen=True)
class VerifyCostCurve:
  """Measured relative cost of one target forward over T new tokens.

  ``VerifyCostCurve({1: 1.0, 4: 1.1, 8: 1.3})(6) == 1.2``. Between measured
  points the curve is linear in T; beyond the last point it extends the last
  segment linearly (a single point gives a flat curve). Monotonicity is not
  required: measured timings can dip.

  Attributes:
    points: sorted ((T, cost), ...) pairs with T >= 1 and cost(1) == 1. A
      mapping or iterable of pairs is accepted and normalised: every cost is
      divided by the cost at T = 1, which must be measured.
  """

  points: tuple[tuple[int, float], ...]

  def __post_init__(self):
    raw = self.points.items() if isinstance(self.points, Mapping) else self.points
    pairs = sorted((t, float(v)) for t, v in raw)
    ts = [t for t, _ in pairs]
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ts):
      raise ValueError(f"verify cost curve T values must be integers, got {ts}")
    if len(set(ts)) != len(ts) or (ts and ts[0] < 1):
      raise ValueError(f"verify cost curve T values must be distinct and >= 1, got {ts}")
    if not ts or ts[0] != 1:
      raise ValueError(f"verify cost curve needs a measurement at T=1, got T={ts}")
    if not all(np.isfinite(v) and v > 0 for _, v in pairs):
      raise ValueError(f"verify costs must be finite and > 0, got {pairs}")
    base = pairs[0][1]
    object.__setattr__(self, "points", tuple((int(t), v / base) for t, v in pairs))

  def __call__(self, t: ArrayLike) -> ArrayLike:
    """Relative cost at ``t`` new tokens (t >= 1), interpolated or extrapolated."""
    t = np.asarray(t, dtype=np.float64)
    if not np.all(t >= 1):
      raise ValueError(f"T must be >= 1, got {t!r}")
    ts = np.array([p[0] for p in self.points], dtype=np.float64)
    vs = np.array([p[1] for p in self.points], dtype=np.float64)
    cost = np.interp(t, ts, vs)
    if len(ts) > 1:
      slope = (vs[-1] - vs[-2]) / (ts[-1] - ts[-2])
      cost = np.where(t > ts[-1], vs[-1] + slope * (t - ts[-1]), cost)
    return _as_result(cost)


def _verify_costs(verify_cost: VerifyCost, t: np.ndarray) -> np.ndarray:
  """Evaluates ``verify_cost`` element-wise at integer token counts ``t``."""
  if isinstance(verify_cost, Mapping):
    verify_cost = VerifyCostCurve(verify_cost)
  flat = [float(verify_cost(int(x))) for x in t.ravel()]
  costs = np.array(flat, dtype=np.float64).reshape(t.shape)
  if not np.all(np.isfinite(costs) & (costs > 0)):
    bad = {int(x): v for x, v in zip(t.ravel(), flat) if not (np.isfinite(v) and v > 0)}
    raise ValueError(f"verify_cost must be finite and > 0, got {bad}")
  return costs


def calibrated_walltime_improvement(alpha: ArrayLike, gamma: ArrayLike, c: ArrayLike,
                                    verify_cost: VerifyCost) -> ArrayLike:
  """Walltime improvement with a measured target cost for verifying gamma + 1 tokens.

  E[tokens] / (gamma c + verify_cost(gamma + 1)). With verify_cost == 1 this is
  ``walltime_improvement``; with verify_cost(T) = T (no parallelism at all) it
  never exceeds 1 for alpha < 1.

  Args:
    alpha: acceptance rate(s) in [0, 1].
    gamma: integer number(s) of draft tokens, >= 1.
    c: draft step time / target single-token step time, >= 0.
    verify_cost: callable T -> relative time of a target forward over T new
      tokens (1 at T = 1), or a mapping of measured points, which is wrapped in
      a ``VerifyCostCurve`` (normalised and interpolated).

  Returns:
    The improvement factor.

  Raises:
    ValueError: on out-of-range inputs or a non-positive verify cost.
  """
  a, g, c = _check_alpha(alpha), _check_gamma(gamma), _check_nonneg(c, "c")
  return _as_result(_expected_tokens(a, g) / (g * c + _verify_costs(verify_cost, g + 1)))


def whole_call_improvement(decode_improvement: ArrayLike, prefill_share: ArrayLike,
                           prefill_ratio: ArrayLike) -> ArrayLike:
  """The speedup of whole calls, prefill included, from the decode loop's.

  The formulas above model the decode loop; a call also prefills its prompt, which
  speculative decoding does not shorten (and a draft with a prefill of its own
  lengthens). With plain decoding spending ``prefill_share`` s of its time in the
  prefill, a speculative prefill ``prefill_ratio`` r_p times as fast as plain's and
  a decode loop ``decode_improvement`` r_d times as fast, the whole call is

      1 / (s / r_p + (1 - s) / r_d)

  times as fast: plain time P + D over speculative P / r_p + D / r_d. At s = 0 it is
  r_d. The experiments take r_d from ``calibrated_walltime_improvement`` and s, r_p
  as measured (``benchmarks/results/calibrated_batches.md``: within 4% of every
  committed chain setting's measured speedup, where the decode-loop prediction
  alone was 30% below it in a 32-token batched run whose prefill was 54% of plain
  decoding's time).

  Args:
    decode_improvement: r_d, the decode loop's speedup, > 0.
    prefill_share: s, in [0, 1).
    prefill_ratio: r_p, plain prefill time / speculative prefill time, > 0.

  Raises:
    ValueError: on out-of-range inputs.
  """
  r_d = np.asarray(decode_improvement, np.float64)
  s = np.asarray(prefill_share, np.float64)
  r_p = np.asarray(prefill_ratio, np.float64)
  for name, v in (("decode_improvement", r_d), ("prefill_ratio", r_p)):
    if not np.all(np.isfinite(v) & (v > 0)):
      raise ValueError(f"{name} must be finite and > 0, got {v}")
  if not np.all((s >= 0) & (s < 1)):
    raise ValueError(f"prefill_share must be in [0, 1), got {s}")
  return _as_result(1.0 / (s / r_p + (1.0 - s) / r_d))


def optimal_gamma(alpha: ArrayLike, c: ArrayLike, max_gamma: int = 16,
                  verify_cost: VerifyCost | None = None) -> ArrayLike:
  """The integer gamma in [1, max_gamma] maximising the expected improvement.

  Uses ``walltime_improvement`` (solved exactly, see ``_paper_optimal_gamma``)
  or, when a ``verify_cost`` is given, ``calibrated_walltime_improvement``
  (brute force over the candidates). Ties go to the smallest gamma. With c = 0
  the paper's improvement grows with gamma for every alpha > 0, so the answer
  is ``max_gamma``: the cap is then the real decision.

  Args:
    alpha: acceptance rate(s) in [0, 1].
    c: draft step time / target step time, >= 0.
    max_gamma: largest gamma considered, >= 1.
    verify_cost: optional measured verify cost (see
      ``calibrated_walltime_improvement``).

  Returns:
    An int for scalar inputs, else an integer array broadcast over alpha and c.

  Raises:
    ValueError: on out-of-range inputs.
  """
  if isinstance(max_gamma, bool) or not isinstance(max_gamma, numbers.Integral):
    raise ValueError(f"max_gamma must be an integer, got {max_gamma!r}")
  if max_gamma < 1:
    raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
  a, c = _check_alpha(alpha), _check_nonneg(c, "c")
  a, c = np.broadcast_arrays(a, c)
  if verify_cost is None:
    best = _paper_optimal_gamma(a, c, max_gamma)
  else:
    # An arbitrary cost curve has no structure to exploit: compare every
    # candidate, laid out along a new last axis [..., max_gamma].
    gammas = np.arange(1, max_gamma + 1, dtype=np.int64)
    verify = _verify_costs(verify_cost, gammas + 1)
    improvement = _expected_tokens(a[..., None], gammas) / (gammas * c[..., None] + verify)
    best = np.argmax(improvement, axis=-1) + 1  # argmax returns the first maximum.
  return int(best) if best.ndim == 0 else best


def _paper_optimal_gamma(a: np.ndarray, c: np.ndarray, max_gamma: int) -> np.ndarray:
  """Argmax of ``walltime_improvement`` over gamma in [1, max_gamma], step by step.

  An argmax over computed improvements is unreliable when alpha^gamma falls
  below float resolution (c = 0, small alpha): the values tie up to rounding
  and the winner jitters. Instead decide each step by a comparison free of
  cancellation. With
  E(g) = sum_{k=0}^{g} a^k and f(g) = E(g) / (g c + 1),

    f(g+1) > f(g)  <=>  a^(g+1) (g c + 1) > c E(g)
                   <=>  c S(g) < g c + 1,   S(g) = sum_{j=1}^{g+1} a^(-j).

  Each step adds c a^(-(g+2)) >= c to the left side and exactly c to the right,
  so once a step fails to improve, all later ones fail (f is unimodal) and the
  optimum is 1 + the number of leading steps that improve; S falls as alpha
  rises, so the optimum is non-decreasing in alpha. At alpha = 0 the terms are
  inf and no step improves (gamma = 1); at c = 0 every step improves iff
  alpha > 0.
  """
  g = np.arange(1, max_gamma, dtype=np.float64)  # Steps g -> g + 1.
  a, c = a[..., None], c[..., None]
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    s = np.cumsum(a ** -np.arange(1.0, max_gamma + 1), axis=-1)[..., 1:]  # S(1..max_gamma-1).
    improves = np.where(c == 0, a > 0, c * s < g * c + 1)
  return 1 + np.sum(np.logical_and.accumulate(improves, axis=-1), axis=-1)


def beta(p: np.ndarray, q: np.ndarray) -> ArrayLike:
  """Per-position acceptance probability sum_x min(p(x), q(x)) (paper Def. 3.1).

  Args:
    p: draft distribution(s) [..., V].
    q: target distribution(s) [..., V] (broadcastable with p).

  Returns:
    beta [...], the probability that a draft token drawn from p is accepted.
  """
  return _as_result(np.sum(np.minimum(np.asarray(p, np.float64), np.asarray(q, np.float64)),
                           axis=-1))


def alpha_from_beta(betas: ArrayLike) -> float:
  """The acceptance rate alpha = E[beta], estimated as the mean of ``betas``.

  Args:
    betas: per-position beta values in [0, 1], any shape, non-empty.

  Returns:
    Their mean.

  Raises:
    ValueError: if empty or any value is outside [0, 1].
  """
  b = np.asarray(betas, dtype=np.float64)
  if b.size == 0:
    raise ValueError("alpha_from_beta needs at least one beta value")
  # Sums of float32 minima can overshoot 1 by rounding; beyond that it is a bug.
  if not np.all((b >= 0.0) & (b <= 1.0 + 1e-6)):
    raise ValueError(f"beta values must be in [0, 1], got min {b.min()}, max {b.max()}")
  return float(min(b.mean(), 1.0))
