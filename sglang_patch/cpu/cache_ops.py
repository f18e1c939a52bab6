"""Torch replacements of SGLang's speculative KV-slot bookkeeping kernels (gathers and fills).

Each function keeps the signature of the SGLang dispatcher it replaces
(``kernels/ops/speculative/cache_locs.py`` and ``kernels/ops/speculative/eagle.py`` in 0.5.23),
whose Triton kernels cannot run on CPU tensors and whose CPU variants come from the CPU build of
``sgl_kernel`` (not on PyPI).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch


def _host(t: torch.Tensor) -> np.ndarray:
    """An index tensor as int64 numpy on the host: the stand-ins' index arithmetic runs in numpy on
    the CPU tensors' memory (no torch dispatch, no device to wait for), so each dispatches only its
    gather or scatter, as the Triton kernel it replaces is one launch."""
    return t.numpy().astype(np.int64)


def _ragged(starts: torch.Tensor, ends: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, col)``: for the concatenation over i of ranges ``[starts[i], ends[i])``, the row
    ``i`` and the column of every element (int64 arrays, computed on the host: `_host`)."""
    s = _host(starts)
    lens = _host(ends) - s
    owner = np.repeat(np.arange(lens.size), lens)
    col = s[owner] + np.arange(owner.size) - (np.cumsum(lens) - lens)[owner]
    return owner, col


def _ragged_gather(req_to_token: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                   ends: torch.Tensor) -> torch.Tensor:
    """Concatenation over i of ``req_to_token[rows[i], starts[i]:ends[i]]`` as int64."""
    owner, col = _ragged(starts, ends)
    return req_to_token[torch.from_numpy(_host(rows)[owner]), torch.from_numpy(col)].to(torch.int64)


def _window_gather(req_to_token: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor, width: int) -> torch.Tensor:
    """Concatenation over i of ``req_to_token[rows[i], starts[i]:starts[i] + width]`` as int64
    (a fixed-width window: one static-shape gather, the fixed-width twin of `_ragged_gather`)."""
    cols = _host(starts)[:, None] + np.arange(width)
    return req_to_token[torch.from_numpy(_host(rows)[:, None]), torch.from_numpy(cols)].reshape(-1).to(torch.int64)


def assign_req_to_token_pool_func(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    batch_size: int,
) -> None:
    """Replaces ``assign_req_to_token_pool_func`` (mem_cache/allocation.py:737): writes
    ``req_to_token[r_i, start_i:end_i]`` from consecutive pieces of ``out_cache_loc``, in one
    scatter (the index arithmetic on the host, `_ragged`)."""
    owner, col = _ragged(start_offset[:batch_size], end_offset[:batch_size])
    rows = _host(req_pool_indices[:batch_size])[owner]
    locs = out_cache_loc[: col.size].numpy().astype(req_to_token.numpy().dtype)
    req_to_token.index_put_((torch.from_numpy(rows), torch.from_numpy(col)), torch.from_numpy(locs))


def assign_draft_cache_locs_contiguous_func(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    topk: int,
    num_cols: int,
    positions: Optional[torch.Tensor] = None,
    mrope: Optional[torch.Tensor] = None,
) -> None:
    """Replaces ``assign_draft_cache_locs_contiguous_func`` (cache_locs.py:85).

    ``out_cache_loc[b * topk * num_cols + k] = req_to_token[r_b, seq_len_b + k]`` for
    ``k < topk * num_cols``; optionally ``positions[b * topk + j] = seq_len_b`` and the same into
    each of the 3 rows of ``mrope`` (``[3, B * topk]``).
    """
    bs = seq_lens.shape[0]
    width = topk * num_cols
    starts = seq_lens.to(torch.int64)
    locs = _window_gather(req_to_token, req_pool_indices, starts, width)
    out_cache_loc[: bs * width].copy_(locs.to(out_cache_loc.dtype))
    if positions is not None:
        positions[: bs * topk].copy_(starts.repeat_interleave(topk).to(positions.dtype))
    if mrope is not None:
        mrope.view(3, -1)[:, : bs * topk].copy_(starts.repeat_interleave(topk).to(mrope.dtype).expand(3, -1))


def assign_extend_cache_locs_func(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device,
) -> torch.Tensor:
    """Replaces ``assign_extend_cache_locs_func`` (cache_locs.py:679).

    Returns ``int64[batch_size * draft_token_num]`` whose front holds the concatenation of
    ``req_to_token[r_i, start_i:end_i]`` (the rest is zero).
    """
    out = torch.zeros(batch_size * draft_token_num, dtype=torch.int64, device=device)
    locs = _ragged_gather(req_to_token, req_pool_indices[:batch_size], start_offset[:batch_size],
                          end_offset[:batch_size])
    out[: locs.numel()] = locs
    return out


