#!/usr/bin/env bash
# The default test run (CI): everything except tests marked 'heavy'.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m pytest -q -m "not heavy" "$@"
