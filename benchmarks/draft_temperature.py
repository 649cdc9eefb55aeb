"""How the draft's own temperature moves acceptance in sampled decoding (lossless either way).

Usage:
  python -m benchmarks.draft_temperature [--temperatures 0.5,1] [--ratios 0,0.6,0.8,0.9,1,1.2]
      [--gamma 3] [--prompts 10] [--seeds 2] [--new_tokens 128] [--draft eagle]
      [--out benchmarks/results/draft_temperature.md]

Speculative sampling is exact for any draft law q: the verifier reads the q each draft was
drawn from (``SpeculativeDecoder.draft_sampler``). The usual rule draws the drafts at the
target's temperature T; this benchmark draws them at ratio × T (ratio 0: the drafter's
argmax, point masses) and reports α = E[β] with β = Σ min(p, q) per scored draft, the accept
rate and tokens per target call, for a chain of ``--gamma`` on two prompt sets: training-side
prompts (where a ratio would be chosen) and the held-out evaluation prompts (where it is
judged). The draft's cost does not depend on its temperature, so at equal step costs the
speedup moves with tokens per call. Untimed; the prompts of a set are decoded as one batch.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from benchmarks.common import (acceptance, command_line, prompt_sets, provenance,
                               write_markdown)
from experiments.machine import probe_output_dir
from experiments.models import load_draft, load_target
from specjax.sampling import make_sampler, scale_temperature
from specjax.speculative import SpeculativeDecoder

TEMPS = flags.DEFINE_list("temperatures", ["0.5", "1"], "target temperatures (> 0)")
RATIOS = flags.DEFINE_list("ratios", ["0", "0.6", "0.8", "0.9", "1", "1.2"],
                           "draft temperature / target temperature (0: argmax drafts)")
GAMMA = flags.DEFINE_integer("gamma", 3, "chain length γ")
PROMPTS = flags.DEFINE_integer("prompts", 10, "prompts of each set")
SEEDS = flags.DEFINE_integer("seeds", 2, "seeds (each decodes every prompt once)")
NEW = flags.DEFINE_integer("new_tokens", 128, "tokens per prompt")
DRAFT = flags.DEFINE_string("draft", "eagle", "draft (experiments.models.load_draft spec)")
OUT = flags.DEFINE_string("out", "benchmarks/results/draft_temperature.md", "markdown output")


def _floats(flag) -> list[float]:
  """A non-empty list flag of numbers, or a usage error naming the flag."""
  try:
    values = [float(x) for x in flag.value]
  except ValueError as e:
    raise app.UsageError(f"--{flag.name} takes numbers: {e}") from None
  if not values:
    raise app.UsageError(f"--{flag.name} must list at least one number")
  return values


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  temps, ratios = _floats(TEMPS), _floats(RATIOS)
  if min(temps) <= 0:
    raise app.UsageError("--temperatures must be > 0: greedy decoding drafts the argmax")
  if min(ratios) < 0:
    raise app.UsageError(f"--ratios must list numbers >= 0, got {RATIOS.value}")
  for flag in (GAMMA, PROMPTS, SEEDS, NEW):
    if flag.value < 1:
      raise app.UsageError(f"--{flag.name} must be >= 1")
  for temp in temps:
    for ratio in ratios:
      try:
        scale_temperature(make_sampler(temp), ratio)
      except ValueError as e:
        raise app.UsageError(f"--ratios={ratio:g} at T = {temp:g}: {e}") from None
  probe_output_dir(os.path.dirname(OUT.value) or ".")
  target = load_target("smollm2")
  draft = load_draft(DRAFT.value, target, lambda: [])
  sets = prompt_sets(target, PROMPTS.value)
  start = time.perf_counter()
  command = command_line("draft_temperature", (TEMPS, RATIOS, GAMMA, PROMPTS, SEEDS, NEW, DRAFT))
  head = ["# Draft temperature: acceptance when the draft samples at ratio × T", "",
          f"Command: `{command}`  ",
          f"{provenance()}; draft `{draft.name}` ({draft.note}); chain γ = {GAMMA.value}; "
          f"{PROMPTS.value} prompts a set, {NEW.value} new tokens (EOS ignored), "
          f"{SEEDS.value} seeds; untimed.", "",
          "Lossless at every ratio (the verifier reads the q each draft was drawn from). "
          "α = Σβ / scored drafts, β = Σₓ min(p, q); ratio 0 drafts the drafter's argmax "
          "(β = p(draft)). Best per set in bold.", ""]
  body = []
  for temp in temps:
    sampler = make_sampler(temp)
    results = {}
    for ratio in ratios:
      ds = scale_temperature(sampler, ratio) if ratio != 1 else None  # 1: the usual rule
      dec = SpeculativeDecoder(target.cfg, draft.drafter, gamma=GAMMA.value, sampler=sampler,
                               draft_sampler=ds, eos_ids=())
      for name, prompts in sets.items():
        results[name, ratio] = acceptance(dec, target, draft, prompts, NEW.value, SEEDS.value)
    body += [f"## T = {temp:g}", "",
             "| draft temperature | " + " | ".join(
                 f"{n}: α | {n}: accept rate | {n}: tokens/call" for n in sets) + " |",
             "|---|" + "---|---|---|" * len(sets)]
    best = {n: max(ratios, key=lambda r: results[n, r]["tokens_per_call"]) for n in sets}
    for ratio in ratios:
      label = "argmax (point masses)" if ratio == 0 else f"{ratio:g} × T = {ratio * temp:g}"
      cells = []
      for n in sets:
        r = results[n, ratio]
        tpc = f"{r['tokens_per_call']:.3f}"
        cells += [f"{r['alpha']:.3f}", f"{r['accept']:.3f}",
                  f"**{tpc}**" if ratio == best[n] else tpc]
      body.append(f"| {label}{' (usual)' if ratio == 1 else ''} | " + " | ".join(cells) + " |")
    body.append("")
    write_markdown(OUT.value, head + body, quiet=True)
  body.append(f"{time.perf_counter() - start:.0f} s.")
  write_markdown(OUT.value, head + body)


if __name__ == "__main__":
  app.run(main)
