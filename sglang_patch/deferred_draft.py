"""Plain rounds without the EAGLE draft extend: the draft catches up later, in one extend.

A plain round (verify width 1) is SGLang's decode step (`sglang_patch.plain_round`): it commits
one token per request and runs no draft. The EAGLE draft must still see every committed token, with
the target's hidden state at its position, before it drafts again (SGLang's own drafting-disabled
round runs a draft extend after every such round, ``eagle_worker_v2.py:1497``; where the draft is a
large share of the target, as on our CPU pairs, that extend is a sixth of a round).

`DeferredDraftExtend` takes that extend out of plain rounds. Each plain round stores what the
extend would have read - the committed token and the target's hidden state at the root
(``EagleDraftExtendInput.hidden_states``) - in per-request-slot device rings, at column ``position
% width`` of the root's position (two scatters, no host read). Before the next round that drafts, or when a request has ``width`` tokens waiting, one
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
The committed tokens the catch-up covers also reach the graft token history then
(`GraftPlanner.append_committed`), as nothing of graft's runs in a plain round.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["DeferredDraftExtend"]

#: ScheduleBatch fields the catch-up extend sets (``prepare_for_draft_extend``,
#: eagle_worker_common.py:112) and restores afterwards.
_BATCH_FIELDS = ("spec_info", "input_ids", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "out_cache_loc",
                 "forward_mode", "prefix_lens", "extend_lens", "extend_num_tokens")


class DeferredDraftExtend:
    """Device rings of the draft extends that plain rounds skipped, and their catch-up.

    Args:
        width: the catch-up window in tokens per request: a request never waits with more than
            ``width`` tokens (the widest verify width N; 1 catches up before every later round).
        device: the worker's device.

    Attributes:
        tokens: ``int[P, width]`` (the sampler's dtype) per request-pool slot (P = pool size), the token committed after
            the root at position p in column ``p % width``.
        hidden: ``[P, width, H_t]`` the target's hidden state at that root (dtype of the target's
            captured hidden states; H_t e.g. 3 x hidden for EAGLE-3), same columns.
        pending: rid -> waiting tokens (host), rebuilt from every decode batch; a request's waiting
            tokens are the last ``pending`` positions before its committed length.
    """

    def __init__(self, width: int, device):
        self.width = int(width)
        self.device = device
        self.tokens: Optional[torch.Tensor] = None
        self.hidden: Optional[torch.Tensor] = None
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
        """Bytes held by the device rings (0 before the first plain round)."""
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.hidden) if t is not None)

    # ------------------------------------------------------------------ device side
    def _ensure(self, pool: int, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.tokens is None:   # the dtypes of the sampler's tokens and the target's hidden states
            self.tokens = torch.zeros(pool, self.width, dtype=tokens.dtype, device=self.device)
            self.hidden = torch.zeros(pool, self.width, hidden.shape[-1], dtype=hidden.dtype, device=self.device)

    def record(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
               pool: int) -> None:
        """A plain round's skipped extend (static shapes, no host read).

        Args:
            slots: ``int64[B]`` request-pool rows.
            positions: ``int[B]`` each root's position (the committed length before it).
            tokens: ``int[B]`` the tokens the round committed (the new bonus tokens).
            hidden: ``[B, H_t]`` the target's hidden state at each root.
            pool: request-pool size (the rings' rows, allocated on first use).
        """
        self._ensure(pool, tokens, hidden)
        col = positions.remainder(self.width)
        self.tokens[slots, col] = tokens.to(self.tokens.dtype)     # no-ops at the first round's dtypes
        self.hidden[slots, col] = hidden.to(self.hidden.dtype)
        self.deferred += int(slots.shape[0])

    def catch_up(self, draft_worker, batch, counts: Sequence[int], req_to_token: torch.Tensor
                 ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """One draft extend over every row's waiting tokens, before ``batch`` drafts.

        Runs ``draft_worker._draft_extend_for_decode`` (eagle_worker_v2.py:1110) with the batch's
        ``seq_lens`` moved back by the waiting counts, so the extend window starts at the first
        waiting position; rows past a request's count write to slot 0. Rows that had nothing
        waiting keep their draft input. The worker must be in the runtime state of ``width`` tokens
        per request. ``batch``'s fields are restored; ``batch.spec_info``'s ``topk_p`` /
        ``topk_index`` / ``hidden_states`` are replaced for the waiting rows.

        Args:
            draft_worker: SGLang's ``EagleDraftWorker``.
            batch: the decode ``ScheduleBatch`` about to run.
            counts: waiting tokens per row (host, from `plan`).
            req_to_token: ``int[P, max_context]`` SGLang's request-to-KV-slot table.
        Returns:
            ``(tokens int[B, width], waiting int64[B])``: the committed tokens the extend covered,
            in position order (the first ``waiting[b]`` of row b), or None when nothing was ever
            recorded.
        """
        if self.tokens is None:
            return None
        bs, n = len(counts), self.width
        cur = batch.seq_lens
        slots = batch.req_pool_indices.to(torch.int64)
        waiting = torch.tensor(list(counts), dtype=torch.int64).to(cur.device, non_blocking=True)   # [B]
        start = cur.to(torch.int64) - waiting
        cols = torch.arange(n, device=cur.device)
        pos = start[:, None] + cols                                                              # [B, n]
        real = cols[None, :] < waiting[:, None]
        loc = torch.where(real, req_to_token[slots[:, None], pos.clamp(0, req_to_token.shape[1] - 1)].to(torch.int64),
                          0)
        ring = pos.remainder(n)
        tokens = self.tokens[slots[:, None], ring]                                               # [B, n]
        select = torch.arange(bs, device=cur.device) * n + (waiting - 1).clamp(min=0)
        saved = {f: getattr(batch, f, None) for f in _BATCH_FIELDS}
        spec = batch.spec_info
        result = SimpleNamespace(
            prepared_draft_extend_inputs=((waiting - 1).clamp(min=0), select, tokens.reshape(-1)),
            accept_lens=waiting.to(torch.int32),
            logits_output=SimpleNamespace(hidden_states=self.hidden[slots[:, None], ring].reshape(bs * n, -1)),
            next_draft_input=SimpleNamespace(),
            new_seq_lens=cur,
        )
        try:
            batch.seq_lens = start.to(cur.dtype)
            if batch.seq_lens_cpu is not None:
                lens = batch.seq_lens_cpu - torch.tensor(list(counts), dtype=batch.seq_lens_cpu.dtype)
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
        self.catch_ups += 1
        return tokens, waiting
