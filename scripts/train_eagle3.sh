#!/usr/bin/env bash
# The recipe of the shipped EAGLE-3 drafter (specjax/assets/smollm2_eagle3/README.md).
#
#   scripts/train_eagle3.sh data  WORKDIR   # the corpus: token ids of the target's answers
#   scripts/train_eagle3.sh train WORKDIR   # train (resumable: rerun to continue)
#   scripts/train_eagle3.sh token WORKDIR2  # a token draft on the same corpus (its own workdir)
#   scripts/train_eagle3.sh medusa WORKDIR3 # Medusa-1 heads on the same corpus (its own workdir)
#   scripts/train_eagle3.sh exit WORKDIR4   # a trained early exit on the same corpus
#   scripts/train_eagle3.sh export WORKDIR --archive=experiments/corpora/NAME.npz
#   scripts/train_eagle3.sh import WORKDIR --archive=experiments/corpora/NAME.npz
#                                           # the corpus as token ids, to commit / rebuilt
#                                           # (same environment and flags as its data stage)
#
# data: the extended prompt set plus chat prompts the target writes itself; the
# target answers each train prompt in several passes (greedy, then T=1), batched
# and jit-compiled, until $GEN_MINUTES. Only token ids are kept (--topk=1).
# TEXT_TOKENS=N adds N tokens of fixed text (code, docstrings, package docs, the
# language reference; specjax/distill/documents.py) scored teacher-forced, and
# CORPUS=text|mix trains on it alone or beside the answers (default: responses).
# train: a fused-feature (low/mid/last layer) EAGLE drafter with training-time
# test (3 unrolled steps), forward KL to the target's top-64 recomputed
# teacher-forced on every batch (--teacher=online), for $STEPS steps or until
# $TRAIN_MINUTES (0: no step, the last checkpoint written as draft/); LENGTH_GROUP=16
# draws batches of similar lengths, trimmed (a third of the padding). token: the
# independent token draft (issue #15 item 3) on the same
# corpus: one layer from the target's layer 0, an 11,008-id vocabulary (the shipped
# draft's size, under 20 MB in float16), full-vocabulary input (--target_input,
# train_draft's default), forward KL to the online teacher's top-64; not run yet at
# this scale. medusa: 4 Medusa-1 heads of one residual block over the target's frozen
# LM head (8,192 rows), forward KL to the corpus' stored top-k with the target's
# features computed once and cached (--teacher=stored: cheap epochs on a CPU; the
# shipped heads, specjax/assets/smollm2_medusa/README.md, give the exact command).
# exit: one such head (two blocks) on the output of the target's first $EXIT_LAYER
# layers over the same 8,192 rows, the layer's features cached like Medusa's (add
# --exit_adapter for a trained decoder layer in front of it). Either
# takes --own_head: each head trains its own copy of those rows (FasterDecoding's design).
# The defaults are the accelerator run; every knob is an environment variable, so
# the same command runs small on a CPU.
set -euo pipefail
usage="usage: train_eagle3.sh data|train|token|medusa|exit|export|import WORKDIR [extra train_draft flags]"
stage=${1:?$usage}
workdir=${2:?$usage}
shift 2
DATA=(--prompt_set=extended --self_instruct_per_topic="${SELF_INSTRUCT:-4}"
      --gen_batch="${GEN_BATCH:-512}" --max_new_tokens="${MAX_NEW:-256}" --topk=1
      --max_prompt_tokens=160 --heldout_batches="${HELDOUT_BATCHES:-2}"
      --heldout_mix_batches="${HELDOUT_MIX:-1}" --train_batches="${TRAIN_BATCHES:-100000}"
      --prompt_passes="${PASSES:-40}" --gen_minutes="${GEN_MINUTES:-1e9}" --data_seed=0
      --text_tokens="${TEXT_TOKENS:-0}" --corpus="${CORPUS:-responses}")
case "$stage" in
  data|export|import)
    python -m experiments.train_draft --stage="$stage" "${DATA[@]}" --workdir="$workdir" "$@" ;;
  train)
    python -m experiments.train_draft --stage=train "${DATA[@]}" --workdir="$workdir" \
      --draft_kind=eagle --eagle_layers=1 --eagle_feature_layers=default --eagle_ttt_steps=3 \
      --teacher=online --teacher_topk=64 --draft_vocab="${VOCAB:-16384}" \
      --steps="${STEPS:-2000}" --batch_size="${BATCH:-64}" --seq_len=416 --lr="${LR:-1e-3}" \
      --warmup_steps="${WARMUP:-100}" --eval_every="${EVAL_EVERY:-250}" \
      --checkpoint_every="${CHECKPOINT_EVERY:-250}" --max_minutes="${TRAIN_MINUTES:-1e9}" \
      --eval_records="${EVAL_RECORDS:-384}" --length_group="${LENGTH_GROUP:-0}" \
      --feature_weight=0.1 --feature_noise=0.05 "$@" ;;
  token)
    python -m experiments.train_draft --stage=train "${DATA[@]}" --workdir="$workdir" \
      --draft_kind=token --draft_layers=0 --target_input --teacher=online --teacher_topk=64 \
      --draft_vocab="${VOCAB:-11008}" --loss=fkl --steps="${STEPS:-2000}" \
      --batch_size="${BATCH:-64}" --seq_len=416 --lr="${LR:-1e-3}" \
      --warmup_steps="${WARMUP:-100}" --eval_every="${EVAL_EVERY:-250}" \
      --checkpoint_every="${CHECKPOINT_EVERY:-250}" --max_minutes="${TRAIN_MINUTES:-1e9}" \
      --eval_records="${EVAL_RECORDS:-384}" "$@" ;;
  medusa)
    python -m experiments.train_draft --stage=train "${DATA[@]}" --workdir="$workdir" \
      --draft_kind=medusa --medusa_heads="${HEADS:-4}" --medusa_layers=1 \
      --teacher="${TEACHER:-stored}" --draft_vocab="${VOCAB:-8192}" --loss=fkl \
      --steps="${STEPS:-2000}" --batch_size="${BATCH:-64}" --seq_len=416 --lr="${LR:-1e-3}" \
      --warmup_steps="${WARMUP:-100}" --eval_every="${EVAL_EVERY:-250}" \
      --checkpoint_every="${CHECKPOINT_EVERY:-250}" --max_minutes="${TRAIN_MINUTES:-1e9}" \
      --eval_records="${EVAL_RECORDS:-384}" "$@" ;;
  exit)
    python -m experiments.train_draft --stage=train "${DATA[@]}" --workdir="$workdir" \
      --draft_kind=exit --exit_layer="${EXIT_LAYER:-10}" --exit_blocks="${BLOCKS:-2}" \
      --teacher="${TEACHER:-stored}" --draft_vocab="${VOCAB:-8192}" --loss=fkl \
      --steps="${STEPS:-2000}" --batch_size="${BATCH:-64}" --seq_len=416 --lr="${LR:-1e-3}" \
      --warmup_steps="${WARMUP:-100}" --eval_every="${EVAL_EVERY:-250}" \
      --checkpoint_every="${CHECKPOINT_EVERY:-250}" --max_minutes="${TRAIN_MINUTES:-1e9}" \
      --eval_records="${EVAL_RECORDS:-384}" "$@" ;;
  *) echo "unknown stage $stage (data, train, token, medusa, exit, export or import)" >&2; exit 2 ;;
esac
