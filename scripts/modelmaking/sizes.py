"""Size presets for ``make_models.py``: corpus cap, tokenizer, target, draft and training budgets.

Step counts (not wall-clock budgets) fix the amount of training, so a given seed and preset give
the same checkpoint on any machine with the same Python standard library.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class MoeSpec:
    """Sparse MLP of a Qwen3-MoE target (``Qwen3MoeForCausalLM``): every decoder layer routes each
    token to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True  # Qwen3-30B-A3B / 235B-A22B renormalise the top-k weights
    router_aux_loss_coef: float = 0.001


@dataclass(frozen=True)
class TargetSpec:
    """Qwen3 target shape and its next-token training schedule (``moe`` set: a Qwen3-MoE target)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    weight_decay: float = 0.1
    warmup_frac: float = 0.05
    moe: MoeSpec | None = None


@dataclass(frozen=True)
class DraftSpec:
    """EAGLE-3 head shape (one decoder layer) and its training-time-test schedule."""

    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    ttt_steps: int  # unrolled draft steps per position (EAGLE-3 "training-time test")
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    step_weight_decay: float = 0.8  # loss weight of unrolled step k is decay**k (EAGLE-3)
    weight_decay: float = 0.0
    warmup_frac: float = 0.05


@dataclass(frozen=True)
class SizeSpec:
    """Everything that defines one model size."""

    name: str
    max_train_chars: int | None  # None: the whole standard library
    tokenizer_chars: int  # text used to learn the BPE merges
    vocab_size: int
    target: TargetSpec
    draft: DraftSpec
    eval_tokens: int  # held-out tokens for loss / agreement metrics
    greedy_prompts: int = 16  # prompts for the greedy-chain acceptance simulation
    greedy_prompt_len: int = 48
    greedy_new_tokens: int = 64
    packages: str = ""  # PyPI sdists added to training: "" none, "default" PACKAGES, "wide" WIDE_PACKAGES
    eval_seq_len: int | None = None  # held-out window length (None: target.seq_len)
    #: another preset whose tokenizer and data stages this one shares: when ``models/<shares>`` holds
    #: them built with the same settings they are copied instead of rebuilt (same files either way)
    shares: str | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


QUICK = SizeSpec(
    name="quick",
    max_train_chars=3_000_000,
    tokenizer_chars=3_000_000,
    vocab_size=2048,
    target=TargetSpec(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        seq_len=128,
        batch_size=8,
        steps=400,
        lr=1e-2,
    ),
    draft=DraftSpec(
        draft_vocab_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        ttt_steps=3,
        seq_len=128,
        batch_size=8,
        steps=300,
        lr=5e-3,
    ),
    eval_tokens=8_192,
    greedy_prompts=8,
)

DEFAULT = SizeSpec(
    name="default",
    max_train_chars=None,
    tokenizer_chars=8_000_000,
    vocab_size=4096,
    target=TargetSpec(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        seq_len=256,
        batch_size=16,
        steps=1200,
        lr=4e-3,
    ),
    draft=DraftSpec(
        draft_vocab_size=2048,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        ttt_steps=3,
        seq_len=256,
        batch_size=8,
        steps=500,
        lr=3e-3,
    ),
    eval_tokens=65_536,
    packages="default",
)

#: The shipped pair (``models/default``), trained on a GPU in minutes
#: (``make_models.py --preset gpu --device cuda``): a 23 M target on 393 M tokens (a few epochs of a ~3x wider corpus),
#: sized so target + head stay under 60 MiB in bf16. Same tokenizer and held-out text (in 256-token
#: windows) as ``default``, so held-out perplexities compare.
GPU = SizeSpec(
    name="gpu",
    max_train_chars=None,
    tokenizer_chars=8_000_000,
    vocab_size=4096,
    target=TargetSpec(
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1536,
        seq_len=512,
        batch_size=64,
        steps=12000,
        lr=3e-3,
        warmup_frac=0.02,
    ),
    draft=DraftSpec(
        draft_vocab_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1024,
        ttt_steps=4,
        seq_len=512,
        batch_size=32,
        steps=4000,
        lr=2e-3,
        warmup_frac=0.02,
    ),
    eval_tokens=65_536,
    packages="wide",
    eval_seq_len=256,
)

#: The MoE test pair (``models/moe-quick``): a 4-layer Qwen3-MoE target (8 experts, top-2 routing) with
#: the quick pair's tokenizer and corpus (copied from ``models/quick`` when built there), and its
#: EAGLE-3 head. Sized for CPU tests of the MoE forward, expert routing and TP/EP serving (a few
#: minutes on 2 cores), not for acceptance.
MOE_QUICK = SizeSpec(
    name="moe-quick",
    max_train_chars=QUICK.max_train_chars,
    tokenizer_chars=QUICK.tokenizer_chars,
    vocab_size=QUICK.vocab_size,
    target=TargetSpec(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,  # unused by the sparse layers; kept for config readers
        seq_len=128,
        batch_size=8,
        steps=300,
        lr=1e-2,
        moe=MoeSpec(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96),
    ),
    draft=DraftSpec(
        draft_vocab_size=1024,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        ttt_steps=3,
        seq_len=128,
        batch_size=8,
        steps=150,
        lr=5e-3,
    ),
    eval_tokens=4_096,  # the HF MoE forward loops over experts: a short eval keeps the build in minutes
    greedy_prompts=4,
    greedy_new_tokens=32,
    shares="quick",
)

#: The MoE pair for GPU benchmarks (``make_models.py --preset moe --device cuda``, into ``models/moe``):
#: the shipped pair's shape, tokenizer, corpus and schedule with a Qwen3-MoE MLP in every layer, 32
#: experts of width 384 with top-4 routing. The active MLP per token (4 x 384) is the dense pair's
#: (1,536), so the two compare at equal compute; the experts hold 8x its MLP parameters (Qwen3-235B-A22B
#: routes 8 of 128). Needs a GPU: the Hugging Face MoE forward loops over the experts.
MOE = replace(GPU, name="moe", shares="gpu",
              target=replace(GPU.target, moe=MoeSpec(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=384)))

PRESETS = {"quick": QUICK, "default": DEFAULT, "gpu": GPU, "moe-quick": MOE_QUICK, "moe": MOE}

#: Output folder under ``models/`` of a preset built without ``--out`` (the gpu preset is the shipped
#: pair; the CPU default preset never overwrites it).
FOLDERS = {"gpu": "default", "default": "default-cpu"}


def folder(preset: str) -> str:
    """``models/<folder>`` of ``preset`` (its name unless `FOLDERS` says otherwise)."""
    return FOLDERS.get(preset, preset)
