"""The fused selection op ``graft::merge_select`` (graft_spec/kernels/select.py): equal to its torch
reference under Triton's interpreter, one op to the dispatcher, traceable.

The bit-for-bit comparisons: tests/interpret/test_select_interpreted.py, run by tests/test_kernels.py
in a subprocess under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations


import torch

from graft_spec.kernels.views import Candidates
from graft_spec.config import GraftPolicy
from graft_spec.merge import merge_select



def _cands(b=3, u=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, u)])
                           for _ in range(b)])
    est = torch.rand(b, u, generator=g)
    return Candidates(torch.randint(0, 4, (b, u), generator=g), parents, est, torch.rand(b, u, generator=g) < 0.9,
                      torch.randint(-1, 30, (b, u), generator=g), torch.randint(0, 6, (b, u), generator=g))


SAMPLED = torch.tensor([True, False, True])
TABLE = torch.linspace(0, 1, 64)


POLICY = GraftPolicy(root_width=2)


def _select(cands, n=6, sampled=SAMPLED, table=TABLE):
    return merge_select(cands, n, POLICY, gain_nodes=n + 2, sampled=sampled, agreement=(10, table))


def _flat(out):
    tree, member_bins, gain = out
    return tree.tokens, tree.parents, tree.logp, tree.source, member_bins, gain


def test_merge_select_is_one_op_inside_fused_ops_everywhere():
    """Inside `fused_ops_everywhere`, `merge_select` on CPU is the one op ``graft::merge_select``
    (its implementation: the reference), with the reference's results."""
    from graft_spec.kernels import fused_ops_everywhere
    from sglang_patch.bench.step import OpCounter

    cands = _cands()
    ref = _flat(_select(cands))
    with fused_ops_everywhere(), OpCounter() as c:
        fused = _flat(_select(cands))
    assert c.ops == 1 and c.names == {"merge_select": 1}
    assert all(torch.equal(a, r) for a, r in zip(fused, ref))
    with OpCounter() as c:
        _select(cands)
    assert c.ops > 1                                    # CPU: the reference's own ops


def test_merge_select_op_traces():
    """The op's fake implementation gives the real shapes and dtypes: ``make_fx`` records one call and
    ``torch.compile(fullgraph=True)`` runs it without a graph break."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graft_spec.kernels import fused_ops_everywhere

    cands = _cands()
    ref = _flat(_select(cands))

    def fn(tokens, parents, est, valid, bins, member, sampled, table):
        return _flat(_select(Candidates(tokens, parents, est, valid, bins, member), sampled=sampled, table=table))

    args = (cands.tokens, cands.parents, cands.est, cands.valid, cands.bins, cands.member, SAMPLED, TABLE)
    with fused_ops_everywhere():
        gm = make_fx(fn, tracing_mode="fake")(*args)
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert [str(n.target) for n in calls if "graft" in str(n.target)] == ["graft.merge_select.default"]
        compiled = torch.compile(fn, fullgraph=True, dynamic=False)(*args)
    for a, r in zip(compiled, ref):
        assert a.dtype == r.dtype and torch.equal(a, r)


def test_merge_select_calls_the_reference_when_switched_off(monkeypatch):
    from graft_spec.kernels import dispatch as layout
    from graft_spec.kernels import fused_ops_everywhere
    from sglang_patch.bench.step import OpCounter

    monkeypatch.setenv(layout.REFERENCE_ENV, "1")
    with fused_ops_everywhere(), OpCounter() as c:
        _select(_cands())
    assert c.ops > 1
