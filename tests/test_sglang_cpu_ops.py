"""Unit tests of the SGLang CPU layer (sglang_patch/cpu): each torch replacement against a simple
reference on random inputs, plus the hook table against the installed SGLang.

References are written here as plain per-element Python loops following SGLang 0.5.23's kernel
semantics (file:line in each replacement's docstring). `test_triton_kernels_agree` additionally
runs SGLang's own Triton kernels with ``TRITON_INTERPRET=1`` (in a subprocess) on the same inputs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_patch.bench.step import OpCounter
from sglang_patch.cpu import attention, cache_ops, hashing, rotary, sampling, tree_ops

ROOT = Path(__file__).resolve().parents[1]
FULL, QLEN, BITS = tree_ops.FULL_MASK, tree_ops.QLEN_ONLY, tree_ops.QLEN_ONLY_BITPACKING


# --------------------------------------------------------------------------- random EAGLE drafts


def random_eagle_draft(gen: torch.Generator, bs: int, topk: int, steps: int, n: int):
    """SGLang-format draft outputs (parent_list, top_scores_index) built the way
    select_top_k_tokens + organize_draft_results do (spec_utils.py:438, eagle_utils.py:100)."""
    scores_list, parents_list = [], []
    p0 = torch.rand(bs, topk, generator=gen).sort(dim=1, descending=True).values
    scores_list.append(p0.view(bs, 1, topk))
    parents_list.append(torch.arange(-1, topk).expand(bs, -1))
    frontier = p0
    for i in range(1, steps):
        child = torch.rand(bs, topk, topk, generator=gen)
        expand = frontier[:, :, None] * child
        best_p, best_i = torch.topk(expand.flatten(1), topk, dim=1)
        scores_list.append(expand)
        parents_list.append(best_i + topk * topk * (i - 1) + topk)
        frontier = best_p
    flat = torch.cat([s.flatten(1) for s in scores_list], dim=1)
    top = torch.topk(flat, n - 1, dim=1).indices.sort(dim=1).values
    parent_list = (torch.cat(parents_list[:-1], dim=1) if steps > 1
                   else torch.empty(bs, 0, dtype=torch.long))
    return parent_list.contiguous(), top.contiguous()


def ref_parents(parent_list, top, topk):
    """Per-node parent by the kernel's rule (spec_tree.py:101-125), Python loops."""
    bs, m = top.shape
    out = []
    for b in range(bs):
        row = [-1]
        for j in range(1, m + 1):
            tb = int(top[b, j - 1]) // topk
            if tb == 0:
                row.append(0)
                continue
            pg = int(parent_list[b, tb])
            row.append(1 + [int(x) for x in top[b]].index(pg))
        out.append(row)
    return out


def ref_build(parent_list, top, seq_lens, topk, n, mode):
    """Reference outputs of build_tree_kernel_efficient_func."""
    parents = ref_parents(parent_list, top, topk)
    bs = len(parents)
    lens = [int(x) for x in seq_lens]
    anc = [[[False] * n for _ in range(n)] for _ in range(bs)]
    depth = [[0] * n for _ in range(bs)]
    nxt = [[-1] * n for _ in range(bs)]
    sib = [[-1] * n for _ in range(bs)]
    for b in range(bs):
        for i in range(n):
            j = i
            while j >= 0:
                anc[b][i][j] = True
                j = parents[b][j]
            depth[b][i] = sum(anc[b][i]) - 1
        for i in range(1, n):
            p = parents[b][i]
            kids = [c for c in range(1, n) if parents[b][c] == p]
            if kids[0] == i:
                nxt[b][p] = i
            pos = kids.index(i)
            sib[b][i] = kids[pos + 1] if pos + 1 < len(kids) else -1
    if mode == QLEN:
        mask = [anc[b][i][j] for b in range(bs) for i in range(n) for j in range(n)]
    elif mode == BITS:
        mask = [sum(1 << j for j in range(n) if anc[b][i][j]) for b in range(bs) for i in range(n)]
    else:
        mask = []
        for b in range(bs):
            for i in range(n):
                mask += [True] * lens[b] + anc[b][i]
    positions = [lens[b] + depth[b][i] for b in range(bs) for i in range(n)]
    index = [[b * n + i for i in range(n)] for b in range(bs)]
    return mask, positions, index, nxt, sib


