"""``GraftWorker``: SGLang's EAGLE V2 worker with prune-then-graft between drafting and verify.

Per decode round (``EAGLEWorkerV2.forward_batch_generation``, ``eagle_worker_v2.py:1416``):

1. **Draft** — EAGLE-3 drafting. `GraftDraftWorker.draft_forward` rebinds the module
   global ``organize_draft_results`` (``eagle_worker_v2.py:919``) for the duration of the call so
   the dense tree's cumulative scores, tokens and parent list are copied into buffers allocated
   once (the copy is recorded by CUDA-graph capture and refreshed by every replay). In eager
   execution it also rebinds ``select_top_k_tokens`` (:812) to feed each depth's best cumulative
   probability to ``graft_spec.prune.DraftStopGate``; once every request of the batch has fired a
   checkpoint, the remaining draft forwards are skipped (paper Sec. 3.1: a low c_d stops the tree
   early) and the nodes they would have produced get probability 0.
2. **Prune -> retrieve -> graft** — `GraftDraftWorker.draft` rebinds ``build_eagle_verify_input``
   (``eagle_worker_v2.py:717``) to `GraftDraftWorker._build_verify_input`, which reranks the dense
   tree (``graft_spec.tree.eagle_rerank``), lets ``GraftPlanner.build`` prune, retrieve and graft
   it into N nodes, and lays the hybrid tree out as a `GraftVerifyInput`.
3. **Verify** — SGLang's ``run_eagle_verify`` (greedy, or target-only tree sampling; the CPU layer
   routes both to ``graft_spec.verify``). `GraftWorker.verify` then feeds the target's top-k at
   every non-padding node to the successor matrix, commits the emitted tokens to the planner and
   counts accepted nodes per source.
4. **Draft extend** — unchanged.

The worker holds no algorithm: it translates SGLang tensors to ``graft_spec`` and back.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from typing import Iterator, List, Optional

import torch
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative import eagle_worker_v2 as _ev2
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2

from graft_spec.pipeline import GraftPlanner
from graft_spec.prune import DraftStopGate
from graft_spec.tree import SOURCE_PADDING, eagle_rerank
from sglang_patch.args import effective_graft_config
from sglang_patch.graft_info import GraftVerifyInput, build_graft_verify_input, split_eagle_lists
from sglang_patch.graft_requests import GraftRequestTracker

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _rebound(owner, name: str, value) -> Iterator[None]:
    """Temporarily replace ``owner.name``: a module global the EAGLE code looks up at call time,
    or a method shadowed by an instance attribute (removed afterwards, so the class's method
    is back rather than a stored bound copy)."""
    had_own = name in vars(owner)
    original = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


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
        self.bs = 0

    def capture(self, score_list, token_list, parent_list) -> None:
        scores = torch.cat([x.reshape(x.shape[0], -1) for x in score_list], dim=1)
        tokens = torch.cat(token_list, dim=1)
        bs = scores.shape[0]
        self.scores[:bs].copy_(scores)
        self.tokens[:bs].copy_(tokens)
        if parent_list.shape[1] > 0:
            self.parents[:bs].copy_(parent_list)
        self.bs = bs


class GraftDraftWorker(EagleDraftWorker):
    """EAGLE-3 draft worker whose verify input is the graft hybrid tree (class-swapped in)."""

    graft: "GraftWorker"
    _sink: Optional[_DenseTreeSink] = None
    #: depth after which the last eager draft call stopped (None: the full depth was drafted)
    _depth_limit: Optional[int] = None

    def _ensure_sink(self, bs: int) -> _DenseTreeSink:
        if self._sink is None or self._sink.scores.shape[0] < bs:
            pool = getattr(getattr(self, "req_to_token_pool", None), "size", 0) or 0
            self._sink = _DenseTreeSink(max(bs, pool), self.topk, self.speculative_num_steps, self.device)
        return self._sink

    def _stop_gate(self, forward_batch) -> Optional[DraftStopGate]:
        """A gate for this eager call, or None where drafting must run the full depth: disabled
        in the config, no checkpoints, or a sampled batch whose verify reads the draft
        distribution of every step."""
        cfg = self.graft.config
        if not cfg.stop_drafting_early or not cfg.checkpoints or forward_batch.forward_mode.is_idle():
            return None
        if get_spec().speculative_use_rejection_sampling and not forward_batch.sampling_info.is_all_greedy:
            return None
        return DraftStopGate(cfg.checkpoints, forward_batch.batch_size, device=self.device)

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

        self._depth_limit = None
        eager = not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        gate = self._stop_gate(forward_batch) if eager else None
        with contextlib.ExitStack() as stack:
            stack.enter_context(_rebound(_ev2, "organize_draft_results", organize_and_capture))
            if gate is not None:
                stack.enter_context(_rebound(_ev2, "select_top_k_tokens",
                                             _gated_select(_ev2.select_top_k_tokens, gate,
                                                           forward_batch.batch_size)))
            if eager:
                runner = self.draft_runner
                vocab = (self.hot_token_id.numel() if self.hot_token_id is not None
                         else runner.model_config.vocab_size)
                stack.enter_context(_rebound(runner, "forward", _counted_forward(
                    runner.forward, gate, self.graft.draft_steps, vocab)))
            result = super().draft_forward(forward_batch)
        self._depth_limit = gate.stop_depth if gate is not None else None
        return result

    def draft(self, batch, *, with_topology: bool = False):
        """``EagleDraftWorker.draft`` building the graft tree instead of the EAGLE tree."""
        self._depth_limit = None  # a CUDA-graph replay drafts the full depth
        with _rebound(_ev2, "build_eagle_verify_input", self._build_verify_input):
            return super().draft(batch, with_topology=with_topology)

    def _build_verify_input(self, batch, draft_input, parent_list, top_scores_index, draft_tokens,
                            draft_probs, *, target_worker, topk, num_steps, num_draft_tokens,
                            tree_mask_mode, device) -> GraftVerifyInput:
        """Same signature as ``eagle_worker_common.build_eagle_verify_input`` (:377)."""
        if batch.forward_mode.is_idle():
            return GraftVerifyInput.create_idle_input(topk, num_steps, num_draft_tokens, device)
        bs = batch.seq_lens.shape[0]
        sink = self._sink
        if sink is None or sink.scores.shape[0] < bs:
            # Rows [:bs] are written by the eager call or by the graph replay (padded bs >= bs).
            raise RuntimeError(f"graft: the dense draft tree of batch size {bs} was not captured")
        scores, tokens, parents = split_eagle_lists(sink.scores[:bs], sink.tokens[:bs], sink.parents[:bs],
                                                    topk, num_steps)
        if self._depth_limit is not None:  # nodes deeper than the stop depth were never drafted
            scores = [x if i < self._depth_limit else torch.zeros_like(x) for i, x in enumerate(scores)]
        lists = (scores, tokens, parents)
        roots = draft_input.bonus_tokens.reshape(bs).to(torch.int64)
        draft = eagle_rerank(*lists, root_tokens=roots, num_nodes=num_draft_tokens)

        seq_lens_cpu = (batch.seq_lens_cpu.tolist() if batch.seq_lens_cpu is not None
                        else batch.seq_lens.tolist())
        rids = self.graft.requests.prepare(batch.reqs, seq_lens_cpu, roots.tolist())
        hybrid = self.graft.planner.build(draft, rids)

        verify_mask = target_worker.model_runner.attn_backend.verify_mask
        if verify_mask is None:
            mode, buffer, fill = tree_mask_mode, None, True
        else:
            mode, fill = verify_mask.mode, verify_mask.is_read
            buffer = verify_mask.buffer if verify_mask.fits(bs) else None
        return build_graft_verify_input(
            hybrid, batch.seq_lens, seq_lens_cpu, mode=mode, topk=topk, steps=num_steps,
            mask_buffer=buffer, fill_prefix=fill)


def _gated_select(select, gate: DraftStopGate, bs: int):
    """``select_top_k_tokens`` that reports each depth's best cumulative draft probability to
    ``gate`` (its 4th result is ``(scores of depth i+1, tokens, parents)``)."""

    def select_and_gate(i, *args):
        out = select(i, *args)
        if gate.stop_depth is None:
            gate.observe(i + 1, out[3][0].reshape(bs, -1).amax(dim=1))
        return out

    return select_and_gate


def _counted_forward(forward, gate: Optional[DraftStopGate], counters: dict, vocab: int):
    """``ModelRunner.forward`` of the draft that counts into ``counters`` {run, skipped} and,
    once ``gate`` has stopped, returns `_skipped_draft_output` instead of running."""

    def forward_unless_stopped(fb, *args, **kwargs):
        if gate is None or gate.stop_depth is None:
            counters["run"] += 1
            return forward(fb, *args, **kwargs)
        counters["skipped"] += 1
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
        planner: ``GraftPlanner`` (retrieval state of all requests, successor matrix).
        requests: `GraftRequestTracker` (per-request state and counters).
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
        self.planner = GraftPlanner(self.config, vocab_size=vocab, device="cpu")
        self.requests = GraftRequestTracker(self.planner)
        self.successor_k = self.config.retrieval.successor_k if self.config.retrieval.successor else 0
        #: eager draft forwards run / skipped by the stop gate since start (server stats)
        self.draft_steps = {"run": 0, "skipped": 0}
        if self._draft_worker is not None:
            self._draft_worker.__class__ = GraftDraftWorker
            self._draft_worker.graft = self
        logger.info("graft worker ready: %s", self.config.model_dump_json())

    # ------------------------------------------------------------------ scheduler hooks
    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        """Free the request's graft state (``batch_result_processor.py:1442``)."""
        self.requests.finish(rid)

    def live_graft_requests(self) -> int:
        """Requests currently holding graft state (tests, logs)."""
        return self.requests.live()

    # ------------------------------------------------------------------ verify
    def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
        """EAGLE verify of the hybrid tree, then the graft bookkeeping of the round."""
        verify_input = batch.spec_info
        result = super().verify(batch, pp_proxy_tensors=pp_proxy_tensors, grammar_barrier=grammar_barrier)
        if isinstance(verify_input, GraftVerifyInput) and not batch.forward_mode.is_idle():
            self._after_verify(batch, verify_input, result)
        return result

    def _after_verify(self, batch, vi: GraftVerifyInput, result) -> None:
        bs = len(batch.reqs)
        n = vi.draft_token_num
        tokens = vi.draft_token.view(bs, n)
        sources = vi.node_source.to(tokens.device)
        # Successor matrix: the target's top-k after every verified non-padding node.
        if self.successor_k > 0 and result.logits_output.next_token_logits is not None:
            logits = result.logits_output.next_token_logits
            topk_ids = torch.topk(logits[: bs * n].float(), self.successor_k, dim=-1).indices
            node_tokens = torch.where(sources == SOURCE_PADDING, -1, tokens).reshape(-1)
            self.planner.observe_tokens(node_tokens.cpu(), topk_ids.cpu())
        # Emitted tokens and accepted sources, per request.
        accept_lens: List[int] = result.accept_lens.tolist()
        accept_index = result.accept_index.to(torch.int64).cpu()
        predict = result.next_token_ids.view(bs, -1).cpu()
        src_cpu = sources.cpu()
        emitted, accepted_sources = [], []
        for b in range(bs):
            k = int(accept_lens[b])
            local = accept_index[b, 1:k] - b * n
            accepted_sources.append(src_cpu[b, local].tolist())
            emitted.append(predict[b, :k].tolist())
        self.requests.commit(batch.reqs, emitted, accepted_sources)
