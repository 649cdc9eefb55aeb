"""Which matmul runs for how many rows, chosen by measurement on the machine it runs on.

The streaming kernel (``streaming_matmul.py``) is much faster than XLA's dot
for decode and verify shapes on some CPUs and was 2-16x slower on others
before it had an AVX2 path: no fixed rule holds everywhere. So on first use
``policy_for`` times both on the model's own projection weights (every layer's:
the whole stream a forward reads) for a grid of row counts M (decode M = batch,
verify M = batch x (γ + 1), prefill chunks M = batch x 64), keeps the kernel
exactly where it was faster, prefetching where that was faster still (hinted into L2 or
non-temporal: ``streaming_matmul.PREFETCH_MODES``, the hint chosen once over every row
count), and caches the decision on disk, keyed by CPU model and flags, jaxlib
version, kernel source and the weight shapes (``cache_key``).
``SPECJAX_MATMUL=xla|kernel|auto`` overrides it (default ``auto``).

Timed over the first four layers only (32 MB for SmolLM2, which a large
last-level cache holds when timed over and over: the 2-core Intel Xeon VM reports
480 MB), the one-row decision flipped between timings of the same code on a quiet
machine: kernel/XLA 0.54 in one, 1.06 in another, which put plain decoding on the
slower path for every later run. Over all thirty layers (240 MB, streamed from
memory as in a forward) it read 0.79-0.85, as a decode step does (kernel 22 ms,
XLA 25-27 ms). A timing taken while other work runs (a test suite's workers)
times that work too, so a measurement during which other processes' threads were
runnable (``other_work``) is cached only provisionally (``MatmulPolicy.contended``)
and timed again by the first process that finds the machine quiet.

The decoder layers' projections and the output head are measured and decided
apart (``PARTS``), each the way the model runs it (a tied head: XLA's dot against
the embedding itself, [V, D]). One chain of both weighed four layers against the
head, where a 30-layer model runs thirty, and timed the tied head's XLA path in a
layout the model does not use: on a 2-core Zen 3 host that chose XLA's dot for
every one-row product, where measured apart both parts take the kernel (kernel/XLA
0.90 for the layers, 0.95 for the head at M = 1) and a one-token forward is 1.23x
faster for it (``benchmarks/results/matmul_parts_avx2.md``).

Worked example: measured medians (ms) {1: (20, 14, 15, 16), 16: (70, 50, 45, 44),
128: (230, 260, 250, 240)} as (XLA, kernel, kernel prefetching into L2, kernel prefetching
non-temporally) give the policy "kernel for M <= 16, prefetching non-temporal at 16, XLA's
dot beyond" (the non-temporal hint was faster over M = 16 and 128 taken together, and at 16
faster than no prefetch): M = 5 takes the decision of the next grid point (16), M = 512 that
of the last (128).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
import types
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import files
from specjax.kernels import streaming_matmul as sm

ENV = "SPECJAX_MATMUL"
CHOICES = ("auto", "xla", "kernel")
# Decode and verify widths, then prefill-sized calls (batch x 64-token chunks).
ROW_GRID = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64, 128, 256)
# Other runnable threads per CPU, sampled before and after a timing, from which it counts as
# contended: one other busy thread on a 2-core host.
BUSY = 0.5
LAYERS, HEAD = "layers", "head"
PARTS = (LAYERS, HEAD)  # measured and decided apart (the module's docstring says why)

_log = logging.getLogger("specjax")


@dataclasses.dataclass(frozen=True)
class MatmulPolicy:
  """Where the streaming kernel runs instead of XLA's dot.

  Attributes:
    grid: row counts M the decision was made at, increasing.
    kernel: per grid point, whether the kernel runs there. Rows m take the
      decision of the smallest grid point >= m, and of the last one beyond.
    source: why (``"measured"``, ``"SPECJAX_MATMUL=xla"``, ...), for logs.
    ratios: per grid point, measured kernel time / XLA time, the fastest of the
      kernel's modes (empty if not measured).
    prefetch: per grid point, the kernel's prefetch mode there
      (``streaming_matmul(prefetch=)``, a key of ``PREFETCH_MODES``); empty: never.
    contended: measured while other work ran on the machine (``other_work``): cached
      provisionally, and timed again by the next process that starts on a quiet machine.
  """

  grid: tuple[int, ...]
  kernel: tuple[bool, ...]
  source: str = ""
  ratios: tuple[float, ...] = ()
  prefetch: tuple[int, ...] = ()
  contended: bool = False

  def __post_init__(self):
    if not self.grid or len(self.grid) != len(self.kernel) or list(self.grid) != sorted(
        set(self.grid)) or self.grid[0] < 1 or len(self.prefetch) not in (0, len(self.grid)) \
        or any(p not in sm.PREFETCH_MODES for p in self.prefetch):
      raise ValueError(f"bad policy grid {self.grid} / decisions {self.kernel} / prefetch "
                       f"{self.prefetch}")

  def _at(self, rows: int) -> int:
    return min(int(np.searchsorted(np.asarray(self.grid), rows)), len(self.grid) - 1)

  def use_kernel(self, rows: int) -> bool:
    """Whether a product with ``rows`` rows goes to the kernel."""
    return self.kernel[self._at(rows)]

  def prefetch_at(self, rows: int) -> int:
    """The kernel's prefetch mode for ``rows`` rows (0: none)."""
    return int(self.prefetch[self._at(rows)]) if self.prefetch else 0

  @property
  def never(self) -> bool:
    return not any(self.kernel)

  @property
  def always(self) -> bool:
    return all(self.kernel)

  def describe(self) -> str:
    """One line: which path for which M, and the measured ratios."""
    if self.never or self.always:
      what = "XLA's dot for every M" if self.never else "streaming kernel for every M"
    else:
      ranges, start = [], 1
      for i, m in enumerate(self.grid):
        if i + 1 == len(self.grid) or self.kernel[i + 1] != self.kernel[i]:
          end = "" if i + 1 == len(self.grid) else str(m)
          name = "kernel" if self.kernel[i] else "XLA"
          ranges.append(f"{name} for M {start}-{end}" if end else f"{name} for M >= {start}")
          start = m + 1
      what = ", ".join(ranges)
    for mode, name in sm.PREFETCH_MODES.items():
      rows = [str(m) for m, k, p in zip(self.grid, self.kernel, self.prefetch) if k and p == mode]
      if mode and rows:
        what += f"; prefetching {name} at M = " + ", ".join(rows)
    text = f"{what} ({self.source}{', under load: provisional' if self.contended else ''})"
    if self.ratios:
      text += "; kernel/XLA time at M = " + ", ".join(
          f"{m}: {r:.2f}" for m, r in zip(self.grid, self.ratios))
    return text

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "MatmulPolicy":
    return cls(grid=tuple(d["grid"]), kernel=tuple(bool(k) for k in d["kernel"]),
               source=d.get("source", ""), ratios=tuple(d.get("ratios", ())),
               prefetch=tuple(int(p) for p in d.get("prefetch", ())),
               contended=bool(d.get("contended", False)))


