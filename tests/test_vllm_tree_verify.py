"""`vllm_worker.tree_verify`: graft trees verified in vLLM's layout (flat logits rows, chain-format output).

Greedy against a walk written here (the root's children in index order, the first whose token is the
target's argmax), ragged tree sizes (the scheduler cuts drafts to a prefix) and trees of the root alone;
sampled: the emitted tokens' joint distribution against the processed target distribution (chi-square),
seeded requests reproducible. No vLLM import except `apply_top_k_top_p`, vLLM's own masking.
"""

from __future__ import annotations

import pytest
import torch

from vllm_worker.tree_verify import PLACEHOLDER_TOKEN_ID, StepTrees, verify_trees


def random_trees(b: int, w: int, vocab: int, g: torch.Generator):
    """Parents-first trees of ``w`` nodes with distinct sibling tokens, sizes cut at random, and
    logits whose argmax at a node is one of its children's tokens half the time."""
    parents = torch.full((b, w), -1, dtype=torch.int64)
    tokens = torch.zeros(b, w, dtype=torch.int64)
    for i in range(b):
        for j in range(1, w):
            while True:
                p = int(torch.randint(0, j, (1,), generator=g))
                t = int(torch.randint(0, vocab, (1,), generator=g))
                if not any(int(parents[i, k]) == p and int(tokens[i, k]) == t for k in range(1, j)):
                    break
            parents[i, j], tokens[i, j] = p, t
    sizes = torch.randint(1, w + 1, (b,), generator=g)
    sizes[0] = w
    logits = torch.randn(int(sizes.sum()), vocab, generator=g)
    start = 0
    for i in range(b):
        s = int(sizes[i])
        for j in range(s):
            kids = [k for k in range(1, s) if int(parents[i, k]) == j]
            if kids and torch.rand(1, generator=g) < 0.6:
                k = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
                logits[start + j, tokens[i, k]] += 10.0
        start += s
    drafts = torch.cat([tokens[i, 1:int(sizes[i])] for i in range(b)])
    return StepTrees(parents, sizes), tokens, drafts, logits


def walk(parents, tokens, size, rows):
    """Greedy verification of one tree by hand: tokens emitted and the accepted node indices."""
    cur, path, out = 0, [0], []
    while True:
        want = int(rows[cur].argmax())
        nxt = next((k for k in range(1, size) if int(parents[k]) == cur and int(tokens[k]) == want), None)
        out.append(want)
        if nxt is None:
            return out, path
        cur = nxt
        path.append(cur)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_trees_emit_the_longest_matching_path_then_the_bonus(seed):
    g = torch.Generator().manual_seed(seed)
    b, w, vocab = 6, 9, 7
    trees, tokens, drafts, logits = random_trees(b, w, vocab, g)
    v = verify_trees(logits, drafts, trees, temperature=None, all_greedy=True, topk=3)
    assert v.output_token_ids.dtype == torch.int32 and v.output_token_ids.shape == (b, w)
    start, accepted = 0, 0
    for i in range(b):
        s = int(trees.sizes[i])
        out, path = walk(trees.parents[i], tokens[i], s, logits[start:start + s])
        row = v.output_token_ids[i].tolist()
        assert row[:len(out)] == out and all(x == PLACEHOLDER_TOKEN_ID for x in row[len(out):])
        assert int(v.accept_length[i]) == len(out)
        assert v.accept_index[i, :len(path)].tolist() == path and (v.accept_index[i, len(path):] == -1).all()
        # the target's top-3 after each node, best first, -1 past the row's size
        assert v.target_topk[i, :s].tolist() == logits[start:start + s].topk(3, -1).indices.tolist()
        assert (v.target_topk[i, s:] == -1).all()
        start += s
        accepted += len(out) - 1
    assert accepted > 0


