"""Retrieval sources: successor matrix, counting trie, suffix index, corpus, planner lifecycle."""

import json
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_spec.config import GraftConfig
from graft_spec.pipeline import GraftPlanner
from graft_spec.retrieval import CorpusIndex, CountTrie, Retriever, SuccessorMatrix, SuffixIndex, rank_template
from graft_spec.tree import SOURCE_RETRIEVED, DraftTree, has_duplicate_siblings, validate_parents


# ----------------------------------------------------------------------------- successor matrix

@pytest.mark.parametrize("k, size, depth", [(8, 80, 6), (3, 20, 3), (1, 10, 10), (4, 7, 1)])
def test_rank_template_shape(k, size, depth):
    par, rank, dep = rank_template(k, size, depth, 0.4, 0.5)
    assert len(par) == min(size, sum(k ** d for d in range(1, depth + 1)))
    assert all(p < i for i, p in enumerate(par))
    assert max(dep) <= depth and all(0 <= r < k for r in rank)
    # the deepest node sits on the all-rank-0 chain (unbalanced, rank-0 chain deepest)
    deepest = max(range(len(par)), key=lambda i: dep[i])
    i = deepest
    while i >= 0:
        assert rank[i] == 0
        i = par[i]
    # siblings carry distinct ranks
    seen = set()
    for p, r in zip(par, rank):
        assert (p, r) not in seen
        seen.add((p, r))


def test_successor_update_and_propose():
    v, k = 50, 3
    sm = SuccessorMatrix(v, k=k, max_depth=3, template_size=12)
    c = sm.propose([0], torch.tensor([5]), 12)
    assert not c.valid.any()
    # rows: 5 -> [6, 7, 8], 6 -> [9, 10, 11], 7 -> [12, 13, 14]
    sm.update(torch.tensor([5, 6, 7]), torch.tensor([[6, 7, 8], [9, 10, 11], [12, 13, 14]]))
    c = sm.propose([0, 1], torch.tensor([5, 40]), 12)
    par, rank, _ = rank_template(k, 12, 3, 0.4, 0.5)
    table = {5: [6, 7, 8], 6: [9, 10, 11], 7: [12, 13, 14]}
    toks = []
    for p, r in zip(par, rank):
        ptok = 5 if p < 0 else toks[p]
        toks.append(table.get(ptok, [-1] * k)[r] if ptok >= 0 else -1)
    assert c.valid[0].tolist() == [t >= 0 for t in toks]
    assert [t for t, ok in zip(c.tokens[0].tolist(), c.valid[0].tolist()) if ok] == [t for t in toks if t >= 0]
    assert not c.valid[1].any()  # unknown root
    # scores are products of per-rank rates along the template path, non-increasing
    rates = sm.rates()
    for i in range(12):
        exp = 1.0
        j = i
        while j >= 0:
            exp *= float(rates[rank[j]])
            j = par[j]
        assert c.score[0, i].item() == pytest.approx(exp, rel=1e-5)


def test_successor_hit_rates_learn():
    sm = SuccessorMatrix(20, k=2, template_size=4)
    r0 = sm.rates().clone()
    sm.update(torch.tensor([1]), torch.tensor([[2, 3]]))
    for _ in range(30):  # the target keeps predicting the old rank-1 token
        sm.update(torch.tensor([1]), torch.tensor([[3, 2]]))
        sm.update(torch.tensor([1]), torch.tensor([[2, 3]]))
    r = sm.rates()
    assert r[1] > r0[1] and r[0] < r0[0]
    # short top-k leaves the remaining ranks empty; negative tokens are ignored
    sm.update(torch.tensor([4, -1]), torch.tensor([[7], [8]]))
    assert sm.table[4].tolist() == [7, -1]


def test_successor_prompt_warm_start():
    sm = SuccessorMatrix(20, k=2)
    sm.update(torch.tensor([3]), torch.tensor([[9, 8]]))
    sm.start("r", [1, 2, 3, 4])
    assert sm.table[1, 0] == 2 and sm.table[2, 0] == 3
    assert sm.table[3].tolist() == [9, 8]  # verified rows are not overwritten by bigrams
    assert sm.live_requests() == 1
    sm.stop("r")
    assert sm.live_requests() == 0


