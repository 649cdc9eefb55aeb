"""α of the shipped token draft by how it reads input ids outside its vocabulary.

Usage:
  python -m benchmarks.draft_input [--prompts 20] [--gamma 4] [--new_tokens 64]
      [--out benchmarks/results/draft_input.md]

The shipped token draft (``specjax/assets/smollm2_draft``) has an 11,008-row
vocabulary. Input ids outside it are read either through the shipped
nearest-embedding ``input_map`` (the row of the most similar in-map token), or
through the target's own row (``ModelDrafter.make_params(input_embed=...)``,
full-vocabulary input: what ``default_drafter(target_embed=...)`` and the
experiments use). A third variant, the target's rows for every id, shows
whether the draft's trained rows matter. Real speculative decoding (chain γ,
batches of 4) on the experiments' held-out prompts, T = 0 and T = 1, same seeds.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from benchmarks.common import provenance, write_markdown
from experiments.machine import probe_output_dir
from experiments.models import load_target
from experiments.prompts import default_prompts
from specjax.drafters import ModelDrafter
from specjax.drafts import load_default_draft
from specjax.sampling import make_sampler
from specjax.speculative import SpeculativeDecoder

PROMPTS = flags.DEFINE_integer("prompts", 20, "held-out prompts (round-robin over categories)")
GAMMA = flags.DEFINE_integer("gamma", 4, "chain length")
NEW = flags.DEFINE_integer("new_tokens", 64, "tokens generated per prompt")
OUT = flags.DEFINE_string("out", "benchmarks/results/draft_input.md", "markdown output")


def main(_):
  probe_output_dir(OUT.value.rsplit("/", 1)[0] or ".")
  target = load_target("smollm2")
  v = target.cfg.vocab_size
  dcfg, dparams, vocab_map, input_map = load_default_draft(target.tokenizer, v,
                                                           with_input_map=True)
  drafter = ModelDrafter(dcfg, target_vocab_size=v)
  embed = target.params["embed"]
  full = drafter.make_params(dparams, vocab_map, input_embed=embed)
  variants = {
      "nearest in-map row (`input_map`, shipped)": drafter.make_params(dparams, vocab_map,
                                                                      input_map=input_map),
      "target's row outside the map (full-vocabulary input)": full,
      "target's rows for every id": dict(full, model={k: x for k, x in full["model"].items()
                                                       if k != "input_rows"}),
  }
  prompts = [target.encode(p.text) for p in default_prompts(PROMPTS.value)]
  batches = [prompts[i:i + 4] for i in range(0, len(prompts), 4)]
  in_map = np.zeros(v, bool)
  in_map[vocab_map] = True
  outside = 1 - in_map[np.concatenate([np.asarray(p) for p in prompts])].mean()
  lines = ["# Token draft: how input ids outside its vocabulary are read", "",
           f"{provenance()}; shipped token draft ({dcfg.vocab_size} rows); {len(prompts)} "
           f"held-out prompts in batches of 4, {NEW.value} new tokens, chain γ = {GAMMA.value}, "
           f"EOS ignored; {outside:.1%} of the prompt tokens are outside the draft's "
           "vocabulary.", "",
           f"Command: `python -m benchmarks.draft_input --prompts={PROMPTS.value} "
           f"--gamma={GAMMA.value} --new_tokens={NEW.value}`", "",
           "| T | input of out-of-map ids | α | accept rate | tokens / call | α per batch |",
           "|---|---|---|---|---|---|"]
  for temp in (0.0, 1.0):
    for name, dp in variants.items():
      dec = SpeculativeDecoder(target.cfg, drafter, gamma=GAMMA.value,
                               sampler=make_sampler(temp), eos_ids=())
      alphas, toks, calls, acc, drafted = [], 0, 0, 0, 0
      for i, b in enumerate(batches):
        m = dec.generate(target.params, dp, b, NEW.value, seed=i, cache_size=512).metrics()
        alphas.append(m["alpha"])
        toks, calls = toks + m["tokens"], calls + m["target_calls"]
        acc, drafted = acc + m["accepted"], drafted + m["drafted"]
      lines.append(f"| {temp:g} | {name} | **{np.mean(alphas):.3f}** | {acc / drafted:.3f} | "
                   f"{toks / calls:.2f} | {', '.join(f'{a:.3f}' for a in alphas)} |")
  write_markdown(OUT.value, lines + [""])


if __name__ == "__main__":
  app.run(main)
