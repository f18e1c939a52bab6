"""The fused kernels (graft_spec/kernels/) against their torch references, and how the step uses them.

The bit-for-bit comparisons run in a subprocess under ``TRITON_INTERPRET=1`` (Triton must see the
switch before it is imported; this session's Triton was imported by SGLang already):
tests/interpret/test_kernels_interpreted.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_fused_kernels_equal_their_references_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{ROOT}")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "interpret" / "test_kernels_interpreted.py")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail


def test_layout_op_is_one_dispatch_and_the_reference_on_cpu():
    """``graft::tree_layout`` is one op to the dispatcher (the step's op counter counts one launch)
    and computes the reference on CPU; `tree_layout` on CPU tensors calls the reference directly."""
    from graft_spec.kernels import layout
    from sglang_patch.bench.step import OpCounter

    parents = torch.tensor([[-1, 0, 0, 1, 3, 2], [-1, 0, 1, 0, 3, 3]])
    seq = torch.tensor([7, 11])
    with OpCounter() as c:
        fused = torch.ops.graft.tree_layout(parents, seq)
    assert c.ops == 1
    ref = layout.layout_reference(parents, seq)
    assert all(torch.equal(a, r) for a, r in zip(fused, ref))
    with OpCounter() as c:
        layout.tree_layout(parents, seq)
    assert c.ops > 1                                    # CPU: the reference's own ops, counted as they run


def test_reference_switch(monkeypatch):
    from graft_spec.kernels import layout

    monkeypatch.setenv(layout.REFERENCE_ENV, "1")
    assert not layout.fused_enabled()
    monkeypatch.setenv(layout.REFERENCE_ENV, "0")
    assert layout.fused_enabled() == (layout.triton is not None)
