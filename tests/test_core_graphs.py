"""`StepGraphs`: the graft step replayed from CUDA graphs equals the eager step, for padded batches,
every captured width and tables that `observe` keeps updating between rounds.

The replay tests need a CUDA device (they run on the lent GPU machine, scripts/bench_step_cuda.py
prints the same check per shape); on CPU the eager fallback is what the worker runs and is tested.
"""

from __future__ import annotations

import pytest
import torch

from graft_spec.config import GraftConfig
from graft_spec.graphs import StepGraphs
from graft_spec.pipeline import GraftPlanner
from graft_spec.retrieval.buffer import HostCandidates
from graft_spec.step import DraftCandidates

from test_core_step import dense_inputs

TOPK, STEPS, VOCAB = 4, 4, 5000
S = TOPK + (STEPS - 1) * TOPK * TOPK
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _planner(device: str) -> GraftPlanner:
    cfg = GraftConfig(num_draft_tokens=24, topk=TOPK, depth=STEPS)
    planner = GraftPlanner(cfg, VOCAB, device=device, max_batch=32, max_slots=32)
    planner.ensure_slots(32)
    return planner


def _inputs(b: int, seed: int, device: str, width: int):
    draft, roots, host, slots, seq_lens, sampled = dense_inputs(b, TOPK, STEPS, VOCAB, width, "cpu",
                                                                torch.Generator().manual_seed(seed))
    mv = lambda t: t.to(device)  # noqa: E731
    draft = DraftCandidates(*(mv(getattr(draft, f)) for f in ("tokens", "parents", "logq", "depth")))
    host = HostCandidates(*(mv(getattr(host, f)) for f in ("tokens", "parents", "logp", "member", "match",
                                                           "anchor_len", "group", "speculate")))
    return draft, mv(roots), host, mv(slots.flip(0)), mv(seq_lens), mv(sampled)


def _same(a, b) -> bool:
    pairs = [(a.tree.tokens, b.tree.tokens), (a.tree.parents, b.tree.parents), (a.tree.source, b.tree.source),
             (a.positions, b.positions), (a.mask, b.mask), (a.first_child, b.first_child),
             (a.next_sibling, b.next_sibling), (a.member_bins, b.member_bins)]
    return all(torch.equal(x, y) for x, y in pairs) and torch.allclose(a.gain, b.gain)


def test_eager_fallback_without_a_capture():
    planner = _planner("cpu")
    graphs = StepGraphs(planner, S, buckets=[4, 16])
    args = _inputs(3, 0, "cpu", planner.buffer.width)
    assert _same(graphs.build(*args, num_nodes=12), planner.build(*args, num_nodes=12))
    assert graphs.eager == 1 and graphs.replays == 0
    with pytest.raises(RuntimeError, match="CUDA"):
        graphs.capture()
    with pytest.raises(ValueError, match="widths"):
        StepGraphs(planner, S, buckets=[4], widths=[1, 25])


@cuda
def test_replay_equals_eager_for_padded_batches_and_updated_tables():
    planner = _planner("cuda")
    graphs = StepGraphs(planner, S, buckets=[1, 4, 16])
    graphs.capture()
    assert graphs.captured == 3 * 2                               # widths 12 and 24 (1 is a plain round)
    for rnd, (b, width) in enumerate([(1, 24), (3, 12), (4, 24), (9, 24), (16, 12), (2, 24)]):
        args = _inputs(b, rnd, "cuda", planner.buffer.width)
        eager = planner.build(*args, num_nodes=width)
        replay = graphs.build(*args, num_nodes=width)
        assert replay.tree.tokens.shape == (b, width)
        assert _same(replay, eager), (b, width)
        # a verify outcome updates the tables the next replay reads in place
        on_path = torch.zeros(b, width, dtype=torch.bool, device="cuda")
        on_path[:, :2] = True
        accept = torch.full((b,), 1, dtype=torch.int64, device="cuda")
        planner.observe(replay, on_path, torch.randint(0, VOCAB, (b, width, planner.successor.k), device="cuda"),
                        torch.randint(0, VOCAB, (b, width), device="cuda"), accept + 1, args[3])
    assert graphs.replays == 6 and graphs.eager == 0
    args = _inputs(17, 9, "cuda", planner.buffer.width)              # above the largest bucket: eager
    assert _same(graphs.build(*args), planner.build(*args)) and graphs.eager == 1
