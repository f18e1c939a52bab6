"""Target-only tree rejection sampling in one kernel, driven by the engine's coins.

The rule (graft_spec/verify.py's module docstring; SGLang ``tree_speculative_sampling_target_only``
with both thresholds 1.0, sgl_kernel ``speculative_sampling.cuh``): from the root, at the current
node with target row p, walk its children in sibling order and accept the first child x_i with
``coin < p(x_1) + ... + p(x_i)``, the coin being the current node's (one per tree node); then move
to x_i and go on, at most ``D - 1`` levels. The bonus is drawn from p at the last node with the
tried children zeroed (the residual), by inverse CDF with the request's final coin. Every emitted
token is distributed as p when siblings are distinct (inverse-CDF sampling per level).

Unlike SGLang's kernel this one takes no draft-probability tensor: SGLang passes a zero
``float32[B, N, V]`` tensor that its kernel writes the rejected children's mass into
(eagle_utils.py:744-748); here the residual is p minus the tried children, so nothing of that size
is allocated.

Probabilities and coins are compared in 32.32 fixed point (``calibration.to_fixed``), so the
cumulative sums are exact and order-free and the kernel (`_tree_sample_kernel`, one program per
request) equals the reference (`tree_sample_reference`, vectorised torch) bit for bit on every
device. The quantisation is 2**-32 per token, below float32's resolution near 1. Rows need not be
normalised for the final draw (it scales the final coin by the residual mass); acceptance compares
the coin with unnormalised mass, as SGLang's kernel does, so rows should sum to 1 up to rounding.
When the tried children hold all of a row's mass (a rounding edge, or a one-hot row whose token was
rejected because its mass rounded below the coin), the bonus is drawn from the whole row.

The op ``graft::tree_sample`` has the reference as its CPU implementation and the kernel as its CUDA
implementation; `tree_sample` is registered by `registry.fused_op`.
"""

from __future__ import annotations

import torch

from ..numerics.fixed import to_fixed
from ..tree import chain_links
from .dispatch import triton
from .registry import fused_op

if triton is not None:
    import triton.language as tl

    from .common import to_fixed as _fixed

__all__ = ["tree_sample", "tree_sample_reference", "tree_sample_triton"]

