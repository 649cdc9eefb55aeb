"""Helpers shared by the benchmark scripts: timing, a warm forward, the provenance line and
the markdown report. The machine's description and the output-directory probe are
``experiments.machine``'s (experiments use them too, and stand below benchmarks/)."""

from __future__ import annotations

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
  (a ``dtype`` cache of at least ``min_cache`` slots; the forward writes the new tokens' keys
  and values into it, as decoding does)."""
  cache = kvc.init_cache(cfg, batch_size, max(min_cache, context + num_tokens),
                         jnp.dtype(dtype)).with_lengths(
      jnp.full((batch_size,), context, jnp.int32))
  tok = jnp.ones((batch_size, num_tokens), jnp.int32)
  pos = jnp.broadcast_to(context + jnp.arange(num_tokens), (batch_size, num_tokens))
  return lambda: forward(params, cfg, tok, pos, cache,
                         attention_impl=attention_impl).logits.block_until_ready()


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


def write_markdown(path: str, lines: list[str]) -> None:
  """Prints the report and writes it to ``path``."""
  text = "\n".join(lines) + "\n"
  print(text)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text)
