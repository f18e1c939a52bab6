"""Retrieval sources: successor table, counting trie, suffix index, corpus, output index, host buffer, planner
lifecycle."""

import json
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graft_spec.sources import SOURCE_CORPUS, SOURCE_SUFFIX
from graft_spec.config import GraftConfig
from graft_spec.pipeline import GraftPlanner
from graft_spec.retrieval import (CorpusIndex, CountTrie, HostCandidateBuffer, OutputRing, Retriever, SuccessorTable,
                                  SuffixIndex, rank_template)


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


def test_successor_update_and_expand():
    v, k = 50, 3
    sm = SuccessorTable(v, k=k, max_depth=3, size=12)
    toks, valid = sm.expand(torch.tensor([5]))
    assert not valid.any()
    # rows: 5 -> [6, 7, 8], 6 -> [9, 10, 11], 7 -> [12, 13, 14]
    sm.update(torch.tensor([5, 6, 7]), torch.tensor([[6, 7, 8], [9, 10, 11], [12, 13, 14]]),
              torch.ones(3, dtype=torch.bool))
    toks, valid = sm.expand(torch.tensor([5, 40]))
    par, rank, _ = rank_template(k, 12, 3, 0.4, 0.5)
    table = {5: [6, 7, 8], 6: [9, 10, 11], 7: [12, 13, 14]}
    want = []
    for p, r in zip(par, rank):
        ptok = 5 if p < 0 else want[p]
        want.append(table.get(ptok, [-1] * k)[r] if ptok >= 0 else -1)
    assert valid[0].tolist() == [t >= 0 for t in want]
    assert [t for t, ok in zip(toks[0].tolist(), valid[0].tolist()) if ok] == [t for t in want if t >= 0]
    assert not valid[1].any()  # unknown root
    assert sm.t_parent.tolist() == par and sm.t_rank.tolist() == rank
    # the slot prior is the product of rank priors along the template path
    for i in range(12):
        exp, j = 1.0, i
        while j >= 0:
            exp *= 0.4 * 0.5 ** rank[j]
            j = par[j]
        assert sm.slot_prior[i].item() == pytest.approx(exp, rel=1e-5)


def test_successor_update_is_deterministic_last_node_wins():
    """A token verified at several nodes of a round takes the top-k of its last node, whatever order
    the device applies writes in; invalid nodes, short top-k and out-of-vocabulary tokens."""
    sm = SuccessorTable(20, k=2, size=4)
    sm.update(torch.tensor([1, 4, 1, 3]), torch.tensor([[2, 3], [5, 6], [7, 8], [9, 9]]),
              torch.tensor([True, True, True, False]))
    assert sm.table[1].tolist() == [7, 8] and sm.table[4].tolist() == [5, 6]
    assert sm.table[3].tolist() == [-1, -1]                     # invalid node: not learnt
    sm.update(torch.tensor([4, -1, 25]), torch.tensor([[7], [8], [9]]), torch.ones(3, dtype=torch.bool))
    assert sm.table[4].tolist() == [7, -1]
    assert (sm.table[20] == -1).all()                           # the empty-parent row stays empty


def test_successor_prompt_warm_start():
    sm = SuccessorTable(20, k=2)
    sm.update(torch.tensor([3]), torch.tensor([[9, 8]]), torch.ones(1, dtype=torch.bool))
    ids = torch.tensor([1, 2, 3, 4, 1, 5])
    sm.warm_start(ids[:-1], ids[1:], torch.tensor([True, True, True, False, True]))
    assert sm.table[2, 0] == 3
    assert sm.table[1, 0] == 5                    # the last bigram of a repeated token wins
    assert sm.table[3].tolist() == [9, 8]         # verified rows are not overwritten by bigrams
    assert sm.table[4, 0] == -1                   # a bigram across a request boundary is skipped


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
        # the occurrence that ends the live (last) stream has no continuation yet: not counted
        occ = sum(1 for s in seqs for i in range(len(s) - best + 1) if s[i:i + best] == suf) - 1
        toks, pars, scores = t.expand(loc, 100, 0.0)
        first = {tk: sc for tk, p, sc in zip(toks, pars, scores) if p == -1}
        assert first == pytest.approx({x: c / occ for x, c in nxt.items()})
        assert all(p < i for i, p in enumerate(pars))
        assert all(scores[i] <= scores[pars[i]] + 1e-12 for i in range(len(toks)) if pars[i] >= 0)


