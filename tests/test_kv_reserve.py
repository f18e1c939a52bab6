"""The batch budget's KV reserve (sglang_patch/kv_reserve.py) without a server: the plan, the estimate
and the hook's pass-through. The server side (the pool smaller by the reserve) is
tests/test_sglang_graft_server.py::TestBatchBudget::test_kv_pool_is_smaller_by_the_reserve."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from sglang_patch import kv_reserve
from sglang_patch.memory import FLASHINFER_WORKSPACE_BYTES

MIB = kv_reserve.MIB


def test_plan_keeps_every_width_that_fits():
    plan = kv_reserve.plan_reserve(1000 * MIB, (1, 12, 24), 24, {1: 10 * MIB, 12: 20 * MIB, 24: 30 * MIB})
    assert plan["widths"] == [1, 12, 24] and plan["dropped"] == []
    assert plan["reserve_bytes"] == 30 * MIB and plan["by_width"] == {1: 10 * MIB, 12: 20 * MIB}


def test_plan_drops_the_widest_extra_width_first_and_width_1_last():
    per = {1: 300 * MIB, 12: 300 * MIB, 18: 300 * MIB, 24: 0}
    plan = kv_reserve.plan_reserve(1000 * MIB, (1, 12, 18, 24), 24, per)
    assert plan["widths"] == [1, 24] and plan["dropped"] == [12, 18] and plan["reserve_bytes"] == 300 * MIB
    plan = kv_reserve.plan_reserve(100 * MIB, (1, 12, 24), 24, per)
    assert plan["widths"] == [24] and plan["reserve_bytes"] == 0
    assert kv_reserve.plan_reserve(-5, (1, 24), 24, per)["widths"] == [24]


def test_estimate_counts_the_flashinfer_workspace_and_graph_buffers():
    shape = dict(graph_max_bs=8, context=4096)
    assert kv_reserve.estimate_width_bytes(12, backend="torch_native", graphs=False, **shape) == 0
    assert kv_reserve.estimate_width_bytes(12, backend="flashinfer", graphs=False, **shape) == FLASHINFER_WORKSPACE_BYTES
    # target verify + draft extend: int32 KV indices and a uint8 tree mask per (token, context position);
    # no draft decode buffers (the full width's are shared): the draft depth and top-k do not enter
    graphs = 2 * (4 + 1) * 8 * 12 * 4096
    assert kv_reserve.estimate_width_bytes(12, backend="fa3", graphs=True, **shape) == graphs
    assert kv_reserve.estimate_width_bytes(1, backend="fa3", graphs=True, **shape) == 2 * 5 * 8 * 1 * 4096


def test_hook_passes_other_servers_through():
    draft = SimpleNamespace(is_draft_worker=True, spec_algorithm=SimpleNamespace(name="GRAFT"))
    other = SimpleNamespace(is_draft_worker=False, spec_algorithm=SimpleNamespace(name="EAGLE3"))
    assert kv_reserve.reserve_after_profile(123, draft, 0) == 123
    assert kv_reserve.reserve_after_profile(123, other, 0) == 123


def test_hook_failure_keeps_the_profiled_bytes(caplog):
    broken = SimpleNamespace(is_draft_worker=False, spec_algorithm=SimpleNamespace(name="GRAFT"), server_args=None)
    with caplog.at_level(logging.WARNING, logger=kv_reserve.__name__):
        assert kv_reserve.reserve_after_profile(456, broken, 0) == 456
    assert "no KV reserve" in caplog.text


@pytest.fixture
def planned(monkeypatch):
    plan = {"widths": [1, 24], "dropped": [12], "reserve_bytes": 64 * MIB, "by_width": {1: 64 * MIB}}
    monkeypatch.setattr(kv_reserve, "_plan", dict(plan))
    return plan


def test_kept_widths_follow_the_plan(planned, monkeypatch):
    assert kv_reserve.kept_widths((1, 12, 24)) == (1, 24)
    monkeypatch.setattr(kv_reserve, "_plan", {})
    assert kv_reserve.kept_widths((1, 12, 24)) == (1, 12, 24)


def test_check_built_warns_only_beyond_the_reserve(planned, caplog):
    with caplog.at_level(logging.WARNING, logger=kv_reserve.__name__):
        kv_reserve.check_built({1: 70 * MIB})
        assert not caplog.text
        kv_reserve.check_built({1: 200 * MIB})
    assert "over the 64 MiB reserved" in caplog.text and "at least 200" in caplog.text
    assert kv_reserve.summary()["built_bytes"] == 200 * MIB and kv_reserve.summary()["by_width"] == {"1": 64 * MIB}


def test_registered_only_in_scheduler_processes_and_once(check_hook_registration):
    from sglang.srt.plugins.hook_registry import HookType

    check_hook_registration(kv_reserve.register_kv_reserve, kv_reserve.SCHEDULER_MODULE, kv_reserve.TARGET,
                            kv_reserve.reserve_after_profile, HookType.AFTER)