def run_build(parent_list, top, seq_lens, topk, steps, n, mode):
    bs = seq_lens.numel()
    if mode == QLEN:
        mask = torch.ones(bs * n * n, dtype=torch.bool)
    elif mode == BITS:
        mask = torch.zeros(bs * n, dtype=[torch.uint8, torch.uint16, torch.uint32][
            int(math.ceil(math.log2(max((n + 7) // 8, 1))))])
    else:
        mask = torch.ones(int(seq_lens.sum()) * n + bs * n * n, dtype=torch.bool)
    pos = torch.empty(bs * n, dtype=torch.long)
    idx, nt, ns = torch.full((3, bs, n), -1, dtype=torch.long)
    tree_ops.build_tree_kernel_efficient_func(parent_list, top, seq_lens, mask, pos, idx, nt, ns,
                                              topk, steps, n, mode)
    return mask, pos, idx, nt, ns


CASES = [(1, 1, 3, 4), (2, 2, 3, 6), (3, 4, 4, 16), (2, 4, 5, 30), (4, 3, 2, 7), (1, 8, 1, 8),
         (2, 1, 6, 7)]


@pytest.mark.parametrize("mode", [QLEN, FULL, BITS])
@pytest.mark.parametrize("bs,topk,steps,n", CASES)
def test_build_tree_matches_reference(bs, topk, steps, n, mode):
    gen = torch.Generator().manual_seed(bs * 1000 + topk * 100 + steps * 10 + n + mode)
    for trial in range(3):
        parent_list, top = random_eagle_draft(gen, bs, topk, steps, n)
        seq_lens = torch.randint(0, 9, (bs,), generator=gen)
        mask, pos, idx, nt, ns = run_build(parent_list, top, seq_lens, topk, steps, n, mode)
        r_mask, r_pos, r_idx, r_nt, r_ns = ref_build(parent_list, top, seq_lens, topk, n, mode)
        assert [int(x) if mode == BITS else bool(x) for x in mask.tolist()] == r_mask
        assert pos.tolist() == r_pos
        assert idx.tolist() == r_idx
        assert nt.tolist() == r_nt
        assert ns.tolist() == r_ns


def test_full_mask_leaves_prefix_columns():
    """FULL_MASK writes only the tree columns; the prefix stays as the caller filled it."""
    gen = torch.Generator().manual_seed(3)
    parent_list, top = random_eagle_draft(gen, 2, 2, 3, 5)
    seq_lens = torch.tensor([3, 2])
    mask = torch.zeros(5 * 5 + 5 * 5 + 5 * 5, dtype=torch.bool)
    pos = torch.empty(10, dtype=torch.long)
    idx, nt, ns = torch.full((3, 2, 5), -1, dtype=torch.long)
    tree_ops.build_tree_kernel_efficient_func(parent_list, top, seq_lens, mask, pos, idx, nt, ns, 2, 3, 5, FULL)
    req0 = mask[: 5 * 8].view(5, 8)
    assert not req0[:, :3].any() and req0[:, 3:].diagonal().all()


# --------------------------------------------------------------------------- greedy verify


def ref_greedy(candidates, index, nxt, sib, target, depth_cap):
    """Walk the links like verify_tree_greedy_kernel_triton (spec_tree.py:218)."""
    bs, n = candidates.shape
    predicts = [0] * (bs * n)
    accept = [[-1] * depth_cap for _ in range(bs)]
    num = [0] * bs
    for b in range(bs):
        last = int(index[b, 0])
        accept[b][0] = last
        cur = 0
        for j in range(1, depth_cap):
            cur = int(nxt[b, cur])
            want = int(target.view(-1)[last])
            while cur != -1 and int(candidates[b, cur]) != want:
                cur = int(sib[b, cur])
            if cur == -1:
                break
            predicts[last] = want
            num[b] += 1
            last = int(index[b, cur])
            accept[b][num[b]] = last
        predicts[last] = int(target.view(-1)[last])
    return predicts, accept, num


@pytest.mark.parametrize("bs,topk,steps,n", CASES)
def test_greedy_verify_matches_reference(bs, topk, steps, n):
    gen = torch.Generator().manual_seed(7 + bs + topk * 3 + steps * 5 + n)
    vocab = 5
    for trial in range(5):
        parent_list, top = random_eagle_draft(gen, bs, topk, steps, n)
        seq_lens = torch.randint(0, 5, (bs,), generator=gen)
        _, _, idx, nt, ns = run_build(parent_list, top, seq_lens, topk, steps, n, QLEN)
        cand = torch.randint(0, vocab, (bs, n), generator=gen)
        # distinct siblings, as EAGLE produces (top-k of one distribution)
        parents = ref_parents(parent_list, top, topk)
        for b in range(bs):
            for p in range(n):
                kids = [c for c in range(1, n) if parents[b][c] == p]
                perm = torch.randperm(max(vocab, len(kids)), generator=gen)[: len(kids)]
                for c, t in zip(kids, perm.tolist()):
                    cand[b, c] = t
        target = torch.randint(0, vocab, (bs, n), generator=gen)
        depth_cap = steps + 1
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept = torch.full((bs, depth_cap), -1, dtype=torch.int32)
        num = torch.empty(bs, dtype=torch.int32)
        tree_ops.verify_tree_greedy_func(predicts, accept, num, cand, idx, nt, ns, target)
        r_pred, r_acc, r_num = ref_greedy(cand, idx, nt, ns, target, depth_cap)
        assert predicts.tolist() == r_pred
        assert accept.tolist() == r_acc
        assert num.tolist() == r_num


def test_greedy_verify_caps_depth():
    """A matching chain longer than accept_index's width is cut, keeping a valid bonus."""
    n = 5
    parents = torch.tensor([[-1, 0, 1, 2, 3]])
    from graft_spec.tree import sibling_links
    nt, ns = sibling_links(parents)
    cand = torch.tensor([[9, 1, 2, 3, 4]])
    target = torch.tensor([[1, 2, 3, 4, 7]])
    idx = torch.arange(n).view(1, n)
    predicts = torch.zeros(n, dtype=torch.int32)
    accept = torch.full((1, 3), -1, dtype=torch.int32)
    num = torch.empty(1, dtype=torch.int32)
    tree_ops.verify_tree_greedy_func(predicts, accept, num, cand, idx, nt, ns, target)
    assert accept.tolist() == [[0, 1, 2]] and num.tolist() == [2]
    assert predicts.tolist() == [1, 2, 3, 0, 0]  # bonus after node 2 = target's 3


def test_greedy_verify_of_a_root_only_tree():
    """Verify width 1 (a plain decode round): the root is accepted and the target's token after it
    is the bonus, in the general path's layout (rows with a non-trivial retrieve index)."""
    bs = 3
    idx = torch.tensor([[4], [0], [9]])
    nt = ns = torch.full((bs, 1), -1)
    cand = torch.tensor([[5], [6], [7]])
    target = torch.tensor([[11], [12], [13]])
    predicts = torch.zeros(10, dtype=torch.int32)
    accept = torch.full((bs, 4), 3, dtype=torch.int32)
    num = torch.full((bs,), 9, dtype=torch.int32)
    tree_ops.verify_tree_greedy_func(predicts, accept, num, cand, idx, nt, ns, target)
    assert accept.tolist() == [[4, -1, -1, -1], [0, -1, -1, -1], [9, -1, -1, -1]]
    assert num.tolist() == [0, 0, 0]
    assert predicts.tolist() == [12, 0, 0, 0, 11, 0, 0, 0, 0, 13]
    assert tree_ops.parents_from_links(nt, ns).tolist() == [[-1]] * bs


def test_parents_from_links_roundtrip_and_unreachable():
    from graft_spec.tree import sibling_links
    gen = torch.Generator().manual_seed(11)
    for _ in range(20):
        n = int(torch.randint(2, 12, (1,), generator=gen))
        par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        parents = torch.tensor([par])
        nt, ns = sibling_links(parents)
        assert tree_ops.parents_from_links(nt, ns).tolist() == [par]
    nt = torch.tensor([[1, -1, -1]])
    ns = torch.tensor([[-1, -1, -1]])
    with pytest.raises(ValueError):
        tree_ops.parents_from_links(nt, ns)


def random_parents(gen, n):
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def test_reconstruct_from_mask_matches_reference():
    """NGRAM metadata from an ancestor mask, against the documented semantics
    (reconstruct_tree.py:21-30) evaluated with loops."""
    gen = torch.Generator().manual_seed(13)
    bs, n = 3, 9
    par = [random_parents(gen, n) for _ in range(bs)]
    anc = torch.zeros(bs, n, n, dtype=torch.bool)
    for b in range(bs):
        for i in range(n):
            j = i
            while j >= 0:
                anc[b, i, j] = True
                j = par[b][j]
    seq = torch.tensor([4, 0, 17])
    pos = torch.empty(bs * n, dtype=torch.long)
    idx, nt, ns = torch.full((3, bs, n), -1, dtype=torch.long)
    tree_ops.reconstruct_indices_from_tree_mask_func(anc.flatten(), seq, pos, idx, nt, ns, bs, n)
    for b in range(bs):
        for t in range(n):
            strict = [j for j in range(t) if anc[b, t, j]]
            assert int(pos[b * n + t]) == len(strict) + int(seq[b])
            assert int(idx[b, t]) == b * n + t
            kids = [k for k in range(t + 1, n) if anc[b, k, t]]
            assert int(nt[b, t]) == (kids[0] if kids else -1)
            p = max(strict) if strict else -1
            sibs = [k for k in range(t + 1, n) if p >= 0 and par[b][k] == p]
            assert int(ns[b, t]) == (sibs[0] if sibs else -1)


# --------------------------------------------------------------------------- target-only sampling


def _sampling_call(cand, nt, ns, probs, depth_cap):
    bs, n = cand.shape
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept = torch.full((bs, depth_cap), -1, dtype=torch.int32)
    num = torch.empty(bs, dtype=torch.int32)
    idx = torch.arange(bs * n).view(bs, n)
    sampling.tree_speculative_sampling_target_only(
        predicts, accept, num, cand, idx, nt, ns, torch.rand(bs, n), torch.rand(bs), probs,
        torch.zeros_like(probs))
    return predicts, accept, num


def _emitted(predicts, accept, num):
    out = []
    for b in range(accept.shape[0]):
        out.append(tuple(int(predicts[int(g)]) for g in accept[b, : int(num[b]) + 1]))
    return out


def test_tree_sampling_is_lossless():
    """The first two emitted tokens follow the target distribution exactly (chi-square bound).

    Tree: root -> {a, b}; a -> {c}. Every request is the same tree; the emitted pair
    (t1, t2) must be distributed as p_root(t1) * p_{t1}(t2), where p_{t1} is the target row of the
    node holding t1 if it is in the tree, else irrelevant (t2 then comes from the next round, so
    only t1 is checked for it).
    """
    torch.manual_seed(0)
    vocab = 4
    parents = torch.tensor([[-1, 0, 0, 1]])
    from graft_spec.tree import sibling_links
    nt, ns = sibling_links(parents)
    cand = torch.tensor([[0, 1, 2, 3]])                  # a=1, b=2, c=3 (child of a)
    p_root = torch.tensor([0.1, 0.4, 0.2, 0.3])
    p_a = torch.tensor([0.25, 0.25, 0.1, 0.4])
    rows = torch.stack([p_root, p_a, torch.full((4,), 0.25), torch.full((4,), 0.25)])
    trials = 20000
    probs = rows.expand(trials, -1, -1).contiguous()
    predicts, accept, num = _sampling_call(cand.expand(trials, -1).contiguous(),
                                           nt.expand(trials, -1).contiguous(),
                                           ns.expand(trials, -1).contiguous(), probs, 3)
    first = torch.tensor([int(predicts[int(accept[b, 0])]) for b in range(trials)])
    counts = torch.bincount(first, minlength=vocab).double()
    chi2 = (((counts - trials * p_root.double()) ** 2) / (trials * p_root.double())).sum()
    assert chi2 < 16.3, (counts, chi2)  # chi2(3 dof), p = 0.001
    # after emitting a (=1) the next token is drawn from p_a (accepted c or the bonus there)
    second = torch.tensor([int(predicts[int(accept[b, 1])]) for b in range(trials) if int(first[b]) == 1])
    c2 = torch.bincount(second, minlength=vocab).double()
    m = second.numel()
    chi2b = (((c2 - m * p_a.double()) ** 2) / (m * p_a.double())).sum()
    assert chi2b < 16.3, (c2, chi2b)
    # accepted paths are real tree paths and lengths agree
    for b in range(50):
        path = [int(x) for x in accept[b] if int(x) >= 0]
        assert len(path) == int(num[b]) + 1 and path[0] == b * 4
        for u, v in zip(path, path[1:]):
            assert int(parents[0, v % 4]) == u % 4


def test_tree_sampling_of_a_root_only_tree_is_plain_sampling():
    """A verify width of 1 (the batch budget's plain decode round): no candidate, the one emitted
    token is the bonus, drawn from the root's target row."""
    torch.manual_seed(1)
    trials = 20000
    p_root = torch.tensor([0.1, 0.4, 0.2, 0.3])
    minus = torch.full((trials, 1), -1, dtype=torch.int64)
    predicts, accept, num = _sampling_call(torch.zeros(trials, 1, dtype=torch.int64), minus, minus,
                                           p_root.expand(trials, 1, -1).contiguous(), 1)
    assert (num == 0).all() and (accept[:, 0] == torch.arange(trials)).all()
    counts = torch.bincount(predicts.long(), minlength=4).double()
    chi2 = (((counts - trials * p_root.double()) ** 2) / (trials * p_root.double())).sum()
    assert chi2 < 16.3, (counts, chi2)  # chi2(3 dof), p = 0.001


def test_tree_sampling_refuses_lossy_thresholds():
    cand = torch.tensor([[0, 1]])
    with pytest.raises(ValueError):
        sampling.tree_speculative_sampling_target_only(
            torch.zeros(2, dtype=torch.int32), torch.full((1, 2), -1, dtype=torch.int32),
            torch.empty(1, dtype=torch.int32), cand, torch.arange(2).view(1, 2),
            torch.tensor([[1, -1]]), torch.tensor([[-1, -1]]), torch.rand(1, 2), torch.rand(1),
            torch.full((1, 2, 3), 1 / 3), torch.zeros(1, 2, 3), threshold_single=0.9)


def test_renorm_matches_reference():
    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(6, 50, generator=gen), dim=-1)
    top_ks = torch.tensor([1, 3, 50, 0, 7, 100])
    out = sampling.top_k_renorm_prob(probs, top_ks)
    for r in range(6):
        k = int(top_ks[r]) if 0 < int(top_ks[r]) <= 50 else 50
        keep = probs[r].argsort(descending=True)[:k]
        ref = torch.zeros(50)
        ref[keep] = probs[r, keep] / probs[r, keep].sum()
        torch.testing.assert_close(out[r], ref)
    top_ps = torch.tensor([0.05, 0.5, 0.9, 1.0, 0.3, 0.99])
    out = sampling.top_p_renorm_prob(probs, top_ps)
    for r in range(6):
        order = probs[r].argsort(descending=True)
        kept, mass = [], 0.0
        for t in order.tolist():
            if mass > float(top_ps[r]):
                break
            kept.append(t)
            mass += float(probs[r, t])
        ref = torch.zeros(50)
        ref[kept] = probs[r, kept] / probs[r, kept].sum()
        torch.testing.assert_close(out[r], ref)


def test_eagle_sample_hook_binds_kernels_only_during_call():
    import sglang.srt.speculative.eagle_utils as eu
    seen = {}

    def fake_orig(*a, **k):
        seen.update({n: getattr(eu, n) for n in sampling._KERNELS})
        return "ok"

    before = {n: getattr(eu, n) for n in sampling._KERNELS}
    assert sampling.eagle_sample_hook(fake_orig, 1, x=2) == "ok"
    for name, fn in sampling._KERNELS.items():
        assert seen[name] is (fn if before[name] is None else before[name])
        assert getattr(eu, name) is before[name]


# --------------------------------------------------------------------------- KV-slot bookkeeping


def _pool(gen, rows=5, cols=40):
    return torch.randperm(rows * cols, generator=gen).view(rows, cols).to(torch.int32)


def test_cache_loc_ops_match_reference():
    gen = torch.Generator().manual_seed(1)
    r2t = _pool(gen)
    rpi = torch.tensor([3, 0, 4])
    seq = torch.tensor([5, 0, 11])
    topk, cols = 2, 3
    out = torch.empty(3 * topk * cols, dtype=torch.int64)
    positions = torch.empty(3 * topk, dtype=torch.int64)
    mrope = torch.empty(3, 3 * topk, dtype=torch.int64)
    cache_ops.assign_draft_cache_locs_contiguous_func(rpi, r2t, seq, out, topk, cols, positions, mrope)
    ref = [int(r2t[r, s + k]) for r, s in zip(rpi.tolist(), seq.tolist()) for k in range(topk * cols)]
    assert out.tolist() == ref
    assert positions.tolist() == [s for s in seq.tolist() for _ in range(topk)]
    assert mrope.tolist() == [positions.tolist()] * 3

    start, end = torch.tensor([2, 0, 7]), torch.tensor([6, 3, 8])
    got = cache_ops.assign_extend_cache_locs_func(rpi, r2t, start, end, 3, 4, "cpu")
    ref = [int(r2t[r, c]) for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist()) for c in range(s, e)]
    assert got.tolist()[: len(ref)] == ref and got.numel() == 12 and got.dtype == torch.int64

    start = torch.tensor([2, 0, 7])
    positions = torch.empty(3, 4, dtype=torch.int64)
    anchor = torch.zeros(3, 2, dtype=torch.int64)
    got = cache_ops.assign_extend_cache_locs_uniform_func(rpi, r2t, start, 3, 4, "cpu", positions_out=positions,
                                                          anchor_src=torch.tensor([7, 8, 9]), anchor_out=anchor)
    ref = [int(r2t[r, c]) for r, s in zip(rpi.tolist(), start.tolist()) for c in range(s, s + 4)]
    assert got.tolist() == ref and got.dtype == torch.int64
    assert positions.tolist() == [[s + c for c in range(4)] for s in start.tolist()]
    assert anchor[:, 0].tolist() == [7, 8, 9] and anchor[:, 1].tolist() == [0, 0, 0]
    with pytest.raises(NotImplementedError, match="full_v2p"):
        cache_ops.assign_extend_cache_locs_uniform_func(rpi, r2t, start, 3, 4, "cpu", full_v2p=r2t)

    end = torch.tensor([6, 3, 8])
    r2t2 = r2t.clone()
    locs = torch.arange(100, 108, dtype=torch.int64)
    cache_ops.assign_req_to_token_pool_func(rpi, r2t2, start, end, locs, 3)
    expect = r2t.clone()
    k = 0
    for r, s, e in zip(rpi.tolist(), start.tolist(), end.tolist()):
        for c in range(s, e):
            expect[r, c] = 100 + k
            k += 1
    assert torch.equal(r2t2, expect)

    window = torch.arange(1000, 1012)
    front = torch.zeros(12, dtype=torch.int64)
    cache_ops.fill_front_out_cache_loc_func(torch.tensor([2, 4, 1]), window, front)
    assert front.tolist()[:7] == [1000, 1001, 1004, 1005, 1006, 1007, 1008]
    front = torch.full((6,), -5, dtype=torch.int64)
    cache_ops.fill_front_out_cache_loc_func(torch.tensor([0, 2, 1]), torch.arange(10, 16), front)
    assert front.tolist() == [12, 13, 14, -5, -5, -5]  # an empty row is skipped, the rest untouched

    acc_tokens = torch.tensor([[5, 6, 7], [8, -1, -1], [1, 2, -1]])
    bonus = torch.empty(3, dtype=torch.int32)
    cache_ops.fill_bonus_tokens_func(acc_tokens, torch.tensor([3, 1, 2]), bonus, 3, 3)
    assert bonus.tolist() == [7, 8, 2]

    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 8]])
    ocl = torch.arange(500, 509)
    acl = torch.zeros(9, dtype=torch.int64)
    cache_ops.fill_accept_out_cache_loc_func(accept_index, ocl, acl, 9)
    assert acl.tolist() == [500, 502, 504, 506, 507, 508, 0, 0, 0]


def test_ragged_slot_writes_dispatch_one_scatter():
    """SGLang's decode allocation (``assign_req_to_token_pool_func``, one Triton launch) runs in every
    speculative server's decode round: its stand-in is one scatter, the index arithmetic on the host."""
    r2t = _pool(torch.Generator().manual_seed(2))
    rpi, start, end = torch.tensor([3, 0, 4]), torch.tensor([5, 0, 9], dtype=torch.int32), \
        torch.tensor([6, 0, 12], dtype=torch.int32)
    locs = torch.arange(40, 44, dtype=torch.int64)
    got = r2t.clone()
    with OpCounter() as ops:   # kernels: views excluded, as in the step benchmark and the op census
        cache_ops.assign_req_to_token_pool_func(rpi, got, start, end, locs, 3)
    assert ops.names == {"index_put_": 1}
    expect = r2t.clone()
    expect[3, 5], expect[4, 9:12] = 40, torch.tensor([41, 42, 43], dtype=r2t.dtype)
    assert torch.equal(got, expect)
    nothing = r2t.clone()   # no request needs a slot this round: the scatter writes nothing
    cache_ops.assign_req_to_token_pool_func(rpi, nothing, start, start, locs[:0], 3)
    assert torch.equal(nothing, r2t)


def test_gather_spec_extras_and_native_kv_move():
    a, b, c, h = torch.randn(6, 2), torch.arange(12).view(6, 2), torch.arange(6), torch.randn(6, 3)
    idx = torch.tensor([4, 1])
    p, i, t, hs = cache_ops.gather_spec_extras(idx, a, b, c, h)
    assert torch.equal(p, a[idx]) and torch.equal(i, b[idx]) and torch.equal(t, c[idx]) and torch.equal(hs, h[idx])
    assert cache_ops.gather_spec_extras(idx, a, b, c, None)[3] is None
    pool = SimpleNamespace(_kv_copy_config={"x": 1}, use_native_move_kv_cache=False)
    cache_ops.native_kv_move_init(pool)
    assert pool._kv_copy_config is None and pool.use_native_move_kv_cache is True


# --------------------------------------------------------------------------- hashing / rotary


def ref_murmur(seed: int, pos: int, col: int) -> int:
    """Textbook MurmurHash3_x86_32 (seed 0) of the 16-byte key (seed lo, seed hi, pos, col)."""
    m = 0xFFFFFFFF
    rotl = lambda x, r: ((x << r) | (x >> (32 - r))) & m  # noqa: E731
    h = 0
    for k in (seed & m, (seed >> 32) & m, pos & m, col & m):
        k = (k * 0xCC9E2D51) & m
        k = rotl(k, 15)
        k = (k * 0x1B873593) & m
        h ^= k
        h = rotl(h, 13)
        h = (h * 5 + 0xE6546B64) & m
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    h ^= h >> 16
    return h


def test_murmur_hash_matches_reference():
    seeds = [0, 1, 2**31 + 7, 2**63 + 12345, 2**64 - 1]
    pos = [0, 5, 2**32 + 3, 77, 123456]
    cols = list(range(0, 3000, 97))
    got = hashing.murmur_hash32(torch.tensor(seeds, dtype=torch.uint64), torch.tensor(pos, dtype=torch.uint64),
                                torch.tensor(cols))
    assert got.dtype == torch.uint32 and got.shape == (5, len(cols))
    ref = [[ref_murmur(s, p, c) for c in cols] for s, p in zip(seeds, pos)]
    assert got.to(torch.int64).tolist() == ref


def _ref_rotary(x, pos, base, dim, neox):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = x.double()
    if neox:
        x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_constructs_without_fallback_kernel(neox):
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    rope = RotaryEmbedding.__new__(RotaryEmbedding)
    rotary.rotary_init_hook(RotaryEmbedding.__init__, rope, 16, 16, 256, 10000, neox, torch.float32)
    assert rope.use_fallback_kernel is False
    import sglang.srt.layers.rotary_embedding.base as base
    assert base._is_cpu is False  # the flag flip did not leak
    gen = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 200, (7,), generator=gen)
    q, k = torch.randn(7, 4 * 16, generator=gen), torch.randn(7, 2 * 16, generator=gen)
    q_out, k_out = rope.forward(pos, q.clone(), k.clone())
    torch.testing.assert_close(q_out.view(7, 4, 16).double(), _ref_rotary(q.view(7, 4, 16), pos, 10000, 16, neox),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.view(7, 2, 16).double(), _ref_rotary(k.view(7, 2, 16), pos, 10000, 16, neox),
                               atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- attention


class _Pool:
    """Minimal KV pool stand-in (set_kv_buffer / get_*_buffer of MHATokenToKVPool)."""

    def __init__(self, slots, heads, dim):
        self.k = torch.zeros(slots, heads, dim)
        self.v = torch.zeros(slots, heads, dim)

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc.loc] = k.view(-1, *self.k.shape[1:])
        self.v[loc.loc] = v.view(-1, *self.v.shape[1:])

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def _attend(q, keys, vals, scale):
    """One query row over explicit key/value rows, GQA by head repetition. q [H, D]."""
    rep = q.shape[0] // keys.shape[1]
    kk = keys.repeat_interleave(rep, dim=1)      # [L, H, D]
    vv = vals.repeat_interleave(rep, dim=1)
    w = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), kk.double()) * scale, dim=-1)
    return torch.einsum("hl,lhd->hd", w, vv.double())


