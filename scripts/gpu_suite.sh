#!/usr/bin/env bash
# On a GPU machine, one call: bootstrap the venv, run the GPU tests and benchmarks, print the table.
# Usage: scripts/gpu_suite.sh [--quick] [--device cuda:0]   (JSON to $OUT/gpu_suite.json when OUT is set)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
exec .venv/bin/python benchmarks/gpu_suite.py "$@"
