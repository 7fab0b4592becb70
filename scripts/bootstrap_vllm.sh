#!/usr/bin/env bash
# Create .venv-vllm (if needed): torch 2.13.0 CPU, vllm==0.33.0 WITHOUT its dependency set (which
# would pull a multi-GB CUDA stack and torchvision), then only the pure-Python packages vLLM's
# scheduler / EC-connector / model-runner-mixin imports need, each constrained to the version range
# the vllm wheel itself declares, and ectier (editable, no deps) with its own small deps.
# Idempotent: a stamp file records what was installed; a second run only checks the import.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV=.venv-vllm
VLLM_VERSION=0.33.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.ectier-bootstrap-$VLLM_VERSION-v3"
export VLLM_TARGET_DEVICE=cpu

# module imported -> distribution (names as vllm's metadata spells them)
PACKAGES=(
  packaging regex cachetools psutil numpy requests tqdm blake3 py-cpuinfo transformers
  huggingface_hub tokenizers safetensors protobuf pydantic prometheus_client pillow msgspec pyzmq
  cloudpickle pyyaml einops filelock cbor2 aiohttp oss-harmony openai pybase64 fastapi xgrammar
  partial-json-parser llguidance uvloop
)

check() {
  "$VENV/bin/python" - <<'PY'
import vllm, ectier_vllm.connector, pytest_timeout  # noqa: F401  (fails loudly if anything is missing)
import vllm.v1.core.sched.scheduler, vllm.v1.worker.ec_connector_model_runner_mixin  # noqa: F401
assert vllm.__version__.startswith("0.33."), vllm.__version__
PY
}

if [ -f "$STAMP" ] && check >/dev/null 2>&1; then
  echo "bootstrap_vllm: $VENV ready (vllm $VLLM_VERSION)"
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_() { "$VENV/bin/pip" --disable-pip-version-check "$@"; }
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  pip_ install --quiet "torch==$TORCH_VERSION"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm') == '$VLLM_VERSION'" >/dev/null 2>&1; then
  pip_ install --quiet --no-deps "vllm==$VLLM_VERSION"
fi
# the declared specifier of each package, read from the installed vllm wheel's metadata
mapfile -t REQS < <("$VENV/bin/python" - "${PACKAGES[@]}" <<'PY'
import sys, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
wanted = {canonicalize_name(n): n for n in sys.argv[1:]}
spec = {}
for r in md.requires("vllm") or []:
    req = Requirement(r)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if canonicalize_name(req.name) in wanted:
        spec[canonicalize_name(req.name)] = f"{req.name}{req.specifier}"
for key, name in wanted.items():
    print(spec.get(key, name))  # not declared by vllm (e.g. uvloop, via fastapi[standard]): unpinned
PY
)
# torch stays the one installed above: a constraint keeps pip from replacing it; every other
# package vllm declares is constrained to vllm's specifier, so one pulled in transitively (e.g.
# apache-tvm-ffi via xgrammar) gets the version vllm wants, not the newest
echo "torch==$TORCH_VERSION" > "$VENV/constraints-ectier.txt"
"$VENV/bin/python" - >> "$VENV/constraints-ectier.txt" <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for r in md.requires("vllm") or []:
    req = Requirement(r)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.url or not req.specifier or req.name.lower().startswith("torch"):
        continue
    print(f"{req.name}{req.specifier}")  # a constraint carries no extras
PY
pip_ install --quiet -c "$VENV/constraints-ectier.txt" "${REQS[@]}" 2>&1 | grep -v -E "^WARNING: Location|dependency conflicts|requires .* which is not installed|but you have torch" || true
# ectier itself (its own deps only; the [vllm] extra would pull vllm's full dependency set)
pip_ install --quiet -c "$VENV/constraints-ectier.txt" numpy lmdb zstandard xxhash msgpack click rich PyYAML \
  prometheus-client pytest pytest-timeout 2>&1 | grep -v -E "^WARNING: Location|dependency conflicts|requires .* which is not installed|but you have torch" || true
pip_ install --quiet --no-deps -e . 2>&1 | grep -v "^WARNING: Location" || true
# the Mooncake client, from the same sources as the core env's (scripts/bootstrap.sh, setup.py's
# mooncake extra; x86_64 Linux only): the `mooncake` variant of `ectier bench connectors` drives vLLM's
# ECMooncakeConnector with it (and its test in tests_vllm runs). Its deps (aiohttp, requests,
# msgpack) are already here. It loads libibverbs.so.1 (scripts/bootstrap.sh test installs
# libibverbs1). Best effort: without it that variant and its test skip, saying why.
if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] \
    && ! "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('mooncake') is None)"; then
  pip_ install --quiet -c "$VENV/constraints-ectier.txt" "mooncake-transfer-engine-non-cuda>=0.3.13" 2>&1 \
    | grep -v -E "^WARNING: Location|dependency conflicts|requires .* which is not installed|but you have torch" || true
  "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('mooncake') is None)" \
    || echo "bootstrap_vllm: the Mooncake client did not install; bench connectors' mooncake variant will skip" >&2
fi
# packages pulled in transitively (e.g. apache-tvm-ffi via xgrammar) that vllm also declares, at a
# version outside vllm's specifier: reinstall them as vllm declares them (pip's "vllm requires X==a,
# but you have X b" would otherwise be printed and the environment differ from a real vllm install)
mapfile -t FIX < <("$VENV/bin/python" - <<'PY'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement
for r in md.requires("vllm") or []:
    req = Requirement(r)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower().startswith("torch"):
        continue  # the CPU torch above stays
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        continue  # not installed: vllm's optional-at-runtime stack (CUDA, ...) is left out on purpose
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        print(f"{req.name}{req.specifier}")
PY
)
if [ "${#FIX[@]}" -gt 0 ]; then
  pip_ install --quiet -c "$VENV/constraints-ectier.txt" "${FIX[@]}" 2>&1 \
    | grep -v -E "^WARNING: Location|dependency conflicts|requires .* which is not installed|but you have torch" || true
fi
check
touch "$STAMP"
echo "bootstrap_vllm: $VENV ready (vllm $VLLM_VERSION, $(du -sh "$VENV" | cut -f1))"