XLA = MatmulPolicy(grid=(1,), kernel=(False,), source="XLA's dot")
KERNEL = MatmulPolicy(grid=(1,), kernel=(True,), source="streaming kernel")


def pooled_hint(timings: dict[int, tuple[float, ...]], first: int) -> int:
  """The prefetch mode, 1 (into L2) or 2 (non-temporal), that was faster over every row count
  from ``first`` on that timed both (the geometric mean of their ratios); 1 where none did.

  Pooled, not per M: which hint suits the host's memory was the same at every M in the A/Bs
  (``benchmarks/results/kernel_ab_nta_zen5.md``: 0.92-0.98 at M = 1-16), while one row
  count's three repeats differ by more than the hints do (identical code ±2%, the hints
  2-8%), so per M the choice between them was mostly noise."""
  ratios = [t[3] / t[2] for m, t in timings.items() if m >= first and len(t) > 3]
  return 2 if ratios and float(np.mean(np.log(ratios))) < 0 else 1


def choose(timings: dict[int, tuple[float, ...]], source: str = "measured",
           prefetch_rows: Optional[int] = None) -> MatmulPolicy:
  """The policy from {M: (XLA seconds, kernel seconds, [kernel seconds in prefetch mode 1,
  [mode 2]])}: the kernel only where it (prefetching or not) was faster than XLA, prefetching
  with the ``pooled_hint`` where that was faster than not, and only from ``prefetch_rows``
  rows on (below, the modes run the same code and a difference measured there is noise;
  default ONE_PASS_ROWS + 1: up to ONE_PASS_ROWS rows the kernel reads each panel once and
  only its passes from cache prefetch, unless the kernel says otherwise,
  ``streaming_matmul.prefetch_rows``)."""
  grid = tuple(sorted(timings))
  first = sm.ONE_PASS_ROWS + 1 if prefetch_rows is None else prefetch_rows
  hint = pooled_hint(timings, first)
  prefetch = tuple(hint if m >= first and len(timings[m]) > 1 + hint
                   and timings[m][1 + hint] < timings[m][1] else 0 for m in grid)
  best = {m: timings[m][1 + p] for m, p in zip(grid, prefetch)}  # the mode that runs
  return MatmulPolicy(grid=grid, kernel=tuple(best[m] < timings[m][0] for m in grid),
                      source=source, ratios=tuple(best[m] / timings[m][0] for m in grid),
                      prefetch=prefetch if any(prefetch) else ())