def tree_sample_reference(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                          candidates: torch.Tensor, retrieve_index: torch.Tensor, next_token: torch.Tensor,
                          next_sibling: torch.Tensor, coins: torch.Tensor, final_coins: torch.Tensor,
                          target_probs: torch.Tensor) -> None:
    """Target-only tree rejection sampling (module docstring), writing SGLang's verify outputs in place.

    Args (SGLang's ``tree_speculative_sampling_target_only`` layout, kernels/ops/speculative/sampling.py:33):
        predicts: ``int32[B * N]``: receives, at every accepted node's global index, the next
            accepted token, and the bonus at the last one.
        accept_index: ``int32[B, D]``: global indices of the accepted path, root first, -1 padded;
            D bounds the path (D - 1 accepted candidates at most).
        accept_token_num: ``int32[B]``: accepted candidates (bonus excluded).
        candidates: ``int[B, N]`` tree tokens (node 0 the root); tokens outside ``[0, V)`` are read
            at the nearest vocabulary id.
        retrieve_index: ``int[B, N]`` global index of every node (``b * N + i``).
        next_token / next_sibling: ``int[B, N]`` first child / next sibling, -1 terminated.
        coins: ``float32[B, N]`` in [0, 1): node i's coin decides among its children.
        final_coins: ``float32[B]`` in [0, 1): the bonus draw.
        target_probs: ``float32[B, N, V]``: row i is the target distribution after node i.
    """
    b, n = candidates.shape
    v = target_probs.shape[-1]
    d = accept_index.shape[1]
    dev = candidates.device
    ar = torch.arange(n, device=dev)
    rows = torch.arange(b, device=dev)
    tok = candidates.to(torch.int64).clamp(0, v - 1)
    parent, rank, prev = chain_links(next_token, next_sibling)
    child = parent >= 0
    probs = target_probs.reshape(b, n, v)
    pfix = to_fixed(probs.reshape(b, n * v).gather(1, parent.clamp(min=0) * v + tok))
    pfix = torch.where(child, pfix, 0)
    same = (parent[:, :, None] == parent[:, None, :]) & (rank[:, None, :] <= rank[:, :, None])
    cum = torch.where(same, pfix[:, None, :], 0).sum(dim=2)                # mass up to each node in its chain
    hit = child & (to_fixed(coins.reshape(b, n)).gather(1, parent.clamp(min=0)) < cum)
    first = hit & ~(hit.gather(1, prev.clamp(min=0)) & (prev >= 0))
    accepted_child = torch.full((b, n + 1), -1, dtype=torch.int64, device=dev).scatter_(
        1, torch.where(first, parent, n), ar.expand(b, n))[:, :n]
    cur = torch.zeros(b, dtype=torch.int64, device=dev)
    active = torch.ones(b, dtype=torch.bool, device=dev)
    num = torch.zeros(b, dtype=torch.int64, device=dev)
    path = torch.full((b, d), -1, dtype=torch.int64, device=dev)
    path[:, 0] = 0
    for j in range(1, d):
        nxt = accepted_child.gather(1, cur[:, None]).squeeze(1)
        active = active & (nxt >= 0)
        path[:, j] = torch.where(active, nxt, -1)
        cur = torch.where(active, nxt, cur)
        num = num + active.to(torch.int64)
    # the bonus: the last node's row without its tried children (all of them, unless the depth ran out)
    tried = ~active[:, None] & (parent == cur[:, None])
    row = to_fixed(probs[rows, cur])
    total = row.sum(dim=1)
    residual = total - torch.where(tried, pfix, 0).sum(dim=1)
    use_residual = residual > 0
    drop = torch.zeros(b, v + 1, dtype=torch.bool, device=dev).scatter_(
        1, torch.where(tried & use_residual[:, None], tok, v), True)[:, :v]
    mass = torch.where(use_residual, residual, total)
    target = (final_coins.reshape(b).to(torch.float64) * mass.to(torch.float64)).to(torch.int64)
    bonus = (torch.where(drop, 0, row).cumsum(dim=1) <= target[:, None]).sum(dim=1).clamp(max=v - 1)
    # SGLang's layout
    glob = retrieve_index.to(torch.int64)
    last_glob = glob.gather(1, cur[:, None]).squeeze(1)
    follows = path[:, 1:] >= 0
    at = torch.where(follows, glob.gather(1, path[:, :-1].clamp(min=0)), last_glob[:, None])
    value = torch.where(follows, candidates.to(torch.int64).gather(1, path[:, 1:].clamp(min=0)), bonus[:, None])
    predicts.view(-1).scatter_(0, torch.cat([at, last_glob[:, None]], dim=1).reshape(-1),
                               torch.cat([value, bonus[:, None]], dim=1).reshape(-1).to(predicts.dtype))
    accept_index.copy_(torch.where(path >= 0, glob.gather(1, path.clamp(min=0)), -1).to(accept_index.dtype))
    accept_token_num.copy_(num.to(accept_token_num.dtype))


