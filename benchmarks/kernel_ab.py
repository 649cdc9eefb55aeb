"""A/B versions of the streaming-matmul source on the embedded model's whole matmul chain.

Usage:
  python -m benchmarks.kernel_ab --sources a.cc,a.cc:prefetch,b.cc[,...]
      [--rows 1,3,5,9,17,33] [--repeats 7 | --seconds 120] [--spells]
      [--out benchmarks/results/kernel_ab.md]

Each source is built like ``specjax/kernels/streaming_matmul.cc`` (same
compiler flags as the "native" variant) into its own library and FFI target,
so every version runs in one process on the same weights: the projections of
all SmolLM2-135M layers and the head, in forward order (``policy._chain``). The
versions are timed alternately per row count M (load from elsewhere hits them
alike); medians and ranges are reported. Every version must give bit-identical
results to the first (the kernel's contract: one FMA per k, in k order), else
the run stops. ``path:prefetch`` runs a source with its ``prefetch`` attribute
on (1: hinted into L2), ``path:nta`` with mode 2 (non-temporal; only sources that
have it). To try a change: copy the source, edit the copy, pass both.

``--seconds`` runs rounds (every version at every M once) for that long instead of
``--repeats`` rounds. ``--spells`` splits the rounds into the host's fast and slow memory
spells by each round's total time (``common.split_spells``; every version has one call at
every M in each round, so the split favours none) and reports each spell apart: on the Zen 5
EPYCs a variant can win in one spell and lose in the other.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.common import interleaved_times, provenance, spell_tables, write_markdown
from specjax.kernels import policy as pol
from specjax.kernels import streaming_matmul as sm
from specjax.kernels.packed import unpack_params
from specjax.loaders import load_model

SOURCES = flags.DEFINE_list("sources", None, "kernel sources to compare (the first is the base)")
ROWS = flags.DEFINE_list("rows", ["1", "3", "5", "9", "17", "33"], "row counts M")
REPEATS = flags.DEFINE_integer("repeats", 7, "timed calls per version and M", lower_bound=1)
SECONDS = flags.DEFINE_float("seconds", None, "run rounds for this long instead of --repeats",
                             lower_bound=1.0)
SPELLS = flags.DEFINE_bool("spells", False, "report the fast and slow memory spells apart "
                           "(split by each round's total time)")
OUT = flags.DEFINE_string("out", "benchmarks/results/kernel_ab.md", "markdown output")


def build(source: str, name: str, workdir: str):
  """Compiles ``source`` and registers it as FFI target ``name``; returns its
  matmul(x, panels, prefetch) and its panel width (``DEFAULT_PANEL`` for sources that do not
  say)."""
  lib_path = os.path.join(workdir, f"{name}.so")
  try:
    sm.build_library(lib_path, "native", source)  # the library's own compiler and flags
  except RuntimeError as e:
    raise SystemExit(f"building {source} failed:\n{e}") from None
  lib = ctypes.cdll.LoadLibrary(lib_path)
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.SpecjaxStreamingMatmul), platform="cpu")
  width = (lib.SpecjaxStreamingMatmulPanel() if hasattr(lib, "SpecjaxStreamingMatmulPanel")
           else sm.DEFAULT_PANEL)  # sources from before the width was the library's

  def matmul(x, panels, prefetch=False):
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * width), jnp.float32)
    return jax.ffi.ffi_call(name, out)(x, panels, prefetch=np.int32(prefetch))

  return matmul, width


def main(_):
  if not SOURCES.value:
    raise SystemExit("--sources needs at least one kernel source")
  suffixes = {":prefetch": 1, ":nta": 2}
  entries = []
  for s in SOURCES.value:
    mode = next((v for k, v in suffixes.items() if s.endswith(k)), 0)
    entries.append((s.removesuffix(":prefetch").removesuffix(":nta"), mode))
  missing = [path for path, _ in entries if not os.path.isfile(path)]
  if missing:
    raise SystemExit(f"no such source: {', '.join(missing)}")
  old = sorted({path for path, mode in entries if mode == 2
                and "kPrefetchNta" not in open(path).read()})
  if old:  # a source from before the modes reads any non-zero attribute as "on"
    raise SystemExit(f"{', '.join(old)} has no non-temporal mode (kPrefetchNta): use :prefetch")
  try:
    rows = [int(m) for m in ROWS.value]
  except ValueError:
    rows = [0]
  if min(rows) < 1:
    raise SystemExit(f"--rows must list integers >= 1, got {','.join(ROWS.value)}")
  cfg, params = load_model(packed=False)
  weights = pol.projection_weights(unpack_params(params, cfg.tie_embeddings),
                                   cfg.tie_embeddings, num_layers=cfg.num_layers)
  ks = [w.shape[0] for w in weights]
  with tempfile.TemporaryDirectory() as tmp:
    built = {path: build(path, f"specjax_ab_{i}", tmp)
             for i, path in enumerate(dict.fromkeys(path for path, _ in entries))}
    widths = sorted({width for _, width in built.values()})
    packed = {c: [jnp.asarray(sm.to_panels(w, width=c)) for w in weights] for c in widths}
    fns = [pol._chain(functools.partial(built[path][0], prefetch=pf), ks) for path, pf in entries]
    panels = [packed[built[path][1]] for path, _ in entries]
    rng = np.random.default_rng(0)
    xs = {m: jnp.asarray(rng.standard_normal((m, ks[0]), dtype=np.float32)) for m in rows}
    for m in rows:  # compile, and check the contract
      base = np.asarray(fns[0](panels[0], xs[m]))
      for s, f, p in zip(SOURCES.value[1:], fns[1:], panels[1:]):
        if not np.array_equal(base, np.asarray(f(p, xs[m]))):
          raise SystemExit(f"{s} is not bit-identical to {SOURCES.value[0]} at M = {m}")
    calls = {(m, i): functools.partial(lambda f, p, x: f(p, x).block_until_ready(), f,
                                       panels[i], xs[m])
             for m in rows for i, f in enumerate(fns)}
    runs = interleaved_times(calls, REPEATS.value, seconds=SECONDS.value)
  names = [os.path.basename(path) + {0: "", 1: " +prefetch", 2: " +nta"}[pf]
           for path, pf in entries]
  mb = sum(w.nbytes for w in weights) / 1e6
  flops = sum(w.size for w in weights) * 2
  rounds = len(runs[rows[0], 0])
  how = (f"{rounds} rounds in {SECONDS.value:g} s" if SECONDS.value
         else f"{REPEATS.value} alternating calls per version")
  flag_text = (f" --seconds={SECONDS.value:g}" if SECONDS.value else f" --repeats={REPEATS.value}")
  lines = ["# Streaming-matmul source A/B (SmolLM2-135M projections and head, f32)", "",
           f"{provenance()}; {len(weights)} matrices, {mb:.0f} MB; median [min, max] of "
           f"{how} (a round calls every version at every M in turn).", "",
           "Command: `python -m benchmarks.kernel_ab --sources=" + ",".join(SOURCES.value)
           + f" --rows={','.join(ROWS.value)}{flag_text}" + (" --spells" if SPELLS.value else "")
           + (f" --out={OUT.value}`" if OUT.value != OUT.default else "`")]
  lines += spell_tables(runs, rows, names, flops, SPELLS.value)
  write_markdown(OUT.value, lines)


if __name__ == "__main__":
  app.run(main)