def projection_weights(params: dict, tie_embeddings: bool, num_layers: Optional[int] = None,
                       part: Optional[str] = None) -> list[np.ndarray]:
  """The [K, N] matrices a forward multiplies by, in order: the first ``num_layers`` layers'
  projections (default every layer's; ``part`` "layers"), the head ("head"), or both (None)."""
  if part not in (None,) + PARTS:
    raise ValueError(f"part must be one of {PARTS} or None, got {part!r}")
  names = ("wqkv", "wo", "w_gate_up", "w_down")
  ws = [] if part == HEAD else [np.asarray(layer[n], np.float32)
                                for layer in params["layers"][:num_layers] for n in names]
  if part != LAYERS:
    ws.append(np.asarray(params["embed"], np.float32).T if tie_embeddings
              else np.asarray(params["lm_head"], np.float32))
  return ws


def _chain(matmul: Callable, ks: Sequence[int]):
  """jit of x -> the products in order, each input cut or padded to the next K."""

  def run(weights, x):
    for i, w in enumerate(weights):
      y = matmul(x, w)
      k = ks[i + 1] if i + 1 < len(ks) else 0
      if k:
        y = y[:, :k] if y.shape[1] >= k else jnp.pad(y, ((0, 0), (0, k - y.shape[1])))
        x = jnp.tanh(y)  # bounded values: no overflow or denormals over the chain
    return y

  return jax.jit(run)


# A row count whose kernel / XLA ratio lies within this factor of 1 is a close call: it is
# timed again before the decision. (On a 2-core Intel Xeon three repeats read the one-row
# kernel at 1.05x XLA's time, a later measurement at 0.90x, and plain decoding ran 12%
# slower on XLA's dot than on the kernel.)
CLOSE_CALL = 1.15


def close_calls(timings: dict[int, tuple[float, ...]], factor: float = CLOSE_CALL) -> list[int]:
  """Row counts whose fastest kernel mode is within ``factor`` of XLA's time, either way."""
  return [m for m, (xla, *kernel) in sorted(timings.items())
          if 1 / factor <= min(kernel) / xla <= factor]


