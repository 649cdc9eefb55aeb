"""Peer benchmark: specjax vs HF transformers on the same prompts, machine and run.

Usage:
  python -m benchmarks.peer [--gamma 4] [--new_tokens 96] [--num_prompts 6]
                            [--out benchmarks/results/peer.md]

Batch 1, SmolLM2-135M-Instruct in f32, every output forced to ``new_tokens``
(EOS ignored) so all methods produce the same number of tokens. Methods:
  HF `generate` greedy and sampled (T = 1); HF assisted generation with the
  shipped draft exported as an HF Llama directory (greedy, constant γ);
  HF prompt lookup (greedy, γ tokens); specjax autoregressive greedy and
  sampled; specjax speculative with the shipped draft (greedy and T = 1), with
  the shipped EAGLE-3 drafter (greedy and T = 1; HF has no counterpart), both
  drafts also at T = 1 with block verification (Sun et al. 2024) instead of
  token-wise rejection, and
  with prompt lookup (greedy); the shipped Medusa-1 heads on the tree their
  held-out accuracies give and the shipped trained early exit (greedy and T = 1;
  HF has neither); the draft-free methods, Jacobi decoding (window
  γ) and lookahead decoding (its default W, N, G tree), greedy and T = 1 (HF
  has neither); and the same drafters with token trees of
  ``--tree_nodes`` nodes (HF has none): an EAGLE-2 dynamic tree of depth γ
  and frontier 4 for the draft model and the EAGLE-3 drafter, and a
  prompt-lookup tree of ``--lookup_branches`` matches (chains of γ from the
  root). Each is warmed up once, then timed over all prompts. Reports
  tokens/s, ratios, and target calls per token for the speculative rows.
"""

from __future__ import annotations

import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags

import specjax
from benchmarks.common import provenance, write_markdown
from experiments.machine import OutputError, matmul_path, probe_output_dir
from specjax import drafts
from specjax.drafters import JacobiDrafter, LookaheadDrafter, PromptLookupDrafter
from specjax.loaders import chat_prompt, load_model, load_model_tokenizer, smollm2_gguf_path
from specjax.sampling import Greedy, Sampling
from specjax.speculative import SpeculativeDecoder
from specjax.speculative.tree import DynamicTree, TreeTopology

TEXTS = ["Write a Python function that merges two sorted lists.",
         "Summarise the plot of Romeo and Juliet in three sentences.",
         "What is the difference between a list and a tuple in Python?",
         "A train travels 120 km in 1.5 hours. What is its average speed?",
         "Rewrite this sentence in a formal tone: we gotta ship it by friday.",
         "Give me four tips for writing clear documentation.",
         "Explain recursion to a ten-year-old.",
         "Write a SQL query that counts orders per customer."]

# Bounds are checked when the flags are parsed, before anything loads.
GAMMA = flags.DEFINE_integer("gamma", 4, "draft length for every speculative method",
                             lower_bound=1)
NEW = flags.DEFINE_integer("new_tokens", 96, "tokens generated per prompt", lower_bound=1)
NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 6, "prompts (batch 1 each)", lower_bound=1,
                                   upper_bound=len(TEXTS))
TREE_NODES = flags.DEFINE_integer("tree_nodes", 8, "nodes of the dynamic trees (depth γ, "
                                  "frontier 4)", lower_bound=2)
LOOKUP_BRANCHES = flags.DEFINE_integer("lookup_branches", 3, "matches (root branches) of the "
                                       "prompt-lookup tree", lower_bound=2)
OUT = flags.DEFINE_string("out", "benchmarks/results/peer.md", "markdown output; its directory "
                          "is created and probed for writing before anything loads")


def _timed(fn, prompts) -> float:
  fn(prompts[0])  # warm-up (compilation / caches)
  start = time.perf_counter()
  for p in prompts:
    fn(p)
  return time.perf_counter() - start


def lookup_tree(branches: int, depth: int) -> TreeTopology:
  """``branches`` chains of ``depth`` nodes from the root, breadth-first."""
  return TreeTopology(tuple(-1 if i < branches else i - branches
                            for i in range(branches * depth)))


