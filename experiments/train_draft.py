"""Train a draft model for the embedded target by self-distillation.

Stages (``--stage``):
  data   the target answers offline prompts (code, summarise/rewrite, QA, math,
         chat; see specjax.distill.data); responses and the target's top-k
         log-probs are cached under ``$SPECJAX_CACHE/distill/<key>/``. With
         ``--text_tokens``, also fixed text (source code, docstrings, package
         docs and the language reference that this machine's Python ships;
         specjax.distill.documents) scored by the target teacher-forced, in
         its own directory beside it.
  train  token-level distillation (forward KL, reverse KL or TV) of a small
         Llama draft with a reduced vocabulary (``--draft_kind=token``), of
         an EAGLE feature drafter that reads the target's hidden states
         (``--draft_kind=eagle``; the target's features over the corpus are
         computed once and cached beside it), or of Medusa-1 heads on the
         target's last hidden state (``--draft_kind=medusa``; their per-head,
         per-rank held-out accuracy is measured at the end and stored with
         them), or of a trained early exit (``--draft_kind=exit``: an exit
         head on the output of the target's first ``--exit_layer`` layers,
         whose features are cached like EAGLE's, behind a trained decoder
         layer with ``--exit_adapter``); resumable orbax
         checkpoints; logs loss and held-out α at T=0 and T=1 (for Medusa:
         head 0's).
  all    data, then train.

``--corpus`` picks what trains: the target's answers, the fixed text or both. The
held-out records are always the answers' (prompts of held-out sources), so α is
compared on the same records whatever the corpus.

Examples (the drafts shipped in specjax/assets/; see their model cards):
  python -m experiments.train_draft --stage=all --workdir=/tmp/draft_run
  python -m experiments.train_draft --stage=train --draft_kind=eagle --workdir=/tmp/eagle_run
  python -m experiments.train_draft --stage=train --draft_kind=medusa --teacher=online \
      --workdir=/tmp/medusa_run
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time

from absl import app, flags, logging

FLAGS = flags.FLAGS
flags.DEFINE_enum("stage", "all", ["data", "train", "all", "export", "import"], "What to run "
                  "(export / import: the answers' corpus of these flags to / from --archive).")
flags.DEFINE_string("archive", None, "export / import: a corpus archive (.npz, token ids only; "
                    "specjax.distill.archive), e.g. experiments/corpora/<name>.npz.")
flags.DEFINE_string("workdir", "/tmp/specjax_draft", "Checkpoints, logs and the final draft.")
flags.DEFINE_string("cache_dir", None, "Corpus cache (default $SPECJAX_CACHE or ~/.cache/specjax).")
# data
flags.DEFINE_integer("gen_batch", 32, "Prompts per generation batch.")
flags.DEFINE_integer("max_new_tokens", 128, "Response budget per prompt.")
flags.DEFINE_integer("max_prompt_tokens", 160, "Longer prompts are dropped.")
flags.DEFINE_integer("topk", 32, "Target log-probs kept per position.")
flags.DEFINE_integer("heldout_batches", 2, "Held-out generation batches (greedy, T=1, ...).")
flags.DEFINE_integer("heldout_mix_batches", 2, "Extra held-out batches (greedy, T=1) of the "
                     "passage categories (code, summarise, qa), which the length-sorted batches "
                     "above under-sample.")
flags.DEFINE_integer("train_batches", 40, "Train generation batches (greedy, T=1 alternating).")
flags.DEFINE_float("gen_minutes", 1e9, "Stop generating new train shards after this long.")
flags.DEFINE_integer("text_tokens", 0, "Data stage: response tokens of fixed text scored "
                     "teacher-forced (0: none); a larger value later extends the same corpus.",
                     lower_bound=0)
flags.DEFINE_list("text_kinds", ["code", "docstring", "docs", "reference"], "Fixed text: "
                  "document kinds (specjax.distill.documents.KINDS).")
flags.DEFINE_integer("text_batch", 16, "Fixed text: sequences per teacher-forced forward (and "
                     "per shard).", lower_bound=1)
flags.DEFINE_enum("corpus", "responses", ["responses", "text", "mix"], "Train stage: the "
                  "target's answers, fixed text (--text_tokens) or both.")
flags.DEFINE_integer("max_train_tokens", 0, "Train stage: train on the leading records of the "
                     "corpus, at most this many response tokens, each corpus (--also_data_seeds, "
                     "--corpus=mix) cut to the same share (0: all of it). The corpus-size axis of "
                     "an ablation; features are still computed (and cached) for whole corpora.",
                     lower_bound=0)
flags.DEFINE_integer("data_seed", 0, "Seed of the prompt set and of sampled responses.")
flags.DEFINE_list("also_data_seeds", [], "Train stage: train on the answers' corpora of these "
                  "data seeds too (each built by the data stage, or imported from an archive, "
                  "with the other flags the same); the held-out records stay --data_seed's.")
flags.DEFINE_enum("prompt_set", "base", ["base", "extended"], "Prompt sources: stdlib docs and "
                  "templates, or those plus package docs, 250 chat topics and 32 request styles "
                  "(specjax.distill.data).")
flags.DEFINE_integer("prompt_passes", 1, "Passes over the train prompts; passes after the first "
                     "sample new responses at T=1 (more tokens from the same prompts).",
                     lower_bound=1)
flags.DEFINE_integer("self_instruct_per_topic", 0, "Chat prompts per topic written by the target "
                     "itself (T=0.7, top-p 0.9) before generation; 0 = none.", lower_bound=0)

# train
flags.DEFINE_enum("loss", "fkl", ["fkl", "rkl", "tv", "top1"], "Distillation divergence "
                  "(DistillSpec), or top1: cross-entropy to the target's argmax (hard labels; "
                  "what greedy acceptance rewards).")
flags.DEFINE_integer("steps", 600, "Optimizer steps.")
flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
flags.DEFINE_integer("seq_len", 288, "Prompt + response tokens per sequence.")
flags.DEFINE_float("lr", 1e-3, "Peak learning rate (AdamW, warmup + cosine decay).")
flags.DEFINE_integer("warmup_steps", 20, "Linear warmup steps.")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
flags.DEFINE_float("clip_norm", 1.0, "Global gradient-norm clip.")
flags.DEFINE_integer("seed", 0, "Training seed (data order, on-policy sampling).")
flags.DEFINE_integer("eval_every", 50, "Held-out α every n steps.")
flags.DEFINE_integer("checkpoint_every", 25, "Orbax checkpoint every n steps.")
flags.DEFINE_integer("on_policy_every", 0, "Every n-th step trains on draft samples scored by "
                     "the target (0 = off).")
flags.DEFINE_integer("draft_vocab", 8192, "Draft vocabulary size (0 = full target vocabulary).")
flags.DEFINE_list("draft_layers", ["0"], "Target layers that initialise the draft's layers.")
flags.DEFINE_bool("target_input", True, "Token draft with --draft_vocab: read ids outside its "
                  "vocabulary through the target's embedding rows during training, as "
                  "inference does (ModelDrafter.make_params(input_embed=...)); off: through "
                  "the nearest kept row.")
flags.DEFINE_float("max_minutes", 1e9, "Stop (checkpointed, resumable) after this long; 0: "
                   "take no step and write the draft of the run's last checkpoint (a run "
                   "stopped between checkpoints, e.g. by a kill).")
flags.DEFINE_enum("draft_kind", "token", ["token", "eagle", "medusa", "exit"], "A token draft "
                  "model, an EAGLE feature drafter over the target's last hidden state, Medusa-1 "
                  "heads on it, or a trained early exit (an exit head on the output of the "
                  "target's first --exit_layer layers).")
flags.DEFINE_integer("exit_layer", 10, "Trained exit: k, the target layers the draft runs.",
                     lower_bound=1)
flags.DEFINE_integer("exit_blocks", 1, "Trained exit: residual blocks of its head (at least "
                     "one: the checkpointer cannot store empty arrays).", lower_bound=1)
flags.DEFINE_bool("exit_adapter", False, "Trained exit: a trained decoder layer (initialised "
                  "from the target's layer --exit_layer, with its own one-layer KV cache) between "
                  "layer k's output and the exit head.")
flags.DEFINE_integer("medusa_heads", 4, "Medusa: heads (the deepest draft).", lower_bound=1)
flags.DEFINE_integer("medusa_layers", 1, "Medusa: residual blocks per head (at least one).",
                     lower_bound=1)
flags.DEFINE_bool("own_head", False, "Medusa and the trained exit: each head trains its own "
                  "copy of the target's LM-head rows (FasterDecoding's Medusa-1; --draft_vocab "
                  "rows, shipped with the heads) instead of sharing the frozen ones.")
flags.DEFINE_integer("eagle_layers", 1, "EAGLE: decoder layers (initialised from the target's last).")
flags.DEFINE_float("feature_weight", 0.1, "EAGLE: weight of the feature regression loss.")
flags.DEFINE_float("feature_noise", 0.05, "EAGLE: uniform noise on input features (× their RMS).")
flags.DEFINE_integer("eagle_ttt_steps", 1, "EAGLE: draft steps unrolled on the drafter's own "
                     "predictions in training (EAGLE-3's training-time test; 1 = off).",
                     lower_bound=1)
flags.DEFINE_list("eagle_feature_layers", [], "EAGLE: target layers fused into the feature "
                  "(EAGLE-3), e.g. 2,15,29, or 'default' for low/mid/last; empty = the last "
                  "hidden state (EAGLE-1).")
flags.DEFINE_enum("teacher", "stored", ["stored", "online"], "Target top-k (and EAGLE features) "
                  "from the corpus files (computed once, cached), or recomputed teacher-forced "
                  "on every batch (the corpus is used as token ids only; best on an accelerator).")
flags.DEFINE_integer("teacher_topk", 64, "Online teacher: target top-k kept per position.")
flags.DEFINE_integer("eval_records", 0, "Held-out records scored by the α evaluations during "
                     "training (an even spread; 0 = all).", lower_bound=0)
flags.DEFINE_integer("feature_batch", 8, "Sequences per forward when caching EAGLE features.")
flags.DEFINE_integer("length_group", 0, "Batches of similar lengths, each trimmed to its "
                     "longest row (rounded up to 64, at most --seq_len) instead of --seq_len: "
                     "each window of this many batches of an epoch's shuffle is sorted by "
                     "length, cut into batches and shuffled again (0: off, every batch "
                     "--seq_len long). On the archived "
                     "answer corpora, 16 cuts the padding from 43% to 14% of the positions.",
                     lower_bound=0)
flags.DEFINE_float("adaspec_keep", 1.0, "AdaSPEC token selection: train on this fraction of "
                   "positions, those where the draft trails --adaspec_reference most (1: off).",
                   lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_string("adaspec_reference", None, "AdaSPEC: the --workdir of a finished run of the "
                    "same draft on the same corpus; its last checkpoint is the reference draft.")
flags.DEFINE_string("init_from", None, "Warm start: the --workdir of an earlier run of the same "
                    "draft (kind, layers, head, vocabulary size) on any corpus; this run starts "
                    "from its last checkpoint's parameters and keeps its vocabulary, with a fresh "
                    "optimizer and schedule. EAGLE drafters, Medusa heads and trained exits may "
                    "also start from a draft directory (a run's draft/, or a shipped one such as "
                    "specjax/assets/smollm2_eagle3): its weights as stored (float16) and "
                    "the setup its draft.json records. An EAGLE drafter of fewer layers than "
                    "--eagle_layers is grown: its layers, then new ones that start as the "
                    "identity (zero output projections).")
flags.DEFINE_string("mesh", "", "Train on a DATAxMODEL device mesh (e.g. 2x4; docs/sharding.md): "
                    "batch rows over data, the target and the draft's heads over model. Empty: "
                    "one device.")


def training_mesh():
  """The --mesh flag as a mesh (None: one device), refused before anything loads."""
  if not FLAGS.mesh:
    return None
  data, sep, model = FLAGS.mesh.partition("x")
  if not (sep and data.isdigit() and model.isdigit()):
    raise app.UsageError(f"--mesh={FLAGS.mesh!r}: expected DATAxMODEL, e.g. 2x4")
  from specjax import sharding
  try:
    mesh = sharding.make_mesh(int(data), int(model))
    sharding.check_batch(FLAGS.batch_size, mesh)
  except ValueError as e:
    raise app.UsageError(f"--mesh / --batch_size: {e}") from None
  return mesh


# each key of the answers' corpus spec and the flag it comes from
_SPEC_FLAGS = dict(data_seed="data_seed", gen_batch="gen_batch", max_new="max_new_tokens",
                   max_prompt="max_prompt_tokens", topk="topk", prompt_set="prompt_set",
                   self_instruct="self_instruct_per_topic")


def corpus_spec(data_seed: int | None = None) -> dict:
  """What keys the answers' corpus of these flags (its directory, an archive's spec), or of
  another ``data_seed`` with the others."""
  spec = {k: getattr(FLAGS, f) for k, f in _SPEC_FLAGS.items()}
  spec["version"] = 1
  if data_seed is not None:
    spec["data_seed"] = data_seed
  if FLAGS.prompt_set == "base" and not FLAGS.self_instruct_per_topic:  # (earlier keys unchanged)
    del spec["prompt_set"], spec["self_instruct"]
  return spec


def corpus_dir(data_seed: int | None = None) -> str:
  from specjax.distill import teacher
  from specjax.loaders.embedded import cache_dir, smollm2_config
  base = FLAGS.cache_dir or cache_dir()
  key = teacher.corpus_key(smollm2_config(), corpus_spec(data_seed))
  return os.path.join(base, "distill", key)


def more_corpus_dirs() -> list[str]:
  """The corpora of --also_data_seeds, refused unless each is finished."""
  if FLAGS.also_data_seeds and FLAGS.corpus == "text":
    raise app.UsageError("--also_data_seeds adds other seeds' answers, which --corpus=text "
                         "leaves out: use --corpus=responses or mix")
  out = []
  for seed in FLAGS.also_data_seeds:
    if not seed.isdigit() or int(seed) == FLAGS.data_seed:
      raise app.UsageError(f"--also_data_seeds: {seed!r} is not a data seed other than "
                           f"--data_seed={FLAGS.data_seed}")
    d = corpus_dir(int(seed))
    if not os.path.exists(os.path.join(d, "spec.json")):
      raise app.UsageError(f"--also_data_seeds: no finished corpus for --data_seed={seed} with "
                           f"these flags ({d}): run the data stage with --data_seed={seed}, or "
                           "import its archive (--stage=import)")
    out.append(d)
  return out


def check_archive_spec(path: str) -> dict:
  """--archive's header, refused (naming the flags to change) unless it holds the corpus of
  these flags: the one the train stage will read."""
  from specjax.distill import archive
  try:
    header = archive.read_header(path)
  except (OSError, ValueError) as e:
    raise app.UsageError(f"--archive: {e}") from None
  theirs, ours = header["spec"], corpus_spec()
  if theirs != ours:
    diff = [f"--{_SPEC_FLAGS.get(k, k)}={theirs.get(k)} (here {ours.get(k)})"
            for k in sorted(set(theirs) | set(ours)) if theirs.get(k) != ours.get(k)]
    raise app.UsageError(f"--archive={path} holds the corpus of other flags; import it with "
                         + ", ".join(diff))
  return header


def export_corpus() -> None:
  """The answers' corpus of these flags into --archive, as token ids."""
  from experiments import machine, report
  from specjax import drafts
  from specjax.distill import archive
  from specjax.loaders import load_model_tokenizer
  from specjax.loaders.embedded import smollm2_config
  directory = corpus_dir()
  if not os.path.exists(os.path.join(directory, "spec.json")):
    raise app.UsageError(f"no finished corpus for these flags at {directory}: run the data "
                         "stage with the same flags first")
  info = dict(command="python -m experiments.train_draft " + " ".join(sys.argv[1:]),
              git=report.git_revision(), cpu=machine.describe_cpu(machine.cpu_info()),
              created=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
  header = archive.pack(directory, FLAGS.archive, cfg=smollm2_config(),
                        tokenizer_sha256=drafts.tokenizer_fingerprint(load_model_tokenizer()),
                        spec=corpus_spec(), info=info)
  logging.info("archived %s into %s (%d bytes): %s", directory, FLAGS.archive,
               os.path.getsize(FLAGS.archive), json.dumps(header["splits"]))


def import_corpus(header: dict) -> None:
  """--archive (its ``header`` checked against these flags) rebuilt into the corpus directory
  of these flags: its stored top-k, or (an archive of ids only) the target's, teacher-forced."""
  import tqdm
  from specjax import drafts
  from specjax.distill import archive
  from specjax.loaders import load_model, load_model_tokenizer
  from specjax.loaders.embedded import smollm2_config
  sha = drafts.tokenizer_fingerprint(load_model_tokenizer())
  try:
    archive.check_target(header, smollm2_config(), sha, FLAGS.archive)
  except ValueError as e:
    raise app.UsageError(f"--archive: {e}") from None
  cfg, params = smollm2_config(), None
  if not header["stored_topk"]:  # ids only: the target scores them again
    cfg, params = load_model()
  bars = {}

  def progress(split, i, n):
    if split not in bars:
      bars[split] = tqdm.tqdm(total=n, desc=f"restoring the archive's {split} shards")
    bars[split].update(1)

  start = time.time()
  archive.restore(FLAGS.archive, corpus_dir(), cfg, tokenizer_sha256=sha, params=params,
                  batch=FLAGS.feature_batch, progress=progress)
  for bar in bars.values():
    bar.close()
  logging.info("corpus %s rebuilt from %s in %.0f s: %s", corpus_dir(), FLAGS.archive,
               time.time() - start, json.dumps(header["splits"]))


TEXT_PROMPT_TOKENS = 64  # fixed text: a longer request's document is skipped (most are
                         # 39-50 ids; a deep dotted name can pass 64)


def text_documents():
  """(train, held-out) documents of --text_kinds, and their fingerprint."""
  import hashlib
  from specjax.distill import documents
  docs = documents.collect(FLAGS.data_seed, kinds=FLAGS.text_kinds)
  h = hashlib.sha256()
  for d in docs:
    h.update(f"{d.kind}|{d.source}|{d.title}|{len(d.text)}\n".encode())
  train, held = documents.split(docs)
  logging.info("fixed text, train: %s", documents.describe(train))
  logging.info("fixed text, held-out: %s", documents.describe(held))
  return train, held, h.hexdigest()[:16]


def text_corpus_dir(fingerprint: str, tokenizer_sha: str) -> str:
  """The fixed-text corpus' directory: keyed by the target, its tokenizer, the documents
  and the record shapes (not by --text_tokens: a larger budget extends it)."""
  from specjax.distill import teacher
  from specjax.loaders.embedded import cache_dir, smollm2_config
  spec = dict(kind="text", data_seed=FLAGS.data_seed, documents=fingerprint,
              tokenizer=tokenizer_sha, max_new=FLAGS.max_new_tokens, topk=FLAGS.topk,
              batch=FLAGS.text_batch, kinds=sorted(FLAGS.text_kinds), version=1)
  key = teacher.corpus_key(smollm2_config(), spec)
  return os.path.join(FLAGS.cache_dir or cache_dir(), "distill", "text-" + key)


def text_corpus_link(directory: str) -> str:
  """Where the answers' corpus records the fixed-text corpus built beside it."""
  return os.path.join(directory, "text_corpus.json")


def run_text_stage(params, cfg, tok, encode, directory: str) -> None:
  """Fixed text scored teacher-forced; the directory is recorded in the answers' corpus."""
  import numpy as np
  import tqdm
  from specjax import drafts, files
  from specjax.distill import documents, teacher

  train_docs, held_docs, fingerprint = text_documents()
  text_dir = text_corpus_dir(fingerprint, drafts.tokenizer_fingerprint(tok))
  length = -(-(TEXT_PROMPT_TOKENS + FLAGS.max_new_tokens) // 32) * 32
  encode_text = lambda text: tok.encode(text, add_special_tokens=False)
  end_id = cfg.eos_token_ids[0]
  written, new_tokens, seconds = {}, 0, 0.0
  for split, docs, budget in (("heldout", held_docs, max(FLAGS.text_tokens // 20, 1)),
                              ("train", train_docs, FLAGS.text_tokens)):
    recs = list(documents.text_records(docs, encode, encode_text, end_id, FLAGS.max_new_tokens,
                                       TEXT_PROMPT_TOKENS, budget))
    batches = []  # whole batches only: a larger budget keeps every earlier shard
    for b in range(0, len(recs) - FLAGS.text_batch + 1, FLAGS.text_batch):
      sel = recs[b:b + FLAGS.text_batch]
      batches.append(([(np.asarray(p, np.int32), np.asarray(r, np.int32)) for p, r, _ in sel],
                      [m for _, _, m in sel]))
    tokens = [sum(len(r) for _, r in seqs) for seqs, _ in batches]
    missing = [not os.path.exists(teacher.shard_path(text_dir, split, i))
               for i in range(len(batches))]
    bar = tqdm.tqdm(total=len(batches), desc=f"fixed text, teacher-forced ({split})")
    start = time.time()
    teacher.build_text_corpus(text_dir, params, cfg, split, batches, FLAGS.topk, length,
                              progress=lambda i, n: bar.update(1))
    bar.close()
    seconds += time.time() - start
    written[split] = sum(tokens)
    new_tokens += sum(t for t, m in zip(tokens, missing) if m)
  rate = new_tokens / seconds if new_tokens else None
  info = dict(directory=text_dir, topk=FLAGS.topk, response_tokens=written,
              kinds=sorted(FLAGS.text_kinds), documents=fingerprint, length=length,
              batch=FLAGS.text_batch, last_invocation=dict(
                  scored_tokens=new_tokens, seconds=round(seconds),
                  tokens_per_second=rate and round(rate)))
  files.write_text(os.path.join(text_dir, "spec.json"), json.dumps(info, indent=2))
  files.write_text(text_corpus_link(directory), json.dumps(info, indent=2))
  logging.info("fixed text in %s: %s response tokens; this invocation scored %d in %.0f s "
               "(%s tokens/s, compilation included)", text_dir, written, new_tokens, seconds,
               rate and f"{rate:.0f}")


def run_data_stage() -> str:
  import tqdm
  from specjax.distill import data, teacher
  from specjax.loaders import load_model, load_model_tokenizer
  from specjax.sampling import Greedy, Sampling

  cfg, params = load_model()
  tok = load_model_tokenizer()
  directory = corpus_dir()
  encode = data.chat_encoder(tok)
  prompts = data.build_prompts(seed=FLAGS.data_seed, extended=FLAGS.prompt_set == "extended")
  if FLAGS.self_instruct_per_topic:
    prompts += self_instructed(params, cfg, tok, encode, directory)
  train_p, held_p = data.split_by_source(prompts)
  logging.info("train prompts: %s", data.describe(train_p))
  logging.info("held-out prompts: %s", data.describe(held_p))
  samplers = (Greedy(), Sampling(temperature=1.0))
  # one cache size (one compiled program) for every batch
  cache_size = -(-(FLAGS.max_prompt_tokens + FLAGS.max_new_tokens) // 64) * 64
  start = time.time()
  for split, ps, n in (("heldout", held_p, FLAGS.heldout_batches),
                       ("train", train_p, FLAGS.train_batches)):
    batches = data.prompt_batches(encode, data.interleave_categories(ps), FLAGS.gen_batch,
                                  FLAGS.max_prompt_tokens)
    per_batch = [samplers[i % 2] for i in range(len(batches))]
    if split == "train":  # later passes: the same prompts in another order, sampled at T=1
      for p in range(1, FLAGS.prompt_passes):
        order = random.Random(FLAGS.data_seed * 1000 + p).sample(list(ps), len(ps))
        more = data.prompt_batches(encode, data.interleave_categories(order), FLAGS.gen_batch,
                                   FLAGS.max_prompt_tokens)
        batches += more
        per_batch += [samplers[1]] * len(more)
    batches, per_batch = batches[:n], per_batch[:n]
    bar = tqdm.tqdm(total=len(batches), desc=f"target generations ({split})")
    teacher.build_corpus(directory, params, cfg, split, batches, per_batch,
                         FLAGS.max_new_tokens, FLAGS.topk, FLAGS.data_seed * 1000,
                         progress=lambda i, n: bar.update(1),
                         deadline=None if split == "heldout" else start + 60 * FLAGS.gen_minutes,
                         cache_size=cache_size)
    bar.close()
    if split == "heldout" and FLAGS.heldout_mix_batches:
      passage = [p for p in ps if p.category in ("code", "summarise", "qa")]
      mix = data.prompt_batches(encode, data.interleave_categories(passage), FLAGS.gen_batch,
                                FLAGS.max_prompt_tokens)[:FLAGS.heldout_mix_batches]
      teacher.build_corpus(directory, params, cfg, "heldout", [None] * n + mix, samplers,
                           FLAGS.max_new_tokens, FLAGS.topk, FLAGS.data_seed * 1000,
                           cache_size=cache_size)
  with open(os.path.join(directory, "spec.json"), "w") as f:
    json.dump(dict(topk=FLAGS.topk, max_new_tokens=FLAGS.max_new_tokens,
                   gen_batch=FLAGS.gen_batch, data_seed=FLAGS.data_seed), f)
  logging.info("corpus in %s (%.0f s)", directory, time.time() - start)
  if FLAGS.text_tokens:
    run_text_stage(params, cfg, tok, encode, directory)
  return directory


def self_instructed(params, cfg, tok, encode, directory: str) -> list:
  """Chat prompts the target writes itself (``data.self_instruct_requests``; T=0.7,
  top-p 0.9: in a small dry run most of its T=1 questions were incoherent), cached."""
  from specjax.distill import data, teacher
  from specjax.sampling import Sampling
  path = os.path.join(directory, "self_instruct.json")
  if os.path.exists(path):
    with open(path) as f:
      return [data.Prompt(**p) for p in json.load(f)]
  requests = data.self_instruct_requests(FLAGS.data_seed, FLAGS.self_instruct_per_topic)
  batches = data.prompt_batches(encode, requests, FLAGS.gen_batch, FLAGS.max_prompt_tokens,
                                drop_last=False)
  out = []
  for i, (ids, meta) in enumerate(batches):
    recs = teacher.generate_with_topk(params, cfg, ids, 64, Sampling(0.7, top_p=0.9), k=1,
                                      seed=FLAGS.data_seed * 1000 + 500 + i)
    for r, m in zip(recs, meta):
      text = data.clean_question(tok.decode(r["response"].tolist(), skip_special_tokens=True))
      if text:
        out.append(data.Prompt("chat", m["source"], text))
  logging.info("self-instruct: %d of %d requests gave a usable prompt", len(out),
               sum(len(b[0]) for b in batches))
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump([dataclasses.asdict(p) for p in out], f)
  return out


def run_train_stage(directory: str, workdir: str) -> None:
  import numpy as np
  from specjax import drafts
  from specjax.distill import teacher, train, vocab
  from specjax.drafters import reduced_vocab
  from specjax.loaders import load_model, load_model_tokenizer

  with open(os.path.join(directory, "spec.json")) as f:
    k = json.load(f)["topk"]
  cfg, params = load_model()
  tok = load_model_tokenizer()
  more_dirs = more_corpus_dirs()
  sources = []  # (corpus directory, its train records): each caches its records' features
  if FLAGS.corpus != "text":
    sources += [(d, teacher.load_corpus(d, "train")) for d in [directory] + more_dirs]
  held = teacher.load_corpus(directory, "heldout")
  text_dir = None
  if FLAGS.corpus != "responses":  # (main checked that the data stage built it)
    with open(text_corpus_link(directory)) as f:
      text_dir = json.load(f)["directory"]
    sources.append((text_dir, teacher.load_corpus(text_dir, "train")))
  train_recs = [r for _, recs in sources for r in recs]
  if FLAGS.max_train_tokens:  # (the records are shared with sources: features attach to both)
    try:
      train_recs = [r for recs in teacher.leading_records([recs for _, recs in sources],
                                                          FLAGS.max_train_tokens) for r in recs]
    except ValueError as e:
      raise app.UsageError(f"--max_train_tokens: {e}") from None
  online = FLAGS.teacher == "online"
  if online:  # token ids only: the target's top-k (and features) come from the Teacher
    k = FLAGS.teacher_topk
    train_recs, held = teacher.ids_only(train_recs), teacher.ids_only(held)
  if FLAGS.eval_records and len(held) > FLAGS.eval_records:
    held = held[::-(-len(held) // FLAGS.eval_records)]
  n_tok = sum(len(r["response"]) for r in train_recs)
  logging.info("corpus: %d train responses (%d tokens), %d held-out", len(train_recs), n_tok,
               len(held))
  os.makedirs(workdir, exist_ok=True)
  setup_file = os.path.join(workdir, "setup.json")
  layers = tuple(int(x) for x in FLAGS.draft_layers)
  setup = dict(corpus=directory, draft_vocab=FLAGS.draft_vocab, draft_layers=list(layers),
               train_responses=len(train_recs), train_tokens=n_tok)
  if text_dir:  # (absent for the answers alone, so earlier runs still resume)
    setup.update(corpus_kind=FLAGS.corpus, text_corpus=text_dir)
  if more_dirs:  # (absent when off, so earlier runs still resume)
    setup.update(also_corpora=more_dirs)
  eagle_run = FLAGS.draft_kind == "eagle"
  medusa_run = FLAGS.draft_kind == "medusa"
  exit_run = FLAGS.draft_kind == "exit"
  if exit_run and not FLAGS.exit_layer < cfg.num_layers:
    raise ValueError(f"--exit_layer must be below the target's {cfg.num_layers} layers, got "
                     f"{FLAGS.exit_layer}")
  feature_layers = (FLAGS.exit_layer - 1,) if exit_run else ()
  if eagle_run:
    from specjax.drafters.eagle import default_feature_layers
    feature_layers = (default_feature_layers(cfg) if FLAGS.eagle_feature_layers == ["default"]
                      else tuple(int(x) for x in FLAGS.eagle_feature_layers))
    setup.update(draft_kind="eagle", draft_layers=FLAGS.eagle_layers,
                 feature_weight=FLAGS.feature_weight, feature_noise=FLAGS.feature_noise)
    # (each absent when off, so earlier runs still resume)
    if FLAGS.eagle_ttt_steps > 1:
      setup.update(ttt_steps=FLAGS.eagle_ttt_steps)
    if feature_layers:
      setup.update(feature_layers=list(feature_layers))
  if medusa_run:
    setup.update(draft_kind="medusa", draft_layers=FLAGS.medusa_layers,
                 medusa_heads=FLAGS.medusa_heads)
  if exit_run:
    setup.update(draft_kind="exit", draft_layers=FLAGS.exit_blocks, exit_layer=FLAGS.exit_layer)
    if FLAGS.exit_adapter:
      setup.update(exit_adapter=True)  # (absent when off, so earlier runs still resume)
  if FLAGS.own_head:
    setup.update(own_head=True)  # (absent when off, so earlier runs still resume)
  if online:
    setup.update(teacher="online", teacher_topk=k)
  token_run = not (eagle_run or medusa_run or exit_run)
  target_input = FLAGS.target_input and bool(FLAGS.draft_vocab) and token_run
  if target_input:
    setup.update(target_input=True)  # (absent when off, so earlier runs still resume)
  reference_setup = dict(setup)
  if FLAGS.init_from:  # (absent when off, so earlier runs still resume)
    init_setup = check_warm_start(reference_setup)  # the same draft, before any compute
    setup.update(init_from=os.path.abspath(FLAGS.init_from))
  if FLAGS.adaspec_keep < 1.0:  # (absent when off, so earlier runs still resume)
    setup.update(adaspec_keep=FLAGS.adaspec_keep,
                 adaspec_reference=os.path.abspath(FLAGS.adaspec_reference))
  if FLAGS.length_group:  # (absent when off, so earlier runs still resume)
    setup.update(length_group=FLAGS.length_group)  # (it decides every step's batch)
  if os.path.exists(setup_file):  # resuming: the corpus and the draft must be the same
    with open(setup_file) as f:
      old = json.load(f)
    if old != setup:
      raise ValueError(f"{workdir} holds a run with another setup: {old} vs {setup}; "
                       "use a fresh --workdir")
  else:
    with open(setup_file, "w") as f:
      json.dump(setup, f, indent=2)
  vocab_map = in_map = None
  if FLAGS.draft_vocab and FLAGS.init_from:  # the continued draft's rows keep their ids
    vocab_map = init_vocab_map(FLAGS.init_from, FLAGS.draft_vocab, cfg.vocab_size)
  elif FLAGS.draft_vocab:
    # Rank by use in responses (expected counts) and, for a token draft, in
    # prompts: it reads the prompt too, and a prompt token outside its
    # vocabulary loses meaning. (EAGLE reads every id through the target's
    # own embedding and Medusa reads features; only their output side is reduced.)
    counts = vocab.token_counts(train_recs, cfg.vocab_size)
    if token_run:
      for r in train_recs:
        np.add.at(counts, r["prompt"], 1.0)
    specials = [i for i in tok.all_special_ids if i < cfg.vocab_size][:8]
    vocab_map = vocab.select_vocab(counts, FLAGS.draft_vocab, always=specials)
  if vocab_map is not None and token_run:
    in_map = vocab.nearest_input_map(vocab_map, np.asarray(params["embed"]))
  objective = frozen = None
  if not token_run and not online:
    from specjax.distill import features
    # (each record's features live with the corpus it comes from, so a corpus added with
    # --also_data_seeds or --corpus=mix reuses what an earlier run computed for the others)
    splits = [(d, "train", recs) for d, recs in sources] + [(directory, "heldout", held)]
    for corpus, split, recs in splits:
      features.corpus_features(corpus, split, recs, params, cfg, FLAGS.feature_batch,
                               layers=feature_layers)
  if eagle_run:
    from specjax.distill import eagle
    from specjax.drafters.eagle import EagleDrafter, eagle_config, init_eagle_weights
    drafter = EagleDrafter(eagle_config(cfg, FLAGS.eagle_layers), feature_layers=feature_layers)
    dparams = init_eagle_weights(cfg, params, FLAGS.eagle_layers, feature_layers=feature_layers)
    objective = eagle.EagleObjective(drafter, FLAGS.feature_weight, FLAGS.feature_noise,
                                     ttt_steps=FLAGS.eagle_ttt_steps)
    frozen = eagle.frozen_arrays(cfg, params, vocab_map)
    dcfg = dataclasses.replace(drafter.cfg, vocab_size=FLAGS.draft_vocab or cfg.vocab_size)
  elif medusa_run:
    from specjax.distill import heads
    from specjax.drafters.medusa import init_medusa_weights
    objective = heads.medusa_objective(cfg, FLAGS.medusa_heads)
    dparams = init_medusa_weights(cfg, FLAGS.medusa_heads, FLAGS.medusa_layers)
    frozen = heads.frozen_arrays(cfg, params, vocab_map)
    dcfg = dataclasses.replace(cfg, vocab_size=FLAGS.draft_vocab or cfg.vocab_size)
  elif exit_run:
    from specjax.distill import heads
    from specjax.drafters.residual_head import zero_blocks
    objective = heads.exit_objective(cfg, adapter=FLAGS.exit_adapter)
    dparams = zero_blocks(1, FLAGS.exit_blocks, cfg.dim)
    if FLAGS.exit_adapter:
      from specjax.drafters.early_exit import adapter_layer
      dparams["adapter"] = adapter_layer(cfg, params, FLAGS.exit_layer)
    frozen = heads.frozen_arrays(cfg, params, vocab_map)
    dcfg = dataclasses.replace(cfg, vocab_size=FLAGS.draft_vocab or cfg.vocab_size)
  if FLAGS.own_head:  # each head's copy of the frozen rows
    dparams["head"] = heads.own_heads(frozen, objective.num_heads)
  if token_run:
    spec = vocab.DraftSpec(vocab_size=FLAGS.draft_vocab or None, layers=layers)
    dcfg, dparams = vocab.init_from_target(cfg, params, spec, vocab_map)
    if target_input:
      objective = train.TokenObjective(dcfg, full_input=True)
      frozen = reduced_vocab.full_input(vocab_map, params["embed"], cfg.vocab_size, dcfg.dim)
  draft = train.Draft(cfg=dcfg, target_vocab_size=cfg.vocab_size, vocab_map=vocab_map,
                      input_map=in_map)
  tc = train.TrainConfig(
      loss=FLAGS.loss, steps=FLAGS.steps, batch_size=FLAGS.batch_size, seq_len=FLAGS.seq_len,
      lr=FLAGS.lr, warmup_steps=FLAGS.warmup_steps, weight_decay=FLAGS.weight_decay,
      clip_norm=FLAGS.clip_norm, seed=FLAGS.seed, eval_every=FLAGS.eval_every,
      checkpoint_every=FLAGS.checkpoint_every, on_policy_every=FLAGS.on_policy_every,
      keep_fraction=FLAGS.adaspec_keep, length_group=FLAGS.length_group)
  if FLAGS.adaspec_keep < 1.0:
    frozen = dict(frozen or {}, reference=adaspec_reference(reference_setup, dparams, tc))
  if FLAGS.init_from:
    dparams, step = _warm_params(FLAGS.init_from, dparams, tc, cfg, tok,
                                 layers=init_setup.get("draft_layers") if eagle_run else None)
    logging.info("warm start from %s at its step %d (%s responses, %s tokens; this corpus: "
                 "%d, %d)", FLAGS.init_from, step, init_setup.get("train_responses"),
                 init_setup.get("train_tokens"), setup["train_responses"], setup["train_tokens"])
  logging.info("draft %s, %.2fM params; %s", dcfg, dcfg.num_params / 1e6, tc)
  start = time.time()
  log_invocation(os.path.join(workdir, "steps.jsonl"))
  online_teacher = None
  if online:
    online_teacher = (train.Teacher(cfg, k, feature_layers if not token_run else None), params)
  trained, _ = train.train(draft, dparams, train_recs, held, tc, workdir, k=k,
                           target=(cfg, params) if tc.on_policy_every else None,
                           deadline=start + 60 * FLAGS.max_minutes,
                           log=lambda m: logging.info("metrics %s", json.dumps(m)),
                           objective=objective, frozen=frozen, teacher=online_teacher,
                           mesh=training_mesh())
  metrics = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  last = metrics[-1]
  # (draft.json's info: the setup and _CARD_ONLY_KEYS, which a warm start from it drops)
  info = dict(setup, train_config=dataclasses.asdict(tc), final=last, topk=k,
              seconds_this_invocation=round(time.time() - start),
              command="python -m experiments.train_draft " + " ".join(sys.argv[1:]))
  if last.get("step") != tc.steps:  # out of time: the draft so far, marked as partial
    logging.info("stopped at step %s of %d; rerun the same command to resume", last.get("step"),
                 tc.steps)
    info["partial"] = f"stopped at step {last.get('step')} of {tc.steps} (--max_minutes)"
  out = os.path.join(workdir, "draft")
  if eagle_run:
    drafts.save_eagle(out, cfg, trained, vocab_map,
                      tokenizer_sha256=drafts.tokenizer_fingerprint(tok), info=info,
                      feature_layers=feature_layers)
  elif medusa_run:
    acc, n = heads.head_accuracy(trained, objective, draft.maps()[0], frozen, held,
                                  tc.seq_len, k, teacher=online_teacher)
    info.update(heldout_positions=int(n.min()), head_top1=[round(float(a), 4) for a in acc[:, 0]],
                head_top5=[round(float(a), 4) for a in acc[:, :5].sum(1)])
    logging.info("held-out head accuracy (rows: heads, columns: ranks):\n%s",
                 np.array2string(acc, precision=3))
    drafts.save_medusa(out, cfg, trained, vocab_map,
                       tokenizer_sha256=drafts.tokenizer_fingerprint(tok), head_accuracy=acc,
                       info=info)
  elif exit_run:
    drafts.save_exit(out, cfg, trained, vocab_map, exit_layer=FLAGS.exit_layer,
                     tokenizer_sha256=drafts.tokenizer_fingerprint(tok), info=info)
  else:
    drafts.save_draft(out, dcfg, trained, vocab_map, input_map=in_map,
                      target_vocab_size=cfg.vocab_size,
                      tokenizer_sha256=drafts.tokenizer_fingerprint(tok), info=info)
  logging.info("draft written to %s: %s", out, json.dumps(last))


def log_invocation(path: str) -> None:
  """Appends this invocation's machine and code to ``path`` (the run's ``steps.jsonl``), so
  the step times that follow it are read against the host that took them (a run resumed
  across sessions may change CPU kind; ``benchmarks.train_steps`` splits on these lines)."""
  from experiments.machine import cpu_info, describe_cpu
  from experiments.report import git_revision
  from specjax.kernels import streaming_matmul as sm
  line = dict(invocation=time.strftime("%Y-%m-%d %H:%M:%S"), cpu=describe_cpu(cpu_info()),
              cpu_family=sm.cpuinfo_field("cpu family"), cpu_model=sm.cpuinfo_field("model"),
              cores=os.cpu_count(), git=git_revision(),
              command="python -m experiments.train_draft " + " ".join(sys.argv[1:]))
  with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")


def _run_setup(workdir: str, flag: str) -> dict:
  path = os.path.join(workdir, "setup.json")
  if not (os.path.exists(path) and os.path.isdir(os.path.join(workdir, "checkpoints"))):
    raise app.UsageError(f"--{flag}={workdir} holds no training run (no setup.json and "
                         "checkpoints/)")
  with open(path) as f:
    return json.load(f)


# draft.json's info: the run's setup and what only the card keeps.
_CARD_ONLY_KEYS = ("train_config", "final", "topk", "seconds_this_invocation", "command",
                   "partial", "heldout_positions", "head_top1", "head_top5", "trained_on",
                   "head_cut_from")


def _is_draft_dir(path: str) -> bool:
  return (os.path.exists(os.path.join(path, "draft.json"))
          and not os.path.exists(os.path.join(path, "setup.json")))


def _warm_start_setup(path: str) -> dict:
  """The setup --init_from trained: a run's setup.json, or what an EAGLE, Medusa or
  trained-exit draft directory's draft.json records of its training."""
  if not _is_draft_dir(path):
    return _run_setup(path, "init_from")
  from specjax.drafts import format as fmt
  try:
    meta = fmt.read_draft_metadata(path, (fmt.EAGLE_FORMAT, fmt.MEDUSA_FORMAT, fmt.EXIT_FORMAT))
  except ValueError as e:
    raise app.UsageError(f"--init_from={path}: {e}; a draft directory warm-starts an EAGLE "
                         "drafter, Medusa heads or a trained exit (for a token draft, pass its "
                         "run's --workdir)") from None
  info = meta.get("info") or {}
  if "draft_kind" not in info:
    raise app.UsageError(f"--init_from={path}: its draft.json records no training setup "
                         "(info.draft_kind); pass the --workdir of the run that trained it")
  return {k: v for k, v in info.items() if k not in _CARD_ONLY_KEYS}


def _grows(theirs, ours) -> bool:
  return isinstance(theirs, int) and isinstance(ours, int) and 0 < theirs < ours


def _warm_params(path: str, dparams, tc, cfg, tok, layers: int | None = None):
  """(the parameters --init_from starts from, their step): a run's last checkpoint, or a
  draft directory's weights, refused unless they are this draft's arrays for this target;
  an EAGLE drafter of ``layers`` < this one's grown to this one's (``eagle.grown``)."""
  grow = "layers" in dparams and _grows(layers, len(dparams["layers"]))  # EAGLE drafters only
  source = dict(dparams, layers=dparams["layers"][:layers]) if grow else dparams
  if not _is_draft_dir(path):
    weights, step = _last_params(path, source, tc)
  else:
    import jax
    import numpy as np
    from specjax import drafts
    meta, weights, _ = drafts.load_trained_weights(
        path, cfg, tokenizer_sha256=drafts.tokenizer_fingerprint(tok))
    want, got = (jax.tree.map(np.shape, p) for p in (source, weights))
    if want != got:
      raise app.UsageError(f"--init_from={path}: its weights {got} are not this draft's {want}")
    step = int(meta["info"].get("final", {}).get("step", 0))
  if grow:
    from specjax.distill import eagle
    weights = eagle.grown(weights, dparams)
    logging.info("--init_from: its %d EAGLE layers, then %d more starting as the identity",
                 layers, len(dparams["layers"]) - layers)
  return weights, step


def _last_params(workdir: str, dparams, tc):
  """(the parameters of ``workdir``'s last checkpoint, its step)."""
  from specjax.distill import checkpoint as ckpt
  from specjax.distill import train
  mngr = ckpt.manager(os.path.join(workdir, "checkpoints"))
  state = ckpt.restore(mngr, train.init_state(dparams, tc))
  return state["params"], int(state["step"])


def adaspec_reference(setup: dict, dparams, tc):
  """The reference draft's parameters: the last checkpoint of --adaspec_reference, a run
  whose setup (corpus, draft, vocabulary) is this one's."""
  theirs = _run_setup(FLAGS.adaspec_reference, "adaspec_reference")
  drawn = lambda d: {k: v for k, v in d.items() if k != "length_group"}  # (how batches are drawn)
  if drawn(theirs) != drawn(setup):
    raise app.UsageError(f"--adaspec_reference={FLAGS.adaspec_reference} trained another setup: "
                         f"{theirs} vs {setup}")
  params, step = _last_params(FLAGS.adaspec_reference, dparams, tc)
  logging.info("AdaSPEC reference: %s at step %d, keeping %.0f%% of positions",
               FLAGS.adaspec_reference, step, 100 * FLAGS.adaspec_keep)
  return params


def init_vocab_map(workdir: str, size: int, target_vocab: int):
  """The draft vocabulary of the run in ``workdir`` (its written draft's ``vocab_map``), or of
  the draft directory ``workdir``: ``size`` ids, each below ``target_vocab``."""
  from specjax.drafts import shards
  out = workdir if _is_draft_dir(workdir) else os.path.join(workdir, "draft")
  try:
    vm = shards.read_tensors(out).get("vocab_map")
  except Exception as e:  # a run stopped before writing its draft, or damaged files
    raise app.UsageError(f"--init_from={workdir}: no readable draft in {out} to take the "
                         f"vocabulary from ({type(e).__name__}: {e}); finish that run first"
                         ) from None
  if vm is None or len(vm) != size:
    raise app.UsageError(f"--init_from={workdir}: its draft's vocabulary has "
                         f"{'no' if vm is None else len(vm)} rows, this run's "
                         f"--draft_vocab={size}")
  from specjax.drafts.format import checked_vocab_map
  return checked_vocab_map(vm, target_vocab, out)  # (before any training)


def check_warm_start(setup: dict) -> dict:
  """--init_from's setup, refused unless it trained the same draft (on any corpus), or an
  EAGLE drafter of fewer layers, which the run grows (``eagle.grown``)."""
  from specjax.distill import checkpoint as ckpt
  theirs = _warm_start_setup(FLAGS.init_from)
  diff = ckpt.draft_mismatch(theirs, setup)
  layers = diff.get("draft_layers")
  if setup.get("draft_kind") == "eagle" and layers and _grows(*layers):
    del diff["draft_layers"]
  if diff:
    raise app.UsageError(f"--init_from={FLAGS.init_from} trained another draft: "
                         + ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in diff.items()))
  return theirs


def main(argv):
  del argv
  if FLAGS.max_minutes < 0:
    raise app.UsageError(f"--max_minutes must be >= 0, got {FLAGS.max_minutes}")
  if FLAGS.adaspec_keep <= 0.0:
    raise app.UsageError(f"--adaspec_keep must be in (0, 1], got {FLAGS.adaspec_keep}")
  if (FLAGS.adaspec_keep < 1.0) != bool(FLAGS.adaspec_reference):
    raise app.UsageError("AdaSPEC needs both --adaspec_keep < 1 and --adaspec_reference")
  training_mesh()  # a bad --mesh fails before the corpus is built
  if FLAGS.init_from:
    _warm_start_setup(FLAGS.init_from)
  if FLAGS.own_head and FLAGS.draft_kind not in ("medusa", "exit"):
    raise app.UsageError("--own_head is for --draft_kind=medusa or exit (their heads' LM-head "
                         f"rows), not {FLAGS.draft_kind}")
  from specjax.distill.documents import KINDS
  if set(FLAGS.text_kinds) - set(KINDS) or not FLAGS.text_kinds:
    raise app.UsageError(f"--text_kinds must be some of {','.join(KINDS)}, got "
                         f"{','.join(FLAGS.text_kinds)}")
  if FLAGS.stage == "all" and FLAGS.corpus != "responses" and not FLAGS.text_tokens:
    raise app.UsageError(f"--corpus={FLAGS.corpus} trains on fixed text: give --text_tokens")
  if FLAGS.stage == "train" and FLAGS.corpus != "responses" and \
      not os.path.exists(text_corpus_link(corpus_dir())):
    raise app.UsageError(f"--corpus={FLAGS.corpus} needs the fixed-text corpus: run the data "
                         "stage with --text_tokens first")
  if FLAGS.stage in ("train", "all"):
    more_corpus_dirs()  # (a missing one fails before the data stage runs)
  if FLAGS.stage in ("export", "import"):
    if not FLAGS.archive:
      raise app.UsageError(f"--stage={FLAGS.stage} needs --archive")
    if FLAGS.stage == "import":
      import_corpus(check_archive_spec(FLAGS.archive))  # (checked before the model loads)
    else:
      export_corpus()
    return
  from specjax import compile_cache  # (a resumed run, or one of several lengths, reuses them)
  logging.info("persistent compilation cache: %s", compile_cache.enable())
  directory = run_data_stage() if FLAGS.stage in ("data", "all") else corpus_dir()
  if FLAGS.stage in ("train", "all"):
    run_train_stage(directory, FLAGS.workdir)


if __name__ == "__main__":
  app.run(main)
