"""Every fused op of the planner's round, kernel against reference inside the planner itself
(`graft_spec.kernels.shadow`), run by Triton's interpreter on CPU tensors: greedy and sampled rows
mixed, several rounds, so each op sees the inputs the ops before it made.

Collected in the main test run, these tests skip unless ``TRITON_INTERPRET=1`` was set before
Triton was imported; tests/test_kernels.py runs this file in a subprocess with it set.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before Triton is imported (tests/test_kernels.py)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shadow_rounds import ROUND_OPS, shadow_rounds  # noqa: E402


def test_every_op_of_the_planners_round_equals_its_reference():
    log = shadow_rounds(b=3, n=12, vocab=300, device="cpu", rounds=2)
    assert not log.mismatches, log.mismatches
    assert ROUND_OPS <= set(log.calls), sorted(log.calls)