# ----------------------------------------------------------------------------- counting trie

@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=50), min_size=1, max_size=3),
       depth=st.integers(2, 6), chunk=st.integers(1, 7))
def test_trie_counts_equal_substring_counts(seqs, depth, chunk):
    """Lazy storage keeps exact counts: every substring's count equals brute force."""
    t = CountTrie(depth)
    for seq in seqs:
        t.reset_stream()
        for i in range(0, len(seq), chunk):
            t.extend(seq[i:i + chunk])
    for n in range(1, depth + 1):
        counts = Counter(tuple(seq[i:i + n]) for seq in seqs for i in range(len(seq) - n + 1))
        for sub, cnt in counts.items():
            loc = t.locate(sub)
            assert loc is not None and t.count(loc) == cnt, (sub, cnt)
        for sub in [(3, 3, 3, 3, 3, 3)[:n], (0, 1, 2, 3, 0, 1)[:n]]:
            if sub not in counts:
                assert t.locate(sub) is None
    seq = seqs[-1]
    # longest match == brute force over the last stream, and the first-level continuation
    # tokens / ratios equal the empirical next-token counts of that suffix
    for max_len in (1, 3, depth - 1):
        loc, length = t.longest_match(seq, max_len)
        best = 0
        for n in range(1, min(max_len, depth - 1, len(seq)) + 1):
            suf = seq[len(seq) - n:]
            if any(s[i:i + n] == suf for s in seqs for i in range(len(s) - n)):
                best = n
        assert length == best
        if not best:
            continue
        assert t.active_match(max_len) == (loc, length)
        suf = seq[len(seq) - best:]
        nxt = Counter(s[i + best] for s in seqs for i in range(len(s) - best) if s[i:i + best] == suf)
        occ = sum(1 for s in seqs for i in range(len(s) - best + 1) if s[i:i + best] == suf)
        toks, pars, scores = t.expand(loc, 100, 0.0)
        first = {tk: sc for tk, p, sc in zip(toks, pars, scores) if p == -1}
        assert first == pytest.approx({x: c / occ for x, c in nxt.items()})
        assert all(p < i for i, p in enumerate(pars))
        assert all(scores[i] <= scores[pars[i]] + 1e-12 for i in range(len(toks)) if pars[i] >= 0)


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=3),
       depth=st.integers(2, 6))
def test_trie_continuation_tree_is_exact(seqs, depth):
    """expand() returns every continuation path w of a substring with score count(sub+w)/count(sub)."""
    t = CountTrie(depth)
    for seq in seqs:
        t.reset_stream()
        t.extend(seq)
    cnt = Counter(tuple(s[i:j]) for s in seqs for i in range(len(s)) for j in range(i + 1, min(len(s), i + depth) + 1))
    for sub in cnt:
        if len(sub) >= depth:
            continue
        toks, pars, scores = t.expand(t.locate(sub), 10_000, 0.0)
        got = {}
        for i in range(len(toks)):
            w, j = [], i
            while j >= 0:
                w.append(toks[j])
                j = pars[j]
            got[sub + tuple(w[::-1])] = scores[i]
        want = {k: v / cnt[sub] for k, v in cnt.items() if len(k) > len(sub) and k[:len(sub)] == sub}
        assert got == pytest.approx(want)


def test_trie_novel_tokens_cost_one_node_each():
    t = CountTrie(12)
    t.extend(list(range(1000)))
    assert t.num_nodes == 1001  # root + one node per distinct token, no deep chains
    t.extend([5, 6, 7])        # "5 6 7" repeats: explicit nodes appear along the match
    loc = t.locate([5, 6, 7])
    assert t.count(loc) == 2 and loc[1] == -1
    toks, _, _ = t.expand(t.active_match(3)[0], 4, 0.0)
    assert toks == [8, 9, 10, 11]  # continuation read lazily from the first occurrence


