#!/usr/bin/env bash
# Create .venv (if needed) and install ectier with the given extras. Usage: scripts/bootstrap.sh test,demo
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-demo}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch: users bring vLLM's build; here we pin the CPU build 2.13.0 when none is installed
# (an unpinned torch would pull a multi-GB CUDA build).
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/pip install --quiet "torch==2.13.0"
fi
.venv/bin/pip install --quiet -e ".[${extras}]"
# the Mooncake client (test / mooncake extras) loads Debian's libibverbs1; install it as root
case ",${extras}," in
  *,test,*|*,mooncake,*)
    if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1
    fi
    ;;
esac