def measure(weights: Sequence[np.ndarray], grid: Sequence[int] = ROW_GRID, repeats: int = 3,
            variant: str = "native", retime: int = 3, xla_transposed: bool = False
            ) -> dict[int, tuple[float, ...]]:
  """Median seconds of the product chain with XLA's dot and the kernel in each prefetch mode
  (``streaming_matmul.PREFETCH_MODES``: off, into L2, non-temporal; the prefetching modes
  only from ``streaming_matmul.prefetch_rows`` rows on, below which they run the same code),
  per row count: (XLA, kernel[, mode 1, mode 2]).

  The paths are timed alternately (XLA, kernel, kernel prefetching into L2, ..., XLA, ...)
  after a warm-up, so load from elsewhere on the machine hits them alike. Close calls
  (``close_calls``) get ``retime`` × ``repeats`` more alternating repeats, and their medians
  are taken over all of them. ``xla_transposed``: XLA's dot contracts against each [K, N]
  weight stored as its [N, K] transpose, as the model multiplies by a tied head (against
  the embedding); the kernel reads the same panels either way.
  """
  ks = [w.shape[0] for w in weights]
  if xla_transposed:
    plain = [jnp.asarray(np.ascontiguousarray(w.T)) for w in weights]
    xla_dot = lambda x, w: jnp.einsum("mk,nk->mn", x, w)
  else:
    plain = [jnp.asarray(w) for w in weights]
    xla_dot = lambda x, w: x @ w
  panels = [jnp.asarray(sm.to_panels(w, variant)) for w in weights]
  fns = (_chain(xla_dot, ks),) + tuple(
      _chain(functools.partial(sm.streaming_matmul, variant=variant, prefetch=mode), ks)
      for mode in sm.PREFETCH_MODES)
  args = (plain,) + (panels,) * len(sm.PREFETCH_MODES)
  rng = np.random.default_rng(0)
  xs = {m: jnp.asarray(rng.standard_normal((m, ks[0]), dtype=np.float32)) for m in grid}
  first = sm.prefetch_rows(variant)
  paths = {m: len(fns) if m >= first else 2 for m in grid}  # XLA, then the kernel's modes
  times = {m: tuple([] for _ in range(paths[m])) for m in grid}
  for m in grid:
    for f, a in zip(fns[:paths[m]], args):
      f(a, xs[m]).block_until_ready()

  def timed(rows: Sequence[int], n: int) -> dict[int, tuple[float, ...]]:
    for _ in range(n):
      for m in rows:
        for i, (f, a) in enumerate(zip(fns[:paths[m]], args)):
          t = time.perf_counter()
          f(a, xs[m]).block_until_ready()
          times[m][i].append(time.perf_counter() - t)
    return {m: tuple(float(np.median(ti)) for ti in t) for m, t in times.items()}

  medians = timed(grid, repeats)
  return timed(close_calls(medians), retime * repeats)


def _runnable_elsewhere() -> Optional[int]:
  """Threads of other processes in state R (running or runnable) now, from /proc; None where
  there is no /proc (not Linux)."""
  me = str(os.getpid())
  try:
    pids = [p for p in os.listdir("/proc") if p.isdigit() and p != me]
  except OSError:
    return None
  count = 0
  for pid in pids:
    try:
      tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
      continue  # gone, or not ours to read
    for tid in tasks:
      try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
          count += f.read().rpartition(")")[2].split()[0] == "R"
      except (OSError, IndexError):
        continue
  return count


def other_work(samples: int = 5, interval_s: float = 0.02,
               runnable: Callable[[], Optional[int]] = _runnable_elsewhere) -> float:
  """Other processes' runnable threads per CPU: the median of ``samples`` readings of
  ``runnable()`` ``interval_s`` apart (this process's own threads, XLA's pool among them, do
  not count); 0.0 where the system does not say."""
  counts = []
  for i in range(samples):
    n = runnable()
    if n is None:
      return 0.0
    counts.append(n)
    if i + 1 < samples:
      time.sleep(interval_s)
  return float(np.median(counts)) / (os.cpu_count() or 1)


def _code_fingerprint(code: types.CodeType) -> tuple:
  """What a function computes, as a value stable across processes: its bytecode, names and
  constants, nested code objects (comprehensions, lambdas) by their own fingerprint, since a
  code object's repr holds its memory address and file path. Line numbers are left out."""
  consts = tuple(_code_fingerprint(c) if isinstance(c, types.CodeType) else repr(c)
                 for c in code.co_consts)
  return code.co_code, code.co_names, consts


