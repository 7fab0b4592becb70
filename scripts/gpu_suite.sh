#!/usr/bin/env bash
# On a GPU machine, one call: run the GPU tests and benchmarks, print the table last.
# Usage: scripts/gpu_suite.sh [--quick] [--device cuda:0]   (JSON to $OUT/gpu_suite.json when OUT is set)
#
# Which Python: if the machine's python3 already has a CUDA build of torch (a GPU box with its own
# torch, e.g. vLLM's), ectier runs from this checkout on that interpreter (PYTHONPATH), so nothing
# is installed and the CPU torch of scripts/bootstrap.sh never replaces the CUDA one. ectier's own
# small dependencies that are missing there (typically lmdb, zstandard) can be brought as wheels in
# .whl/ (no network needed on the GPU machine; see docs/benchmarks.md "GPU suite"). Otherwise the
# usual venv is bootstrapped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ectier-site .whl/*.whl
    export PYTHONPATH="/tmp/ectier-site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$PWD:$PWD/bindings${PYTHONPATH:+:$PYTHONPATH}"
  missing=$("$PY" - <<'PY'
import importlib.util
print(" ".join(m for m in ("lmdb", "zstandard", "xxhash", "msgpack", "yaml", "click", "rich", "prometheus_client", "pytest")
               if importlib.util.find_spec(m) is None))
PY
)
  if [ -n "$missing" ]; then
    echo "gpu_suite.sh: $PY has CUDA torch but lacks: $missing (bring them as wheels in .whl/, see docs/benchmarks.md)" >&2
    exit 1
  fi
  exec "$PY" benchmarks/gpu_suite.py "$@"
fi
scripts/bootstrap.sh test
exec .venv/bin/python benchmarks/gpu_suite.py "$@"
