"""Speculative-decoding attention for SGLang's ``torch_native`` backend (pure torch SDPA).

SGLang 0.5.23's ``TorchNativeAttnBackend`` (``srt/layers/attention/torch_native_backend.py``)
serves prefill/extend and one-token decode only:

* TARGET_VERIFY (the target scoring the draft tree) reaches ``forward_extend`` (:279) with no
  ``extend_*`` lengths and needs the tree mask; `verify_forward_extend` adds that path.
* The EAGLE multi-step draft decode needs a per-step backend whose ``topk`` rows per request each
  read the committed prefix plus their own draft slots; ``DraftBackendFactory`` has no
  ``torch_native`` entry (``srt/speculative/draft_utils.py:84,122``).
  `TorchNativeMultiStepDraftBackend` is that backend, `add_torch_native_draft_backends` its entry.
* DRAFT_EXTEND_V2 is a plain causal extend (``prefix_lens``/``extend_lens`` are set by
  ``prepare_for_draft_extend``, eagle_worker_common.py:112), which the stock backend already runs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

if TYPE_CHECKING:  # pragma: no cover
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def verify_kv_mask(custom_mask: Optional[torch.Tensor], seq_lens: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Per-request ``bool[n, seq_len_b + n]`` attention masks of a verify batch.

    ``custom_mask`` is SGLang's flat tree mask in either layout (eagle_utils.py:138): QLEN_ONLY
    (``B * n * n``, tree part only) or FULL_MASK (per request ``n x (seq_len_b + n)``, prefix
    columns included); the layout is told apart by its size. ``None`` means a chain (causal).
    The committed prefix is always fully visible.

    Args:
        custom_mask: flat bool tensor, or None.
        seq_lens: ``int[B]`` committed lengths before the verify window.
        n: draft tokens per request (tree size incl. root).
    Returns:
        list of B bool tensors ``[n, seq_len_b + n]``.
    Raises:
        ValueError: the mask size matches neither layout.
    """
    lens = [int(x) for x in seq_lens.tolist()]
    bs = len(lens)
    device = seq_lens.device
    if custom_mask is None:
        tree = torch.tril(torch.ones(n, n, dtype=torch.bool, device=device))
        trees = [tree] * bs
        full = None
    elif custom_mask.numel() == bs * n * n:
        trees = list(custom_mask.reshape(bs, n, n).to(torch.bool))
        full = None
    elif custom_mask.numel() == sum(lens) * n + bs * n * n:
        full, trees, off = [], None, 0
        for length in lens:
            size = n * (length + n)
            full.append(custom_mask[off: off + size].reshape(n, length + n).to(torch.bool))
            off += size
    else:
        raise ValueError(f"verify mask of {custom_mask.numel()} entries fits neither layout "
                         f"(bs={bs}, n={n}, seq_lens_sum={sum(lens)})")
    if full is not None:
        return full
    return [torch.cat([torch.ones(n, length, dtype=torch.bool, device=device), t], dim=1)
            for length, t in zip(lens, trees)]


def verify_forward_extend(backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          layer: "RadixAttention", forward_batch: "ForwardBatch",
                          save_kv_cache: bool = True) -> torch.Tensor:
    """TARGET_VERIFY attention of ``TorchNativeAttnBackend``: each request's ``n`` tree tokens
    attend to the committed prefix and to their tree ancestors (and themselves).

    The tree tokens' K/V are first written to ``forward_batch.out_cache_loc`` (which SGLang set to
    ``req_to_token[b, seq_len : seq_len + n]``, eagle_utils.py:357), so per request the keys are
    ``req_to_token[b, :seq_len + n]``.

    Args:
        backend: the ``TorchNativeAttnBackend`` instance.
        q: ``[B * n, H_q * D]``; k, v: ``[B * n, H_kv, D]`` (or flat); layer: the RadixAttention.
        forward_batch: a TARGET_VERIFY batch (``spec_info.draft_token_num``, ``custom_mask``).
    Returns:
        ``[B * n, H_q * D_v]`` attention output.
    Raises:
        NotImplementedError: sliding-window or cross-attention layers.
    """
    if layer.is_cross_attention or (layer.sliding_window_size is not None and layer.sliding_window_size > -1):
        raise NotImplementedError("CPU tree verify: sliding-window/cross attention layers are not supported")
    n = int(forward_batch.spec_info.draft_token_num)
    q_, out, attend = _rows(backend, q, k, v, layer, forward_batch, save_kv_cache)
    req_to_token = backend.req_to_token_pool.req_to_token
    rows = forward_batch.req_pool_indices.tolist()
    if n == 1:  # a root-only tree (verify width 1, a plain decode step) sees every key: no mask, as in decode
        for b, (row, length) in enumerate(zip(rows, forward_batch.seq_lens.tolist())):
            out[b:b + 1] = attend(q_[b:b + 1], req_to_token[row, : int(length) + 1].to(torch.int64), None)
        return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
    masks = verify_kv_mask(getattr(forward_batch.spec_info, "custom_mask", None), forward_batch.seq_lens, n)
    for b, (row, mask) in enumerate(zip(rows, masks)):
        slots = req_to_token[row, : mask.shape[1]].to(torch.int64)
        out[b * n:(b + 1) * n] = attend(q_[b * n:(b + 1) * n], slots, mask)
    return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