def _layer(hq=4, hk=2, d=8):
    return SimpleNamespace(layer_id=0, tp_q_head_num=hq, tp_k_head_num=hk, qk_head_dim=d, v_head_dim=d,
                           scaling=d ** -0.5, is_cross_attention=False, sliding_window_size=-1)


@pytest.mark.parametrize("mode,n", [(QLEN, 6), (FULL, 6), (None, 6), (QLEN, 1), (FULL, 1), (None, 1)])
def test_verify_attention_matches_reference(mode, n):
    """n = 1: the root-only tree of a plain decode round."""
    gen = torch.Generator().manual_seed(9)
    bs, hq, hk, d = 3, 4, 2, 8
    layer = _layer(hq, hk, d)
    seq_lens = torch.tensor([4, 0, 9])
    r2t = torch.randperm(200, generator=gen)[: 4 * 32].view(4, 32).to(torch.int32)
    rpi = torch.tensor([2, 0, 3])
    pool = _Pool(200, hk, d)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    parent_list, top = random_eagle_draft(gen, bs, 2, 3, n)
    if mode is None:
        parents = [list(range(-1, n - 1))] * bs        # chain
        mask = None
    elif n == 1:
        parents = [[-1]] * bs
        mask = torch.ones(bs if mode == QLEN else int(seq_lens.sum()) + bs, dtype=torch.bool)
    else:
        nmask = (torch.ones(bs * n * n, dtype=torch.bool) if mode == QLEN
                 else torch.ones(int(seq_lens.sum()) * n + bs * n * n, dtype=torch.bool))
        pos = torch.empty(bs * n, dtype=torch.long)
        idx, nt, ns = torch.full((3, bs, n), -1, dtype=torch.long)
        tree_ops.build_tree_kernel_efficient_func(parent_list, top, seq_lens, nmask, pos, idx, nt, ns, 2, 3, n, mode)
        parents = ref_parents(parent_list, top, 2)
        mask = nmask
    out_loc = torch.cat([r2t[r, s: s + n].long() for r, s in zip(rpi.tolist(), seq_lens.tolist())])
    q = torch.randn(bs * n, hq * d, generator=gen)
    k = torch.randn(bs * n, hk, d, generator=gen)
    v = torch.randn(bs * n, hk, d, generator=gen)
    backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                              swa_out_cache_loc=None)
    fb = SimpleNamespace(spec_info=SimpleNamespace(draft_token_num=n, custom_mask=mask), seq_lens=seq_lens,
                         req_pool_indices=rpi, out_cache_loc=out_loc,
                         forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    out = attention.forward_extend_hook(None, backend, q, k, v, layer, fb).view(bs, n, hq, d)
    for b in range(bs):
        L = int(seq_lens[b])
        prefix = r2t[int(rpi[b]), :L].long()
        for i in range(n):
            anc, j = [], i
            while j >= 0:
                anc.append(j)
                j = parents[b][j]
            keys = torch.cat([pool.k[prefix], k.view(bs, n, hk, d)[b, sorted(anc)]])
            vals = torch.cat([pool.v[prefix], v.view(bs, n, hk, d)[b, sorted(anc)]])
            ref = _attend(q.view(bs, n, hq, d)[b, i], keys, vals, layer.scaling)
            torch.testing.assert_close(out[b, i].double(), ref, atol=1e-5, rtol=1e-5)


def test_prefix_extend_attention_matches_stock_and_reference():
    """Extends with a cached prefix (prefill after a radix hit, EAGLE draft extend) computed for the
    new tokens only agree with the stock full-sequence method and with a direct softmax."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.layers.radix_attention import AttentionType

    gen = torch.Generator().manual_seed(11)
    hq, hk, d = 4, 2, 8
    layer = SimpleNamespace(**vars(_layer(hq, hk, d)), attn_type=AttentionType.DECODER, logit_cap=0.0)
    prefix, ext = [5, 0, 7, 3], [1, 4, 3, 0]
    r2t = torch.randperm(200, generator=gen)[: 5 * 32].view(5, 32).to(torch.int32)
    rpi = torch.tensor([4, 1, 0, 2])
    pool = _Pool(200, hk, d)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    out_loc = torch.cat([r2t[r, p: p + e].long() for r, p, e in zip(rpi.tolist(), prefix, ext)])
    t = sum(ext)
    q = torch.randn(t, hq * d, generator=gen)
    k = torch.randn(t, hk, d, generator=gen)
    v = torch.randn(t, hk, d, generator=gen)
    backend = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                              swa_out_cache_loc=None)
    fb = SimpleNamespace(seq_lens=torch.tensor([p + e for p, e in zip(prefix, ext)]), req_pool_indices=rpi,
                         out_cache_loc=out_loc, extend_prefix_lens=torch.tensor(prefix),
                         extend_seq_lens=torch.tensor(ext), extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=ext,
                         encoder_lens=None, forward_mode=SimpleNamespace(is_target_verify=lambda: False))
    stock_calls = []

    def stock(*a, **kw):
        stock_calls.append(1)
        return TorchNativeAttnBackend.forward_extend(*a, **kw)

    out = attention.forward_extend_hook(stock, backend, q, k, v, layer, fb)
    assert not stock_calls, "a plain causal extend must not take the stock O(L^2) path"
    ref_backend = SimpleNamespace(**vars(backend))  # the stock method calls its own helper
    ref_backend._run_sdpa_forward_extend = lambda *a, **kw: TorchNativeAttnBackend._run_sdpa_forward_extend(
        ref_backend, *a, **kw)
    stock_out = TorchNativeAttnBackend.forward_extend(ref_backend, q, k, v, layer, fb)
    torch.testing.assert_close(out, stock_out, atol=1e-5, rtol=1e-5)
    start = 0
    for r, p, e in zip(rpi.tolist(), prefix, ext):
        for i in range(e):
            slots = r2t[r, : p + i + 1].long()
            ref = _attend(q[start + i].view(hq, d), pool.k[slots], pool.v[slots], layer.scaling)
            torch.testing.assert_close(out[start + i].view(hq, d).double(), ref, atol=1e-5, rtol=1e-5)
        start += e


def test_draft_branch_table_and_step_attention():
    gen = torch.Generator().manual_seed(4)
    r2t = torch.randperm(300, generator=gen)[:3 * 40].view(3, 40).to(torch.int32)
    rpi, seq_lens, topk, steps = torch.tensor([1, 2]), torch.tensor([5, 2]), 3, 4
    table = attention.draft_branch_table(r2t, rpi, seq_lens, topk, steps)
    for b in range(2):
        L = int(seq_lens[b])
        for j in range(topk):
            row = table[b * topk + j].tolist()
            r = int(rpi[b])
            assert row[:L] == r2t[r, :L].tolist()
            assert row[L: L + steps] == [int(r2t[r, L + j * steps + s]) for s in range(steps)]

    # Step backend: each (request, branch) query attends to its prefix + own first step+1 draft slots.
    hq, hk, d = 4, 2, 8
    layer = _layer(hq, hk, d)
    pool = _Pool(300, hk, d)
    pool.k.normal_(generator=gen)
    pool.v.normal_(generator=gen)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=r2t), token_to_kv_pool=pool)
    multi = attention.TorchNativeMultiStepDraftBackend(runner, topk, steps)
    assert len(multi.attn_backends) == steps - 1
    fb = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False), req_pool_indices=rpi,
                         seq_lens=seq_lens, out_cache_loc=None)
    multi.init_forward_metadata(fb)
    step = 1
    out_loc = torch.tensor([int(r2t[int(rpi[b]), int(seq_lens[b]) + j * steps + step])
                            for b in range(2) for j in range(topk)])
    fb.out_cache_loc = out_loc
    q = torch.randn(2 * topk, hq * d, generator=gen)
    k = torch.randn(2 * topk, hk, d, generator=gen)
    v = torch.randn(2 * topk, hk, d, generator=gen)
    out = multi.attn_backends[step].forward_decode(q, k, v, layer, fb).view(2 * topk, hq, d)
    for row in range(2 * topk):
        b = row // topk
        slots = table[row, : int(seq_lens[b]) + step + 1]
        ref = _attend(q.view(-1, hq, d)[row], pool.k[slots], pool.v[slots], layer.scaling)
        torch.testing.assert_close(out[row].double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool.k[out_loc], k)  # the step's own K/V were written first


def test_draft_backend_factory_hook_adds_torch_native():
    seen = {}

    def fake_create(factory, name, backend_map, template, stamps_children=False):
        seen["map"] = backend_map
        return backend_map["torch_native"]()

    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(1, 4)),
                             token_to_kv_pool=_Pool(4, 1, 2))
    factory = SimpleNamespace(draft_model_runner=runner, topk=2, speculative_num_steps=3)
    stamp, backend = attention.add_torch_native_draft_backends(fake_create, factory, "decode_attention_backend",
                                                               {"triton": None}, "x", True)
    assert stamp == "torch_native" and isinstance(backend, attention.TorchNativeMultiStepDraftBackend)
    assert "triton" in seen["map"]
    stamp, backend = attention.add_torch_native_draft_backends(fake_create, factory, "prefill_attention_backend",
                                                               {}, "x", False)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    assert type(backend) is TorchNativeAttnBackend


# --------------------------------------------------------------------------- hook table / switch


def test_hook_targets_exist_with_matching_signatures():
    """Every hook target exists in the installed SGLang; REPLACE functions accept the original's
    parameters by name (so keyword call sites keep working)."""
    import inspect
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookType

    from sglang_patch.cpu import _stand_in_unimportable_modules
    from sglang_patch.cpu.hooks import HOOKS, OVERLAP_HOOK

    _stand_in_unimportable_modules()
    table = HOOKS + [OVERLAP_HOOK]
    targets = [t for t, _, _ in table]
    assert len(targets) == len(set(targets))
    for target, kind, fn in table:
        owner, attr = target.rsplit(".", 1)
        orig = getattr(pkgutil.resolve_name(owner), attr)
        assert callable(orig), target
        if kind == HookType.REPLACE:
            want = [p for p in inspect.signature(orig).parameters if p != "self"]
            have = list(inspect.signature(fn).parameters)
            assert have[: len(want)] == want, (target, want, have)


def test_overlap_hook_is_opt_in(monkeypatch):
    from sglang_patch.cpu.hooks import HOOKS, OVERLAP_HOOK, hook_table

    monkeypatch.delenv("GRAFT_SGLANG_CPU_OVERLAP", raising=False)
    assert hook_table() == HOOKS
    monkeypatch.setenv("GRAFT_SGLANG_CPU_OVERLAP", "1")
    assert hook_table() == HOOKS + [OVERLAP_HOOK]


def test_switch_env_override(monkeypatch):
    from sglang_patch.cpu.switch import ENV_VAR, cpu_layer_enabled

    monkeypatch.setenv(ENV_VAR, "0")
    assert cpu_layer_enabled() is False
    monkeypatch.setenv(ENV_VAR, "1")
    assert cpu_layer_enabled() is True
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert cpu_layer_enabled() is False
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE")
    assert cpu_layer_enabled() is (not torch.cuda.is_available())


# --------------------------------------------------------------------------- SGLang's own kernels

def _anc_of(par):
    n = len(par)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = par[j]
    return anc


_TRITON_CHECK = textwrap.dedent(r"""
    import json, sys, torch
    from sglang.kernels.ops.speculative import spec_tree, cache_locs
    from sglang.kernels.ops.sampling import murmur_hash
    cases = json.loads(sys.stdin.read())
    out = []
    for c in cases:
        pl = torch.tensor(c["parent_list"], dtype=torch.long).view(c["bs"], -1)
        top = torch.tensor(c["top"], dtype=torch.long).view(c["bs"], -1)
        seq = torch.tensor(c["seq_lens"], dtype=torch.long)
        bs, n = c["bs"], c["n"]
        mask = torch.ones(bs * n * n, dtype=torch.bool)
        pos = torch.empty(bs * n, dtype=torch.long)
        idx, nt, ns = torch.full((3, bs, n), -1, dtype=torch.long)
        spec_tree.sgl_build_tree_kernel_triton(pl, top, seq, mask, pos, idx, nt, ns, c["topk"], c["steps"], n,
                                               spec_tree.TreeMaskMode.QLEN_ONLY)
        cand = torch.tensor(c["cand"], dtype=torch.long).view(bs, n)
        tgt = torch.tensor(c["target"], dtype=torch.long).view(bs, n)
        pred = torch.zeros(bs * n, dtype=torch.int32)
        acc = torch.full((bs, c["steps"] + 1), -1, dtype=torch.int32)
        num = torch.empty(bs, dtype=torch.int32)
        spec_tree.verify_tree_greedy_triton(pred, acc, num, cand, idx, nt, ns, tgt)
        out.append(dict(mask=mask.tolist(), pos=pos.tolist(), nt=nt.tolist(), ns=ns.tolist(),
                        pred=pred.tolist(), acc=acc.tolist(), num=num.tolist()))
    # reconstruct_tree.py imports sgl_kernel.speculative at import time: stub it (test only).
    import types
    stub = types.ModuleType("sgl_kernel.speculative")
    stub.reconstruct_indices_from_tree_mask = None
    sys.modules["sgl_kernel"] = types.ModuleType("sgl_kernel")
    sys.modules["sgl_kernel.speculative"] = stub
    from sglang.kernels.ops.speculative import reconstruct_tree
    rec = []
    for m in json.loads(sys.argv[1]):
        mask = torch.tensor(m["mask"], dtype=torch.bool)
        bs, n = m["bs"], m["n"]
        pos = torch.empty(bs * n, dtype=torch.long)
        idx, nt, ns = torch.full((3, bs, n), -1, dtype=torch.long)
        reconstruct_tree.reconstruct_indices_from_tree_mask_triton(mask, torch.tensor(m["seq"]), pos, idx, nt, ns,
                                                                   bs, n)
        rec.append(dict(pos=pos.tolist(), idx=idx.tolist(), nt=nt.tolist(), ns=ns.tolist()))
    h = torch.empty((2, 5), dtype=torch.uint32)
    murmur_hash.murmur_hash32_kernel[(2, 1)](torch.tensor([3, 2**40 + 1], dtype=torch.uint64),
        torch.tensor([7, 9], dtype=torch.uint64), torch.arange(5), h, 2, 5, BLOCK_SIZE=8)
    print(json.dumps(dict(trees=out, murmur=h.to(torch.int64).tolist(), reconstruct=rec)))
""")


def test_triton_kernels_agree():
    """SGLang's Triton build-tree / greedy-verify / reconstruct-from-mask / murmur kernels
    (TRITON_INTERPRET=1, on CPU) give the same outputs as the replacements."""
    gen = torch.Generator().manual_seed(21)
    cases, mine = [], []
    for bs, topk, steps, n in CASES[:5]:
        parent_list, top = random_eagle_draft(gen, bs, topk, steps, n)
        seq = torch.randint(0, 6, (bs,), generator=gen)
        cand = torch.randint(0, 3, (bs, n), generator=gen)
        target = torch.randint(0, 3, (bs, n), generator=gen)
        cases.append(dict(bs=bs, topk=topk, steps=steps, n=n, parent_list=parent_list.flatten().tolist(),
                          top=top.flatten().tolist(), seq_lens=seq.tolist(), cand=cand.flatten().tolist(),
                          target=target.flatten().tolist()))
        mask, pos, idx, nt, ns = run_build(parent_list, top, seq, topk, steps, n, QLEN)
        pred = torch.zeros(bs * n, dtype=torch.int32)
        acc = torch.full((bs, steps + 1), -1, dtype=torch.int32)
        num = torch.empty(bs, dtype=torch.int32)
        # the Triton verify accepts duplicate siblings too (first match wins), as does ours
        tree_ops.verify_tree_greedy_func(pred, acc, num, cand, idx, nt, ns, target)
        mine.append(dict(mask=mask.tolist(), pos=pos.tolist(), nt=nt.tolist(), ns=ns.tolist(),
                         pred=pred.tolist(), acc=acc.tolist(), num=num.tolist()))
    masks, mine_rec = [], []
    for bs, n in [(1, 5), (3, 12), (2, 17)]:
        anc = torch.stack([_anc_of(random_parents(gen, n)) for _ in range(bs)])
        seq = torch.randint(0, 30, (bs,), generator=gen)
        masks.append(dict(bs=bs, n=n, mask=anc.flatten().tolist(), seq=seq.tolist()))
        pos = torch.empty(bs * n, dtype=torch.long)
        idx, nt, ns = torch.full((3, bs, n), -1, dtype=torch.long)
        tree_ops.reconstruct_indices_from_tree_mask_func(anc.flatten(), seq, pos, idx, nt, ns, bs, n)
        mine_rec.append(dict(pos=pos.tolist(), idx=idx.tolist(), nt=nt.tolist(), ns=ns.tolist()))
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _TRITON_CHECK, json.dumps(masks)], input=json.dumps(cases), env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs["trees"] == mine
    assert theirs["reconstruct"] == mine_rec
    ours = hashing.murmur_hash32(torch.tensor([3, 2**40 + 1], dtype=torch.uint64),
                                 torch.tensor([7, 9], dtype=torch.uint64), torch.arange(5))
    assert theirs["murmur"] == ours.to(torch.int64).tolist()