def cache_key(weight_shapes: Sequence[tuple[int, int]], cpu: Optional[str] = None,
              xla_transposed: bool = False) -> str:
  """What a measured decision is valid for: CPU model and flags, jaxlib, kernel source, shapes
  (and ``measure``'s ``xla_transposed``), and the rule that turns timings into a decision
  (``choose``'s compiled code: no source file needed, and comment edits do not invalidate the
  cache)."""
  cpu = sm.cpu_signature() if cpu is None else cpu
  parts = (cpu, jax.lib.__version__, sm.source_hash(), repr(tuple(map(tuple, weight_shapes))),
           repr(ROW_GRID), repr(_code_fingerprint(choose.__code__)))
  if xla_transposed:  # (absent when off: the layers' keys do not depend on it)
    parts += ("XLA against [N, K]",)
  return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _cache_path(key: str) -> str:
  return os.path.join(sm.cache_dir(), f"matmul-policy-{key}.json")


def policy_for(params: dict, tie_embeddings: bool,
               measure_fn: Callable[..., dict] = measure, part: str = LAYERS,
               load_fn: Optional[Callable[[], float]] = None) -> MatmulPolicy:
  """The matmul policy for ``part`` of this model here (its decoder layers' projections or its
  output head, ``PARTS``): ``SPECJAX_MATMUL``, else the cached or new measurement
  (``measure_fn(weights, xla_transposed=...)``). Logs the decision (a warning when it
  measures: once per machine and part; for both, about 30 s on a 2-core Intel Xeon when the
  kernel had two modes to time, under 30 s on a 2-core Zen 5 with three).

  A measurement during which ``load_fn()`` (default ``other_work``: other processes'
  runnable threads per CPU, read before and after) reached ``BUSY`` is cached as
  ``contended``; a cached contended one is used while the machine is still busy and measured
  again once it is quiet."""
  if part not in PARTS:
    raise ValueError(f"part must be one of {PARTS}, got {part!r}")
  choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
  if choice not in CHOICES:
    raise ValueError(f"{ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
  if choice == "xla":
    return dataclasses.replace(XLA, source=f"{ENV}=xla")
  if not sm.available():
    if choice == "kernel":
      raise RuntimeError(f"{ENV}=kernel needs the streaming matmul kernel: "
                         f"{sm.unavailable_reason()}")
    if jax.default_backend() == "cpu":
      _log.warning("specjax: using XLA's dot (the streaming kernel is unavailable: %s)",
                   sm.unavailable_reason())
    return dataclasses.replace(XLA, source=f"kernel unavailable: {sm.unavailable_reason()}")
  if any(np.asarray(layer[n]).dtype != np.float32 for layer in params["layers"]
         for n in ("wqkv", "wo", "w_gate_up", "w_down")):
    return dataclasses.replace(XLA, source="weights are not float32")
  if choice == "kernel":
    return dataclasses.replace(KERNEL, source=f"{ENV}=kernel")
  weights = projection_weights(params, tie_embeddings, part=part)
  transposed = part == HEAD and tie_embeddings  # lm_head contracts against embed [V, D]
  path = _cache_path(cache_key([w.shape for w in weights], xla_transposed=transposed))
  try:
    with open(path) as f:
      cached = MatmulPolicy.from_json(json.load(f))
  except (OSError, ValueError, KeyError, TypeError):
    cached = None
  load_fn = load_fn or other_work
  load = load_fn() if cached is None or cached.contended else 0.0
  if cached is not None and (not cached.contended or load >= BUSY):
    _log.info("specjax matmul, %s (%s, kernel %s): %s", part, sm.cpu_model(), sm.isa(),
              cached.describe())
    return cached
  _log.warning("specjax: timing the streaming kernel against XLA's dot on this CPU (%s, "
               "kernel path %s) for the %s%s; once per machine, cached in %s", sm.cpu_model(),
               sm.isa(), part, " again, on a quiet machine" if cached else "", path)
  timings = measure_fn(weights, xla_transposed=transposed)
  load = max(load, load_fn())
  policy = dataclasses.replace(
      choose(timings, source=f"measured on {sm.cpu_model()}, {sm.isa()}",
             prefetch_rows=sm.prefetch_rows()), contended=load >= BUSY)
  files.write_text(path, json.dumps(policy.to_json()))  # concurrent processes: whole files
  _log.warning("specjax matmul, %s: %s", part, policy.describe())
  if policy.contended:
    _log.warning("specjax matmul, %s: timed while %.1f other threads per CPU were runnable; "
                 "kept provisionally, timed again by the next process to start on a quiet "
                 "machine", part, load)
  return policy
