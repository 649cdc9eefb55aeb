"""Export a draft as a standard Hugging Face Llama directory.

  python -m experiments.export_draft --out /tmp/smollm2-draft-hf [--draft DIR] [--check]
      [--overwrite]

A non-empty --out directory is refused unless --overwrite is given; then the
safetensors files and index of the checkpoint it held are removed first
(``save_hf``), so the new config never meets stale weights.

The directory (config.json, model.safetensors, tokenizer files) loads with
``transformers.AutoModelForCausalLM.from_pretrained`` and can be passed to
``generate(..., assistant_model=...)``; it also reloads with
``specjax.loaders.load_hf``. A reduced vocabulary is expanded to the full one
(see ``specjax.drafts.expand_to_full_vocab`` for what untrained rows hold); input
ids outside it read the target's embedding rows, as ``default_drafter(target_embed=)``
does (``--notarget_input``: the draft's shipped nearest-row map instead).
``--check`` compares transformers' and specjax's logits on a chat prompt and
runs one assisted generation against the embedded target (loaded by
transformers from its GGUF file).
"""

from __future__ import annotations

import os

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Output directory.", required=True)
flags.DEFINE_string("draft", None, "Draft directory (default: the shipped SmolLM2 draft).")
flags.DEFINE_bool("check", False, "Verify the export with transformers (slow, loads the target).")
flags.DEFINE_bool("target_input", True, "Input rows of ids outside a reduced vocabulary from "
                  "the target's embedding (loads the target's weights); else the shipped map.")
flags.DEFINE_bool("overwrite", False, "Write into a non-empty --out directory, replacing the "
                  "checkpoint it holds.")


def check_out_dir(out: str, overwrite: bool) -> None:
  """Refuses an --out that is a file, or a non-empty directory without ``overwrite``."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise app.UsageError(f"--out={out} exists and is not a directory")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise app.UsageError(f"--out={out} is not empty ({len(os.listdir(out))} entries); pass "
                         "--overwrite to replace the checkpoint it holds")


def main(argv):
  del argv
  from specjax import drafts
  from specjax.loaders import chat_prompt, load_hf, load_model, load_model_tokenizer

  check_out_dir(FLAGS.out, FLAGS.overwrite)
  tok = load_model_tokenizer()
  path = FLAGS.draft or drafts.DEFAULT_DRAFT_DIR
  cfg, params, vocab_map, in_map = drafts.load_draft(
      path, target_vocab_size=len(tok), tokenizer_sha256=drafts.tokenizer_fingerprint(tok),
      with_input_map=True)
  target_embed = load_model(packed=False)[1]["embed"] if FLAGS.target_input else None
  drafts.export_hf(FLAGS.out, cfg, params, vocab_map, len(tok), tokenizer=tok, input_map=in_map,
                   input_embed=target_embed)
  hcfg, _ = load_hf(FLAGS.out)
  size = sum(os.path.getsize(os.path.join(FLAGS.out, f)) for f in os.listdir(FLAGS.out))
  logging.info("exported %s -> %s (%.0f MB, vocab %d, %d layers); reloads through load_hf",
               path, FLAGS.out, size / 2**20, hcfg.vocab_size, hcfg.num_layers)
  if FLAGS.check:
    check(FLAGS.out, tok, chat_prompt(tok, "Write a Python function that reverses a string."))


def check(out_dir: str, tok, prompt: list[int]) -> None:
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers
  from specjax.kv_cache import init_cache
  from specjax.loaders import load_hf, smollm2_gguf_path
  from specjax.model import forward

  cfg, params = load_hf(out_dir)
  n = len(prompt)
  ours = np.asarray(forward(params, cfg, jnp.asarray([prompt]), jnp.arange(n)[None],
                            init_cache(cfg, 1, n)).logits[0])
  draft = transformers.AutoModelForCausalLM.from_pretrained(out_dir, torch_dtype=torch.float32)
  with torch.no_grad():
    theirs = draft(torch.tensor([prompt])).logits[0].numpy()
  logging.info("max |logit diff| specjax vs transformers: %.2e", np.abs(ours - theirs).max())
  trained = np.zeros(cfg.vocab_size, bool)
  trained[np.any(np.asarray(params["lm_head"]) != 0, axis=0)] = True
  probs = np.exp(theirs - theirs.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  logging.info("probability mass the export puts on tokens outside the draft vocabulary "
               "(logit 0), mean over the prompt's positions: %.2e", probs[:, ~trained].sum(-1).mean())
  gguf = smollm2_gguf_path()
  target = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gguf), gguf_file=os.path.basename(gguf), torch_dtype=torch.float32)
  ids = torch.tensor([prompt])
  kw = dict(max_new_tokens=48, do_sample=False, pad_token_id=tok.eos_token_id)
  plain = target.generate(ids, **kw)
  assisted = target.generate(ids, assistant_model=draft, **kw)
  same = torch.equal(plain, assisted)
  logging.info("HF assisted greedy generation equals plain greedy: %s\n%s", same,
               tok.decode(assisted[0, len(prompt):]))


if __name__ == "__main__":
  app.run(main)