def dynamic_tree(num_nodes: int, depth: int) -> DynamicTree:
  """An EAGLE-2 tree of ``num_nodes`` nodes, depth <= γ (at most the nodes), frontier 4."""
  k, d = min(4, num_nodes), min(depth, num_nodes)
  return DynamicTree(k, d, min(num_nodes, k + (d - 1) * k * k))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if os.path.isdir(OUT.value):
    raise app.UsageError(f"--out {OUT.value!r} is a directory; give the markdown file's path")
  try:
    probe_output_dir(os.path.dirname(OUT.value) or ".", "--out")
  except OutputError as e:
    raise app.UsageError(str(e))
  n, g, nodes = NEW.value, GAMMA.value, TREE_NODES.value
  cfg, params = load_model()
  tok = load_model_tokenizer()
  prompts = [chat_prompt(tok, t) for t in TEXTS[:NUM_PROMPTS.value]]
  drafter, dp = drafts.default_drafter(tok, cfg.vocab_size, target_embed=params["embed"])
  eagle, eagle_dp = drafts.default_eagle_drafter(cfg, params, tok)
  medusa, medusa_dp = drafts.default_medusa_drafter(cfg, params, tok)
  exit_, exit_dp = drafts.default_exit_drafter(cfg, params, tok)
  dyn, lookup = dynamic_tree(nodes, g), lookup_tree(LOOKUP_BRANCHES.value, g)
  la = LookaheadDrafter(cfg.vocab_size)
  heads_tree = medusa.default_tree()
  cache = max(len(p) for p in prompts) + n + max(g, dyn.cache_headroom, lookup.cache_headroom,
                                                la.default_tree().cache_headroom,
                                                heads_tree.cache_headroom) + 8
  calls = {}  # speculative rows: target calls per generated token

  def sj_ar(sampler):
    return lambda p: specjax.generate(params, cfg, [p], n, sampler, eos_ids=(), cache_size=cache)

  def sj_spec(d, d_params, sampler, tree=None, name=None, verification="tokenwise"):
    dec = SpeculativeDecoder(cfg, d, gamma=None if tree else g, tree=tree, sampler=sampler,
                             eos_ids=(), verification=verification)

    def run(p):
      out = dec.generate(params, d_params, [p], n, cache_size=cache)
      if name:
        calls.setdefault(name, []).append(int(out.steps) / n)
      return out
    return run

  tree_name = f"EAGLE-2 tree N={dyn.num_nodes} (depth {dyn.depth}, top-{dyn.top_k})"
  lookup_name = f"{LOOKUP_BRANCHES.value}-branch tree (depth {g})"
  la_name = f"W={la.window}, N={la.ngram}, G={la.guesses}: {la.default_tree().num_nodes} nodes"
  la_greedy = f"specjax lookahead decoding, greedy ({la_name})"
  spec_rows = {
      f"specjax speculative, shipped draft, greedy (γ={g})": (drafter, dp, Greedy(), None),
      f"specjax speculative, shipped draft, T=1 (γ={g})": (drafter, dp, Sampling(1.0), None),
      f"specjax speculative, shipped draft, T=1, block verification (γ={g})": (
          drafter, dp, Sampling(1.0), None, "block"),
      f"specjax speculative, shipped draft, {tree_name}, greedy": (drafter, dp, Greedy(), dyn),
      f"specjax speculative, shipped draft, {tree_name}, T=1": (drafter, dp, Sampling(1.0), dyn),
      f"specjax speculative, EAGLE-3 drafter, greedy (γ={g})": (eagle, eagle_dp, Greedy(), None),
      f"specjax speculative, EAGLE-3 drafter, T=1 (γ={g})": (eagle, eagle_dp, Sampling(1.0), None),
      f"specjax speculative, EAGLE-3 drafter, T=1, block verification (γ={g})": (
          eagle, eagle_dp, Sampling(1.0), None, "block"),
      f"specjax speculative, EAGLE-3 drafter, {tree_name}, greedy": (eagle, eagle_dp, Greedy(), dyn),
      f"specjax speculative, EAGLE-3 drafter, {tree_name}, T=1": (
          eagle, eagle_dp, Sampling(1.0), dyn),
      f"specjax speculative, prompt lookup, greedy (γ={g})": (
          PromptLookupDrafter(cfg.vocab_size), (), Greedy(), None),
      f"specjax speculative, prompt lookup, {lookup_name}, greedy": (
          PromptLookupDrafter(cfg.vocab_size), (), Greedy(), lookup),
      f"specjax Jacobi decoding, greedy (window {g})": (
          JacobiDrafter(cfg.vocab_size), (), Greedy(), None),
      f"specjax Jacobi decoding, T=1 (window {g})": (
          JacobiDrafter(cfg.vocab_size), (), Sampling(1.0), None),
      f"specjax speculative, Medusa-1 heads, their {heads_tree.num_nodes}-node tree, greedy": (
          medusa, medusa_dp, Greedy(), heads_tree),
      f"specjax speculative, Medusa-1 heads, their {heads_tree.num_nodes}-node tree, T=1": (
          medusa, medusa_dp, Sampling(1.0), heads_tree),
      f"specjax speculative, trained exit after layer {exit_.cfg.num_layers}, greedy (γ={g})": (
          exit_, exit_dp, Greedy(), None),
      f"specjax speculative, trained exit after layer {exit_.cfg.num_layers}, T=1 (γ={g})": (
          exit_, exit_dp, Sampling(1.0), None),
      la_greedy: (la, (), Greedy(), la.default_tree()),
      f"specjax lookahead decoding, T=1 ({la_name})": (la, (), Sampling(1.0), la.default_tree()),
  }

  times = {
      "specjax autoregressive, greedy": _timed(sj_ar(Greedy()), prompts),
      "specjax autoregressive, T=1": _timed(sj_ar(Sampling(1.0)), prompts),
  }
  for name, (d, d_params, sampler, tree, *verification) in spec_rows.items():
    times[name] = _timed(sj_spec(d, d_params, sampler, tree, name, *verification), prompts)
    calls[name] = calls[name][1:]  # drop the warm-up call's count

  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(os.cpu_count() or 1)
  path = smollm2_gguf_path()
  hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                            dtype=torch.float32).eval()
  with tempfile.TemporaryDirectory() as export_dir:
    dcfg, dparams, vocab_map, in_map = drafts.load_default_draft(tok, cfg.vocab_size,
                                                                 with_input_map=True)
    drafts.export_hf(export_dir, dcfg, dparams, vocab_map, cfg.vocab_size,
                     input_embed=params["embed"], tokenizer=tok)  # as specjax's row reads it
    assistant = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
  assistant.generation_config.num_assistant_tokens = g
  assistant.generation_config.num_assistant_tokens_schedule = "constant"
  assistant.generation_config.assistant_confidence_threshold = 0.0

  def hf_gen(**kw):
    def run(p):
      ids = torch.tensor([p])
      with torch.inference_mode():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0, **kw)
    return run

  torch.manual_seed(0)
  times.update({
      "HF generate, greedy": _timed(hf_gen(do_sample=False), prompts),
      "HF generate, T=1": _timed(hf_gen(do_sample=True, temperature=1.0, top_k=0), prompts),
      f"HF assisted generation, shipped draft, greedy (γ={g})": _timed(
          hf_gen(do_sample=False, assistant_model=assistant), prompts),
      f"HF prompt lookup, greedy (γ={g})": _timed(
          hf_gen(do_sample=False, prompt_lookup_num_tokens=g), prompts),
  })

  total = n * len(prompts)
  tps = {k: total / v for k, v in times.items()}
  base = tps["HF generate, greedy"]
  rows = [f"| {k} | {v:.1f} | {v / base:.2f}x | "
          f"{sum(calls[k]) / len(calls[k]):.2f} |" if k in calls else
          f"| {k} | {v:.1f} | {v / base:.2f}x | |" for k, v in tps.items()]
  spec = tps[f"specjax speculative, shipped draft, greedy (γ={g})"]
  goals = [
      f"- specjax speculative / HF assisted generation (same draft, greedy): "
      f"**{spec / tps[f'HF assisted generation, shipped draft, greedy (γ={g})']:.2f}x** (goal ≥ 2x)",
      f"- specjax speculative / specjax autoregressive (greedy): "
      f"**{spec / tps['specjax autoregressive, greedy']:.2f}x** (goal ≥ 2x)",
      f"- specjax speculative with the EAGLE-3 drafter / specjax autoregressive (greedy): "
      f"**{tps[f'specjax speculative, EAGLE-3 drafter, greedy (γ={g})'] / tps['specjax autoregressive, greedy']:.2f}x**",
      f"- best specjax tree row / specjax autoregressive (greedy): "
      f"**{max(v for k, v in tps.items() if 'tree' in k and 'greedy' in k) / tps['specjax autoregressive, greedy']:.2f}x**",
      f"- specjax lookahead decoding / specjax autoregressive (greedy): "
      f"**{tps[la_greedy] / tps['specjax autoregressive, greedy']:.2f}x**",
      f"- specjax autoregressive / HF generate (greedy): "
      f"**{tps['specjax autoregressive, greedy'] / base:.2f}x**",
  ]
  write_markdown(OUT.value, [
      "# Peer benchmark: specjax vs HF transformers (SmolLM2-135M-Instruct, f32, batch 1, CPU)",
      "",
      f"Command: `python -m benchmarks.peer --gamma {g} --new_tokens {n} "
      f"--num_prompts {len(prompts)} --tree_nodes {nodes} --lookup_branches "
      f"{LOOKUP_BRANCHES.value}` ({provenance()}, torch {torch.__version__}).",
      f"specjax matmul: {matmul_path(params)}.",
      "",
      f"{len(prompts)} chat prompts x {n} new tokens each (EOS ignored), one warm-up call per "
      "method, then all prompts timed. Target calls per token: verify forwards per generated "
      "token (1.00 for plain decoding; lower is better).",
      "",
      "| method | tokens/s | vs HF greedy | target calls / token |",
      "|---|---|---|---|",
      *rows,
      "",
      *goals,
  ])


if __name__ == "__main__":
  app.run(main)
