"""Helpers shared by the benchmark scripts: timing, a warm forward, the provenance line and
the markdown report. The machine's description and the output-directory probe are
``experiments.machine``'s (experiments use them too, and stand below benchmarks/)."""

from __future__ import annotations

import functools
import glob
import os
import re
import subprocess
import tempfile
import time
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from experiments.machine import cpu_info, describe_cpu
from specjax import files
from specjax import kv_cache as kvc
from specjax.model import forward


def median_time(fn: Callable[[], object], repeats: int = 15) -> float:
  """Median seconds of ``fn()`` after one warm-up call."""
  return float(np.median(interleaved_times({0: fn}, repeats)[0]))


def interleaved_times(fns: dict, repeats: int, seconds: Optional[float] = None) -> dict:
  """{key: [seconds of each call]} of ``repeats`` rounds that call every ``fns[key]()`` in
  turn, after one warm-up call each (compilation), so that load from elsewhere on the
  machine hits them alike; the i-th entries of the lists are one round's. With ``seconds``,
  rounds run until that much time has passed instead (at least one)."""
  for f in fns.values():
    f()
  runs = {key: [] for key in fns}
  end = None if seconds is None else time.time() + seconds
  done = 0
  while (done < repeats) if end is None else (done == 0 or time.time() < end):
    done += 1
    for key, f in fns.items():
      start = time.perf_counter()
      f()
      runs[key].append(time.perf_counter() - start)
  return runs


def split_spells(t1: np.ndarray) -> tuple[np.ndarray, float]:
  """(a bool mask of the fast rounds, the threshold) of rounds timed ``t1`` (a one-token
  forward, or the round's whole time): fast below the midpoint of the 10th and 90th
  percentiles. Some hosts (the Zen 5 EPYCs) switch between a fast and a slow memory spell for
  seconds to a minute (``benchmarks.bandwidth_spells``); a ratio of two timings is only
  meaningful within one spell."""
  threshold = float(np.mean(np.percentile(t1, [10, 90])))
  return np.asarray(t1) < threshold, threshold


def spell_tables(runs: dict, rows: list[int], names: list[str], flops: float,
                 spells: bool) -> list[str]:
  """``kernel_ab``'s markdown tables of ``runs`` ({(M, version index): [seconds of each
  round]}): one for all rounds, or with ``spells`` one per memory spell (``split_spells`` of
  each round's total time), each with every version's median [min, max] and its ratio to the
  first's. (Here, not in the benchmark, so that tests can import it: benchmark modules
  define absl flags of the same names and cannot be imported together.)"""
  rounds = len(runs[rows[0], 0])
  lines = []
  if spells:
    fast, threshold = split_spells(np.sum(list(runs.values()), axis=0))
    lines += ["", f"A round is in the fast spell when its calls took under {threshold:.2f} s "
              "in all (`common.split_spells`)."]
    parts = [(f"Fast spell ({int(fast.sum())} rounds)", fast),
             (f"Slow spell ({int((~fast).sum())} rounds)", ~fast)]
  else:
    parts = [(None, np.ones(rounds, bool))]
  for title, sel in parts:
    lines += [""] + ([f"## {title}", ""] if title else [])
    if not sel.any():
      lines.append("No rounds.")
      continue
    lines += ["| M | " + " | ".join(f"{n} ms" for n in names) + " | "
              + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + f" | {names[0]} GFLOP/s |",
              "|---" * (2 * len(names) + 1) + "|"]
    for m in rows:
      ts = [np.asarray(runs[m, i])[sel] for i in range(len(names))]
      med = [np.median(t) for t in ts]
      cells = [f"{v * 1e3:.1f} [{t.min() * 1e3:.1f}, {t.max() * 1e3:.1f}]"
               for v, t in zip(med, ts)]
      lines.append(f"| {m} | " + " | ".join(cells) + " | "
                   + " | ".join(f"{v / med[0]:.2f}" for v in med[1:])
                   + f" | {flops * m / med[0] / 1e9:.0f} |")
  return lines


def forward_fn(cfg, params, num_tokens: int, context: int = 200, batch_size: int = 1, *,
               dtype=jnp.float32, attention_impl: str = "auto",
               min_cache: int = 256) -> Callable[[], object]:
  """A warm-callable forward over ``num_tokens`` new tokens per row after ``context`` cached
  (a ``dtype`` cache of at least ``min_cache`` slots). As in decoding, each call writes the
  new tokens' keys and values into the cache in place: the cache is donated and the
  returned one (its lengths reset to ``context``) is the next call's, so where the backend
  honours donation no call copies the whole cache (not timed against the copying version)."""
  size = max(min_cache, context + num_tokens)
  lengths = jnp.full((batch_size,), context, jnp.int32)
  tok = jnp.ones((batch_size, num_tokens), jnp.int32)
  pos = jnp.broadcast_to(context + jnp.arange(num_tokens), (batch_size, num_tokens))
  state = [kvc.init_cache(cfg, batch_size, size, jnp.dtype(dtype)).with_lengths(lengths)]

  def run():
    state[0], logits = _forward_in_place(params, cfg, tok, pos, state[0], attention_impl)
    logits.block_until_ready()

  # The compiled program's text, for ``op_times`` (which custom call each thunk runs).
  run.hlo_text = lambda: _forward_in_place.lower(  # type: ignore[attr-defined]
      params, cfg, tok, pos, state[0], attention_impl).compile().as_text()
  return run