if triton is not None:
    @triton.jit
    def _tree_sample_kernel(pred_ptr, acc_ptr, num_ptr, cand_ptr, ridx_ptr, nt_ptr, ns_ptr, coin_ptr, final_ptr,
                            prob_ptr, N, V, D, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
        """One program per request: the walk over sibling chains, then two passes over the last row."""
        b = tl.program_id(0).to(tl.int64)
        base = b * N
        nodes = tl.arange(0, BLOCK_N)
        toks = tl.load(cand_ptr + base + nodes, mask=nodes < N, other=0).to(tl.int64)
        toks = tl.minimum(tl.maximum(toks, 0), V - 1)
        last = tl.zeros([], dtype=tl.int64)
        num = tl.zeros([], dtype=tl.int64)
        active = tl.full([], 1, dtype=tl.int32)
        rejected = tl.zeros([], dtype=tl.int64)
        tried = tl.zeros([BLOCK_N], dtype=tl.int32)
        tl.store(acc_ptr + b * D, tl.load(ridx_ptr + base).to(tl.int32))
        for j in range(1, D):
            if active != 0:
                coin = _fixed(tl.load(coin_ptr + base + last))
                row = prob_ptr + (base + last) * V
                c = tl.load(nt_ptr + base + last).to(tl.int64)
                mass = tl.zeros([], dtype=tl.int64)
                found = tl.full([], -1, dtype=tl.int64)
                tried = tl.zeros([BLOCK_N], dtype=tl.int32)
                while c >= 0:
                    t = tl.minimum(tl.maximum(tl.load(cand_ptr + base + c).to(tl.int64), 0), V - 1)
                    mass += _fixed(tl.load(row + t))
                    if coin < mass:
                        found = c
                        c = tl.full([], -1, dtype=tl.int64)
                    else:
                        tried = tl.where(nodes == c, 1, tried)
                        c = tl.load(ns_ptr + base + c).to(tl.int64)
                if found >= 0:
                    tl.store(pred_ptr + tl.load(ridx_ptr + base + last), tl.load(cand_ptr + base + found).to(tl.int32))
                    num += 1
                    tl.store(acc_ptr + b * D + num, tl.load(ridx_ptr + base + found).to(tl.int32))
                    last = found
                    tried = tl.zeros([BLOCK_N], dtype=tl.int32)
                else:
                    active = tl.zeros([], dtype=tl.int32)
                    rejected = mass
        for k in range(1, D):                            # the rest of the path row
            if k > num:
                tl.store(acc_ptr + b * D + k, tl.full([], -1, dtype=tl.int32))
        row = prob_ptr + (base + last) * V
        total = tl.zeros([], dtype=tl.int64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            total += tl.sum(_fixed(tl.load(row + offs, mask=offs < V, other=0.0)), axis=0)
        residual = total - rejected
        use_residual = residual > 0
        mass = tl.where(use_residual, residual, total)
        drop_tok = tl.where((tried != 0) & use_residual, toks, -1)
        target = (tl.load(final_ptr + b).to(tl.float64) * mass.to(tl.float64)).to(tl.int64)
        run = tl.zeros([], dtype=tl.int64)
        count = tl.zeros([], dtype=tl.int64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            x = _fixed(tl.load(row + offs, mask=offs < V, other=0.0))
            here = tl.sum(((drop_tok >= v0) & (drop_tok < v0 + BLOCK_V)).to(tl.int32), axis=0)
            if here > 0:                                 # the tried children in this chunk read as 0
                for e in range(0, N):
                    te = tl.max(tl.where(nodes == e, drop_tok, -1), axis=0)
                    x = tl.where(offs == te, 0, x)
            cum = run + tl.cumsum(x, axis=0)
            count += tl.sum(((cum <= target) & (offs < V)).to(tl.int64), axis=0)
            run += tl.sum(x, axis=0)
        bonus = tl.minimum(count, V - 1)
        tl.store(pred_ptr + tl.load(ridx_ptr + base + last), bonus.to(tl.int32))
        tl.store(num_ptr + b, num.to(tl.int32))


def tree_sample_triton(predicts, accept_index, accept_token_num, candidates, retrieve_index, next_token,
                       next_sibling, coins, final_coins, target_probs) -> None:
    """`tree_sample_reference` as one Triton launch over B programs (CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``). Same arguments and effects; ``predicts`` / ``accept_index`` /
    ``accept_token_num`` must be ``int32`` and contiguous (SGLang's).

    Raises:
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("graft tree_sample: Triton is not installed")
    b, n = candidates.shape
    v = target_probs.shape[-1]
    if b == 0:
        return
    _tree_sample_kernel[(b,)](predicts, accept_index, accept_token_num, candidates.contiguous(),
                              retrieve_index.contiguous(), next_token.contiguous(), next_sibling.contiguous(),
                              coins.contiguous().to(torch.float32), final_coins.contiguous().to(torch.float32),
                              target_probs.contiguous(), n, v, accept_index.shape[1],
                              BLOCK_N=triton.next_power_of_2(max(n, 2)), BLOCK_V=1024)


def _tree_sample_fake(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                      candidates: torch.Tensor, retrieve_index: torch.Tensor, next_token: torch.Tensor,
                      next_sibling: torch.Tensor, coins: torch.Tensor, final_coins: torch.Tensor,
                      target_probs: torch.Tensor) -> None:
    return None


#: ``graft::tree_sample``: `tree_sample_reference`'s contract, one fused launch on a CUDA device (or
#: inside `fused_ops_everywhere`), the torch reference elsewhere or with ``GRAFT_REFERENCE_KERNELS=1``.
tree_sample = fused_op("tree_sample", tree_sample_reference, _tree_sample_fake,
                       tree_sample_triton if triton is not None else None,
                       mutates=("predicts", "accept_index", "accept_token_num"))
