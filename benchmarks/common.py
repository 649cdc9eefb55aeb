"""Helpers shared by the benchmark scripts: timing, a warm forward, the provenance line and
the markdown report. The machine's description and the output-directory probe are
``experiments.machine``'s (experiments use them too, and stand below benchmarks/)."""

from __future__ import annotations

import functools
import os
import subprocess
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments.machine import cpu_info, describe_cpu
from specjax import kv_cache as kvc
from specjax.model import forward


def median_time(fn: Callable[[], object], repeats: int = 15) -> float:
  """Median seconds of ``fn()`` after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


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

  return run


@functools.partial(jax.jit, static_argnames=("cfg", "attention_impl"), donate_argnames="cache")
def _forward_in_place(params, cfg, tok, pos, cache, attention_impl):
  out = forward(params, cfg, tok, pos, cache, attention_impl=attention_impl)
  return out.cache.with_lengths(cache.lengths), out.logits  # lengths back to the context


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
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path + ".tmp", "w") as f:
    f.write(text)
  os.replace(path + ".tmp", path)


def int_list(flag) -> list[int]:
  """A non-empty list flag of integers >= 1, or SystemExit naming the flag (before anything
  is built)."""
  try:
    values = [int(x) for x in flag.value]
  except ValueError as e:
    raise SystemExit(f"--{flag.name} takes integers: {e}") from None
  if not values or min(values) < 1:
    raise SystemExit(f"--{flag.name} must list integers >= 1, got {flag.value}")
  return values