@settings(max_examples=40, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=30), min_size=1, max_size=3),
       depth=st.integers(2, 6))
def test_trie_continuation_tree_is_exact(seqs, depth):
    """expand() returns every continuation path w of a substring with the product of continuation
    frequencies: count(x + c) / count(x) per step, where an occurrence of x that ends the live (last)
    stream is not counted (it has no continuation yet)."""
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
        last = tuple(seqs[-1])

        def freq(x):  # continuation-eligible occurrences of x
            live = cnt[x] >= 2 and len(x) <= len(last) and last[len(last) - len(x):] == x
            return cnt[x] - live

        want = {}
        for k in cnt:
            if len(k) > len(sub) and k[:len(sub)] == sub:
                want[k] = math.prod(cnt[k[:i + 1]] / freq(k[:i]) for i in range(len(sub), len(k)))
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
    # after "1 2": 3 twice, 4 once, out of the 3 occurrences of "1 2" that can continue (the 4th
    # ends the stream); "1 2 3" is always followed by 1, so that grandchild (2/3 * 1.0) comes
    # before the child 4 (1/3)
    assert toks[:3] == [3, 1, 4] and pars[:3] == [-1, 0, -1]
    assert scores[:3] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert all(scores[i] <= scores[pars[i]] for i in range(len(toks)) if pars[i] >= 0)
    assert all(p < i for i, p in enumerate(pars))
    toks2, _, _ = t.expand(loc, 10, 0.34)
    assert toks2 == [3, 1]  # 4 (1/3) is pruned by min_prob


# ----------------------------------------------------------------------------- suffix index

def test_suffix_index_proposes_continuation():
    s = SuffixIndex(max_depth=8, max_match=4, min_prob=0.0)
    s.start("a", [10, 11, 12, 13, 14, 15, 20, 21, 10, 11])
    p = s.propose("a", 5)
    assert p.tokens[:4] == [12, 13, 14, 15] and p.parents[:4] == [-1, 0, 1, 2] and p.match_len == 2
    assert s.propose("zzz", 5).tokens == []
    s.extend("a", [12])
    assert s.propose("a", 5).tokens[0] == 13 and s.propose("a", 5).match_len == 3


def test_suffix_index_long_repeat_gives_deep_chain():
    """A repeated long stretch proposes its whole continuation as one chain (up to depth - match),
    with count-ratio probability 1 along it."""
    s = SuffixIndex(max_depth=64, max_match=16, min_prob=0.1)
    period = list(range(100, 130))
    s.start("r", period * 3 + period[:5])
    p = s.propose("r", 60)
    assert p.match_len == 16
    assert p.tokens[:40] == (period[5:] + period)[:40]
    assert p.parents[:40] == list(range(-1, 39))
    assert all(x == 1.0 for x in p.probs[:40])


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
    assert s.propose(0, 4).tokens[0] == 9


def test_lifecycle_no_leaks():
    cfg = GraftConfig(num_draft_tokens=16, topk=4, depth=3, retrieval={"outputs": True})
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
        # what stays is the output index's fixed ring and tables (in ``base`` already)
        assert planner.outputs.inserted == 8 * 50 * (rep + 1)
        assert planner.memory_bytes() == base
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
        idx.start("r", [0, 2, 3])
        p = idx.propose("r", 8)
        # after "2 3": 4 (then 5) and 9, one occurrence each
        assert sorted(t for t, q in zip(p.tokens, p.parents) if q == -1) == [4, 9] and p.match_len == 2
        assert idx.live_requests() == 1
        idx.stop("r")
        assert idx.live_requests() == 0
    idx = CorpusIndex.from_file(tmp_path / "c.txt", tokenizer=tok, max_depth=4, max_match=2, min_prob=0.0)
    idx.start("r", tok("b"))
    assert idx.propose("r", 4).tokens[0] == vocab["c"]
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


