#!/usr/bin/env bash
# The vLLM suite (tests_vllm/): ECTierConnector inside vLLM 0.33's real Scheduler and model-runner
# EC mixin, on CPU, in .venv-vllm. Fails (never skips) when vllm cannot be imported or no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap_vllm.sh
export VLLM_TARGET_DEVICE=cpu
if ! .venv-vllm/bin/python -c "import vllm, ectier_vllm.connector" ; then
  echo "test_vllm.sh: vllm or ectier_vllm.connector cannot be imported in .venv-vllm; that is a failure" >&2
  exit 1
fi
set +e
.venv-vllm/bin/python -m pytest -c tests_vllm/pytest.ini tests_vllm "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test_vllm.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