def test_trie_expand_scores_and_order():
    t = CountTrie(4)
    t.extend([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2])
    loc, length = t.longest_match([1, 2], 2)
    assert length == 2
    toks, pars, scores = t.expand(loc, 10, 0.0)
    # after "1 2": 3 twice, 4 once, out of count("1 2") = 4 occurrences; "1 2 3" is always
    # followed by 1, so that grandchild (score 0.5 * 1.0) comes before the child 4 (0.25)
    assert toks[:3] == [3, 1, 4] and pars[:3] == [-1, 0, -1]
    assert scores[:3] == pytest.approx([2 / 4, 2 / 4, 1 / 4])
    assert all(scores[i] <= scores[pars[i]] for i in range(len(toks)) if pars[i] >= 0)
    assert all(p < i for i, p in enumerate(pars))
    toks2, _, _ = t.expand(loc, 10, 0.3)
    assert toks2 == [3, 1]  # 4 (0.25) is pruned by min_prob


# ----------------------------------------------------------------------------- suffix index

def test_suffix_index_proposes_continuation():
    s = SuffixIndex(max_depth=8, max_match=4, min_prob=0.0)
    s.start("a", [10, 11, 12, 13, 14, 15, 20, 21, 10, 11])
    c = s.propose(["a"], torch.tensor([11]), 5)
    assert c.tokens[0, :4].tolist() == [12, 13, 14, 15] and c.parents[0, :4].tolist() == [-1, 0, 1, 2]
    assert c.valid[0].all()
    # root missing from the stream: matched by walking the tail + root
    s.start("b", [1, 2, 3, 4, 1, 2])
    c = s.propose(["b", "zzz"], torch.tensor([3, 5]), 5)
    assert c.tokens[0, 0].item() == 4 and not c.valid[1].any()
    s.extend("b", [3])
    assert s.propose(["b"], torch.tensor([3]), 5).tokens[0, 0].item() == 4


def test_suffix_index_memory_cap_and_eviction():
    s = SuffixIndex(max_depth=8, max_match=4, max_nodes=2000)
    rng = random.Random(0)
    s.start(0, [rng.randrange(1000) for _ in range(100)])
    for _ in range(300):
        s.extend(0, [rng.randrange(1000) for _ in range(5)])
        assert s.num_nodes(0) <= 2000 + 8
    assert s.rebuilds > 0
    # recent context survives eviction
    s.extend(0, [7, 8, 9, 7, 8])
    assert s.propose([0], torch.tensor([8]), 4).tokens[0, 0].item() == 9


def test_lifecycle_no_leaks():
    cfg = GraftConfig(num_draft_tokens=16, topk=4, depth=3)
    planner = GraftPlanner(cfg, vocab_size=500)
    base = planner.memory_bytes()
    rng = random.Random(1)
    for rep in range(3):
        for r in range(50):
            planner.start_request(r, [rng.randrange(500) for _ in range(64)])
            planner.extend(r, [rng.randrange(500) for _ in range(8)])
        assert planner.live_requests() == 50
        assert planner.memory_bytes() > base
        for r in range(50):
            planner.stop_request(r)
        assert planner.live_requests() == 0
        assert planner.memory_bytes() <= base + 1024
    planner.stop_request("never-started")  # harmless


# ----------------------------------------------------------------------------- corpus

