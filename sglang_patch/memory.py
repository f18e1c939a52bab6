"""What graft holds in accelerator memory beyond EAGLE-3's, computed from a model's ``config.json``.

    python -m sglang_patch.memory --model-config configs/shapes/qwen3-8b.json --tp 1
    python -m sglang_patch.memory --model-config configs/shapes/qwen3-235b-a22b.json --tp 8 \
        --draft-config configs/shapes/qwen3-235b-a22b-eagle3.json --graft-config configs/qwen3-235b-a22b.yaml

prints one table per model: the weights and KV bytes per token on one rank, graft's persistent state
(successor table, token history, output index), and for each verify width ``w`` of the batch budget
the bytes of its runtime state and of one round at batch ``B`` (greedy and sampled), against
EAGLE-3 verifying the same ``w``. Every figure is per rank, in bytes, from the formulas below (an
estimate of the large buffers, not a measurement; small bookkeeping tensors are left out).

Per extra verify width (a ``SpecRuntimeState`` built by ``EAGLEWorkerV2.build_adaptive_runtime_state``,
SGLang 0.5.23 ``speculative/eagle_worker_v2.py:1777``; EAGLE-3 builds one state, at N):
* the target attention backend's own workspace (``init_new_workspace=True``, :1797; FlashInfer's is
  ``SGLANG_FLASHINFER_WORKSPACE_SIZE`` = 384 MiB, ``environ.py:1221``; ``--attn-workspace-mib``);
* with CUDA graphs, the graph buffers of the two attention backends sized by the width, the target's
  verify backend and the draft extend's: FlashInfer's ``init_cuda_graph_state``
  (``layers/attention/flashinfer_backend.py:1100-1138``) allocates KV indices ``int32`` and a tree
  mask ``uint8`` of ``max_num_tokens * context`` each, ``max_num_tokens = max_bs * w``
  (``decode_cuda_graph_runner.py:424``, ``eagle_draft_extend_cuda_graph_runner.py:151``):
  ``2 * 5 * max_bs * w * context`` bytes;
* no draft decode buffers: every width >= 2 drafts the full depth and shares the full width's draft
  decode backend and graphs (`sglang_patch.verify_widths`), whose KV indices
  (``depth * max_bs * topk * context`` ``int32``, ``flashinfer_backend.py:2630``) SGLang's builder
  would allocate again per width (`draft_decode_bytes`, the table's ``draft_decode_shared``); width 1
  does not draft;
* no extra CUDA-graph pool: SGLang's graph runners share one memory pool, whose size is set by the
  widest state.

The graph buffers are FlashInfer's; other backends (FA3's page tables, Triton's) hold less, so the
estimate is an upper bound for them.

Per round (transient, batch ``B``, ``T = B * w`` verify tokens):
* greedy: target logits ``[T, V]`` float32 (the vocab-parallel head all-gathers the full vocabulary on
  every rank), the captured aux hidden states ``[T, 3H]``, the residual stream and one layer's
  activations (attention q/k/v/o, and for MoE the routed ``[T * top_k, 2 * I / tp]`` expert input);
* sampled: plus the target probabilities ``[B, w, V]`` float32; EAGLE-3 also allocates the zero draft
  probabilities of the same size that SGLang's tree sampling kernel takes
  (``speculative/eagle_utils.py:744-748``), graft does not (its own kernel, ``sglang_patch/tree_sampling.py``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from graft_spec.config import load_config

MIB = 1024 ** 2
GIB = 1024 ** 3
#: FlashInfer's workspace per attention backend (SGLang 0.5.23 ``environ.py:1221``).
FLASHINFER_WORKSPACE_BYTES = 384 * MIB
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


@dataclass(frozen=True)
class ModelShape:
    """The shapes of a (dense or MoE) Qwen3 target read from its ``config.json``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    experts: int = 0            # 0: dense
    top_k: int = 0
    moe_intermediate: int = 0
    tied: bool = False
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, cfg: Dict) -> "ModelShape":
        """From a Hugging Face ``config.json`` dict (``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` keys).

        Raises:
            KeyError: a required key (``hidden_size``, ``num_hidden_layers``, ...) is missing.
        """
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        heads = cfg["num_attention_heads"]
        return cls(
            hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
            kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
            intermediate=cfg.get("intermediate_size", 0), experts=cfg.get("num_experts", 0) or 0,
            top_k=cfg.get("num_experts_per_tok", 0) or 0, moe_intermediate=cfg.get("moe_intermediate_size", 0) or 0,
            tied=bool(cfg.get("tie_word_embeddings", False)), dtype_bytes=_DTYPE_BYTES.get(dtype, 2))

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one of ``tp`` ranks holds (replicated when fewer heads than ranks)."""
        return max(1, self.kv_heads // tp)

    def weight_bytes(self, tp: int) -> int:
        """Parameters one of ``tp`` ranks holds, in bytes (embedding and head vocab-parallel; MoE experts
        split over the ranks whether by TP or EP; router and norms replicated)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.heads * d // tp * 2 + h * self.kv_heads_per_rank(tp) * d * 2
        if self.experts:
            mlp = self.experts * 3 * h * self.moe_intermediate // tp + self.experts * h
        else:
            mlp = 3 * h * self.intermediate // tp
        embed = self.vocab * h // tp * (1 if self.tied else 2)
        return (self.layers * (attn + mlp + 2 * h) + embed + h) * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int) -> int:
        """KV cache bytes per token on one of ``tp`` ranks (K and V, every layer)."""
        return 2 * self.layers * self.kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes

    def activation_bytes(self, tokens: int, tp: int) -> int:
        """One forward's transient activations for ``tokens`` tokens on one rank, without the logits:
        residual + normed stream, q/k/v/o of one layer, the MLP (or routed-expert) intermediate, and
        the three captured aux hidden states (EAGLE-3)."""
        h, d, b = self.hidden, self.head_dim, self.dtype_bytes
        qkv = (self.heads // tp + 2 * self.kv_heads_per_rank(tp)) * d
        if self.experts:
            mlp = self.top_k * 3 * self.moe_intermediate // max(1, tp) + self.top_k + self.experts
        else:
            mlp = 3 * self.intermediate // tp
        return tokens * (2 * h + qkv + self.heads // tp * d + mlp + 3 * h) * b


@dataclass(frozen=True)
class DraftShape:
    """An EAGLE-3 head (one decoder layer over ``2H`` inputs, ``fc`` from ``3H``, a draft vocabulary)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, cfg: Dict, target: ModelShape) -> "DraftShape":
        """From an EAGLE-3 head's ``config.json`` (``LlamaForCausalLMEagle3`` keys); missing keys default
        to the target's (hidden size, heads) and a 32,000-token draft vocabulary."""
        heads = cfg.get("num_attention_heads", target.heads)
        hidden = cfg.get("hidden_size", target.hidden)
        return cls(hidden=hidden, heads=heads, kv_heads=cfg.get("num_key_value_heads", target.kv_heads),
                   head_dim=cfg.get("head_dim") or hidden // heads,
                   intermediate=cfg.get("intermediate_size", target.intermediate or 4 * hidden),
                   draft_vocab=cfg.get("draft_vocab_size", 32000), dtype_bytes=target.dtype_bytes)

    def weight_bytes(self, target_hidden: int) -> int:
        """Head parameters (replicated on every rank; the embedding is the target's)."""
        h = self.hidden
        attn = 2 * h * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * h
        return (3 * target_hidden * h + attn + 3 * h * self.intermediate + self.draft_vocab * h) * self.dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """Draft KV bytes per token (one layer)."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Serving:
    """The serving settings the table depends on (SGLang flags and the graft config)."""

    tp: int = 1
    num_draft_tokens: int = 60
    topk: int = 10
    depth: int = 7
    widths: Sequence[int] = ()        # () = the batch budget's default (1, ceil(N/2), N)
    max_running_requests: int = 64
    context: int = 40960
    batch: int = 64
    attn_workspace: int = FLASHINFER_WORKSPACE_BYTES
    successor_k: int = 8
    history_len: int = 256
    outputs_max_tokens: int = 262_144
    outputs: bool = True

    def verify_widths(self) -> List[int]:
        """The batch budget's widths (`graft_spec.config.GraftConfig.verify_widths` with the budget on)."""
        n = self.num_draft_tokens
        return sorted(set(self.widths or {1, max(2, -(-n // 2)), n}))


def width_state_bytes(s: Serving, width: int) -> int:
    """Bytes of one extra verify-width runtime state (module docstring): the target backend's
    workspace plus, with CUDA graphs (``max_running_requests`` > 0), the target verify and draft
    extend backends' graph buffers, ``2 * 5 * max_bs * width * context``."""
    return s.attn_workspace + 2 * 5 * s.max_running_requests * width * s.context


def draft_decode_bytes(s: Serving) -> int:
    """Bytes of the draft decode backend's graph KV indices, ``depth * max_bs * topk * context`` ``int32``:
    held once by the full-width state and shared by every width >= 2 (what a per-width copy would add)."""
    return s.depth * s.max_running_requests * s.topk * s.context * 4


def round_bytes(m: ModelShape, s: Serving, width: int, sampled: bool, zero_draft_probs: bool) -> int:
    """Transient bytes of one verify round at batch ``s.batch`` and ``width`` tokens per request.

    Args:
        sampled: add the sampling tensors (target probabilities, and with ``zero_draft_probs`` the
            zero draft probabilities of the same ``[B, w, V]`` float32 shape).
    """
    t = s.batch * width
    total = t * m.vocab * 4 + m.activation_bytes(t, s.tp)
    if sampled:
        total += s.batch * width * m.vocab * 4 * (2 if zero_draft_probs else 1)
    return total


def graft_persistent_bytes(m: ModelShape, s: Serving) -> Dict[str, int]:
    """Graft's own device state beyond EAGLE-3's: successor table ``int32[V + 2, k]``, token history
    ``int64[max_bs, history_len]``, output index ``8 * (2C + K * H)`` (graft_spec/retrieval/output_ring.py:165)."""
    slots = 1 << max(1, (2 * s.outputs_max_tokens - 1).bit_length())
    k_lengths = 8  # match lengths <= the default max_match (retrieval/output_ring.py MATCH_LENGTHS)
    return {
        "successor_table": (m.vocab + 2) * s.successor_k * 4,
        "token_history": s.max_running_requests * (s.history_len + 1) * 8,
        "output_index": 8 * (2 * s.outputs_max_tokens + k_lengths * slots) if s.outputs else 0,
    }


def table(m: ModelShape, d: Optional[DraftShape], s: Serving) -> Dict:
    """The whole memory table as a dict (what the CLI prints; JSON with ``--json``)."""
    n = s.num_draft_tokens
    rows = []
    for w in s.verify_widths():
        rows.append({
            "width": w,
            "state_graft": 0 if w == n else width_state_bytes(s, w),
            "draft_decode_shared": draft_decode_bytes(s) if 1 < w < n else 0,
            "round_greedy_eagle3": round_bytes(m, s, w, sampled=False, zero_draft_probs=True),
            "round_greedy_graft": round_bytes(m, s, w, sampled=False, zero_draft_probs=False),
            "round_sampled_eagle3": round_bytes(m, s, w, sampled=True, zero_draft_probs=True),
            "round_sampled_graft": round_bytes(m, s, w, sampled=True, zero_draft_probs=False),
        })
    persistent = graft_persistent_bytes(m, s)
    extra_states = sum(r["state_graft"] for r in rows)
    return {
        "tp": s.tp, "batch": s.batch, "num_draft_tokens": n, "topk": s.topk, "depth": s.depth,
        "max_running_requests": s.max_running_requests, "context": s.context,
        "weights_target": m.weight_bytes(s.tp), "weights_draft": d.weight_bytes(m.hidden) if d else 0,
        "kv_per_token": m.kv_bytes_per_token(s.tp) + (d.kv_bytes_per_token() if d else 0),
        "graft_persistent": persistent, "graft_width_states": extra_states,
        "graft_draft_decode_shared": sum(r["draft_decode_shared"] for r in rows),
        "graft_beyond_eagle3": extra_states + sum(persistent.values()),
        "widths": rows,
    }


def _fmt(b: int) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"


def render(name: str, t: Dict) -> str:
    """The table as Markdown."""
    lines = [f"### {name}: TP {t['tp']}, N {t['num_draft_tokens']} (topk {t['topk']}, depth {t['depth']}), "
             f"batch {t['batch']}, max_running_requests {t['max_running_requests']}, context {t['context']}",
             "",
             f"weights per rank: target {_fmt(t['weights_target'])}, EAGLE-3 head {_fmt(t['weights_draft'])}; "
             f"KV (target + head) {t['kv_per_token'] / 1024:.1f} KiB per token per rank",
             f"graft beyond EAGLE-3, held for the server's life: {_fmt(t['graft_beyond_eagle3'])} "
             f"(extra width states {_fmt(t['graft_width_states'])}; "
             + ", ".join(f"{k} {_fmt(v)}" for k, v in t["graft_persistent"].items()) + "); "
             f"not held: {_fmt(t['graft_draft_decode_shared'])} of draft decode buffers a state per width would "
             "add (widths >= 2 share the full width's)",
             "",
             "| width w | graft state (extra) | draft decode (shared, not held) | round greedy (EAGLE-3 = graft) "
             "| round sampled EAGLE-3 | round sampled graft (no zero draft probs) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in t["widths"]:
        lines.append(f"| {r['width']} | {_fmt(r['state_graft'])} | {_fmt(r['draft_decode_shared'])} | "
                     f"{_fmt(r['round_greedy_graft'])} | {_fmt(r['round_sampled_eagle3'])} | "
                     f"{_fmt(r['round_sampled_graft'])} |")
    return "\n".join(lines)


def serving_from_graft_config(path: Optional[Path], **kw) -> Serving:
    """`Serving` with the tree shape, budget widths and retrieval sizes of a graft config file
    (validated by ``graft_spec.config.load_config``); ``kw`` overrides."""
    fields: Dict = {}
    if path is not None:
        cfg = load_config(str(path), environ={})
        r = cfg.retrieval
        fields = dict(num_draft_tokens=cfg.num_draft_tokens, topk=cfg.topk, depth=cfg.depth,
                      widths=tuple(cfg.verify_widths), successor_k=r.successor_k, history_len=r.history_len,
                      outputs_max_tokens=r.outputs_max_tokens, outputs=r.outputs != "off")
    fields.update({k: v for k, v in kw.items() if v is not None})
    return Serving(**fields)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", type=Path, required=True, help="the target's config.json")
    ap.add_argument("--draft-config", type=Path, default=None, help="the EAGLE-3 head's config.json")
    ap.add_argument("--graft-config", type=Path, default=None, help="graft YAML (tree shape, widths, retrieval)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-running-requests", type=int, default=None)
    ap.add_argument("--context", type=int, default=None, help="context length of the tree-mask buffers")
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--attn-workspace-mib", type=float, default=FLASHINFER_WORKSPACE_BYTES / MIB)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cfg = json.loads(a.model_config.read_text())
    m = ModelShape.from_config(cfg)
    d = DraftShape.from_config(json.loads(a.draft_config.read_text()), m) if a.draft_config else None
    s = serving_from_graft_config(a.graft_config, tp=a.tp, batch=a.batch,
                                  max_running_requests=a.max_running_requests or max(a.batch, 1),
                                  context=a.context or min(cfg.get("max_position_embeddings", 40960), 40960),
                                  num_draft_tokens=a.num_draft_tokens,
                                  attn_workspace=int(a.attn_workspace_mib * MIB))
    t = table(m, d, s)
    print(json.dumps(t, indent=2) if a.json else render(a.model_config.stem, t))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
