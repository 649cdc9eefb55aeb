#!/usr/bin/env bash
# The default test run (CI): everything except tests marked 'heavy'.
#
# pytest-xdist spreads the test files over 4 worker processes (--dist loadfile: a
# file's tests, and so its module fixtures, stay in one worker). On 2 cores that
# keeps both busy while one worker compiles, and it keeps each process's compile
# count low: after several hundred XLA:CPU compilations a single process has
# segfaulted inside LLVM (seen three times, in different tests, each of which
# passes alone). The experiments smoke run that two files share runs once (see
# tests/conftest.py). SPECJAX_TEST_WORKERS=0 runs everything in one process.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python -m pytest -q -m "not heavy" -n "${SPECJAX_TEST_WORKERS:-4}" --dist loadfile \
  tests pallas_kernels "$@"
