#!/usr/bin/env bash
# The README's main-job command: on a fresh CPU machine, install, serve a model pair (the shipped
# models/default when present, else the quick test pair made in ~2 min) with Graft and
# without speculation, print sampled completions as text, check the greedy outputs are identical to
# no speculation, and report the tokens/s ratio, how many decode rounds speculated (the batch budget
# runs a round as a plain decode step where speculating would not pay) and the tau of those rounds.
# Stops both servers.
#
#   bash scripts/quickstart.sh
#
# Knobs (environment): GRAFT_VENV (venv, default ./.venv), QUICKSTART_MODELS (default models/default),
# QUICKSTART_PROMPTS (JSONL, default data/humaneval_dev.jsonl), QUICKSTART_N (prompts, 8),
# QUICKSTART_MAX_NEW_TOKENS (96), QUICKSTART_GRAFT_CONFIG (default configs/default.yaml),
# QUICKSTART_ARGS (extra graft server flags, e.g. "--graft-retrieval suffix").
# --dtype float32: the bf16 checkpoints run in float32, so speculation and plain decoding round alike.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${GRAFT_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
MODELS="${QUICKSTART_MODELS:-$ROOT/models/default}"
PROMPTS="${QUICKSTART_PROMPTS:-$ROOT/data/humaneval_dev.jsonl}"
N="${QUICKSTART_N:-8}"
MAX_NEW="${QUICKSTART_MAX_NEW_TOKENS:-96}"

# 1. Environment (the one install recipe) when the venv is missing.
if [ ! -x "$PY" ]; then
  echo "quickstart: no venv at $VENV, running scripts/install_cpu.sh"
  bash scripts/install_cpu.sh
fi

# 2. Models: the shipped pair models/default when the checkout has it (scripts/ship_models.py),
#    else the tiny quick pair, built here in about two minutes (its text is mostly whitespace).
CONFIG="${QUICKSTART_GRAFT_CONFIG:-$ROOT/configs/default.yaml}"
if [ ! -f "$MODELS/DONE" ]; then
  if [ -n "${QUICKSTART_MODELS:-}" ]; then
    echo "quickstart: no models in $MODELS (make them with: $PY scripts/make_models.py --out $MODELS)" >&2
    exit 1
  fi
  MODELS="$ROOT/models/quick"
  CONFIG="${QUICKSTART_GRAFT_CONFIG:-$ROOT/configs/quick.yaml}"
  echo "quickstart: no shipped pair in models/default; making the quick models in $MODELS"
  "$PY" scripts/make_models.py --quick --out "$MODELS"
fi

# 3. Two servers on loopback, each in its own process group, always stopped on exit: Graft and the
#    same target without speculation (the reference for the greedy check and the tokens/s ratio).
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PIDS=()
stop_servers() {
  for pid in "${PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
}
trap stop_servers EXIT INT TERM
CPU_ARGS=(--dtype float32 --device cpu --attention-backend torch_native --disable-cuda-graph
          --mem-fraction-static 0.5 --max-total-tokens 65536 --sleep-on-idle --random-seed 0)
start_server() {  # name port args...
  local name=$1 port=$2; shift 2
  local log="${TMPDIR:-/tmp}/graft_quickstart_${name}_${port}.log"
  setsid "$PY" -m sglang.launch_server --model-path "$MODELS/target" "${CPU_ARGS[@]}" \
    --host 127.0.0.1 --port "$port" "$@" >"$log" 2>&1 &
  PIDS+=($!)
  disown $! 2>/dev/null || true  # stop_servers reaps it; no "Killed" job report
  echo "quickstart: $name server pid $! on 127.0.0.1:$port (log: $log)"
}
wait_healthy() {  # name port
  local pid=${PIDS[$3]} log="${TMPDIR:-/tmp}/graft_quickstart_$1_$2.log"
  for _ in $(seq 1 600); do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "quickstart: the $1 server exited during startup; last log lines:" >&2
      tail -n 40 "$log" >&2
      exit 1
    fi
    if "$PY" -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$2/health_generate', timeout=30).status_code != 200)" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  echo "quickstart: the $1 server never became healthy; last log lines:" >&2
  tail -n 40 "$log" >&2
  exit 1
}
GRAFT_PORT="$(free_port)"
REF_PORT="$(free_port)"
# shellcheck disable=SC2086
start_server graft "$GRAFT_PORT" --speculative-algorithm graft \
  --speculative-draft-model-path "$MODELS/draft" \
  --graft-config "$CONFIG" --graft-return-sources true ${QUICKSTART_ARGS:-}
start_server nospec "$REF_PORT"
wait_healthy graft "$GRAFT_PORT" 0
wait_healthy nospec "$REF_PORT" 1
grep -m1 "graft worker ready" "${TMPDIR:-/tmp}/graft_quickstart_graft_${GRAFT_PORT}.log" || true

# 4. Text, the greedy check against no speculation, the tokens/s ratio, speculated rounds and their tau.
"$PY" scripts/quickstart_client.py --url "http://127.0.0.1:$GRAFT_PORT" \
  --reference-url "http://127.0.0.1:$REF_PORT" --prompts "$PROMPTS" --n "$N" --max-new-tokens "$MAX_NEW"
