"""The fused host-proposal op ``graft::host_part`` (graft_spec/kernels/host_part.py) on CPU: the
identity correction prices as none, the op is one op to the dispatcher, traceable, and switched off
by ``GRAFT_REFERENCE_KERNELS=1``. The kernel against its reference under Triton's interpreter:
tests/interpret/test_host_part_interpreted.py (run by tests/test_kernels.py).
"""

from __future__ import annotations


import torch

from graft_spec.kernels.host_part import host_part, host_part_reference
from graft_spec.retrieval.buffer import HostCandidates
from interpret.test_host_part_interpreted import case_args, host_case



def _host(case: dict) -> HostCandidates:
    b = case["tokens"].shape[0]
    return HostCandidates(case["tokens"], case["parents"], case["logp"], case["member"], case["match"],
                          case["anchor_len"], torch.zeros(b, dtype=torch.int64))


def test_identity_correction_is_no_correction():
    """``apply_correction(est, 1, False)`` is ``est`` bit for bit on every float32 of [0, 1] the table can
    hold: the op with the identity equals the uncorrected step."""
    from graft_spec.numerics.correction import apply_correction

    est = torch.cat([torch.rand(100000), torch.tensor([0.0, 1.0, 1e-45, 1e-38, 0.5, 1 - 2 ** -24])])
    out = apply_correction(est, torch.ones(()), torch.zeros((), dtype=torch.bool))
    assert torch.equal(out.view(torch.int32), est.view(torch.int32))


def test_host_part_is_one_op_inside_fused_ops_everywhere():
    """Inside `fused_ops_everywhere`, `host_part` on CPU is the one op ``graft::host_part`` (its
    implementation: the reference), with the reference's results; outside it, the reference's ops."""
    from graft_spec.kernels import fused_ops_everywhere
    from sglang_patch.bench.step import OpCounter

    args = case_args(host_case(7, 3, 24))
    ref = host_part_reference(*args)
    with fused_ops_everywhere(), OpCounter() as c:
        fused = host_part(*args)
    assert c.ops == 1 and c.names == {"host_part": 1}
    # tokens and members: copies (an op returns no input)
    assert fused[0] is not args[0].tokens and fused[5] is not args[0].member
    assert all(torch.equal(a, r) for a, r in zip(fused, ref))
    with OpCounter() as c:
        host_part(*args)
    assert c.ops > 1                                                # CPU: the reference's own ops


def test_host_part_op_traces():
    """The op's fake implementation gives the real shapes and dtypes: ``make_fx`` records one call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graft_spec.kernels import fused_ops_everywhere

    from graft_spec.kernels.host_part import host_part as op

    args = case_args(host_case(8, 2, 16))
    tensors = op.flatten(*args)
    per_mode = tensors.pop()                     # the one int: the layout's per_mode, last

    def fn(*ts):
        return host_part(*op.unflatten([*ts, per_mode]))

    with fused_ops_everywhere():
        gm = make_fx(fn, tracing_mode="fake")(*tensors)
    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "graft" in str(n.target)]
    assert calls == ["graft.host_part.default"]
    out = gm(*tensors)
    ref = host_part_reference(*args)
    assert all(a.dtype == r.dtype and torch.equal(a, r) for a, r in zip(out, ref))


def test_host_part_calls_the_reference_when_switched_off(monkeypatch):
    from graft_spec.kernels import dispatch as layout
    from graft_spec.kernels import fused_ops_everywhere
    from sglang_patch.bench.step import OpCounter

    monkeypatch.setenv(layout.REFERENCE_ENV, "1")
    with fused_ops_everywhere(), OpCounter() as c:
        host_part(*case_args(host_case(9, 2, 8)))
    assert c.ops > 1