# ----------------------------------------------------------------------------- retriever

def test_retriever_from_config_sources_and_buffer_rows(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps([[1, 2, 3, 4]]))
    cfg = GraftConfig(retrieval={"successor": False, "suffix": True, "corpus": True, "outputs": False,
                                 "corpus_path": str(tmp_path / "c.json"), "max_candidates": 8})
    r = Retriever.from_config(cfg)
    assert [s.name for s in r.sources] == ["suffix", "corpus"]
    r.start("q", [7, 2, 3, 9, 7, 2])
    buf = HostCandidateBuffer(2, 8)
    r.fill(buf, 1, "q", anchor_len=6)
    hc = buf.upload(2)
    # the suffix index (first half) continues "7 2" with 3 9 7 2; the corpus continues "2" with 3 4
    assert hc.tokens[1, :4].tolist() == [3, 9, 7, 2] and hc.member[1, :4].tolist() == [SOURCE_SUFFIX] * 4
    assert hc.tokens[1, 4:7].tolist() == [3, 4] + hc.tokens[1, 6:7].tolist()
    assert hc.member[1, 4:6].tolist() == [SOURCE_CORPUS] * 2 and hc.parents[1, 4:6].tolist() == [-1, 4]
    assert (hc.member[1, 6:] == -1).all() and hc.anchor_len[1] == 6
    assert hc.match[1, 0] == 2 and hc.logp[1, :4].tolist() == [0.0] * 4
    with pytest.raises(FileNotFoundError):
        Retriever.from_config(GraftConfig(retrieval={"corpus": True, "corpus_path": str(tmp_path / "no.json")}))


def test_buffer_upload_is_not_overwritten_by_the_next_fill():
    """The host fills the next round while the previous upload may still be in flight (a
    non-blocking copy on CUDA; on CPU the upload aliases the staging memory): the two staging
    blocks alternate, so a filled-and-uploaded round keeps its rows while the next one is written."""
    from graft_spec.retrieval.base import Proposal

    buf = HostCandidateBuffer(2, 4)
    buf.clear(0, anchor_len=5)
    buf.put(0, 0, SOURCE_SUFFIX, Proposal([11, 12], [-1, 0], [0.5, 0.25], 2))
    first = buf.upload(1)
    buf.clear(0, anchor_len=9)
    buf.put(0, 0, SOURCE_SUFFIX, Proposal([21], [-1], [1.0], 3))
    second = buf.upload(1)
    assert first.tokens[0, :2].tolist() == [11, 12] and first.anchor_len.tolist() == [5]
    assert second.tokens[0, :1].tolist() == [21] and second.anchor_len.tolist() == [9]
    assert first.tokens.data_ptr() != second.tokens.data_ptr()


# ----------------------------------------------------------------------------- output index

def _windows(rows):
    """TokenHistory-style right-aligned windows of the given contexts."""
    length = max(len(r) for r in rows)
    hist = torch.tensor([[0] * (length - len(r)) + r for r in rows])
    return hist, torch.tensor([len(r) for r in rows])


def test_output_index_proposes_what_earlier_requests_wrote():
    ring = OutputRing(capacity=256, max_match=4, depth=6)
    ring.start("a", [1, 2, 3])
    ring.extend("a", [10, 11, 12, 13])
    hist, count = _windows([[5, 3], [1, 2, 3, 10, 11], [9, 9, 9]])
    groups = torch.zeros(3, dtype=torch.int64)
    assert not ring.propose(hist, count, groups)[1].any()        # a live request's output is not in it
    ring.stop("a")
    tokens, valid, match = ring.propose(hist, count, groups)
    # "... 3" continues as a's did after its prompt tail; "2 3 10 11" (the longest match, 4) with 12 13
    assert tokens[0, 0, :4].tolist() == [10, 11, 12, 13] and valid[0, 0].tolist() == [True] * 4 + [False] * 2
    assert tokens[1, 0, :2].tolist() == [12, 13] and valid[1, 0].sum() == 2
    assert match[:, 0].tolist() == [1, 4, 0] and not valid[2].any()
    assert not valid[:, 1].any()                                  # one request: no second continuation
    assert ring.live_requests() == 0 and ring.inserted == 4
    ring.stop("never-started")                                    # harmless


