#!/usr/bin/env bash
# The end-to-end tables on one GPU (or TPU): issue #36 item 5, ../shared/ACCELERATOR.md item 2-3.
#
#   scripts/accelerator_tables.sh OUT [PHASE ...]     # default: every phase, in this order
#
# Phases (each writes under OUT; rerun a phase to resume it, experiments.run keeps a
# progress log and the XLA compilation cache lives in $SPECJAX_CACHE):
#   device   nvidia-smi, jax and the devices                   -> OUT/device.txt
#   default  python -m experiments.run (the default experiment; bf16 and the Pallas tree
#            attention kernel by default on GPU/TPU)            -> OUT/default/
#   xla      the γ sweep again with XLA's attention (SPECJAX_ATTENTION=reference), the
#            measured alternative to the kernel                 -> OUT/default_xla_attention/
#   trees    python -m experiments.run --experiment=tree_sweep  -> OUT/trees/
#   batch    python -m benchmarks.batch_sweep (B = 1…32)        -> OUT/batch_sweep.md
#   peer     python -m benchmarks.peer                          -> OUT/peer.md
#   bf16     python -m benchmarks.bf16: bfloat16 against float32 on this device (greedy
#            agreement and where texts part, top-two gaps there, speed) -> OUT/bf16.md
#   kernels  python -m benchmarks.tree_attention (Pallas vs XLA attention alone, B 1 and 8, S
#            to 16k) and benchmarks.tune_tree_attention_gpu (GPU tiling sweep) (GPU/TPU only;
#            the sweep GPU only)
#                                                  -> OUT/tree_attention.md, OUT/tune_tree_attention.md
#   dispatch python -m benchmarks.attention_dispatch, SmolLM2-135M- and Llama-3-8B-shaped
#            targets with random weights: whole forwards with the Pallas kernel against XLA's
#            attention (cache writes included; B 1/8/32, T 1…64, context 512 and 4096), the
#            in-model measurement the dispatch rule is chosen from
#                                                  -> OUT/attention_dispatch_<shape>.md
#   verify   python -m benchmarks.verify_curve: a Llama-3-8B-shaped target, random bf16
#            weights, T = 1…64 × B = 1…32, and the speedup the calibrated theory predicts
#            with α from OUT/default/results.json (a prediction) -> OUT/verify_curve.md
#
# The device tool runs at most ten minutes a command: give it one or two phases a
# command (default and xla first). Target: <= 20 minutes on an H100 in all (issue #36;
# not yet measured). Every results file carries the device in its header. Extra arguments after
# the phases are not accepted; instead:
#   SPECJAX_ACCEL_ARGS    flags for experiments.run (default, xla and trees phases)
#   SPECJAX_VERIFY_ARGS   flags for benchmarks.verify_curve (e.g. --batch_sizes=1,8,32)
#   SPECJAX_DISPATCH_ARGS flags for benchmarks.attention_dispatch (e.g. --contexts=4096)
#   SPECJAX_PHASE_SECONDS a wall-clock limit per phase: a phase that fails or runs out of
#                         time is logged in OUT/phases.log and the next one starts (a
#                         short lease keeps whatever the earlier phases wrote)
# The verify phase reads α from OUT/default/results.json, or from the committed CPU run
# (experiments/results/results.json) when the default phase has not written one.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: accelerator_tables.sh OUT [device|default|xla|trees|batch|peer|bf16|kernels|dispatch|verify ...]}
shift
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(device default xla trees batch peer bf16 kernels dispatch verify)
for p in "${phases[@]}"; do
  case "$p" in device|default|xla|trees|batch|peer|bf16|kernels|dispatch|verify) ;;
    *) echo "unknown phase '$p': use device, default, xla, trees, batch, peer, bf16, kernels," \
            "dispatch or verify" >&2
       exit 2 ;;
  esac
done
mkdir -p "$out"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${SPECJAX_CACHE:-$HOME/.cache/specjax}/xla}
read -r -a extra <<< "${SPECJAX_ACCEL_ARGS:-}"
read -r -a verify_extra <<< "${SPECJAX_VERIFY_ARGS:-}"
read -r -a dispatch_extra <<< "${SPECJAX_DISPATCH_ARGS:-}"
limit=${SPECJAX_PHASE_SECONDS:-0}
run() {
  echo "+ $*" >&2
  if [ "$limit" -gt 0 ]; then timeout --kill-after=10 "$limit" "$@"; else "$@"; fi
}
for p in "${phases[@]}"; do
  start=$(date +%s)
  status=0
  case "$p" in
    device)
      { date -u; git rev-parse HEAD; nvidia-smi 2>&1 || echo "nvidia-smi: not available";
        python -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"
      } > "$out/device.txt"; cat "$out/device.txt" ;;
    default) run python -m experiments.run --out="$out/default" "${extra[@]}" || status=$? ;;
    xla) SPECJAX_ATTENTION=reference run python -m experiments.run --experiment=gamma_sweep \
           --out="$out/default_xla_attention" "${extra[@]}" || status=$? ;;
    trees) run python -m experiments.run --experiment=tree_sweep --out="$out/trees" \
             "${extra[@]}" || status=$? ;;
    batch) run python -m benchmarks.batch_sweep --out="$out/batch_sweep.md" || status=$? ;;
    peer) run python -m benchmarks.peer --out="$out/peer.md" || status=$? ;;
    bf16) run python -m benchmarks.bf16 --out="$out/bf16.md" || status=$? ;;
    kernels)
      run python -m benchmarks.tree_attention --out="$out/tree_attention.md" || status=$?
      run python -m benchmarks.tune_tree_attention_gpu \
        --tune_out="$out/tune_tree_attention.md" || status=$? ;;
    dispatch)
      for shape in smollm2_135m llama3_8b; do
        run python -m benchmarks.attention_dispatch --shape="$shape" \
          --out="$out/attention_dispatch_$shape.md" "${dispatch_extra[@]}" || status=$?
      done ;;
    verify)
      alpha="$out/default/results.json"
      [ -f "$alpha" ] || alpha=experiments/results/results.json
      run python -m benchmarks.verify_curve --out="$out/verify_curve.md" --results="$alpha" \
        "${verify_extra[@]}" || status=$? ;;
  esac
  echo "phase $p: $(( $(date +%s) - start )) s, exit $status" | tee -a "$out/phases.log"
done
