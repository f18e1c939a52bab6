"""The torch ops each fused op's launcher issues besides its Triton launch, recorded in the
interpreter tests.

On a CUDA device every torch op is a kernel launch of its own, so a launcher that casts an input
(``.to(torch.int8)``), copies a strided view (``.contiguous()``) or post-processes an output
(``.bool()``, ``.log()``) costs one launch per call beyond its kernel. `install_op_recorder` wraps
every launcher of `LAUNCHERS` while the interpreted tests run (``TRITON_INTERPRET=1``, CPU tensors:
the same Python the CUDA path runs) and counts the aten ops dispatched inside it outside the Triton
launch itself, views and allocations excluded (neither launches a kernel); tests/test_kernels.py
reads the record and holds every launcher to 0.

    TRITON_INTERPRET=1 GRAFT_RECORD_LAUNCHER_OPS=/tmp/ops.json python -m pytest tests/interpret/...
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

ENV = "GRAFT_RECORD_LAUNCHER_OPS"
#: ``module:function`` of every fused op's CUDA launcher (the function its op registers for "cuda")
LAUNCHERS = (
    "graft_spec.kernels.draft_part:draft_part_triton", "graft_spec.kernels.draft_part:dense_draft_part_triton",
    "graft_spec.kernels.factors:factors_triton", "graft_spec.kernels.successor_part:successor_part_triton",
    "graft_spec.kernels.chain_part:chain_part_triton", "graft_spec.kernels.host_part:host_part_triton",
    "graft_spec.kernels.stack:stack_triton", "graft_spec.kernels.select:select_triton",
    "graft_spec.kernels.layout:layout_triton", "graft_spec.kernels.observe:observe_rows_triton",
    "graft_spec.kernels.successor:successor_update_triton", "graft_spec.kernels.refresh:refresh_triton",
    "graft_spec.kernels.tree_sample:tree_sample_triton", "sglang_patch.tree_mask:verify_mask_triton",
    "graft_spec.kernels.tree_attention:paged_tree_attention_triton",
    "graft_spec.kernels.inputs:load_rows_triton", "graft_spec.kernels.inputs:load_outcome_triton",
)
#: ops that launch no kernel: views and allocations
FREE_OPS = frozenset({"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "t",
                      "transpose", "as_strided", "alias", "detach", "split", "unbind", "diagonal", "unflatten",
                      "view_as", "split_with_sizes", "_reshape_alias", "empty", "empty_like", "empty_strided",
                      "new_empty", "new_empty_strided"})


class _Ops(TorchDispatchMode):
    """Counts aten ops outside Triton launches (`paused` while the interpreter runs a kernel)."""

    def __init__(self):
        super().__init__()
        self.paused = 0
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.paused and name not in FREE_OPS:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


def install_op_recorder(path: str) -> None:
    """Wrap every launcher of `LAUNCHERS` (module attributes, before the tests import them) and write
    ``{launcher: {"calls", "launches", "extra_ops" (the most in one call), "names"}}`` to ``path`` at exit."""
    from triton.runtime.interpreter import InterpretedFunction

    record: dict[str, dict] = {}
    active: list[_Ops] = []
    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        for mode in active:
            mode.paused += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            for mode in active:
                mode.paused -= 1
            if active:
                active[-1].launches += 1

    InterpretedFunction.run = counted_run

    def wrap(key, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            mode = _Ops()
            mode.launches = 0
            active.append(mode)
            try:
                with mode:
                    return fn(*args, **kwargs)
            finally:
                active.pop()
                entry = record.setdefault(key, {"calls": 0, "launches": 0, "extra_ops": 0, "names": []})
                entry["calls"] += 1
                entry["launches"] = max(entry["launches"], mode.launches)
                if len(mode.names) > entry["extra_ops"]:
                    entry["extra_ops"], entry["names"] = len(mode.names), sorted(set(mode.names))
        return counted

    for key in LAUNCHERS:
        mod, name = key.split(":")
        module = importlib.import_module(mod)
        setattr(module, name, wrap(key, getattr(module, name)))
    atexit.register(lambda: Path(path).write_text(json.dumps(record, indent=1, sort_keys=True)))
