#!/usr/bin/env bash
# The GPU checks in one command, for a CUDA machine that has torch, Triton and pytest but no package
# registry and no SGLang (the lent device machines):
#
#   here, with the registry:   bash scripts/device_check.sh --prepare   # pydantic wheels into .device/
#   there, in one call:        bash scripts/device_check.sh             # carry: [".device"]
#
# Writes into $OUT (default ./device_out): device.txt (GPU, torch, Triton), tests.log (the CUDA tests
# of tests/test_core_graphs.py: StepGraphs replays equal eager builds, many rounds with no eager build
# in between end in the eager planner state; of tests/test_kernels_cuda.py: every fused op against its
# reference inside the planner's rounds at N 24 / 60, batch 1 / 64, greedy and sampled rows, the Qwen3
# vocabulary, and tree sampling at that vocabulary with the same coins; of tests/test_tree_attention.py:
# the paged tree attention kernel against its reference on random trees at Qwen3-8B's heads) and
# step_cuda.json / step_cuda.log (scripts/bench_step_cuda.py --forward: kernels and ms per round, replayed vs eager, fused trees vs the
# torch reference, beside a Qwen3-8B-shaped verify forward and an EAGLE-3 head round).
# GRAFT_DEVICE_BENCH_ARGS adds arguments to the benchmark (e.g. "--batches 64 --nodes 60").
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/.device/wheels"

if [ "${1:-}" = "--prepare" ]; then
  # the device's python3 is CPython 3.12 on x86-64 (/work/.library/device/KINDS.md); pydantic is the
  # only import of graft_spec that its image lacks
  mkdir -p "$WHEELS"
  python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" "pydantic>=2.5"
  grep -qxF "/.device/" "$ROOT/.git/info/exclude" 2>/dev/null || echo "/.device/" >> "$ROOT/.git/info/exclude"
  ls "$WHEELS"
  exit 0
fi

cd "$ROOT"
OUT="${OUT:-$ROOT/device_out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1 GRAFT_NO_MODEL_BUILD=1
python3 -c "import pydantic" 2>/dev/null || python3 -m pip install --quiet --no-index --find-links "$WHEELS" pydantic
{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
'device', torch.cuda.get_device_name())"; } 2>&1 | tee "$OUT/device.txt"
# one call of at most GRAFT_DEVICE_BUDGET_S seconds (default 330: the lent machines' per-call limit is
# 600 s and a check must leave time to run it again); each step gets at most what is left
DEADLINE=$((SECONDS + ${GRAFT_DEVICE_BUDGET_S:-330}))
left() { local l=$((DEADLINE - SECONDS)); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
timeout "$(left 150)" python3 -m pytest -q -p no:cacheprovider tests/test_core_graphs.py tests/test_kernels_cuda.py \
  tests/test_tree_attention.py 2>&1 | tee "$OUT/tests.log"
# shellcheck disable=SC2086
timeout "$(left 230)" python3 scripts/bench_step_cuda.py --json "$OUT/step_cuda.json" --forward \
  ${GRAFT_DEVICE_BENCH_ARGS:-} 2>&1 | tee "$OUT/step_cuda.log"
echo "device_check: $SECONDS s" | tee -a "$OUT/device.txt"
