"""``GraftWorker``: SGLang's EAGLE V2 worker with the graft step between drafting and verify.

Per decode round (``EAGLEWorkerV2.forward_batch_generation``, ``eagle_worker_v2.py:1416``):

1. **Draft** — EAGLE-3 drafting, unchanged but observed. `GraftDraftWorker.draft_forward` rebinds the
   module global ``organize_draft_results`` (``eagle_worker_v2.py:919``) for the duration of the
   call so the dense tree's cumulative scores, tokens and parent list are copied into buffers
   allocated once (the copy is recorded by CUDA-graph capture and refreshed by every replay). In
   eager execution it also rebinds ``select_top_k_tokens`` (:812) to feed each depth's best
   cumulative probability to a stop gate (graft_spec/gate.py; with checkpoints, prune.py's): once no
   deeper draft node could be selected, the remaining draft forwards are skipped and the nodes they
   would have produced get probability 0. Under CUDA-graph replay the full depth is drafted.
2. **Host proposals** — the suffix index / corpus fill the pinned candidate buffer from the tokens
   the host knows (``req.output_ids``, which lag a round under the overlap scheduler) and upload it
   with one non-blocking copy: after the draft graph was launched, or before drafting when the eager
   stop gate needs them.
3. **Graft step** — `GraftDraftWorker.draft` rebinds ``build_eagle_verify_input`` (:717) to
   `GraftDraftWorker._build_verify_input`, which runs ``GraftPlanner.build`` (graft_spec/step.py: one
   pure device function, static shapes, no host read) and lays the tree out as a `GraftVerifyInput`.
   In eager drafting with the expected-gain gate the retrieved candidates were priced before
   drafting (the gate's floor) and the build reuses them (``RoundRetrieval``).
4. **Verify** — SGLang's ``run_eagle_verify`` (greedy, or target-only tree sampling; the CPU layer
   routes both to ``graft_spec.verify``). `GraftWorker.verify` then runs the device bookkeeping
   (``GraftPlanner.observe_verified``: calibration counts, successor table, commit log) and attaches a
   ``DeviceAuxiliaryOutput`` (``managers/auxiliary_output.py``): SGLang copies it to the host with its
   own result copy and calls ``consume`` before streaming, where per-token sources and counters are
   recorded (`GraftRequestTracker.record`). No host read in the worker's decode path.
5. **Draft extend** — unchanged, launched right after verify.

**Batch budget** (``batch_budget`` in the config, on by default): before a decode round is launched
`GraftWorker.forward_batch_generation` asks ``graft_spec.budget.BatchBudget`` for the round's verify
width (expected tokens per second from the calibrated gain of the requests' last rounds and the round
times measured here, launch to launch) and switches SGLang's runtime state to it
(`sglang_patch.verify_widths`). Width 1 is a plain round: SGLang's own decode step
(`sglang_patch.plain_round`), in which graft only records the draft extend it skips
(`sglang_patch.deferred_draft`); the draft catches up over the skipped tokens in one extend before the
next drafting round. Batches with a request that needs the exact decode step (penalties, logprobs,
``sglang_patch.request_features``) run plain rounds; requests with ``custom_params:
{"graft_speculate": false}`` get no candidates and count as gaining nothing.

Graft's own code in a round is contained (`sglang_patch.containment`): a failure is logged, counted
and replaced by a lossless fallback; repeated failures turn speculation off.

With tensor parallelism every rank builds its own tree, then the first rank's is broadcast to all
(`StepOutput.pack`, one collective), and the eager stop gate's decision per depth is the first
rank's too: ranks always verify the same tree and run the same number of draft forwards, whatever
their host state (tests/test_sglang_tp.py perturbs one rank on purpose).

The SGLang names this worker rebinds for the length of a call are listed, with SGLang's lines, in
`sglang_patch.rebinding`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.managers.auxiliary_output import append_auxiliary_output
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative import eagle_worker_v2 as _ev2
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2

from graft_spec.pipeline import (BatchBudget, DenseDraft, DraftStopGate, GraftPlanner, GraftStats, HostCandidates,
                                 RoundStats, StepOutput, kernel_path, prometheus_enabled,
                                 use_reference_kernels)
from sglang_patch.args import effective_graft_config
from sglang_patch.containment import FollowingGate, RoundGuard
from sglang_patch.deferred_draft import DeferredDraftExtend
from sglang_patch.graft_info import GraftVerifyInput, build_graft_verify_input, tree_mask_numel
from sglang_patch.graft_requests import GraftRequestTracker, tenant_of
from sglang_patch.kv_reserve import kept_widths
from sglang_patch.plain_round import plain_decode_round
from sglang_patch.request_features import plain_round_reason, speculates
from sglang_patch.rebinding import rebound
from sglang_patch.tree_sampling import graft_sampling
from sglang_patch.verify_widths import WidthStates, agree_width

logger = logging.getLogger(__name__)

#: Fault injection (tests): the TP rank whose own graft tree is scrambled (`GraftWorker.inject_fault`).
FAULT_ENV = "GRAFT_FAULT_PERTURB_RANK"


class _DenseTreeSink:
    """Buffers that receive the dense EAGLE tree of every draft call.

    ``scores`` ``float32[max_bs, S]`` cumulative draft probabilities, ``tokens`` ``int64[max_bs, S]``,
    ``parents`` ``int64[max_bs, 1 + topk * (steps - 1)]`` with S = topk + (steps - 1) * topk**2.
    Allocated once so CUDA-graph replays write to the same memory.
    """

    def __init__(self, max_bs: int, topk: int, steps: int, device):
        s = topk + (steps - 1) * topk * topk
        self.scores = torch.zeros(max_bs, s, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(max_bs, s, dtype=torch.int64, device=device)
        self.parents = torch.zeros(max_bs, 1 + topk * (steps - 1), dtype=torch.int64, device=device)

    def capture(self, score_list, token_list, parent_list) -> None:
        scores = torch.cat([x.reshape(x.shape[0], -1) for x in score_list], dim=1)
        bs = scores.shape[0]
        self.scores[:bs].copy_(scores)
        self.tokens[:bs].copy_(torch.cat(token_list, dim=1))
        if parent_list.shape[1] > 0:
            self.parents[:bs].copy_(parent_list)

    def dense(self, topk: int, steps: int, bs: Optional[int] = None, scores: Optional[torch.Tensor] = None
              ) -> DenseDraft:
        """The sink's first ``bs`` rows (all when None) as the step's `DenseDraft`, read in place;
        ``scores`` replaces the sink's scores (the eager stop gate's zeroed undrafted depths)."""
        rows = slice(None) if bs is None else slice(0, bs)
        return DenseDraft(self.scores[rows] if scores is None else scores, self.tokens[rows], self.parents[rows],
                          topk, steps)


@dataclass
class _RoundHost:
    """``HostAuxiliaryOutput`` of a round: its `RoundStats` on the host (SGLang calls `consume` after
    committing the round's tokens and before streaming them, ``auxiliary_output.py``)."""

    worker: "GraftWorker"
    stats: RoundStats

    def consume(self, batch, commits) -> None:
        self.worker.guard.call("the round's host output", self._consume, batch, commits)

    def _consume(self, batch, commits) -> None:
        sources = self.stats.sources.tolist()
        budget = self.worker.budget
        if budget is not None:   # before `record`, which frees the round's finished requests (their curves too)
            expected = self.stats.expected
            budget.observe([r.rid for r in batch.reqs], None if expected is None else expected.numpy(),
                           [1 + sum(1 for x in row if x >= 0) for row in sources],
                           width=len(sources[0]) + 1 if sources else None)
        self.worker.requests.record(batch.reqs, commits, sources)
        self.worker.stats.record_round(sources, self.stats.members, self.stats.depths)   # per row, host copies


@dataclass
class _RoundDevice:
    """``DeviceAuxiliaryOutput`` of a round: SGLang copies it to the host with its own result copy
    (pinned, non-blocking: ``GenerationBatchResult.copy_to_cpu``)."""

    worker: "GraftWorker"
    stats: RoundStats

    def copy_to_host(self, copy_tensor) -> _RoundHost:
        s = self.stats
        expected = None if s.expected is None else copy_tensor(s.expected)
        return _RoundHost(self.worker, RoundStats(copy_tensor(s.sources), copy_tensor(s.members),
                                                  copy_tensor(s.depths), expected))


class GraftDraftWorker(EagleDraftWorker):
    """EAGLE-3 draft worker whose verify input is the graft hybrid tree (class-swapped in)."""

    graft: "GraftWorker"
    _sink: Optional[_DenseTreeSink] = None
    #: depth after which the last eager draft call stopped (None: the full depth was drafted)
    _depth_limit: Optional[int] = None
    #: host proposals prepared before drafting (eager gate), else None
    _host: Optional[HostCandidates] = None
    _gate = None

    def _ensure_sink(self, bs: int) -> _DenseTreeSink:
        if self._sink is None or self._sink.scores.shape[0] < bs:
            pool = getattr(getattr(self, "req_to_token_pool", None), "size", 0) or 0
            self._sink = _DenseTreeSink(max(bs, pool), self.topk, self.speculative_num_steps, self.device)
        return self._sink

    def _eager(self) -> bool:
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def draft(self, batch, *, with_topology: bool = False):
        """``EagleDraftWorker.draft`` building the graft tree instead of the EAGLE tree."""
        self._depth_limit, self._host, self._gate = None, None, None
        if not batch.forward_mode.is_idle() and self.cuda_graph_runner is None:  # eager drafting
            self._gate, self._host = self.graft.stop_gate(batch)
        with rebound(_ev2, "build_eagle_verify_input", self._build_verify_input):
            return super().draft(batch, with_topology=with_topology)

    def draft_forward(self, forward_batch):
        """``EagleDraftWorker.draft_forward`` with the dense tree captured into `_DenseTreeSink`;
        in eager execution the draft forwards are counted and, with a stop gate, those after the
        stop depth skipped. CUDA-graph capture gets the capture only (the stop decision is
        data-dependent and a replay runs no Python)."""
        original_organize = _ev2.organize_draft_results

        def organize_and_capture(score_list, token_list, parents_list, num_draft_token):
            parent_list, top_scores_index, draft_tokens = original_organize(
                score_list, token_list, parents_list, num_draft_token)
            self._ensure_sink(score_list[0].shape[0]).capture(score_list, token_list, parent_list)
            return parent_list, top_scores_index, draft_tokens

        eager = self._eager()
        gate = self._gate if eager and not forward_batch.forward_mode.is_idle() else None
        with contextlib.ExitStack() as stack:
            stack.enter_context(rebound(_ev2, "organize_draft_results", organize_and_capture))
            if gate is not None:
                stack.enter_context(rebound(_ev2, "select_top_k_tokens",
                                             _gated_select(_ev2.select_top_k_tokens, gate,
                                                           forward_batch.batch_size)))
            if eager:
                runner = self.draft_runner
                vocab = (self.hot_token_id.numel() if self.hot_token_id is not None
                         else runner.model_config.vocab_size)
                stack.enter_context(rebound(runner, "forward", _counted_forward(
                    runner.forward, gate, self.graft.stats, vocab)))
            result = super().draft_forward(forward_batch)
        self._depth_limit = gate.stop_depth if gate is not None else None
        return result

    def _build_verify_input(self, batch, draft_input, parent_list, top_scores_index, draft_tokens,
                            draft_probs, *, target_worker, topk, num_steps, num_draft_tokens,
                            tree_mask_mode, device) -> GraftVerifyInput:
        """Same signature as ``eagle_worker_common.build_eagle_verify_input`` (:377): the round's
        draft and host proposals (`_round_inputs`), the graft step (`_graft_step`), the first rank's
        tree on every rank (`_agree_tree`), laid out in SGLang's verify format (`_layout`)."""
        if batch.forward_mode.is_idle():
            return GraftVerifyInput.create_idle_input(topk, num_steps, num_draft_tokens, device)
        draft, roots, host, retrieved = self._round_inputs(batch, draft_input, topk, num_steps)
        out = self._graft_step(batch, draft, roots, host, retrieved, num_draft_tokens)
        return _layout(self._agree_tree(out, batch), batch, target_worker, tree_mask_mode, topk, num_steps)

    def _round_inputs(self, batch, draft_input, topk: int, num_steps: int):
        """``(draft, roots, host, retrieved)`` of the round: the dense draft tree from the sink (nodes
        deeper than an eager stop depth zeroed), the roots, the host proposals (the stop gate's when
        it ran before drafting, with its retrieval; rescrambled by an injected fault)."""
        bs = batch.seq_lens.shape[0]
        sink = self._sink
        if sink is None or sink.scores.shape[0] < bs:
            # Rows [:bs] are written by the eager call or by the graph replay (padded bs >= bs).
            raise RuntimeError(f"graft: the dense draft tree of batch size {bs} was not captured")
        gated = self._host is not None   # the expected-gain gate computed this round's retrieval before drafting
        host = self._host if gated else self.graft.host_candidates(batch)
        scores = sink.scores[:bs]
        if self._depth_limit is not None:  # nodes deeper than the stop depth were never drafted
            s_keep = topk + (self._depth_limit - 1) * topk * topk
            scores = torch.cat([scores[:, :s_keep], torch.zeros_like(scores[:, s_keep:])], dim=1)
        draft = sink.dense(topk, num_steps, bs, scores)   # read as it is by the step
        roots = draft_input.bonus_tokens.reshape(bs).to(torch.int64)
        self.graft._slots()
        retrieved = self._gate.retrieved if gated else None   # priced by the gate before drafting
        injected, draft = self.graft.inject_fault(host, draft)
        if injected is not host:   # fault injection scrambled this rank's host proposals: price them anew
            host, retrieved = injected, None
        return draft, roots, host, retrieved

    def _graft_step(self, batch, draft, roots, host, retrieved, num_draft_tokens: int) -> StepOutput:
        """`GraftPlanner.build` of the round, contained (`RoundGuard`): a failing step, or
        speculation switched off, gives a tree that proposes nothing (padding)."""
        graft = self.graft
        sampled = graft.sampled_rows(batch)

        def build() -> StepOutput:
            graft.guard.inject()
            if graft.guard.off:   # speculation off (no plain width to switch to): a tree that proposes nothing
                return padding()
            return graft.planner.build(draft, roots, host, batch.req_pool_indices, batch.seq_lens, sampled,
                                       num_nodes=num_draft_tokens, retrieved=retrieved)

        def padding() -> StepOutput:
            return StepOutput.padding(roots, batch.seq_lens, num_draft_tokens, graft.planner.calibrator.table)

        return graft.guard.call("the graft step", build, fallback=padding)

    def _agree_tree(self, out: StepOutput, batch) -> StepOutput:
        """With tensor parallelism every rank verifies the first rank's tree (one broadcast); the gain
        curve stays the rank's own (only the first rank's width choice is used)."""
        group = self.graft.tp_group()
        if group is None:
            return out
        packed, gain = out.pack(), out.gain
        group.broadcast(packed, src=0)
        out = StepOutput.unpack(packed, batch.seq_lens, out.estimates, out.groups, out.factors)
        out.gain = gain
        return out


def _layout(out: StepOutput, batch, target_worker, tree_mask_mode, topk: int, steps: int) -> GraftVerifyInput:
    """``out`` as a `GraftVerifyInput`, in the target backend's mask buffer when it fits."""
    bs, n = out.tree.tokens.shape
    verify_mask = target_worker.model_runner.attn_backend.verify_mask
    if verify_mask is None:
        mode, buffer, fill = tree_mask_mode, None, True
    else:
        mode, fill = verify_mask.mode, verify_mask.is_read
        buffer = verify_mask.buffer if verify_mask.fits(bs) else None
    numel = None
    if buffer is None:  # as eagle_worker_v2.py:1707: the host's sum, else an upper bound (no device read)
        total = batch.seq_lens_sum
        if total is None and getattr(batch, "seq_lens_cpu", None) is not None:
            total = int(batch.seq_lens_cpu.sum())
        if total is None:
            runner = target_worker.model_runner
            total = bs * getattr(runner.attn_backend, "max_context_len", runner.model_config.context_len)
        numel = tree_mask_numel(mode, bs, n, total)
    return build_graft_verify_input(out, batch.seq_lens, mode=mode, topk=topk, steps=steps,
                                    mask_buffer=buffer, fill_prefix=fill, full_mask_numel=numel)


def _gated_select(select, gate, bs: int):
    """``select_top_k_tokens`` that reports each depth's best cumulative draft probability to
    ``gate`` (its 4th result is ``(scores of depth i+1, tokens, parents)``)."""

    def select_and_gate(i, *args):
        out = select(i, *args)
        if gate.stop_depth is None:
            gate.observe(i + 1, out[3][0].reshape(bs, -1).amax(dim=1))
        return out

    return select_and_gate


def _counted_forward(forward, gate, stats: GraftStats, vocab: int):
    """``ModelRunner.forward`` of the draft that counts into ``stats`` (run / skipped) and, once
    ``gate`` has stopped, returns `_skipped_draft_output` instead of running."""

    def forward_unless_stopped(fb, *args, **kwargs):
        if gate is None or gate.stop_depth is None:
            stats.count_draft_forward(True)
            return forward(fb, *args, **kwargs)
        stats.count_draft_forward(False)
        return _skipped_draft_output(fb, vocab)

    return forward_unless_stopped


def _skipped_draft_output(forward_batch, vocab: int) -> SimpleNamespace:
    """Stands in for ``ModelRunner.forward``'s output at a skipped draft step: uniform logits
    ``float32[n, vocab]`` and zero hidden states ``[n, H]`` (n = the step's input tokens). The
    candidates drafted from them are given probability 0 in ``_build_verify_input``."""
    hidden = forward_batch.spec_info.hidden_states
    n = forward_batch.input_ids.shape[0]
    logits = torch.zeros(n, vocab, dtype=torch.float32, device=hidden.device)
    states = torch.zeros(n, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
    return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=states))


