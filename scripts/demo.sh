#!/usr/bin/env bash
# Set up everything on a fresh machine and run the main job: `ectier demo` on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh demo
exec .venv/bin/ectier demo "$@"
