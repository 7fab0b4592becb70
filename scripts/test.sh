#!/usr/bin/env bash
# Set up everything on a fresh machine and run the whole test suite (extra args go to the core pytest):
# 1. the core suite (tests/, .venv), 2. the vLLM suite (tests_vllm/, .venv-vllm: scripts/test_vllm.sh).
# Both always run; the script fails if either fails (or collects nothing).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
set +e
.venv/bin/python -m pytest --durations=30 "$@"  # the 30 slowest tests, to keep CI time in view
core=$?
set -e
if [ "$core" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  core=1
fi
echo "test.sh: core suite exit status $core; now the vLLM suite (scripts/test_vllm.sh)"
set +e
scripts/test_vllm.sh
vllm_rc=$?
set -e
echo "test.sh: core suite exit status $core, vLLM suite exit status $vllm_rc"
if [ "$core" -ne 0 ]; then exit "$core"; fi
exit "$vllm_rc"
