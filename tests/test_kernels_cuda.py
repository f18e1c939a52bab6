"""On a GPU (scripts/device_check.sh): every fused op against its torch reference at the shapes a
server runs, through the planner's own rounds (`graft_spec.kernels.shadow`): N 24 / 60, batch 1 / 64,
greedy and sampled rows mixed, the Qwen3 vocabulary; and the tree sampling kernel at that vocabulary
with the same coins. Skipped without a CUDA device; on CPU the same rounds run under Triton's
interpreter (tests/interpret/test_shadow_interpreted.py)."""

from __future__ import annotations

import random

import pytest
import torch

from shadow_rounds import ROUND_OPS, shadow_rounds

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/device_check.sh)")

QWEN3_VOCAB = 151936


@pytest.mark.parametrize("b,n", [(1, 24), (1, 60), (64, 24), (64, 60)])
def test_every_fused_op_of_the_round_equals_its_reference(b, n):
    log = shadow_rounds(b, n, QWEN3_VOCAB, "cuda", rounds=3)
    assert not log.mismatches, log.mismatches
    assert ROUND_OPS <= set(log.calls), sorted(log.calls)


def _sibling_links(parents: list) -> tuple[list, list]:
    """SGLang's first-child / next-sibling links of a parents-first tree, siblings in index order."""
    n = len(parents)
    first, nxt = [-1] * n, [-1] * n
    for c in range(n - 1, 0, -1):
        p = parents[c]
        nxt[c], first[p] = first[p], c
    return first, nxt


@pytest.mark.parametrize("b,n", [(1, 24), (64, 60)])
def test_tree_sample_at_the_qwen3_vocabulary_with_the_same_coins(b, n):
    from graft_spec.kernels.shadow import shadow_references
    from graft_spec.kernels.tree_sample import tree_sample

    rng = random.Random(n)
    g = torch.Generator(device="cuda").manual_seed(b)
    pars = [[-1] + [rng.randrange(i) for i in range(1, n)] for _ in range(b)]
    links = [_sibling_links(p) for p in pars]
    cand = torch.randint(0, QWEN3_VOCAB, (b, n), device="cuda", generator=g)
    probs = torch.softmax(torch.randn(b, n, QWEN3_VOCAB, device="cuda", generator=g) * 3, -1)
    for i, ps in enumerate(pars):                # mass on each node's children: acceptances happen
        for c, p in enumerate(ps[1:], 1):
            probs[i, p, cand[i, c]] += 1.0
    probs /= probs.sum(-1, keepdim=True)
    predicts = torch.full((b * n,), -7, dtype=torch.int32, device="cuda")
    accept = torch.full((b, 6), -5, dtype=torch.int32, device="cuda")
    num = torch.full((b,), -3, dtype=torch.int32, device="cuda")
    with shadow_references() as log:
        tree_sample(predicts, accept, num, cand, torch.arange(b * n, device="cuda").view(b, n),
                    torch.tensor([f for f, _ in links], device="cuda"), torch.tensor([s for _, s in links], device="cuda"),
                    torch.rand(b, n, device="cuda", generator=g), torch.rand(b, device="cuda", generator=g), probs)
    assert log.calls == {"tree_sample": 1} and not log.mismatches, log.mismatches
    assert int(num.sum()) > 0                      # some children were accepted
