"""The batch budget's verify widths as SGLang runtime states, and the per-request opt-out.

Each verify width ``w`` of ``GraftConfig.verify_widths`` is one SGLang ``SpecRuntimeState``
(``speculative/adaptive_runtime_state.py``): draft and target attention backends and their CUDA
graphs captured for ``w`` verify tokens per request. They are built once at startup, after SGLang's
own capture (``EAGLEWorkerV2.build_adaptive_runtime_state``, ``eagle_worker_v2.py:1777``), and a
round switches between them before it starts (``apply_runtime_state``, :1862). Width 1 is a plain
round, SGLang's own decode step (`sglang_patch.plain_round`): its state is SGLang's ``steps = 0``
state with the target's graphs captured in ``DECODE`` mode (`PlainDecodeGraphRunner`, in place of the
``DecodeCudaGraphRunner`` looked up at ``eagle_worker_v2.py:1811``); every other width drafts the
full depth.

One state per distinct shape: the draft decode backend and its CUDA graphs depend on the draft depth
and top-k only (``DraftBackendFactory(draft_runner, topk, speculative_num_steps)``, :396; the graph
runner's buffers are ``max_bs * topk`` tokens, ``eagle_draft_cuda_graph_runner.py:164``), which every
width >= 2 shares with the full width N, so those widths' states hold the full-width state's draft
decode backend and graphs (`_sharing_draft_decode`; SGLang's builder would build both again). The
target's backend and verify graphs, and the draft extend's, are sized by the width and stay per state. The KV the
scheduler reserves per round is sized for the widest state (``max_speculative_num_draft_tokens``,
``runtime_context.py:1982``), as for SGLang's own adaptive steps.

SGLang logs every state switch at INFO (``apply_runtime_state``, :1866); with the budget choosing a
width every round that is one line per round, so `QuietSwitches` moves those lines to DEBUG (graft's
own line per switch, ``graft_worker`` logger). The bytes the extra states hold (their tensors, and on
CUDA the device memory their build took) are kept in `WidthStates.bytes_by_width` for
``/server_info`` (``worker.memory_beyond_eagle3``), beside the reserve taken off the KV cache for
them before it was sized (`sglang_patch.kv_reserve`). The flags SGLang refuses for its own adaptive
states are refused for graft at startup (`sglang_patch.args.refuse_width_state_combinations`).

The choice itself (`graft_spec.budget.BatchBudget`) is host-side and made before the round is
launched; with tensor parallelism the first rank's choice is broadcast on the CPU group (one small
host collective per round, no device sync), so every rank runs the same shapes.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, Iterator, Sequence

import torch
from sglang.srt.speculative import eagle_worker_v2 as _ev2
from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

from sglang_patch.kv_reserve import check_built
from sglang_patch.plain_round import PlainDecodeGraphRunner

from sglang_patch.rebinding import rebound

logger = logging.getLogger(__name__)

__all__ = ["WidthStates", "agree_width", "QuietSwitches", "tensor_bytes"]

#: Start of SGLang's per-switch INFO line (``eagle_worker_v2.py:1866``).
SWITCH_MESSAGE = "Switch adaptive runtime state"


class QuietSwitches(logging.Filter):
    """A filter for SGLang's ``eagle_worker_v2`` logger that re-emits its state-switch INFO line at
    DEBUG (other records pass unchanged)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and str(record.msg).startswith(SWITCH_MESSAGE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def tensor_bytes(objs, _seen=None) -> int:
    """Bytes of the distinct tensors held by ``objs`` and, one level down, by their attributes, lists,
    tuples and dicts (an attention backend's buffers, a graph runner's static inputs). Storage shared
    between tensors is counted once; CUDA-graph memory pools are not tensors and are not counted."""
    seen = set() if _seen is None else _seen
    total = 0

    def visit(x, depth):
        nonlocal total
        if isinstance(x, torch.Tensor):
            try:
                key = (x.device, x.untyped_storage().data_ptr())
                size = x.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # meta / sparse / wrapper tensors
                return
            if key not in seen:
                seen.add(key)
                total += size
        elif depth > 0 and isinstance(x, (list, tuple)):
            for v in x:
                visit(v, depth - 1)
        elif depth > 0 and isinstance(x, dict):
            for v in x.values():
                visit(v, depth - 1)
        elif depth > 0 and hasattr(x, "__dict__") and not isinstance(x, type):
            for v in vars(x).values():
                visit(v, depth - 1)

    for o in objs:
        visit(o, 3)
    return total

class WidthStates:
    """One ``SpecRuntimeState`` per verify width of a `GraftWorker` (``EAGLEWorkerV2``).

    Args:
        worker: the graft worker (its current state is the full width N).
    """

    def __init__(self, worker):
        self.worker = worker
        self.states: Dict[int, SpecRuntimeState] = {}
        #: width -> bytes its state holds beyond the full-width state's (tensors not shared with it;
        #: on CUDA the larger of that and the device memory the build took)
        self.bytes_by_width: Dict[int, int] = {}
        #: widths whose state holds the full-width state's draft decode backend and graphs
        self.shared_draft_decode: list = []

    def build(self, widths: Sequence[int]) -> None:
        """Register the current (full-width) state and build one for every other width (startup)."""
        w = self.worker
        dw = w._draft_worker
        self.states[w.speculative_num_draft_tokens] = SpecRuntimeState(
            speculative_num_steps=w.speculative_num_steps,
            speculative_num_draft_tokens=w.speculative_num_draft_tokens,
            draft_attn_backend=dw.draft_attn_backend,
            cuda_graph_runner=dw.cuda_graph_runner,
            target_attn_backend=w._target_worker.model_runner.attn_backend,
            target_graph_runner=w._target_worker.model_runner.decode_cuda_graph_runner,
            draft_extend_attn_backend=dw.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=dw.cuda_graph_runner_for_draft_extend,
        )
        graphs_off = _ev2.check_cuda_graph_backend(_ev2.Phase.DECODE, _ev2.Backend.DISABLED)
        cuda_graph_bs = None if graphs_off else _ev2.get_exec().graph.cuda_graph_bs_decode
        with (_ev2.draft_tp_context(dw.parallel_layout), _ev2.speculative_moe_backend_context(),
              _ev2.speculative_moe_a2a_backend_context()):
            full = self.states[w.speculative_num_draft_tokens]
            for width in widths:
                if width in self.states:
                    continue
                steps = 0 if width == 1 else w.speculative_num_steps
                share = (steps == full.speculative_num_steps and not _ev2._is_musa
                         and not _ev2.current_platform.is_out_of_tree())
                before = _device_bytes(w.device)
                with contextlib.ExitStack() as stack:
                    if share:
                        stack.enter_context(_sharing_draft_decode(dw, full))
                    if width == 1:   # plain rounds replay decode graphs, not one-node verify graphs
                        stack.enter_context(rebound(_ev2, "DecodeCudaGraphRunner", PlainDecodeGraphRunner))
                    state = w.build_adaptive_runtime_state(
                        speculative_num_steps=steps, speculative_num_draft_tokens=width, cuda_graph_bs=cuda_graph_bs)
                self.states[width] = state
                if (share and state.draft_attn_backend is full.draft_attn_backend
                        and state.cuda_graph_runner is full.cuda_graph_runner):
                    self.shared_draft_decode.append(width)
                try:  # accounting only: a failure here must not stop the server
                    seen: set = set()
                    tensor_bytes(_state_parts(full), seen)      # what the full-width state already holds
                    held = tensor_bytes(_state_parts(self.states[width]), seen)
                except Exception as exc:  # noqa: BLE001
                    logger.debug("graft: width %d state bytes not counted (%s)", width, exc)
                    held = 0
                self.bytes_by_width[width] = max(held, _device_bytes(w.device) - before)
        check_built(self.bytes_by_width)
        if not getattr(_ev2.logger, "_graft_quiet_switches", False):
            _ev2.logger.addFilter(QuietSwitches())
            _ev2.logger._graft_quiet_switches = True
        logger.info("graft batch budget: verify widths %s (runtime states built; %d bytes beyond the "
                    "full-width state: %s; widths %s on the full width's draft decode backend and graphs)",
                    sorted(self.states), sum(self.bytes_by_width.values()), self.bytes_by_width,
                    self.shared_draft_decode)

    def activate(self, width: int) -> None:
        """Switch the worker to ``width`` (no-op when it is current).

        Raises:
            KeyError: a width without a built state.
        """
        w = self.worker
        if w.speculative_num_draft_tokens == width:
            return
        state = self.states[width]
        logger.debug("graft: verify width %d -> %d", w.speculative_num_draft_tokens, width)
        if w.speculative_num_steps == state.speculative_num_steps:
            # SGLang's apply_runtime_state returns early when the step counts match
            # (eagle_worker_v2.py:1864); widths >= 2 share the draft depth.
            w.speculative_num_steps = -1
        w.apply_runtime_state(state)


@contextlib.contextmanager
def _sharing_draft_decode(draft_worker, full: SpecRuntimeState) -> Iterator[None]:
    """While SGLang builds a width's state (``build_adaptive_runtime_state``, eagle_worker_v2.py:1792-1793)
    for a width that drafts the full depth: the draft worker's ``init_attention_backend`` builds the
    draft extend backend and puts the full-width draft decode backend back, and the draft decode graph
    runner "class" (``EAGLEDraftCudaGraphRunner`` / ``EAGLEDraftNpuGraphRunner``, looked up at :488-491)
    returns the full-width runner instead of capturing new graphs. Not used on MUSA, whose draft extend
    runner is looked up under the same name (:543), nor on an out-of-tree platform, whose runner
    classes come from its plugin (:151-161): a new runner there would re-initialise the shared
    backend's graph buffers under the full width's graphs, so such states keep SGLang's own build."""
    init = draft_worker.init_attention_backend

    def init_keeping_draft_decode():
        init()
        draft_worker.draft_attn_backend = full.draft_attn_backend
        draft_worker.draft_runner.draft_attn_backend = full.draft_attn_backend

    def full_width_runner(_worker):
        return full.cuda_graph_runner

    with contextlib.ExitStack() as stack:
        stack.enter_context(rebound(draft_worker, "init_attention_backend", init_keeping_draft_decode))
        for name in ("EAGLEDraftCudaGraphRunner", "EAGLEDraftNpuGraphRunner"):
            stack.enter_context(rebound(_ev2, name, full_width_runner))
        yield


def _state_parts(state: SpecRuntimeState) -> list:
    """The objects a runtime state holds (backends and graph runners), for `tensor_bytes`."""
    return [getattr(state, f) for f in ("draft_attn_backend", "cuda_graph_runner", "target_attn_backend",
                                         "target_graph_runner", "draft_extend_attn_backend",
                                         "cuda_graph_runner_for_draft_extend")]


def _device_bytes(device) -> int:
    """Device memory reserved by torch's caching allocator (CUDA), else 0."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.memory_reserved(torch.device(device)))
    return 0


def agree_width(group, width: int) -> int:
    """The first TP rank's width (a broadcast on the group's CPU (gloo) group: no device sync)."""
    t = torch.tensor([width], dtype=torch.int64)
    torch.distributed.broadcast(t, src=group.ranks[0], group=group.cpu_group)
    return int(t[0])