class GraftWorker(EAGLEWorkerV2):
    """``--speculative-algorithm graft`` worker (constructed by the scheduler, ``scheduler.py:1056``).

    Attributes:
        config: effective ``GraftConfig`` (tree shape = SGLang's resolved shape).
        planner: ``GraftPlanner`` on the worker's device (calibrator, successor table, commit log,
            host sources).
        requests: `GraftRequestTracker` (per-request host state and counters).
    """

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__(server_args=server_args, gpu_id=gpu_id, nccl_port=nccl_port,
                         target_worker=target_worker)
        spec = get_spec()
        # The resolved view: the tree shape was declared by GraftSpec.handle_server_args.
        self.config = effective_graft_config(resolving_view(server_args))
        shape = (spec.speculative_num_draft_tokens, spec.speculative_eagle_topk, spec.speculative_num_steps)
        if shape != (self.config.num_draft_tokens, self.config.topk, self.config.depth):
            raise RuntimeError(f"graft: resolved tree shape {shape} differs from the graft config")
        vocab = target_worker.model_config.vocab_size
        max_bs = resolving_view(server_args).max_running_requests or 1
        # the token history's rows are request-pool slots; the pool is allocated after this constructor
        self.planner = GraftPlanner(self.config, vocab_size=vocab, device=self.device, max_batch=max_bs)
        #: server-wide statistics (``/server_info``, and ``/metrics`` with ``--enable-metrics``)
        self.stats = GraftStats(prometheus=prometheus_enabled())
        #: containment of graft's own round code (`sglang_patch.containment`)
        self.guard = RoundGuard(on_failure=self.stats.record_failure)
        #: the verify widths this server builds: the config's, less those the KV reserve dropped
        self.widths = widths = kept_widths(self.config.verify_widths)
        #: the batch budget (None: one width, N, every round)
        self.budget = BatchBudget(widths, self.config.batch_budget) if len(widths) > 1 else None
        #: per-request host state; a freed request's gain curve leaves the budget with it
        self.requests = GraftRequestTracker(self.planner, on_free=self.budget.forget if self.budget else None,
                                            return_sources=self.config.return_sources)
        self.width_states = WidthStates(self)
        #: plain rounds' skipped draft extends and their catch-up: over up to N plain rounds' tokens,
        #: or (``defer_draft_extend: false``) over each plain round's token before the next round
        self.deferred = (DeferredDraftExtend(max(widths) if self.config.batch_budget.defer_draft_extend else 1,
                                             self.device) if self.budget is not None else None)
        #: the graft step's CUDA graphs (`init_cuda_graphs`; None: the step runs eagerly)
        #: which graft step runs: kernels (fused / reference) and graphs or eager (`_capture_step_graphs`)
        self.step_path = "not prepared"
        self._launch: Optional[tuple] = None        # (width, batch size, perf_counter) of the last decode launch
        if self._draft_worker is not None:
            self._draft_worker.__class__ = GraftDraftWorker
            self._draft_worker.graft = self
        logger.info("graft worker ready: %s", self.config.model_dump_json())

    # ------------------------------------------------------------------ ranks
    def tp_group(self):
        """SGLang's TP group coordinator when this worker has peers (graft refuses DP attention, so the
        attention TP group is the TP group), else None."""
        from sglang.srt.runtime_context import get_parallel

        group = getattr(get_parallel(), "tp_group", None)
        return group if group is not None and group.world_size > 1 else None

    def _agree(self, decision: torch.Tensor) -> torch.Tensor:
        """The first rank's value of a local decision tensor (a broadcast), so every rank drafts alike."""
        t = decision.reshape(1).to(torch.int64)
        self.tp_group().broadcast(t, src=0)
        return t[0].bool()

    def inject_fault(self, host: HostCandidates, draft):
        """Fault injection for the rank-agreement test: on the TP rank named by
        ``GRAFT_FAULT_PERTURB_RANK``, the host proposals and the draft scores are scrambled, so this
        rank's own tree differs from its peers'. Without the environment variable: a no-op."""
        import os

        rank = os.environ.get(FAULT_ENV)
        group = self.tp_group()
        if rank is None or group is None or int(rank) != group.rank_in_group:
            return host, draft
        if not getattr(self, "_fault_noted", False):
            self._fault_noted = True
            logger.warning("%s=%s: TP rank %s scrambles its own host proposals and draft scores "
                           "(fault injection for tests)", FAULT_ENV, rank, rank)
        host = dataclasses.replace(host, tokens=host.tokens.flip(1), packed=None)   # the block is stale
        return host, dataclasses.replace(draft, scores=draft.scores.flip(1))

    def _slots(self) -> None:
        """Size the per-slot state (token history, per-request correction) to the request pool (its
        rows are ``req_pool_indices``) on first use."""
        self.planner.ensure_slots(self.target_worker.model_runner.req_to_token_pool.req_to_token.shape[0])

    # ------------------------------------------------------------------ per round (host side)
    def host_candidates(self, batch) -> HostCandidates:
        """Sync the host sources with the batch's requests and upload their proposals (and their
        opt-out flags); when that fails (contained), rows without host proposals."""
        speculate = [speculates(r) for r in batch.reqs]
        return self.guard.call(
            "the host proposals", lambda: self.planner.host_candidates(self.requests.prepare(batch.reqs), speculate),
            fallback=lambda: self.planner.no_host_candidates([r.rid for r in batch.reqs], speculate))

    @staticmethod
    def sampled_rows(batch) -> torch.Tensor:
        """``bool[B]``: rows verified by sampling (SGLang maps temperature 0 to top_k 1)."""
        return batch.sampling_info.top_ks.reshape(-1) > 1

    def stop_gate(self, batch):
        """`_stop_gate`, contained: when it fails the round drafts the full depth (with TP, following
        the first rank's stop decisions, `FollowingGate`)."""
        group = self.tp_group()
        return self.guard.call("the stop gate", self._stop_gate, batch,
                               fallback=lambda: (FollowingGate(self._agree) if group is not None else None, None))

    def _stop_gate(self, batch):
        """``(gate, host)`` for a round drafted eagerly: the stop gate (None when disabled, or for a
        sampled batch under checkpoints with rejection sampling) and, with the expected-gain gate, the
        host proposals, prepared here because the gate needs them before drafting (else None: they
        are prepared after the draft was launched). The expected-gain gate's floor is taken at the
        round's verify width, and its ``retrieved`` candidates are reused by the round's build."""
        cfg = self.config
        if not cfg.stop_drafting_early:
            return None, None
        bs = batch.seq_lens.shape[0]
        if cfg.checkpoints:
            if get_spec().speculative_use_rejection_sampling and not batch.sampling_info.is_all_greedy:
                return None, None
            gate = DraftStopGate(cfg.checkpoints, bs, device=self.device)
            if self.tp_group() is not None:
                gate.agree = self._agree
            return gate, None
        host = self.host_candidates(batch)
        roots = batch.spec_info.bonus_tokens.reshape(bs).to(torch.int64)
        gate = self.planner.stop_gate(roots, host, batch.req_pool_indices, batch.seq_lens,
                                      self.sampled_rows(batch), num_nodes=self.speculative_num_draft_tokens)
        if self.tp_group() is not None:
            gate.agree = self._agree
        return gate, host

    # ------------------------------------------------------------------ scheduler hooks
    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        """Free the request's graft state (``batch_result_processor.py:1442``)."""
        self.guard.call("freeing a request's graft state", self.requests.finish, rid)   # its gain curve too

    def note_prefill_finished(self, rid: str) -> None:
        """Free the graft state of a request that finished in its prefill, which SGLang does not
        report to a speculative worker (`sglang_patch.prefill_finish`)."""
        self.guard.call("freeing a request's graft state", self.requests.finish, rid)

    # ------------------------------------------------------------------ batch budget
    def init_cuda_graphs(self):
        """SGLang's capture, then one runtime state per further verify width (`WidthStates`), then
        the graft step's own graphs (`graft_spec.graphs.StepGraphs`, CUDA with graphs on only)."""
        super().init_cuda_graphs()
        if self.budget is not None and self._draft_worker is not None:
            self.width_states.build(self.budget.widths)
        self._capture_step_graphs()

    def _capture_step_graphs(self) -> None:
        """The planner's graphs, one per (SGLang decode batch size, verify width)
        (`GraftPlanner.capture_graphs`; `GraftPlanner.build` replays them). None on CPU, with
        ``--disable-cuda-graph`` (the fused kernels compile once eagerly then) and without a draft
        worker.

        Start-up never dies on graft's own kernels: a Triton compile or graph capture failure of
        the fused step switches the process to the torch references (`use_reference_kernels`) with
        one warning naming the cause and captures those; a capture failure of the references
        leaves the step eager. `step_path` says which runs (``/server_info``: ``graft.step_path``).
        """
        if self._draft_worker is None or torch.device(self.device).type != "cuda":
            self.step_path = "torch reference, eager (CPU)" if self._draft_worker is not None else "none"
            return
        self._slots()  # the token history is read inside the graphs: size it before capture
        graphed = not _ev2.check_cuda_graph_backend(_ev2.Phase.DECODE, _ev2.Backend.DISABLED)
        buckets = _ev2.get_exec().graph.cuda_graph_bs_decode if graphed else [1]
        # the graphs read the draft where the draft calls write it (no copy per round)
        sink = self._draft_worker._ensure_sink(max(buckets))
        draft_buffer = sink.dense(self.topk, self.speculative_num_steps)
        for attempt in ("fused", "reference"):
            try:
                graphs = self.planner.capture_graphs(self.topk, self.speculative_num_steps, buckets, self.widths,
                                                     replay=graphed, draft_buffer=draft_buffer)
            except Exception as exc:  # noqa: BLE001 - a compile or capture error of graft's step
                cause = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                if attempt == "fused" and kernel_path() == "fused":
                    logger.warning("graft: the fused step failed at start-up (%s); running the torch reference "
                                   "kernels instead", cause, exc_info=exc)
                    use_reference_kernels(cause)
                    continue
                if graphed:
                    logger.warning("graft: capturing the graft step failed (%s); the step runs eagerly", cause,
                                   exc_info=exc)
                    self.step_path = f"{kernel_path()}, eager (capture failed: {cause})"
                    return
                raise
            self.step_path = f"{kernel_path()}, {'CUDA graphs' if graphed else 'eager'}"
            logger.info("graft step: %s (%d build and %d observe graphs: batch sizes %s, widths %s)",
                        self.step_path, graphs.captured, graphs.observes_captured, list(graphs.buckets),
                        list(graphs.widths))
            return

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        """``EAGLEWorkerV2.forward_batch_generation`` with the round's verify width chosen first."""
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())
        if decode:
            self.guard.next_round()
        if self.budget is not None:
            if decode:
                self._choose_width(batch)
            else:
                self._launch = None  # a prefill in between: the next decode launch is not a round time
        if decode and self.budget is not None and self.speculative_num_draft_tokens == 1:
            return self._plain_round(batch, on_publish, grammar_barrier)
        return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier,
                                                pp_proxy_tensors=pp_proxy_tensors)

    def _plain_round(self, batch, on_publish, grammar_barrier):
        """Width 1: SGLang's decode step (`sglang_patch.plain_round`); graft only records the draft
        extend it skips (`DeferredDraftExtend.record`) and counts the round on the host."""
        result = plain_decode_round(self._target_worker, batch, self.req_to_token_pool.req_to_token,
                                    on_publish=on_publish, grammar_barrier=grammar_barrier,
                                    keep_draft_state=on_publish is None)
        out = result.logits_output
        bs = len(batch.reqs)

        def bookkeeping() -> None:
            self.deferred.record(batch.req_pool_indices, batch.seq_lens, result.next_token_ids, out.hidden_states,
                                 self.req_to_token_pool.req_to_token.shape[0])
            self.budget.observe((), None, (1,) * bs, width=1)
            self.stats.record_plain(bs)

        self.guard.call("the plain round's bookkeeping", bookkeeping)
        if not batch.return_hidden_states:   # the draft's input only: not copied to the host
            out.hidden_states = None
        return result

    def _choose_width(self, batch) -> None:
        """The round's verify width (the first rank's, on every rank), the draft's catch-up when the
        round drafts or a request's deferred window is full, and the width's runtime state. A failing
        choice or catch-up plan is contained (`RoundGuard`): the round is plain."""
        now = time.perf_counter()
        reqs = batch.reqs
        guard = self.guard

        def choose() -> int:
            if self._launch is not None:
                width, bs, start = self._launch
                self.budget.round_time(width, bs, now - start)
            if guard.off:
                return self.budget.plain(len(reqs), "speculation off")
            exact = next((why for why in map(plain_round_reason, reqs) if why), None)
            if exact is not None:   # SGLang's decode step serves it exactly (sglang_patch/request_features.py)
                return self.budget.plain(len(reqs), exact)
            return self.budget.choose([r.rid for r in reqs], [speculates(r) for r in reqs])

        width = guard.call("the width choice", choose, fallback=lambda: 1)
        group = self.tp_group()
        if group is not None:
            width = agree_width(group, width)
        counts = guard.call("the draft catch-up plan", self.deferred.plan, [r.rid for r in reqs], width)
        if counts is not None:
            self.width_states.activate(self.deferred.width)
            waited = self.deferred.catch_up(self._draft_worker, batch, counts, self.req_to_token_pool.req_to_token)
            if waited is not None:   # the plain rounds' tokens reach the token history too
                self.planner.append_committed(batch.req_pool_indices, *waited)
            done = time.perf_counter()   # the catch-up is charged to the plain rounds it covers, not to this one
            self.budget.catch_up_time(len(reqs), max(counts), done - now)
            now = done
        self.width_states.activate(width)
        self.stats.record_width(width, len(reqs))
        self._launch = (width, len(reqs), now)

    def clear_cache_pool(self):
        """SGLang's ``/flush_cache`` hook (``scheduler.py:5531``, idle scheduler only): the planner
        forgets earlier requests' text (`GraftPlanner.clear_cache`), as NGRAM resets its trie."""
        super().clear_cache_pool()
        self.planner.clear_cache()

    def live_graft_requests(self) -> int:
        """Requests currently holding graft state (tests, logs)."""
        return self.requests.live()

    # ------------------------------------------------------------------ prefill
    def _forward_prefill_batch(self, batch, on_publish=None, pp_proxy_tensors=None, coordination_plan=None):
        """Target prefill + draft extend, then each request's context and first token into its
        device token history, and the prompt bigrams into the successor table (warm start)."""
        result = super()._forward_prefill_batch(batch, on_publish, pp_proxy_tensors, coordination_plan)
        if batch.forward_mode.is_idle() or not isinstance(result.next_token_ids, torch.Tensor):
            return result
        first = result.next_token_ids.reshape(-1).to(torch.int64)
        self._slots()
        slots = batch.req_pool_indices
        if self.deferred is not None:  # the prefill ran its own draft extend
            self.deferred.forget([r.rid for r in batch.reqs])
        # each request's context (host lists; prefill only, not the decode path), then its first token
        self.guard.call("the prefill's graft state", self.planner.prefill, [r.rid for r in batch.reqs], slots,
                        [list(r.origin_input_ids) + list(r.output_ids) for r in batch.reqs], first,
                        batch.input_ids, getattr(batch, "extend_lens", None), [tenant_of(r) for r in batch.reqs])
        return result

    # ------------------------------------------------------------------ verify
    def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
        """EAGLE verify of the hybrid tree (sampled requests by graft's tree sampling, without the zero
        draft-probability tensor: `sglang_patch.tree_sampling`), then the round's device bookkeeping."""
        verify_input = batch.spec_info
        with graft_sampling():
            result = super().verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
        if (isinstance(verify_input, GraftVerifyInput) and verify_input.graft_out is not None
                and not batch.forward_mode.is_idle()):
            self.guard.call("the round's bookkeeping", self._after_verify, batch, verify_input, result)
        return result

    def _after_verify(self, batch, vi: GraftVerifyInput, result) -> None:
        out = vi.graft_out
        bs, n = out.tree.tokens.shape
        committed = result.next_token_ids.view(bs, -1)
        if n > 1:   # the verify outcome as SGLang reports it: the planner takes the top-k it learns from
            logits = result.logits_output.next_token_logits if self.planner.successor_k else None
            stats = self.planner.observe_verified(out, result.accept_index, logits, committed, result.accept_lens,
                                                  batch.req_pool_indices)
        else:       # a one-node tree: nothing accepted beyond the root, and its root learns nothing
            stats = self.planner.observe(out, None, None, committed, result.accept_lens, batch.req_pool_indices)
        stats.sources = stats.sources.to(torch.int8)
        result.logits_output.auxiliary_device_output = append_auxiliary_output(
            result.logits_output.auxiliary_device_output, _RoundDevice(self, stats))
