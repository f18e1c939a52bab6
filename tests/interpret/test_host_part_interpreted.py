"""The fused host-proposal kernel (graft_spec/kernels/host_part.py) against `host_part_reference`, bit
for bit, run by Triton's interpreter on CPU.

Collected in the main test run, these tests skip unless ``TRITON_INTERPRET=1`` was set before
Triton was imported; tests/test_kernels_host_part.py runs this file in a subprocess with it set. The
interpreter costs ~0.1 s per request and ~3 ms more per candidate (two M-step walks), so the big
batches are fixed examples with narrow rows and the wide rows come in small batches.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1 before Triton is imported "
                                       "(tests/test_kernels_host_part.py)")

NAMES = ("tokens", "parents", "est", "valid", "bins", "member")
KINDS = ("tree", "chain", "empty", "garbage")


@functools.lru_cache(maxsize=1)
def planner():
    """A default `GraftPlanner` (its step and calibrator: bin layout, edges, retrieval bases)."""
    from graft_spec.config import GraftConfig
    from graft_spec.pipeline import GraftPlanner

    return GraftPlanner(GraftConfig(), 500, max_slots=1)


def calibrator():
    return planner().calibrator


def _depths(parents: list[int]) -> list[int]:
    """1-based depths below the anchor of a row whose parents precede their children."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def host_case(seed: int, b: int, m: int, length: int = 32, vocab: int = 5, kinds=KINDS, nan: bool = True,
              gaps=None) -> dict:
    """Inputs of `host_part_reference` (``[b, m]`` host candidates, ``length``-token histories) built to
    hit every branch of the re-anchoring: gaps of 0, a few tokens, the history's count and length,
    beyond both, and negative; consumed prefixes that match the committed tokens (most) or not; deep
    chains and bushy trees; invalid members (-1) and out-of-range ones; -inf, 0 and NaN
    log-probabilities; rows as an empty buffer row leaves them (parent 0 at column 0: a cycle) and rows
    of arbitrary parents (cycles too); greedy and sampled rows; corrected and identity rows.
    ``gaps``: one gap for every row instead of drawn ones."""
    g = torch.Generator().manual_seed(seed)

    def rand() -> float:
        return float(torch.rand((), generator=g))

    def randint(lo: int, hi: int) -> int:       # inclusive
        return int(torch.randint(lo, hi + 1, (), generator=g))

    hist = torch.randint(0, vocab, (b, length), generator=g)
    count = torch.where(torch.rand(b, generator=g) < 0.6, length, torch.randint(0, length + 1, (b,), generator=g))
    seq = torch.randint(length, 4 * length, (b,), generator=g)
    tokens = torch.randint(0, vocab, (b, m), generator=g)
    parents = torch.full((b, m), -1, dtype=torch.int64)
    logp = torch.zeros(b, m)
    member = torch.full((b, m), -1, dtype=torch.int64)
    match = torch.randint(-1, 50, (b, m), generator=g)
    gap = torch.zeros(b, dtype=torch.int64)
    for r in range(b):
        c = int(count[r])
        gap[r] = gaps if gaps is not None else [0, 0, 1, 2, 3, 5, c, c + 1, length, length + 3, -1, -4,
                                                 randint(0, m + 1)][randint(0, 12)]
        kind = kinds[randint(0, len(kinds) - 1)]
        if kind == "empty":                               # HostCandidateBuffer's zeros, member -1
            parents[r] = 0
            tokens[r] = 0
            continue
        if kind == "garbage":                             # any parent < m: self-loops and cycles
            parents[r] = torch.randint(-2, m, (m,), generator=g)
            member[r] = torch.randint(-1, 6, (m,), generator=g)
            logp[r] = -torch.rand(m, generator=g) * 8
            continue
        chain = kind == "chain"
        par = [-1 if i == 0 else (i - 1 if chain and rand() < 0.85 else randint(-1, i - 1)) for i in range(m)]
        depth = _depths(par)
        gp = int(gap[r])
        for i in range(m):
            d = depth[i]
            if d <= gp and rand() < 0.9:                  # the committed token (a consumed match)
                tokens[r, i] = hist[r, min(max(length - gp + d - 1, 0), length - 1)]
            u = rand()
            step = 0.0 if u < 0.15 else (-math.inf if u < 0.18 else math.log(max(rand(), 1e-6)))
            if nan and u > 0.985:
                step = math.nan
            logp[r, i] = (logp[r, par[i]] if par[i] >= 0 else 0.0) + step
        parents[r] = torch.tensor(par)
        member[r] = torch.tensor([(-1, -1, 2, 2, 2, 3, 3, 3, 4, 5, 0, 6, 9)[randint(0, 12)] for _ in range(m)])
    anchor = seq + 1 - gap
    sampled = torch.rand(b, generator=g) < 0.5
    cal = calibrator()
    n = cal.table.numel()
    table = torch.rand(n, generator=g)
    table[torch.rand(n, generator=g) < 0.1] = 0.0
    table[torch.rand(n, generator=g) < 0.1] = 1.0
    from graft_spec.sources import NUM_MEMBERS

    nm = NUM_MEMBERS
    scale = torch.where(torch.rand(b, nm, generator=g) < 0.3, 1.0, torch.rand(b, nm, generator=g))
    under = torch.rand(b, nm, generator=g) < 0.5
    ident = torch.rand(b, generator=g) < 0.3
    scale[ident], under[ident] = 1.0, False
    return dict(tokens=tokens, parents=parents, logp=logp, match=match, member=member, anchor_len=anchor, hist=hist,
                count=count, seq_lens=seq, sampled=sampled, est_table=table, scale=scale, under=under)


