"""The planner's eager rounds with every fused op checked against its reference (`shadow_references`),
shared by the interpreted test (tests/interpret/test_shadow_interpreted.py, CPU tensors) and the GPU
check (tests/test_kernels_cuda.py): the synthetic workload of ``sglang_patch.bench.step`` (requests
whose streams repeat phrases, so every retrieval source proposes), greedy and sampled rows mixed,
build then observe of a verify outcome (the first child chain accepted up to a random depth)."""

from __future__ import annotations

import torch

from graft_spec.kernels.shadow import ShadowLog, shadow_references
from graft_spec.pipeline import DenseDraft, fused_ops_everywhere, on_path_from_accept_index
from sglang_patch.bench.step import dense_lists, workload

#: the fused ops one build + observe round of the default config launches
ROUND_OPS = frozenset({"dense_draft_part", "successor_part", "chain_part", "host_part", "stack_candidates",
                       "merge_select", "tree_layout", "request_factors", "observe_rows", "successor_update",
                       "refresh_table"})


def shadow_rounds(b: int, n: int, vocab: int, device: str, rounds: int = 3, seed: int = 0) -> ShadowLog:
    """``rounds`` build + observe rounds of batch ``b`` at budget ``n`` on ``device``, every fused op
    run as kernel and reference; returns the `ShadowLog`."""
    dev = torch.device(device)
    planner, streams, rids, ctx, topk, depth, rng, gen = workload(b, n, vocab, seed, dev)
    slots = torch.arange(b, device=dev)
    sampled = (torch.arange(b, device=dev) % 2) == 1
    with fused_ops_everywhere(), shadow_references() as log:
        for _ in range(rounds):
            sl, tl, pl = dense_lists(b, topk, depth, vocab, gen)
            draft = DenseDraft(torch.cat([x.reshape(b, -1) for x in sl], 1).to(dev), torch.cat(tl, 1).to(dev),
                               torch.cat([x.reshape(b, -1) for x in pl[:-1]], 1).to(dev), topk, depth)
            roots = torch.tensor([s.buf[0] if s.buf else 0 for s in streams], device=dev)
            out = planner.build(draft, roots, planner.host_candidates(rids), slots,
                                torch.tensor(ctx, device=dev) - 1, sampled)
            accept, index = _first_child_paths(out.tree.parents.cpu(), torch.randint(0, 3, (b,), generator=gen))
            planner.observe(out, on_path_from_accept_index(index.to(dev), n),
                            torch.randint(0, vocab, (b, n, planner.successor.k), generator=gen).to(dev),
                            torch.randint(0, vocab, (b, n), generator=gen).to(dev), accept + 1, slots)
            accept = accept.to(dev)
            for r, s in zip(rids, streams):
                toks = s.take(rng.randint(1, 4))
                planner.extend(r, toks)
                ctx[r] += len(toks)
    return log


def _first_child_paths(parents: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A consistent verify outcome: from each root, the first child ``want[i]`` times (fewer where the
    tree ends); ``(accepted int64[B], accept_index int64[B, N])`` in SGLang's global indices."""
    b, n = parents.shape
    index = torch.full((b, n), -1, dtype=torch.int64)
    accepted = torch.zeros(b, dtype=torch.int64)
    for i in range(b):
        cur, path = 0, [0]
        for _ in range(int(want[i])):
            kids = [c for c in range(1, n) if int(parents[i, c]) == cur]
            if not kids:
                break
            cur = kids[0]
            path.append(cur)
        index[i, : len(path)] = torch.tensor(path) + i * n
        accepted[i] = len(path) - 1
    return accepted, index