def _rows(backend, q, k, v, layer, forward_batch, save_kv_cache: bool):
    """Shared start of the per-request SDPA paths: the new tokens' K/V written to
    ``forward_batch.out_cache_loc``; returns ``(q [T, H_q, D], out [T, H_q, D_v] (empty), attend)``
    with ``attend(q_rows [e, H_q, D], slots int64[L], mask bool[e, L] or None) -> [e, H_q, D_v]``."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    k_buf = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_buf = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
    out = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
    gqa = layer.tp_q_head_num != layer.tp_k_head_num

    def attend(rows: torch.Tensor, slots: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        qb = rows.transpose(0, 1)                               # [H, e, D]
        kb = k_buf[slots].transpose(0, 1).to(qb.dtype)          # [H_kv, L, D]
        vb = v_buf[slots].transpose(0, 1).to(qb.dtype)
        ob = scaled_dot_product_attention(qb.unsqueeze(0), kb.unsqueeze(0), vb.unsqueeze(0), attn_mask=mask,
                                          scale=layer.scaling, enable_gqa=gqa)
        return ob.squeeze(0).transpose(0, 1)

    return q_, out, attend


def prefix_extend_forward(backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          layer: "RadixAttention", forward_batch: "ForwardBatch",
                          save_kv_cache: bool = True) -> torch.Tensor:
    """Causal extend attention computed for the new tokens only.

    The stock ``_run_sdpa_forward_extend`` (torch_native_backend.py:84) pads every request's
    queries to its whole sequence and runs full ``L x L`` causal attention, then keeps the last
    ``e`` rows: a draft extend of one token per request (every decode round of an EAGLE-style
    method, plain verify-width-1 rounds included) costs O(L^2) per layer instead of O(L). Here the
    ``e`` new queries attend to the ``L`` keys with the bottom-right-aligned causal mask
    (``key j visible to new token i iff j <= prefix + i``), no mask when ``e == 1``; the rows are the
    same softmax over the same keys.

    Args:
        backend: the ``TorchNativeAttnBackend`` instance.
        q: ``[T, H_q * D]`` (T = sum of extend lengths); k, v: ``[T, H_kv, D]`` (or flat) or None.
        layer: a causal self-attention RadixAttention (no sliding window).
        forward_batch: an EXTEND / DRAFT_EXTEND batch (``extend_prefix_lens``, ``extend_seq_lens``).
    Returns:
        ``[T, H_q * D_v]`` attention output.
    """
    q_, out, attend = _rows(backend, q, k, v, layer, forward_batch, save_kv_cache)
    prefix = forward_batch.extend_prefix_lens_cpu
    ext = forward_batch.extend_seq_lens_cpu
    prefix = [int(x) for x in (prefix if prefix is not None else forward_batch.extend_prefix_lens.tolist())]
    ext = [int(x) for x in (ext if ext is not None else forward_batch.extend_seq_lens.tolist())]
    req_to_token = backend.req_to_token_pool.req_to_token
    start = 0
    for row, p, e in zip(forward_batch.req_pool_indices.tolist(), prefix, ext):
        if e == 0:
            continue
        slots = req_to_token[row, : p + e].to(torch.int64)
        mask = None
        if e > 1:
            mask = (torch.arange(p + e, device=q.device)[None, :]
                    <= p + torch.arange(e, device=q.device)[:, None])
        out[start:start + e] = attend(q_[start:start + e], slots, mask)
        start += e
    return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


def _plain_causal(layer, forward_batch) -> bool:
    """A layer and batch `prefix_extend_forward` serves: causal self-attention, no sliding window,
    no encoder, no ragged query padding."""
    from sglang.srt.layers.radix_attention import AttentionType

    return (not layer.is_cross_attention and layer.attn_type != AttentionType.ENCODER_ONLY
            and (layer.sliding_window_size is None or layer.sliding_window_size <= -1)
            and forward_batch.encoder_lens is None and layer.qk_head_dim == layer.v_head_dim
            and forward_batch.extend_seq_lens is not None and forward_batch.extend_prefix_lens is not None)


def forward_extend_hook(orig, backend, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
    """AROUND hook on ``TorchNativeAttnBackend.forward_extend`` (torch_native_backend.py:279):
    TARGET_VERIFY batches go to `verify_forward_extend`, plain causal extends (prefill with a cached
    prefix, draft extend) to `prefix_extend_forward`, everything else to the stock method."""
    if forward_batch.forward_mode.is_target_verify():
        return verify_forward_extend(backend, q, k, v, layer, forward_batch, save_kv_cache)
    if not args and not kwargs and _plain_causal(layer, forward_batch):
        return prefix_extend_forward(backend, q, k, v, layer, forward_batch, save_kv_cache)
    return orig(backend, q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)


def draft_branch_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, topk: int, num_steps: int) -> torch.Tensor:
    """KV slot table of the EAGLE multi-step draft decode, one row per (request, branch).

    Row ``b * topk + j`` = the request's committed slots ``req_to_token[r_b, :seq_len_b]``
    followed by branch ``j``'s draft slots ``req_to_token[r_b, seq_len_b + j * num_steps + s]``
    for ``s < num_steps``. At draft step ``s`` a branch reads the first ``seq_len_b + s + 1``
    entries. This is the layout of SGLang's ``generate_draft_decode_kv_indices``
    (kernels/ops/speculative/cache_locs.py:161, page size 1) and of the CPU
    ``build_draft_decode_metadata_cpu`` (intel_amx_backend.py:438).

    Args:
        req_to_token: ``int32[R, C]``; req_pool_indices: ``int64[B]``; seq_lens: ``int[B]``.
    Returns:
        ``int64[B * topk, max(seq_lens) + num_steps]`` (unused tail entries are 0).
    """
    bs = seq_lens.shape[0]
    lens = seq_lens.to(torch.int64)
    width = int(lens.max()) + num_steps if bs else num_steps
    rows = req_to_token[req_pool_indices.to(torch.int64)].to(torch.int64)  # [B, C]
    col = torch.arange(width, device=rows.device)
    padded = torch.nn.functional.pad(rows, (0, max(0, width - rows.shape[1])))[:, :width]
    prefix = torch.where(col[None, :] < lens[:, None], padded, 0)
    table = prefix.repeat_interleave(topk, dim=0)                            # [B*topk, W]
    j = torch.arange(topk, device=rows.device)
    s = torch.arange(num_steps, device=rows.device)
    src = lens[:, None, None] + j[None, :, None] * num_steps + s[None, None, :]   # [B, topk, steps]
    slots = rows.gather(1, src.reshape(bs, -1)).reshape(bs * topk, num_steps)
    dst = (lens[:, None] + s[None, :]).repeat_interleave(topk, dim=0)          # [B*topk, steps]
    table.scatter_(1, dst, slots)
    return table


def _torch_native_cls():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    return TorchNativeAttnBackend


@functools.cache
def _step_backend_cls():
    """``TorchNativeAttnBackend`` subclass whose decode reads the (request, branch) slot table."""

    class TorchNativeDraftStepBackend(_torch_native_cls()):
        branch_rows: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

        def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, *args, **kwargs):
            if self.branch_rows is None:
                return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, *args, **kwargs)
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            table, seq_lens, rows = self.branch_rows
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
            q_ = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
            o_ = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
            self._run_sdpa_forward_decode(
                q_, o_, self.token_to_kv_pool.get_key_buffer(layer.layer_id),
                self.token_to_kv_pool.get_value_buffer(layer.layer_id), table, rows, seq_lens,
                None, scaling=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=False)
            return o_.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

    return TorchNativeDraftStepBackend


class TorchNativeMultiStepDraftBackend:
    """Per-step torch_native backends for the EAGLE draft decode loop (``topk`` rows/request).

    Mirrors the contract of ``IntelAMXMultiStepDraftBackend`` (intel_amx_backend.py:426):
    ``attn_backends[step]`` is handed to the draft model at step ``step``
    (eagle_worker_v2.py:841), and ``init_forward_metadata`` is called once per draft round
    (eagle_worker_v2.py:711).
    """

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [_step_backend_cls()(model_runner) for _ in range(max(speculative_num_steps - 1, 0))]

    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Build the (request, branch) slot table and every step's visible lengths."""
        if forward_batch.forward_mode.is_idle() or not self.attn_backends:
            return
        first = self.attn_backends[0]
        table = draft_branch_table(first.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                                   forward_batch.seq_lens, self.topk, self.speculative_num_steps)
        rows = torch.arange(table.shape[0], device=table.device)
        base_lens = forward_batch.seq_lens.to(torch.int64).repeat_interleave(self.topk)
        for step, backend in enumerate(self.attn_backends):
            backend.init_forward_metadata(forward_batch)
            backend.branch_rows = (table, base_lens + step + 1, rows)


def add_torch_native_draft_backends(orig, factory, backend_name, backend_map, error_template,
                                    stamps_children=False, *args, **kwargs):
    """AROUND hook on ``DraftBackendFactory._create_backend`` (draft_utils.py:47): adds a
    ``torch_native`` entry to the backend map it is given. ``stamps_children`` is True exactly for
    the multi-step draft-decode container (draft_utils.py:115), False for the draft-extend backend.
    """
    def make():
        if stamps_children:
            return ("torch_native", TorchNativeMultiStepDraftBackend(
                factory.draft_model_runner, factory.topk, factory.speculative_num_steps))
        return ("torch_native", _torch_native_cls()(factory.draft_model_runner))

    backend_map = {**backend_map, "torch_native": make}
    return orig(factory, backend_name, backend_map, error_template, stamps_children, *args, **kwargs)
