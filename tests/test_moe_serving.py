"""A Qwen3-MoE target on CPU (issue 46): graft and EAGLE3 at ``--tp-size 2`` against single-rank no-spec.

The pair is ``models/moe-quick`` (``scripts/make_models.py --preset moe-quick``: a 4-layer
``Qwen3MoeForCausalLM``, 8 experts, top-2 routing, the quick pair's tokenizer, and its EAGLE-3
head), built on demand here the way tests/conftest.py builds ``models/quick`` (a few seconds when it
is up to date). SGLang 0.5.23 runs the MoE layers through ``FusedMoE`` with the unquantized
method's torch path on a plain CPU (``layers/quantization/unquant.py``), and the EAGLE-3 capture
through ``Qwen3MoeForCausalLM.set_eagle3_layers_to_capture`` (``models/qwen3_moe.py``).

What must hold:
* graft at TP 2 gives, greedily, token for token the single-rank no-spec outputs at concurrency 1
  and 8 (one server for both), and speculates (accept length > 1);
* EAGLE3 at TP 2 with ``--ep-size 2`` (the 8 experts split over the two ranks) gives the same
  outputs (concurrency 8).

Three server starts (1-2 min each on 2 cores): the single-rank reference, graft at TP 2 (concurrency 1
and 8 on one server) and EAGLE3 at TP 2 with ``--ep-size 2``. Expert parallelism on CPU runs through
two CPU-layer hooks (``sglang_patch/cpu/moe.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_server import accept_length, generate_many, serve  # noqa: E402
from test_sglang_graft_server import CODE, COMMON, QUICK, SHAPE  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MOE = Path(os.environ.get("GRAFT_MOE_MODELS", ROOT / "models" / "moe-quick"))

pytestmark = [
    pytest.mark.server,
    pytest.mark.models,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not (QUICK / "DONE").exists(), reason="quick models missing (their tokenizer gives the prompts)"),
]

#: prompts and length: fewer than the dense TP tests, the MoE forward is slower on CPU
N_PROMPTS = 8
MAX_NEW = 48
PROMPTS = CODE[:N_PROMPTS]
TP2 = ["--tp-size", "2"]
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}


def _spec(algorithm: str) -> list[str]:
    return ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(MOE / "draft"), *SHAPE]


@pytest.fixture(scope="module")
def moe_models() -> Path:
    """``models/moe-quick`` built or refreshed (make_models skips every up-to-date stage)."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_models.py"), "--preset", "moe-quick",
                    "--out", str(MOE)], check=True)
    return MOE


@pytest.fixture(scope="module")
def reference(moe_models) -> list[list[int]]:
    """Single-rank greedy output ids of the MoE target without speculation (concurrency 1)."""
    with serve(moe_models / "target", COMMON, name="moe_ref") as srv:
        return [o["output_ids"] for o in generate_many(srv.url, PROMPTS, concurrency=1, max_new_tokens=MAX_NEW)]


def _check_equal(outs: list[dict], reference: list[list[int]], what: str) -> None:
    bad = [i for i, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
    assert not bad, f"{what}: prompts {bad} differ from the single-rank no-spec output"


def test_moe_target_generates(reference):
    """The reference itself is not degenerate: every prompt decodes MAX_NEW tokens or stops at EOS."""
    assert len(reference) == N_PROMPTS and all(len(r) > 1 for r in reference)


def test_moe_tp2_graft_equals_single_rank_no_spec(moe_models, reference):
    """Also: the batch budget's width states are built before the server is ready, reported in
    ``/server_info``, and SGLang's per-switch INFO line is gone (debug level)."""
    with serve(moe_models / "target", [*COMMON, *TP2, *_spec("graft")], name="moe_tp2_graft", env=TP_ENV) as srv:
        for c in (1, 8):
            outs = generate_many(srv.url, PROMPTS, concurrency=c, max_new_tokens=MAX_NEW)
            _check_equal(outs, reference, f"graft TP2 concurrency {c}")
            print(f"\nMoE graft TP2 concurrency {c}: accept length {accept_length(outs):.3f}")
            if c == 1:
                assert accept_length(outs) > 1.2
        info = httpx.get(f"{srv.url}/server_info", timeout=60).json()
        log = srv.log_tail(2_000_000)
    mem = info["internal_states"][0]["graft"]["worker"]["memory_beyond_eagle3"]
    print(f"\nMoE graft TP2 memory beyond EAGLE-3 (bytes): {mem}")
    assert sorted(mem["width_states_by_width"]) == ["1", "12"] or sorted(mem["width_states_by_width"]) == [1, 12]
    assert mem["planner"] > 0 and mem["total"] >= mem["planner"]
    assert mem["widths_sharing_draft_decode"] == [12]   # one draft decode state for widths 12 and 24
    built, ready = log.find("runtime states built"), log.find("The server is fired up")
    assert 0 <= built < ready, "the width states must be built before the server says it is ready"
    assert "Built adaptive runtime state" not in log[ready:], "a width state was built after ready"
    assert "Switch adaptive runtime state" not in log, "state switches should log at debug level"


def test_moe_tp2_ep2_eagle3_equals_single_rank_no_spec(moe_models, reference):
    """EAGLE3 at TP 2 with the experts split over the ranks (``--ep-size 2``)."""
    args = [*COMMON, *TP2, "--ep-size", "2", *_spec("EAGLE3")]
    with serve(moe_models / "target", args, name="moe_tp2_ep2_eagle3", env=TP_ENV) as srv:
        outs = generate_many(srv.url, PROMPTS, concurrency=8, max_new_tokens=MAX_NEW)
    _check_equal(outs, reference, "EAGLE3 TP2 EP2 concurrency 8")
    print(f"\nMoE EAGLE3 TP2 EP2 concurrency 8: accept length {accept_length(outs):.3f}")