def test_a_root_alone_is_a_plain_decode_row():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(4))
    trees = StepTrees(torch.full((3, 1), -1, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
    v = verify_trees(logits, torch.zeros(0, dtype=torch.int64), trees, temperature=None, all_greedy=True)
    assert v.output_token_ids[:, 0].tolist() == logits.argmax(-1).tolist()
    assert v.accept_length.tolist() == [1, 1, 1]


def test_mismatched_shapes_are_refused():
    trees = StepTrees(torch.tensor([[-1, 0]]), torch.tensor([2]))
    with pytest.raises(ValueError, match="do not make 1 trees"):
        verify_trees(torch.randn(3, 5), torch.tensor([1]), trees, temperature=None, all_greedy=True)


def _processed(logits, temperature, top_k, top_p):
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    x = logits / temperature
    x = apply_top_k_top_p(x.clone(), torch.full((x.shape[0],), top_k), torch.full((x.shape[0],), top_p))
    return torch.softmax(x, -1)


@pytest.mark.parametrize("top", [(0, 1.0), (4, 0.9)], ids=["softmax", "topk-topp"])
def test_sampled_trees_emit_the_target_distribution(top):
    """Root -> children a, b, c (a -> a', b -> b'); the first two emitted tokens over many rows of the
    same tree against p(x1) p(x2 | x1) from the processed rows, where x2 exists (x1 accepted)."""
    pytest.importorskip("vllm")
    from scipy.stats import chi2

    top_k, top_p = top
    vocab, temp = 6, 0.8
    g = torch.Generator().manual_seed(11)
    one = torch.randn(6, vocab, generator=g) * 1.5            # rows: root, a, b, c, a', b'
    parents = torch.tensor([-1, 0, 0, 0, 1, 2])
    toks = torch.tensor([0, 2, 4, 1, 3, 0])
    b = 40000
    trees = StepTrees(parents.expand(b, 6).clone(), torch.full((b,), 6))
    logits = one.repeat(b, 1)
    drafts = toks[1:].repeat(b)
    k = torch.full((b,), top_k if top_k else vocab)
    p = torch.full((b,), top_p)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    torch.manual_seed(5)
    v = verify_trees(logits, drafts, trees, temperature=torch.full((b,), temp), all_greedy=False,
                     top_k=k if top_k else None, top_p=p if top_p < 1 else None, top_k_top_p=apply_top_k_top_p)
    probs = _processed(one, temp, top_k if top_k else vocab, top_p).double()
    out = v.output_token_ids.to(torch.int64)
    first = out[:, 0]
    node_of = {2: 1, 4: 2, 1: 3}
    exp1 = probs[0]
    cnt1 = torch.bincount(first, minlength=vocab).double()
    keep = exp1 > 0
    assert (cnt1[~keep] == 0).all()
    stat = (((cnt1 - b * exp1) ** 2) / (b * exp1))[keep].sum()
    assert stat < chi2.ppf(0.999, int(keep.sum()) - 1), (cnt1, b * exp1)
    checked = 0
    for tok, node in node_of.items():
        rows = first == tok
        m = int(rows.sum())
        if m < 1000:            # a child the processed root row (nearly) rules out
            continue
        exp2 = probs[node]
        cnt2 = torch.bincount(out[rows, 1], minlength=vocab).double()
        keep2 = exp2 > 0
        assert (cnt2[~keep2] == 0).all() and (out[rows, 1] >= 0).all()
        if int(keep2.sum()) > 1:
            stat2 = (((cnt2 - m * exp2) ** 2) / (m * exp2))[keep2].sum()
            assert stat2 < chi2.ppf(0.999, int(keep2.sum()) - 1), (tok, cnt2, m * exp2)
        checked += 1
    assert checked >= 2
    # the trees were used: most rows accept at least one node
    assert float((v.accept_length > 1).double().mean()) > 0.3


def test_seeded_requests_draw_their_coins_from_their_generator():
    g = torch.Generator().manual_seed(3)
    trees, _, drafts, logits = random_trees(4, 6, 5, g)
    temp = torch.tensor([0.0, 1.0, 1.0, 1.0])

    def run(seed):
        gens = {1: torch.Generator().manual_seed(seed), 3: torch.Generator().manual_seed(seed + 1)}
        return verify_trees(logits, drafts, trees, temperature=temp, all_greedy=False, generators=gens)

    a, b = run(7), run(7)
    assert torch.equal(a.output_token_ids[[1, 3]], b.output_token_ids[[1, 3]])
    greedy = verify_trees(logits, drafts, trees, temperature=None, all_greedy=True)
    assert torch.equal(a.output_token_ids[0], greedy.output_token_ids[0])     # the greedy row stays greedy
    outs = {tuple(run(s).output_token_ids[1].tolist()) for s in range(40)}
    assert len(outs) > 1