@functools.partial(jax.jit, static_argnames=("cfg", "attention_impl"), donate_argnames="cache")
def _forward_in_place(params, cfg, tok, pos, cache, attention_impl):
  out = forward(params, cfg, tok, pos, cache, attention_impl=attention_impl)
  return out.cache.with_lengths(cache.lengths), out.logits  # lengths back to the context


def op_times(fn: Callable[[], object], hlo_text: str, repeats: int = 5) -> dict[str, float]:
  """Seconds per call of ``fn`` (one jitted program, warm) spent in each kind of operation,
  from a ``jax.profiler`` trace of ``repeats`` calls: each custom call under its target's
  name (the CPU kernels), "XLA ops" for the rest of the program's thunks, and "between
  ops" for the executor's time outside them. ``hlo_text``: the compiled program
  (``forward_fn(...).hlo_text()``), which names each custom call's target."""
  return op_profile(fn, hlo_text, repeats).kinds


class OpProfile(NamedTuple):
  """Seconds per call by kind of operation (``op_times``) and by operation (HLO name)."""
  kinds: dict[str, float]
  ops: dict[str, float]


def op_profile(fn: Callable[[], object], hlo_text: str, repeats: int = 5,
               module: Optional[str] = None) -> OpProfile:
  """``op_times``, with each operation's own time beside the kinds' (``OpProfile``).
  ``module``: count only the thunks of the XLA module of this name (e.g. "jit_run": the
  decoding loop, without the prefill that the same call runs first), and no "between ops"
  (the executors' spans, nested in loops, name no module). A thunk's time excludes the
  thunks nested in it (a while loop's, its body's)."""
  target = dict(re.findall(r"%?([^\s%]+) = [^\n]*custom_call_target=\"([^\"]+)\"", hlo_text))
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory):
      for _ in range(repeats):
        fn()
    path = max(glob.glob(f"{directory}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)
    data = jax.profiler.ProfileData.from_file(path)
  totals: dict[str, float] = {}
  ops: dict[str, float] = {}
  executed = 0.0
  for plane in data.planes:
    for line in plane.lines:  # an executor's thread: its runs and the thunks inside them
      events = list(line.events)
      spans = [e.duration_ns for e in events if e.name == "ThunkExecutor::Execute"]
      if module is None and not spans:
        continue  # a whole program's breakdown reads its executors' threads only
      executed += sum(spans)
      for op, seconds in _exclusive_ns(events, module).items():
        kind = target.get(op, "XLA ops")
        totals[kind] = totals.get(kind, 0.0) + seconds
        ops[op] = ops.get(op, 0.0) + seconds
  if module is None:
    totals["between ops"] = max(0.0, executed - sum(totals.values()))
  return OpProfile(kinds={k: v / repeats / 1e9 for k, v in totals.items()},
                   ops={k: v / repeats / 1e9 for k, v in ops.items()})


def _exclusive_ns(events, module: Optional[str]) -> dict[str, float]:
  """{HLO op: nanoseconds} of a trace line's thunks (of ``module``, or all), each without the
  thunks nested in it: a while loop's thunk spans its body's, which are traced too."""
  thunks = sorted(((e.start_ns, e.start_ns + e.duration_ns, dict(e.stats).get("hlo_op"))
                   for e in events
                   if dict(e.stats).get("hlo_op") is not None and not e.name.startswith("end: ")
                   and module in (None, dict(e.stats).get("hlo_module"))),
                  key=lambda t: (t[0], -t[1]))
  out: dict[str, float] = {}
  stack: list[tuple[float, str]] = []  # (end, op) of the thunks that enclose the current one
  for start, end, op in thunks:
    while stack and stack[-1][0] <= start:
      stack.pop()
    if stack:  # nested: its time is its parent's no more
      out[stack[-1][1]] = out.get(stack[-1][1], 0.0) - (end - start)
    out[op] = out.get(op, 0.0) + (end - start)
    stack.append((end, op))
  return out


def forward_time(cfg, params, num_tokens: int, context: int = 200, repeats: int = 15,
                 batch_size: int = 1) -> float:
  """Median seconds of one forward (``forward_fn``)."""
  return median_time(forward_fn(cfg, params, num_tokens, context, batch_size), repeats)


def provenance() -> str:
  """git revision, CPU, cores and library versions, for the line under a results title."""
  rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True).stdout.strip()
  return (f"git {rev}, {describe_cpu(cpu_info())}, {os.cpu_count()} cores, "
          f"jax {jax.__version__}")


def write_markdown(path: str, lines: list[str], quiet: bool = False) -> None:
  """Writes the report to ``path`` (and prints it, unless ``quiet``: a table rewritten
  after every row, so that a run cut short keeps what it measured)."""
  text = "\n".join(lines) + "\n"
  if not quiet:
    print(text)
  files.write_text(path, text)


def command_line(module: str, flag_list) -> str:
  """``python -m benchmarks.<module> --flag=value ...`` for the results' header (lists
  comma-joined)."""
  return f"python -m benchmarks.{module} " + " ".join(
      f"--{f.name}={','.join(f.value) if isinstance(f.value, list) else f.value}"
      for f in flag_list)


def prompt_sets(target, num: int) -> dict[str, list[list[int]]]:
  """``num`` training-side prompts (where a setting would be chosen) and ``num`` held-out
  evaluation prompts (where it is judged), encoded for ``target``."""
  from experiments.prompts import default_prompts, training_prompts
  return {"training-side": [target.encode(t) for t in training_prompts(num)],
          "held-out": [target.encode(p.text) for p in default_prompts(num)]}


def held_out_setup(draft_spec: str, num: int):
  """(target, draft, evals, prompts): the embedded SmolLM2 with the draft ``draft_spec``
  (``experiments.models.load_draft``), ``num`` held-out prompts and their encodings."""
  from experiments.models import load_draft, load_target
  from experiments.prompts import default_prompts
  target = load_target("smollm2")
  draft = load_draft(draft_spec, target, lambda: [])
  evals = default_prompts(num)
  return target, draft, evals, [target.encode(p.text) for p in evals]


def realised_tokens_per_call(dec, target, draft, prompts, new: int, seed: int) -> float:
  """Emitted tokens per target call of one ``dec`` run of ``prompts`` (one batch), every row
  to exactly ``new`` tokens (``dec`` without EOS)."""
  out = dec.generate(target.params, draft.params, prompts, new, seed=seed)
  assert np.all(out.num_generated == new)
  return float(out.metrics()["tokens_per_call"])


def paired_step_sums(dec, target, draft, prompts, new: int, seed: int, per_step,
                     size: int) -> tuple[float, np.ndarray]:
  """Decodes ``prompts`` (one batch) with ``dec`` step by step, every row to exactly ``new``
  tokens (``dec`` without EOS), and sums the jitted ``per_step(proposal, scores, done,
  key)`` -> [size] over the steps: what other rules would have done with the very drafts
  and target scores this run verified. ``key`` is a fresh key per step, from a stream apart
  from the decoder's (which the run's own draws keep). Returns (the run's realised tokens
  per target call, the sums)."""
  propose, verify, finish = jax.jit(dec.propose), jax.jit(dec.verify), jax.jit(dec.finish)
  state, prompt_lens = dec.prepare(target.params, draft.params, prompts, new, seed=seed)
  sums = np.zeros(size)
  key = jax.random.PRNGKey(seed + 1)
  while not bool(jnp.all(state.done)):
    rng, k_draft, k_accept = jax.random.split(state.rng, 3)
    key, k_step = jax.random.split(key)
    proposal, draft_state = propose(draft.params, state, k_draft)
    scores = verify(target.params, state, proposal)
    sums += np.asarray(per_step(proposal, scores, state.done, k_step))
    state = finish(state, proposal, scores, k_accept, draft_state, rng)
  c = jax.device_get(state.counters)
  assert np.all(np.asarray(state.seq_lens) - np.asarray(prompt_lens) == new)
  return float(np.sum(c.emitted) / np.sum(c.target_calls)), sums


def acceptance(dec, target, draft, prompts, new: int, seeds: int) -> dict:
  """α (Σβ / scored drafts; None where nothing was scored: trees), accept rate and tokens
  per call of ``dec`` over ``seeds`` decodes of ``prompts`` (one batch)."""
  total = {k: 0.0 for k in ("beta_sum", "beta_count", "accepted", "drafted", "emitted",
                            "target_calls")}
  for seed in range(seeds):
    out = dec.generate(target.params, draft.params, prompts, new, seed=1000 * seed,
                       cache_size=max(map(len, prompts)) + new + dec.cache_headroom)
    for k in total:
      total[k] += float(np.sum(out.per_row[k]))
  return dict(alpha=total["beta_sum"] / total["beta_count"] if total["beta_count"] else None,
              accept=total["accepted"] / max(total["drafted"], 1),
              tokens_per_call=total["emitted"] / max(total["target_calls"], 1))


def _number_list(flag, cast, kind: str, least) -> list:
  """A non-empty list flag of ``kind`` >= ``least``, or SystemExit naming the flag."""
  try:
    values = [cast(x) for x in flag.value]
  except ValueError as e:
    raise SystemExit(f"--{flag.name} takes {kind}: {e}") from None
  if not values or min(values) < least:
    raise SystemExit(f"--{flag.name} must list {kind} >= {least}, got {flag.value}")
  return values


def temperature_list(flag) -> list[float]:
  """A non-empty list flag of temperatures >= 0 (0: greedy), or SystemExit naming the flag
  (before anything is built)."""
  return _number_list(flag, float, "numbers", 0)


def int_list(flag, least: int = 1) -> list[int]:
  """A non-empty list flag of integers >= ``least``, or SystemExit naming the flag (before
  anything is built)."""
  return _number_list(flag, int, "integers", least)