def test_corpus_formats_and_cap(tmp_path):
    seqs = [[1, 2, 3, 4, 5], [7, 2, 3, 9]]
    (tmp_path / "c.json").write_text(json.dumps(seqs))
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(x) for x in [seqs[0], {"tokens": seqs[1]}]) + "\n")
    (tmp_path / "t.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    (tmp_path / "c.txt").write_text("a b c d\nb c x\n")
    vocab = {w: i for i, w in enumerate("abcdx")}
    tok = lambda s: [vocab[w] for w in s.split()]  # noqa: E731
    for name in ("c.json", "c.jsonl"):
        idx = CorpusIndex.from_file(tmp_path / name, max_depth=6, max_match=3, min_prob=0.0)
        idx.start("r", [0, 2])
        c = idx.propose(["r"], torch.tensor([3]), 8)
        # after "2 3": 4 (then 5) and 9, one occurrence each
        assert sorted(c.tokens[0, c.parents[0] == -1].tolist()) == [4, 9]
        assert idx.live_requests() == 1
        idx.stop("r")
        assert idx.live_requests() == 0
    idx = CorpusIndex.from_file(tmp_path / "c.txt", tokenizer=tok, max_depth=4, max_match=2, min_prob=0.0)
    idx.start("r", tok("b"))
    assert idx.propose(["r"], torch.tensor([vocab["b"]]), 4).tokens[0, 0].item() == vocab["c"]
    with pytest.raises(ValueError, match="tokenizer"):
        CorpusIndex.from_file(tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="suffix"):
        CorpusIndex.from_file(tmp_path / "c.json.gz")
    small = CorpusIndex(max_depth=8, max_match=4, max_mb=0.5)
    added = small.add_sequences([list(range(i, i + 500)) for i in range(0, 100000, 500)])
    slack = 128 * 8 * 200  # one check interval of nodes
    assert small.truncated and added < 100000 and 0.5 * 2 ** 20 < small.memory_bytes() < 0.5 * 2 ** 20 + slack
    big = CorpusIndex.from_texts(["a b c d"], tok, max_depth=4, max_match=2)
    assert big.num_tokens == 4


# ----------------------------------------------------------------------------- planner

def test_planner_build_and_observe():
    cfg = GraftConfig(num_draft_tokens=12, topk=2, depth=4,
                      checkpoints=[{"depth": 1, "threshold": 0.99, "keep": 3}])
    planner = GraftPlanner(cfg, vocab_size=100)
    planner.start_request("x", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
    planner.start_request("y", [1])
    d = DraftTree(tokens=torch.tensor([[6, 50, 51, 52, 53], [1, 60, 61, 62, 63]]),
                  parents=torch.tensor([[-1, 0, 0, 1, 1], [-1, 0, 0, 1, 1]]),
                  logp=torch.log(torch.tensor([[1.0, 0.5, 0.4, 0.3, 0.2]] * 2)),
                  source=torch.zeros(2, 5, dtype=torch.int64))
    out = planner.build(d, ["x", "y"])
    validate_parents(out.parents)
    assert out.tokens.shape == (2, 12) and not has_duplicate_siblings(out.tokens, out.parents).any()
    assert planner.last_info.prune.stage.tolist() == [0, 0]
    # request x: the suffix index proposes 7 8 5 6 ... after root 6
    paths = out.tokens[0][out.source[0] == SOURCE_RETRIEVED].tolist()
    assert paths[:4] == [7, 8, 5, 6]
    # successor matrix learns from observe and proposes for y next time
    topk = (torch.arange(2 * 12 * 3).reshape(2, 12, 3) * 7) % 97
    planner.observe(out, topk)
    table = planner.retriever.successor.table
    flat = out.tokens.flatten().tolist()
    for pos, t in enumerate(flat):
        if flat.count(t) == 1:
            assert table[t].tolist() == topk.reshape(-1, 3)[pos].tolist() + [-1] * (table.shape[1] - 3)
    planner.observe_tokens(torch.tensor([1]), torch.tensor([[70, 71, 72]]))
    out2 = planner.build(d, ["x", "y"])
    root_kids = out2.tokens[1][(out2.parents[1] == 0) & (out2.source[1] == SOURCE_RETRIEVED)].tolist()
    assert set(root_kids) >= {70, 71}
    with pytest.raises(ValueError):
        planner.build(d, ["x"])


def test_retriever_from_config_sources(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps([[1, 2, 3]]))
    cfg = GraftConfig(retrieval={"successor": False, "suffix": True, "corpus": True,
                                 "corpus_path": str(tmp_path / "c.json")})
    r = Retriever.from_config(cfg, 10)
    assert [s.name for s in r.sources] == ["suffix", "corpus"] and r.successor is None
    with pytest.raises(FileNotFoundError):
        Retriever.from_config(GraftConfig(retrieval={"corpus": True, "corpus_path": str(tmp_path / "no.json")}), 10)