def assign_extend_cache_locs_uniform_func(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
    device,
    *,
    full_v2p: Optional[torch.Tensor] = None,
    swa_v2p: Optional[torch.Tensor] = None,
    full_out: Optional[torch.Tensor] = None,
    swa_out: Optional[torch.Tensor] = None,
    page_size: int = 1,
    positions_out: Optional[torch.Tensor] = None,
    anchor_src: Optional[torch.Tensor] = None,
    anchor_out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Replaces ``assign_extend_cache_locs_uniform_func`` (cache_locs.py:596), the verify window's
    KV slots of every verify round (``eagle_prepare_for_verify``, eagle_utils.py:357).

    Every row extends exactly ``draft_token_num`` tokens, so this is one static-shape gather,
    ``req_to_token[r_b, start_b : start_b + draft_token_num]`` flattened to
    ``int64[batch_size * draft_token_num]``, as the Triton kernel computes it (SGLang's own
    non-Triton fallback goes through the ragged variant). Optionally ``positions_out``
    ``int64[batch_size, draft_token_num]`` = start + column and ``anchor_out[:, 0]`` = ``anchor_src``.

    Raises:
        NotImplementedError: the fused physical-slot translation (``full_v2p``), Triton only.
    """
    del swa_v2p, full_out, swa_out, page_size
    if full_v2p is not None:
        raise NotImplementedError("assign_extend_cache_locs_uniform_func: the fused write translation "
                                  "(full_v2p) needs a Triton device")
    if draft_token_num == 1 and positions_out is None and anchor_out is None:   # a plain round: one slot each
        return req_to_token[req_pool_indices[:batch_size], start_offset[:batch_size]].to(torch.int64)
    starts = start_offset[:batch_size].to(torch.int64)
    if positions_out is not None:
        positions_out.copy_((starts[:, None] + torch.arange(draft_token_num, device=starts.device))
                            .view_as(positions_out))
    if anchor_out is not None:
        anchor_out[:, 0].copy_(anchor_src.view(-1))
    return _window_gather(req_to_token, req_pool_indices[:batch_size], starts, draft_token_num).to(device)


def fill_front_out_cache_loc_func(num_front: torch.Tensor, out_cache_loc: torch.Tensor,
                                  front_out_cache_loc: torch.Tensor) -> None:
    """Replaces ``fill_front_out_cache_loc_func`` (cache_locs.py:752): packs the first
    ``num_front[i]`` slots of request i's window (``out_cache_loc`` viewed ``[B, window]``), in row
    order (a mask over the fixed-width window: no ragged index arithmetic)."""
    bs = num_front.numel()
    window = out_cache_loc.view(bs, -1)
    keep = torch.arange(window.shape[1], device=window.device)[None, :] < num_front.reshape(bs, 1)
    locs = window[keep]
    front_out_cache_loc[: locs.numel()] = locs.to(front_out_cache_loc.dtype)


def fill_bonus_tokens_func(accept_tokens: torch.Tensor, accept_lens: torch.Tensor,
                           bonus_tokens: torch.Tensor, accept_stride: int, batch_size: int) -> None:
    """Replaces ``fill_bonus_tokens_func`` (eagle.py:32):
    ``bonus[b] = accept_tokens.flat[b * accept_stride + accept_lens[b] - 1]``."""
    idx = torch.arange(batch_size, device=accept_lens.device) * accept_stride + accept_lens[:batch_size].to(torch.int64) - 1
    bonus_tokens[:batch_size].copy_(accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_func(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                   accept_out_cache_loc: torch.Tensor, size: int) -> None:
    """Replaces ``fill_accept_out_cache_loc_func`` (eagle.py:73): the slots
    ``out_cache_loc[accept_index]`` of all non-negative entries, packed to the front in order."""
    flat = accept_index.reshape(-1)[:size].to(torch.int64)
    kept = flat[flat >= 0]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def native_kv_move_init(pool) -> None:
    """REPLACE for ``MHATokenToKVPool._init_kv_copy_and_warmup`` (memory_pool.py:2375).

    The stock method configures and warms up a Triton byte-copy kernel over raw layer pointers
    (``kernels/ops/kvcache/cache_move.py:181``), which cannot run on CPU. Instead the pool is put on
    SGLang's own torch path for ``move_kv_cache`` (``move_kv_cache_native``, memory_pool.py:5666,
    the ``SGLANG_NATIVE_MOVE_KV_CACHE`` route of ``_move_kv_cache_impl`` :3444): per-layer
    ``k[tgt] = k[src]`` (gather before scatter, so overlapping moves are safe).
    """
    pool._kv_copy_config = None
    pool.use_native_move_kv_cache = True


def gather_spec_extras(indices: torch.Tensor, topk_p_buf: torch.Tensor, topk_index_buf: torch.Tensor,
                       output_tokens_buf: torch.Tensor, hidden_states_buf: Optional[torch.Tensor]):
    """Replaces ``gather_spec_extras`` (kernels/ops/speculative/gather_spec_extras.py:60), the
    overlap scheduler's relay read (managers/overlap_utils.py:507): rows ``indices`` of each buffer.

    Returns:
        ``(topk_p, topk_index, bonus_tokens, hidden_states or None)``.
    """
    idx = indices.to(torch.int64)
    hidden = hidden_states_buf[idx] if hidden_states_buf is not None else None
    return topk_p_buf[idx], topk_index_buf[idx], output_tokens_buf[idx], hidden