def test_output_index_matches_the_longest_tail_and_the_latest_occurrence():
    """Chain 0: the longest matched tail's latest occurrence; chain 1: the longest match whose next
    token differs from chain 0's."""
    ring = OutputRing(capacity=256, max_match=8, depth=3)
    for rid, out in (("x", [7, 8, 1, 2, 30, 31]), ("y", [1, 2, 40, 41]), ("z", [9, 2, 50])):
        ring.start(rid, [])
        ring.extend(rid, out)
        ring.stop(rid)
    hist, count = _windows([[8, 1, 2], [5, 1, 2], [4, 9, 2]])
    tokens, valid, match = ring.propose(hist, count, torch.zeros(3, dtype=torch.int64))
    assert match.tolist() == [[3, 2], [2, 1], [2, 0]]
    assert tokens[0, 0, :2].tolist() == [30, 31]                   # "8 1 2": only x has it
    assert tokens[0, 1, :2].tolist() == [40, 41] and valid[0, 1].sum() == 2   # "1 2": y wrote it last
    assert tokens[1, 0, :2].tolist() == [40, 41]                   # "1 2": y wrote it last
    assert tokens[1, 1, :1].tolist() == [50] and valid[1, 1].sum() == 1      # "2": z wrote it last
    assert tokens[2, 0, :1].tolist() == [50] and not valid[2, 1].any()   # "9 2" and "2" agree


def _lookup_per_length(hist, count, max_match, depth):
    """Prompt lookup one match length at a time, in plain Python (the oracle for `lookup_propose`):
    the longest tail (<= max_match, <= count) that occurs earlier in the valid window, its latest
    occurrence, continued with the period when it runs into the present."""
    b, length = hist.shape
    end = length - 1
    tokens = torch.zeros(b, depth, dtype=torch.int64)
    match = torch.zeros(b, dtype=torch.int64)
    for i in range(b):
        row, first = hist[i].tolist(), length - int(count[i])
        best_j, best_m = -1, 0
        for m in range(1, min(max_match, int(count[i])) + 1):
            ends = [j for j in range(first + m - 1, end) if row[j - m + 1: j + 1] == row[end - m + 1:]]
            if ends:
                best_j, best_m = ends[-1], m
        period = max(end - best_j, 1)
        tokens[i] = torch.tensor([row[min(max(best_j + 1 + t % period, 0), end)] for t in range(depth)])
        match[i] = best_m
    return tokens, (match > 0)[:, None].expand(b, depth), match


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.sampled_from([2, 5, 30]), max_match=st.sampled_from([1, 3, 8, 20]),
       length=st.sampled_from([16, 40]), blocks=st.sampled_from([False, True]))
