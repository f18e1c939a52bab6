"""Plain rounds without the EAGLE draft extend: the draft catches up later, in one extend.

A plain round (verify width 1, SGLang's ``steps = 0`` path, ``eagle_worker_v2.py:1469``) verifies
the root alone, then runs the EAGLE draft extend over that one committed token to keep the
draft's KV cache and next-step top-k current (:1497). On a GPU that extend is a small fraction of
the round; where the draft is a large share of the target (our CPU pairs: one draft layer per six
target layers, each with its own per-request attention loop) it is a sixth of a plain round.

`DeferredDraftExtend` takes that extend out of plain rounds. Each plain round stores what the
extend would have read - the committed token and the target's hidden state at the root
(``EagleDraftExtendInput.hidden_states``) - in per-request-slot device buffers (a scatter, no host
read). Before the next round that drafts, or when a request has ``width`` tokens waiting, one
draft extend runs over the waiting tokens of every request of the batch, in the full-width
runtime state and its CUDA graph: SGLang's own ``_draft_extend_for_decode`` (:1110) with the
window moved back to the first waiting position, ``num_accept_tokens`` = the waiting count, and
the padding rows written to the allocator's dummy slot 0 (``allocator/token.py:43``). It writes
the same draft KV entries and yields the same next-step top-k and hidden state as the extends it
replaces (the draft attends causally, so N tokens in one extend = N extends of one token).

The waiting counts are known on the host without a device read: every request of a plain round's
batch gains one (the scheduler does not drop running requests from decode batches; a prefill or
re-prefill resets the count), so every TP rank makes the same catch-up decision.

Only the draft is affected: the target verifies whatever the draft proposes, so outputs are the
same with or without deferral; acceptance is the same because the draft state at drafting time is.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence

import torch

__all__ = ["DeferredDraftExtend"]

#: ScheduleBatch fields the catch-up extend sets (``prepare_for_draft_extend``,
#: eagle_worker_common.py:112) and restores afterwards.
_BATCH_FIELDS = ("spec_info", "input_ids", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "out_cache_loc",
                 "forward_mode", "prefix_lens", "extend_lens", "extend_num_tokens")


class DeferredDraftExtend:
    """Device buffers of the draft extends that plain rounds skipped, and their catch-up.

    Args:
        width: the catch-up window in tokens per request (the widest verify width N): a request
            never waits with more than ``width`` tokens.
        device: the worker's device.

    Attributes:
        tokens: ``int64[P, width]`` committed tokens waiting per request-pool slot (P = pool size).
        hidden: ``[P, width, H_t]`` the target's hidden state at each waiting token's position
            (dtype of the target's captured hidden states; H_t e.g. 3 x hidden for EAGLE-3).
        count: ``int64[P]`` waiting tokens per slot (device mirror of `pending`).
        pending: rid -> waiting tokens (host), rebuilt from every decode batch.
    """

    def __init__(self, width: int, device):
        self.width = int(width)
        self.device = device
        self.tokens: Optional[torch.Tensor] = None
        self.hidden: Optional[torch.Tensor] = None
        self.count: Optional[torch.Tensor] = None
        self.pending: Dict[str, int] = {}
        self.catch_ups = 0          # catch-up extends run (``/server_info``)
        self.deferred = 0           # draft extends skipped (request-rounds)

    # ------------------------------------------------------------------ host side
    def plan(self, rids: Sequence[str], width: int) -> Optional[List[int]]:
        """Before a decode round of verify width ``width``: the waiting counts per row when a catch-up
        must run first (the round drafts, or a request's window is full), else None. Updates
        `pending` for the round (a plain round adds one per request)."""
        counts = [self.pending.get(r, 0) for r in rids]
        full = width == 1 and max(counts, default=0) >= self.width
        need = any(counts) and (width > 1 or full)
        after = [0 if need else c for c in counts]
        self.pending = {r: c + 1 for r, c in zip(rids, after)} if width == 1 else {}
        return counts if need else None

    def forget(self, rids: Sequence[str]) -> None:
        """Requests (re-)prefilled: their prefill ran its own draft extend."""
        for r in rids:
            self.pending.pop(r, None)

    def memory_bytes(self) -> int:
        """Bytes held by the device buffers (0 before the first plain round)."""
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.hidden, self.count) if t is not None)

    # ------------------------------------------------------------------ device side
    def reset(self, slots: torch.Tensor) -> None:
        """``slots`` ``int[B]`` (re-)prefilled: nothing waits there any more (a device write)."""
        if self.count is not None:
            self.count[slots.to(torch.int64)] = 0

    def _ensure(self, pool: int, hidden: torch.Tensor) -> None:
        if self.tokens is None:
            self.tokens = torch.zeros(pool, self.width, dtype=torch.int64, device=self.device)
            self.hidden = torch.zeros(pool, self.width, hidden.shape[-1], dtype=hidden.dtype, device=self.device)
            self.count = torch.zeros(pool, dtype=torch.int64, device=self.device)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, pool: int) -> None:
        """A plain round's skipped extend: ``tokens`` ``int[B]`` committed (the new bonus tokens) and
        ``hidden`` ``[B, H_t]`` the target's hidden state at each root, appended per slot
        (``slots`` ``int[B]`` request-pool rows). Static shapes, no host read."""
        self._ensure(pool, hidden)
        slots = slots.to(torch.int64)
        k = self.count[slots].clamp(max=self.width - 1)
        self.tokens[slots, k] = tokens.reshape(-1).to(torch.int64)
        self.hidden[slots, k] = hidden.to(self.hidden.dtype)
        self.count[slots] = k + 1
        self.deferred += int(slots.shape[0])

    def catch_up(self, draft_worker, batch, counts: Sequence[int], req_to_token: torch.Tensor) -> None:
        """One draft extend over every row's waiting tokens, before ``batch`` drafts.

        Runs ``draft_worker._draft_extend_for_decode`` (eagle_worker_v2.py:1110) with the batch's
        ``seq_lens`` moved back by the waiting counts, so the extend window starts at the first
        waiting position; rows past a request's count write to slot 0. Rows that had nothing
        waiting keep their draft input. The worker must be in its full-width runtime state
        (``width`` tokens per request). ``batch``'s fields are restored; ``batch.spec_info``'s
        ``topk_p`` / ``topk_index`` / ``hidden_states`` are replaced for the waiting rows.

        Args:
            draft_worker: SGLang's ``EagleDraftWorker``.
            batch: the decode ``ScheduleBatch`` about to draft.
            counts: waiting tokens per row (host, from `plan`).
            req_to_token: ``int[P, max_context]`` SGLang's request-to-KV-slot table.
        """
        if self.count is None:
            return
        bs, n = len(counts), self.width
        slots = batch.req_pool_indices.to(torch.int64)
        waiting = self.count[slots]                                     # [B]
        cur = batch.seq_lens
        start = cur.to(torch.int64) - waiting
        cols = torch.arange(n, device=cur.device)
        pos = (start[:, None] + cols).clamp(0, req_to_token.shape[1] - 1)
        real = cols[None, :] < waiting[:, None]
        loc = torch.where(real, req_to_token[slots[:, None], pos].to(torch.int64), 0)
        select = torch.arange(bs, device=cur.device) * n + (waiting - 1).clamp(min=0)
        saved = {f: getattr(batch, f, None) for f in _BATCH_FIELDS}
        spec = batch.spec_info
        result = SimpleNamespace(
            prepared_draft_extend_inputs=((waiting - 1).clamp(min=0), select, self.tokens[slots].reshape(-1)),
            accept_lens=waiting.to(torch.int32),
            logits_output=SimpleNamespace(hidden_states=self.hidden[slots].reshape(bs * n, -1)),
            next_draft_input=SimpleNamespace(),
            new_seq_lens=cur,
        )
        try:
            batch.seq_lens = start.to(cur.dtype)
            if batch.seq_lens_cpu is not None:
                lens = batch.seq_lens_cpu - torch.tensor(counts, dtype=batch.seq_lens_cpu.dtype)
                batch.seq_lens_cpu = lens
                batch.seq_lens_sum = int(lens.sum())
            elif batch.seq_lens_sum is not None:
                batch.seq_lens_sum = batch.seq_lens_sum - sum(counts)
            batch.out_cache_loc = loc.reshape(-1).to(saved["out_cache_loc"].dtype
                                                     if saved["out_cache_loc"] is not None else torch.int64)
            draft_worker._draft_extend_for_decode(batch, result, kv_loc_plan=None)
        finally:
            for f, v in saved.items():
                setattr(batch, f, v)
        new = result.next_draft_input
        has = (waiting > 0)[:, None]
        spec.topk_p = torch.where(has, new.topk_p.to(spec.topk_p.dtype), spec.topk_p)
        spec.topk_index = torch.where(has, new.topk_index.to(spec.topk_index.dtype), spec.topk_index)
        if spec.hidden_states is not None and getattr(new, "hidden_states", None) is not None:
            spec.hidden_states = torch.where(has, new.hidden_states.to(spec.hidden_states.dtype), spec.hidden_states)
        self.count[slots] = 0
        self.catch_ups += 1
