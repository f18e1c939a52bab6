"""End-to-end greedy tree decoding with a tiny random Qwen3 equals `generate(do_sample=False)`.

Per step: a noisy copy of the target drafts an EAGLE tree (per-step lists in SGLang's
format -> `eagle_rerank`), `GraftPlanner.build` prunes it and grafts successor-matrix
and suffix-index candidates, the target scores the hybrid tree in one forward with the
4D tree mask + tree position ids (no KV cache: the whole context is re-run each step),
and `greedy_verify` picks the accepted path.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from graft_spec.config import GraftConfig  # noqa: E402
from graft_spec.metrics import AcceptanceStats  # noqa: E402
from graft_spec.pipeline import GraftPlanner  # noqa: E402
from graft_spec.step import tree_draft_candidates  # noqa: E402
from graft_spec.sources import GRAFTED_SOURCES, SOURCE_DRAFT  # noqa: E402
from graft_spec.tree import eagle_rerank, eagle_step  # noqa: E402
from graft_spec.verify import greedy_verify  # noqa: E402

V, PROMPT, NEW, TOPK, DEPTH, N = 96, 12, 48, 3, 4, 16


@pytest.fixture(scope="module")
def model():
    cfg = transformers.Qwen3Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(10.0)  # random weights give near-uniform outputs; sharpen them
    return m


def last_logits(model, seqs):
    with torch.no_grad():
        return model(torch.tensor(seqs)).logits[:, -1].float()


def draft_tree(model, ctx, gen, noise):
    """EAGLE tree from a noisy copy of the target, built step by step like SGLang does."""
    sl, tl, pl = [], [], []
    fs, frontier = None, [[]]
    for step in range(DEPTH):
        logits = last_logits(model, [ctx + path for path in frontier])
        q = torch.softmax(logits + noise * torch.randn(logits.shape, generator=gen), -1)
        p, ids = q.topk(TOPK, dim=-1)                       # [F, topk]
        if step == 0:
            (s, t, pa), fs, nxt = eagle_step(0, p[0][None], ids[0][None], None)
            frontier = [[int(ids[0, f])] for f in range(TOPK)]
        else:
            (s, t, pa), fs, nxt = eagle_step(step, p[None], ids[None], fs)
            frontier = [frontier[int(x) // TOPK] + [int(ids.flatten()[x])] for x in nxt[0]]
        sl.append(s)
        tl.append(t)
        pl.append(pa)
    return eagle_rerank(sl, tl, pl, torch.tensor([ctx[-1]]), N)


def tree_logits(model, ctx, tree):
    """Target logits at every tree node: one forward over ctx[:-1] + tree with a 4D mask."""
    prefix = ctx[:-1]
    lp, n = len(prefix), tree.num_nodes
    total = lp + n
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:lp, :lp] = torch.ones(lp, lp, dtype=torch.bool).tril()
    mask[lp:, :lp] = True
    mask[lp:, lp:] = tree.mask()[0]
    pos = torch.cat([torch.arange(lp), tree.positions(torch.tensor([lp]))[0]])
    ids = torch.tensor([prefix + tree.tokens[0].tolist()])
    with torch.no_grad():
        out = model(ids, attention_mask=mask[None, None], position_ids=pos[None]).logits
    return out[0, lp:].float()


def test_greedy_tree_decoding_equals_generate(model):
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, V, (PROMPT,), generator=g).tolist()
    ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, PROMPT, dtype=torch.long),
                         max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref = ref[0, PROMPT:].tolist()

    cfg = GraftConfig(num_draft_tokens=N, topk=TOPK, depth=DEPTH,
                      retrieval={"successor_k": 4, "suffix_max_depth": 8, "suffix_max_match": 4,
                                 "suffix_min_prob": 0.05})
    planner = GraftPlanner(cfg, vocab_size=V)
    planner.start_request("r", prompt)
    with torch.no_grad():
        pre = model(torch.tensor([prompt])).logits[0].float()
    # warm start from the prefill: the target's top-4 after every prompt token
    planner.successor.update(torch.tensor(prompt), pre.topk(4, -1).indices, torch.ones(PROMPT, dtype=torch.bool))
    first = int(pre[-1].argmax())
    ctx, out = prompt + [first], [first]
    planner.extend("r", [first])

    stats = AcceptanceStats()
    rejected_with_children = 0
    while len(out) < NEW:
        draft = draft_tree(model, ctx, g, noise=1.0)
        step = planner.build(tree_draft_candidates(draft), draft.tokens[:, 0], planner.host_candidates(["r"]),
                             torch.zeros(1, dtype=torch.int64), torch.tensor([len(ctx) - 1]),
                             torch.zeros(1, dtype=torch.bool))
        tree = step.tree
        tree.validate()
        logits = tree_logits(model, ctx, tree)
        res = greedy_verify(tree.tokens, tree.parents, logits.argmax(-1)[None], source=tree.source)
        em = res.emitted(tree.tokens)[0]
        on_path = torch.zeros(1, N, dtype=torch.bool).scatter_(1, res.accept_index.clamp(min=0),
                                                                res.accept_index >= 0)
        planner.observe(step, on_path, logits.topk(4, -1).indices[None], torch.tensor([em + [0] * (N - len(em))]),
                        res.accept_length, torch.zeros(1, dtype=torch.int64))
        last = int(res.accept_index[0, res.accept_length[0] - 1])
        rejected_with_children += int((tree.parents[0] == last).any())
        stats.update(res)
        ctx += em
        out += em
        planner.extend("r", em)
    planner.stop_request("r")

    assert out[:NEW] == ref
    # both acceptance and rejection happened, from both kinds of candidates
    assert stats.by_source[SOURCE_DRAFT] > 0 and sum(stats.by_source[s] for s in GRAFTED_SOURCES) > 0
    assert rejected_with_children > 0
    assert max(stats.hist) >= 3 and stats.steps < NEW
    assert planner.live_requests() == 0