def case_args(case: dict) -> tuple:
    """`host_part_reference`'s positional arguments for a `host_case`."""
    from graft_spec.kernels.views import HostBlock, Prices, Windows

    c = case
    return (HostBlock(c["tokens"], c["parents"], c["logp"], c["match"], c["member"], c["anchor_len"]),
            Windows(c["hist"], c["count"]), c["seq_lens"], c["sampled"],
            Prices(c["est_table"], c["scale"], c["under"]), calibrator().retrieval_view)


def _assert_kernel_equals_reference(case: dict) -> None:
    from graft_spec.kernels.host_part import host_part_reference, host_part_triton

    args = case_args(case)
    ref = host_part_reference(*args)
    for fused in (host_part_triton(*args), host_part_triton(*packed_args(case))):
        for name, r, f in zip(NAMES, ref, fused):
            assert r.dtype == f.dtype and r.shape == f.shape, name
            if r.dtype == torch.float32:                      # bit for bit, signed zeros included
                r, f = r.view(torch.int32), f.view(torch.int32)
            assert torch.equal(r, f), name


def packed_args(case: dict) -> tuple:
    """`case_args` with the candidate fields as the worker passes them: views of a packed host block
    (`HostCandidates.unpack`: strided rows, the anchor lengths a column)."""
    from graft_spec.retrieval.buffer import HostCandidates

    b, m = case["tokens"].shape
    host = HostCandidates(case["tokens"], case["parents"], case["logp"].double(), case["member"], case["match"],
                          case["anchor_len"], torch.zeros(b, dtype=torch.int64), torch.ones(b, dtype=torch.bool))
    block = torch.zeros(b, 5, m + 1, dtype=torch.int64)
    host.pack_into(block)
    h = HostCandidates.unpack(block)
    assert not h.tokens.is_contiguous() or b == 1
    return case_args(dict(case, tokens=h.tokens, parents=h.parents, logp=h.logp, match=h.match, member=h.member,
                          anchor_len=h.anchor_len))


@settings(max_examples=10, deadline=None)
@given(shape=st.sampled_from([(1, 1), (1, 2), (1, 64), (2, 128), (3, 8), (3, 24), (16, 8), (16, 16), (4, 64)]),
       seed=st.integers(0, 2 ** 31 - 1), length=st.sampled_from([1, 8, 32]))
def test_host_part_kernel_equals_reference(shape, seed, length):
    b, m = shape
    _assert_kernel_equals_reference(host_case(seed, b, m, length))


@pytest.mark.parametrize("b,m", [(64, 8), (16, 64), (1, 256)])
def test_host_part_kernel_equals_reference_at_batch_and_buffer_sizes(b, m):
    """A full batch of narrow rows, the default buffer width (64) at 16 requests, a wide row."""
    _assert_kernel_equals_reference(host_case(b * 1000 + m, b, m))


@pytest.mark.parametrize("gap", [0, 1, 3, 7, 15, 16, 17, 40, -1])
def test_host_part_kernel_on_deep_chains(gap):
    """One 16-deep chain per row, every row at the same gap: everything consumed, a part, nothing, the
    history (32 tokens) exceeded, the host ahead."""
    _assert_kernel_equals_reference(host_case(gap + 100, 4, 16, kinds=("chain",), gaps=gap))


def test_host_part_kernel_on_the_reanchor_example():
    """tests/test_core_step.py's re-anchoring example (two paths matching the committed tokens, one not)
    at gaps 0, 2 and beyond the history's count, with the reference's expected survivors."""
    from graft_spec.kernels.host_part import host_part_reference

    tok = torch.tensor([[8, 9, 10, 11, 5, 3, 4]])
    par = torch.tensor([[-1, 0, 1, 2, 0, -1, 5]])
    logp = torch.log(torch.tensor([[0.9, 0.8, 0.6, 0.5, 0.1, 0.05, 0.04]]))
    hist = torch.tensor([[5, 6, 7, 8, 9]])
    for anchor, count, survivors in ((12, 5, 7), (10, 5, 2), (9, 2, 0)):
        case = dict(tokens=tok, parents=par, logp=logp, match=torch.full((1, 7), 3), member=torch.full((1, 7), 2),
                    anchor_len=torch.tensor([anchor]), hist=hist, count=torch.tensor([count]),
                    seq_lens=torch.tensor([11]), sampled=torch.tensor([False]),
                    est_table=torch.linspace(0, 1, calibrator().table.numel()), scale=torch.ones(1, 7),
                    under=torch.zeros(1, 7, dtype=torch.bool))
        assert int(host_part_reference(*case_args(case))[3].sum()) == survivors
        _assert_kernel_equals_reference(case)
