#!/usr/bin/env bash
# The README's main-job command: on a fresh CPU machine, install, make the quick models, serve Graft
# with SGLang, send real prompts, print the outputs and the mean accept length, stop the server.
#
#   bash scripts/quickstart.sh
#
# Knobs (environment): GRAFT_VENV (venv, default ./.venv), QUICKSTART_MODELS (default models/quick),
# QUICKSTART_PROMPTS (JSONL, default data/humaneval_dev.jsonl), QUICKSTART_N (prompts, 8),
# QUICKSTART_MAX_NEW_TOKENS (96), QUICKSTART_PORT (free port), QUICKSTART_GRAFT_CONFIG (default
# configs/quick.yaml), QUICKSTART_ARGS (extra server flags, e.g. "--graft-retrieval suffix").
# --dtype float32: SGLang would otherwise run the float32 quick models in float16.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${GRAFT_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
MODELS="${QUICKSTART_MODELS:-$ROOT/models/quick}"
PROMPTS="${QUICKSTART_PROMPTS:-$ROOT/data/humaneval_dev.jsonl}"
N="${QUICKSTART_N:-8}"
MAX_NEW="${QUICKSTART_MAX_NEW_TOKENS:-96}"

# 1. Environment (the one install recipe) when the venv is missing.
if [ ! -x "$PY" ]; then
  echo "quickstart: no venv at $VENV, running scripts/install_cpu.sh"
  bash scripts/install_cpu.sh
fi

# 2. Small real models (reused when complete: the DONE marker is written last).
if [ ! -f "$MODELS/DONE" ]; then
  echo "quickstart: making the quick models in $MODELS"
  "$PY" scripts/make_models.py --quick --out "$MODELS"
fi

# 3. The Graft server on loopback, in its own process group; always stopped on exit.
PORT="${QUICKSTART_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}"
LOG="${TMPDIR:-/tmp}/graft_quickstart_${PORT}.log"
SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
}
trap stop_server EXIT INT TERM

# shellcheck disable=SC2086
setsid "$PY" -m sglang.launch_server \
  --model-path "$MODELS/target" \
  --speculative-algorithm graft \
  --speculative-draft-model-path "$MODELS/draft" \
  --graft-config "${QUICKSTART_GRAFT_CONFIG:-$ROOT/configs/quick.yaml}" \
  --dtype float32 --device cpu --attention-backend torch_native --disable-cuda-graph \
  --mem-fraction-static 0.5 --max-total-tokens 65536 --sleep-on-idle \
  --host 127.0.0.1 --port "$PORT" ${QUICKSTART_ARGS:-} >"$LOG" 2>&1 &
SERVER_PID=$!
disown "$SERVER_PID" 2>/dev/null || true  # stop_server reaps it; no "Killed" job report
echo "quickstart: server pid $SERVER_PID on 127.0.0.1:$PORT (log: $LOG)"

for _ in $(seq 1 600); do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "quickstart: the server exited during startup; last log lines:" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
  if "$PY" - "$PORT" <<'PY' 2>/dev/null; then break; fi
import sys, httpx
sys.exit(0 if httpx.get(f"http://127.0.0.1:{sys.argv[1]}/health_generate", timeout=30).status_code == 200 else 1)
PY
  sleep 1
done
if ! "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health', timeout=10).status_code != 200)"; then
  echo "quickstart: server not healthy; last log lines:" >&2
  tail -n 40 "$LOG" >&2
  exit 1
fi
grep -m1 "graft worker ready" "$LOG" || true

# 4. Real prompts, outputs, accept lengths.
"$PY" scripts/quickstart_client.py --url "http://127.0.0.1:$PORT" --prompts "$PROMPTS" \
  --n "$N" --max-new-tokens "$MAX_NEW"
echo "quickstart: per-request graft lines from the server log:"
grep "graft request" "$LOG" | tail -n "$N" || true
