"""The fused device retrieval candidates (graft_spec/kernels/successor_part.py, chain_part.py) on CPU:
each op is one op to the dispatcher with the reference's results, and traceable. The kernels against
their references under Triton's interpreter: tests/interpret/test_device_sources_interpreted.py (run
by tests/test_kernels.py).
"""

from __future__ import annotations


import torch

from graft_spec.config import GraftConfig
from graft_spec.device_sources import ChainSource, SuccessorSource
from graft_spec.pipeline import GraftPlanner



def _warm_planner(seed: int, b: int = 4, outputs: str = "greedy"):
    """A planner after six observed rounds (calibrator, successor table, history and per-request
    windows warmed; as tests/test_core_step.py `test_build_reuses_the_gate_retrieval`), with an output
    index holding earlier answers to the rows' contexts, and one more round's inputs."""
    from test_core_step import dense_inputs

    topk, steps, n, vocab = 3, 4, 12, 32
    cfg = GraftConfig(num_draft_tokens=n, topk=topk, depth=steps, retrieval={"max_candidates": 16, "outputs": outputs})
    planner = GraftPlanner(cfg, vocab, max_slots=b)
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(b)
    ctx = torch.randint(0, 6, (b, 40), generator=gen)
    planner.reset_slots(slots, ctx, torch.full((b,), 40))
    if planner.outputs is not None:
        for row in ctx.tolist():
            planner.outputs.insert(row[-10:] + [int(t) for t in torch.randint(0, vocab, (12,), generator=gen)])
    for _ in range(6):
        draft, roots, host, _, seq, sampled = dense_inputs(b, topk, steps, vocab, 16, "cpu", gen)
        out = planner.build(draft, roots, host, slots, seq, sampled)
        on_path = torch.zeros(b, n, dtype=torch.bool)
        on_path[:, 0] = True
        on_path[:, 1] = torch.rand(b, generator=gen) < 0.5
        planner.observe(out, on_path, torch.randint(0, vocab, (b, n, planner.successor.k), generator=gen),
                        out.tree.tokens[:, :3], 1 + on_path[:, 1].long(), slots)
    draft, roots, host, _, seq, sampled = dense_inputs(b, topk, steps, vocab, 16, "cpu", gen)
    return planner, roots, host, slots, sampled


def _source_args(planner, kind, roots, host, slots, sampled):
    """The op arguments of the planner's ``kind`` source (`graft_spec.device_sources`) for one round."""
    from graft_spec.device_sources import RoundInputs

    hist, count = planner.history.gather(slots)
    r = RoundInputs(roots, host, hist, count, torch.full_like(roots, 16), sampled, planner.calibrator.table,
                    planner.factors(slots))
    return next(s for s in planner.step.sources if isinstance(s, kind)).args(r)


def _assert_same(a, r):
    for x, y in zip(a, r, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_successor_part_is_one_op_inside_fused_ops_everywhere():
    from graft_spec.kernels import fused_ops_everywhere
    from graft_spec.kernels.successor_part import successor_part, successor_part_reference
    from sglang_patch.bench.step import OpCounter

    planner, roots, host, slots, sampled = _warm_planner(0)
    args = _source_args(planner, SuccessorSource, roots, host, slots, sampled)
    ref = successor_part_reference(*args)
    with fused_ops_everywhere(), OpCounter() as c:
        fused = successor_part(*args)
    assert c.ops == 1 and c.names == {"successor_part": 1}
    _assert_same(fused, ref)
    with OpCounter() as c:
        successor_part(*args)
    assert c.ops > 1                                    # CPU: the reference's own ops


def test_chain_part_is_one_op_inside_fused_ops_everywhere():
    from graft_spec.kernels import fused_ops_everywhere
    from graft_spec.kernels.chain_part import chain_part, chain_part_reference
    from sglang_patch.bench.step import OpCounter

    planner, roots, host, slots, sampled = _warm_planner(0, outputs="on")
    args = _source_args(planner, ChainSource, roots, host, slots, sampled)
    ref = chain_part_reference(*args)
    with fused_ops_everywhere(), OpCounter() as c:
        fused = chain_part(*args)
    assert c.ops == 1 and c.names == {"chain_part": 1}
    _assert_same(fused, ref)
    with OpCounter() as c:
        chain_part(*args)
    assert c.ops > 1                                    # CPU: the reference's own ops


def test_device_source_ops_trace():
    """The fake implementations give the real shapes and dtypes (``make_fx`` in fake mode records one
    call of each op)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graft_spec.kernels.chain_part import chain_part, chain_part_reference
    from graft_spec.kernels.successor_part import successor_part, successor_part_reference

    planner, roots, host, slots, sampled = _warm_planner(0, outputs="on")
    s_args = _source_args(planner, SuccessorSource, roots, host, slots, sampled)
    c_args = _source_args(planner, ChainSource, roots, host, slots, sampled)
    for fused, args, ref in ((successor_part, s_args, successor_part_reference(*s_args)),
                             (chain_part, c_args, chain_part_reference(*c_args))):
        op = getattr(torch.ops.graft, fused.name)
        args = fused.flatten(*args)                     # the op's flat schema arguments
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

        def call(*ts, args=args, tensors=tensors, op=op):
            full = list(args)
            for i, t in zip(tensors, ts):
                full[i] = t
            return op(*full)

        gm = make_fx(call, tracing_mode="fake")(*[args[i] for i in tensors])
        calls = [nd for nd in gm.graph.nodes if nd.op == "call_function" and "graft" in str(nd.target)]
        assert len(calls) == 1
        out = [nd for nd in gm.graph.nodes if nd.op == "output"][0].args[0]
        for m, r in zip(out, ref, strict=True):
            assert m.meta["val"].shape == r.shape and m.meta["val"].dtype == r.dtype