def test_lookup_equals_the_per_length_reference(seed, vocab, max_match, length, blocks):
    """`lookup_propose` finds every position's matched length with one comparison block and a
    cumulative product; its chain, validity and match length equal a per-length search in plain
    Python (short histories, loops that wrap with their period, several comparison blocks)."""
    from graft_spec.numerics import lookup

    g = torch.Generator().manual_seed(seed)
    b, depth = 8, 6
    hist = torch.randint(0, vocab, (b, length), generator=g)
    count = torch.randint(0, length + 1, (b,), generator=g)
    count[0] = length
    hist[1, -12:] = torch.tensor([4, 5, 6] * 4)                    # a loop of period 3 at the right end
    hist[1, -13] = 7                                               # ... that starts there (its match: 9)
    count[1] = length
    hist[:, : length // 4] = torch.where(torch.arange(length // 4) < (length - count)[:, None],
                                         -1, hist[:, : length // 4])   # invalid positions padded as history does
    with pytest.MonkeyPatch.context() as mp:
        if blocks:
            mp.setattr(lookup, "_BLOCK_ELEMENTS", 7 * max_match * b)       # 7 positions a block
        got = lookup.lookup_propose(hist, count, max_match, depth)
    want = _lookup_per_length(hist, count, max_match, depth)
    assert torch.equal(got[2], want[2]) and torch.equal(got[1], want[1])
    assert torch.equal(torch.where(got[1], got[0], 0), torch.where(want[1], want[0], 0))
    assert got[2][1] == min(max_match, 9) and got[0][1].tolist() == [4, 5, 6, 4, 5, 6]


def _propose_per_length(ring, hist, count, groups):
    """The output index's proposal computed one match length at a time, each tail hashed token by
    token with the reference `_mgram_hash` (the oracle for `OutputRing.propose`'s vectorised form)."""
    from graft_spec.retrieval.output_ring import CHAINS
    from graft_spec.numerics.hashing import mgram_hash as _mgram_hash

    b, length = hist.shape
    cap, total = ring.capacity, int(ring.total)
    ps, oks = [], []
    for k, m in enumerate(ring.lengths):
        if m > length:
            break
        tail = hist[:, length - m:]
        p = ring.table[k, _mgram_hash(tail, groups) & (ring.slots - 1)]
        at = (p[:, None] - m + 1 + torch.arange(m)).clamp(min=0) % cap
        ok = ((p >= 0) & (p - m + 1 > total - cap) & (count >= m) & (ring.ring[at] == tail).all(dim=1)
              & (ring.tag[p.clamp(min=0) % cap] == groups))
        nxt = ring.ring[(p + 1).clamp(min=0) % cap]
        ps.append(p)
        oks.append(ok & (nxt >= 0) & (p + 1 < total))
    tokens = torch.zeros(b, CHAINS, ring.depth, dtype=torch.int64)
    valid = torch.zeros(b, CHAINS, ring.depth, dtype=torch.bool)
    match = torch.zeros(b, CHAINS, dtype=torch.int64)
    for i in range(b):
        good = [k for k in range(len(ps)) if oks[k][i]]
        if not good:
            continue
        first = good[-1]
        first_tok = int(ring.ring[(int(ps[first][i]) + 1) % cap])
        other = [k for k in good if int(ring.ring[(int(ps[k][i]) + 1) % cap]) != first_tok]
        for c, k in enumerate([first] + other[-1:]):
            p = int(ps[k][i])
            match[i, c] = ring.lengths[k]
            for t in range(ring.depth):
                tok = int(ring.ring[(p + 1 + t) % cap])
                if tok < 0 or p + 1 + t >= total:
                    break
                tokens[i, c, t], valid[i, c, t] = tok, True
    return tokens, valid, match


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.sampled_from([3, 6, 40]), max_match=st.sampled_from([1, 4, 16, 32]),
       length=st.sampled_from([8, 20, 48]))
def test_output_index_proposal_equals_the_per_length_reference(seed, vocab, max_match, length):
    """`OutputRing.propose` hashes every tail length with one prefix sum and verifies every match with
    one gather; its tokens, validity and match lengths equal a per-length, token-by-token computation
    on a small ring (wrapped and overwritten positions, hash collisions, two isolation groups, short
    histories, negative tokens in the window)."""
    from graft_spec.numerics.hashing import mgram_hash as _mgram_hash, tail_hashes as _tail_hashes, wrap64 as _wrap64
    from graft_spec.tree import HASH_POW

    g = torch.Generator().manual_seed(seed)
    ring = OutputRing(capacity=64, max_match=max_match, depth=5)
    for r in range(12):                                              # 12 x (4..20 + 1) > 64: the ring wraps
        n = int(torch.randint(4, 21, (1,), generator=g))
        ring.insert(torch.randint(0, vocab, (n,), generator=g).tolist(), group=r % 2)
    b = 24
    hist = torch.randint(0, vocab, (b, length), generator=g)
    hist[0, : length // 2] = -1                                      # padding left of a short history
    count = torch.randint(0, length + 1, (b,), generator=g)
    groups = torch.randint(0, 2, (b,), generator=g)
    got, want = ring.propose(hist, count, groups), _propose_per_length(ring, hist, count, groups)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.equal(torch.where(got[1], got[0], 0), want[0])
    assert got[1].any()                                              # the small vocabulary does match
    # the hashes themselves, bit for bit, also for token ids near the int64 range
    big = torch.randint(-(1 << 62), 1 << 62, (5, 32), generator=g)
    tags = torch.arange(5)
    lens = torch.tensor([1, 2, 7, 32])
    pow_r = torch.tensor([_wrap64(HASH_POW ** r) for r in range(32)])
    pow_m = torch.tensor([_wrap64(HASH_POW ** m) for m in lens.tolist()])
    fast = _tail_hashes(big.flip(1), tags, lens, pow_r, pow_m)
    for k, m in enumerate(lens.tolist()):
        assert torch.equal(fast[:, k], _mgram_hash(big[:, 32 - m:], tags))


def test_output_index_groups_are_isolated_and_forgotten_on_handover():
    ring = OutputRing(capacity=256, max_match=2, depth=4)
    for rid, group, out in (("x", 1, [40, 41]), ("y", 2, [50, 51])):
        ring.start(rid, [7], group)
        ring.extend(rid, out)
        ring.stop(rid)
    hist, count = _windows([[7]] * 4)
    tokens, valid, _ = ring.propose(hist, count, torch.tensor([1, 2, 0, 3]))
    assert tokens[0, 0, :2].tolist() == [40, 41] and tokens[1, 0, :2].tolist() == [50, 51]
    assert valid.sum(dim=(1, 2)).tolist() == [2, 2, 0, 0]
    ring.forget_group(1)
    assert not ring.propose(hist, count, torch.tensor([1, 2, 0, 3]))[1][0].any()


def test_flush_empties_the_output_index_and_successor_table_in_place():
    """`GraftPlanner.clear_cache` (SGLang's ``/flush_cache``): the output index and the successor
    table forget earlier requests' text, in place (CUDA graphs keep their addresses), and fill
    again afterwards from position 0; the calibration is kept."""
    from graft_spec.config import GraftConfig
    from graft_spec.pipeline import GraftPlanner

    planner = GraftPlanner(GraftConfig(num_draft_tokens=6, topk=2, depth=2, retrieval={"outputs": "on"}), 64)
    ring, succ = planner.outputs, planner.successor
    ring.start("a", [1, 2, 3])
    ring.extend("a", [10, 11, 12])
    ring.stop("a")
    succ.warm_start(torch.tensor([3, 10]), torch.tensor([10, 11]), torch.ones(2, dtype=torch.bool),
                    torch.zeros(2, dtype=torch.int64))
    hist, count = _windows([[2, 3]])
    groups = torch.zeros(1, dtype=torch.int64)
    assert ring.propose(hist, count, groups)[1].any() and succ.expand(torch.tensor([3]))[1].any()
    planner.calibrator.trials += 1.0
    addresses = [t.data_ptr() for t in (ring.ring, ring.tag, ring.table, ring.total, succ.table)]
    planner.clear_cache()
    assert not ring.propose(hist, count, groups)[1].any() and not succ.expand(torch.tensor([3]))[1].any()
    assert [t.data_ptr() for t in (ring.ring, ring.tag, ring.table, ring.total, succ.table)] == addresses
    assert int(ring.total) == 0 and bool((planner.calibrator.trials[:-1] == 1.0).all())
    ring.start("b", [1, 2, 3])
    ring.extend("b", [20, 21])
    ring.stop("b")
    tokens, valid, _ = ring.propose(hist, count, groups)
    assert tokens[0, 0, :2].tolist() == [20, 21] and valid[0, 0].sum() == 2


def test_output_index_memory_is_fixed_and_keeps_the_newest():
    rng = random.Random(3)
    ring = OutputRing(capacity=512, max_match=4, depth=4)
    fixed = ring.index_bytes()
    for r in range(300):                                          # ~12 times the capacity
        ring.start(r, [rng.randrange(5000)])
        ring.extend(r, [rng.randrange(5000) for _ in range(20)])
        ring.stop(r)
    assert ring.index_bytes() == fixed == ring.memory_bytes()
    ring.start("new", [1, 2])
    ring.extend("new", [4242, 4343, 4444])
    ring.stop("new")
    hist, count = _windows([[9, 4242], [rng.randrange(5000) for _ in range(3)]])
    tokens, valid, _ = ring.propose(hist, count, torch.zeros(2, dtype=torch.int64))
    assert tokens[0, 0, :2].tolist() == [4343, 4444] and valid[0].sum() == 2
    # an overwritten position is never proposed: the oldest requests are gone
    old = OutputRing(capacity=64, max_match=2, depth=2)
    old.insert([1, 2, 3])
    for r in range(20):
        old.insert([100 + r, 200 + r, 300 + r])
    hist, count = _windows([[1, 2]])
    assert not old.propose(hist, count, torch.zeros(1, dtype=torch.int64))[1].any()


def test_output_index_in_the_planner_follows_isolation():
    def ring(**kw):
        return GraftPlanner(GraftConfig(num_draft_tokens=16, topk=4, depth=3, retrieval=kw), vocab_size=100).outputs

    assert ring() is not None                      # on by default, for greedy rows (docs/benchmark.md)
    assert ring(outputs=False) is None and ring(outputs="off") is None
    assert ring(outputs=True).depth == 15          # chains as deep as the tree
    assert ring(outputs=True, isolation="request") is None
    assert [s.name for s in Retriever.from_config(GraftConfig(retrieval={"outputs": True})).sources] == ["suffix"]
    # the planner tags a request with its tenant's group; the step proposes on the device
    planner = GraftPlanner(GraftConfig(num_draft_tokens=16, topk=4, depth=3,
                                       retrieval={"outputs": True, "isolation": "tenant", "suffix": False,
                                                  "successor": False, "lookup": False}),
                           vocab_size=100, max_slots=4)
    planner.start_request(1, [3, 4], tenant="t1")
    planner.extend(1, [5, 6, 7])
    planner.stop_request(1)
    planner.start_request(2, [4], tenant="t2")
    planner.start_request(3, [4], tenant="t1")
    hc = planner.host_candidates([2, 3])
    slots = torch.tensor([0, 1])
    planner.history.reset(slots, torch.tensor([[4], [4]]), torch.tensor([1, 1]))
    hist, count = planner.history.gather(slots)
    tokens, valid, _ = planner.outputs.propose(hist, count, hc.group)
    assert not valid[0].any()
    assert tokens[1, 0, :3].tolist() == [5, 6, 7] and valid[1].sum() == 3


@pytest.mark.parametrize("outputs, kept", [("greedy", [True, False]), ("on", [True, True])])
def test_output_index_holds_the_outputs_of_the_modes_it_proposes_to(outputs, kept):
    """With ``outputs: greedy`` a sampled request's output is a draw the greedy rows would not make:
    it stays out of the index (the greedy answer after the same m-gram is what a greedy row needs)."""
    planner = GraftPlanner(GraftConfig(num_draft_tokens=16, topk=4, depth=3,
                                       retrieval={"outputs": outputs, "suffix": False}), vocab_size=100)
    for rid, sampled in ((0, False), (1, True)):
        planner.start_request(rid, [3, 4], sampled=sampled)
        planner.extend(rid, [10 + rid] * 5)
        planner.stop_request(rid)
    assert planner.outputs.inserted == 5 * sum(kept)
    hist, count = _windows([[4]])
    tokens, valid, _ = planner.outputs.propose(hist, count, torch.zeros(1, dtype=torch.int64))
    latest = max(rid for rid, k in enumerate(kept) if k)          # chain 0: the latest occurrence
    assert bool(valid[0, 0, 0]) and int(tokens[0, 0, 0]) == 10 + latest
