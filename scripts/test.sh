#!/usr/bin/env bash
# Set up everything on a fresh machine and run the whole test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh test
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
