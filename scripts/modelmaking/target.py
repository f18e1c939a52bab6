"""The target model: a Hugging Face ``Qwen3ForCausalLM`` (or, for a preset with ``moe``, a
``Qwen3MoeForCausalLM``) trained as a next-token LM on the corpus.

Saved with ``save_pretrained`` (safetensors, float32) plus tokenizer files and
``generation_config.json``, which is the directory layout SGLang's ``--model-path`` loads
(``srt/models/qwen3.py`` ``Qwen3ForCausalLM``, ``srt/models/qwen3_moe.py`` ``Qwen3MoeForCausalLM``).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM, GenerationConfig, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from .data import eval_windows, random_windows
from .device import autocast
from .schedule import lr_at, make_adamw
from .sizes import TargetSpec
from .tokenizer import FILES as TOKENIZER_FILES


def build_config(spec: TargetSpec, vocab_size: int, ids: dict[str, int]) -> Qwen3Config | Qwen3MoeConfig:
    """Qwen3 config for ``spec``: float32, no sliding window, no attention bias.

    ``spec.tie_word_embeddings`` False (the presets) gives a separate output matrix, as the
    larger Qwen3 models have. With ``spec.moe`` the config is a ``Qwen3MoeConfig`` whose every
    decoder layer is sparse (``decoder_sparse_step`` 1, no ``mlp_only_layers``), as in Qwen3-235B-A22B.
    """
    if spec.moe is None:
        cls, extra = Qwen3Config, {"architectures": ["Qwen3ForCausalLM"]}
    else:
        cls = Qwen3MoeConfig
        extra = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": spec.moe.num_experts,
                 "num_experts_per_tok": spec.moe.num_experts_per_tok,
                 "moe_intermediate_size": spec.moe.moe_intermediate_size, "norm_topk_prob": spec.moe.norm_topk_prob,
                 "router_aux_loss_coef": spec.moe.router_aux_loss_coef, "decoder_sparse_step": 1,
                 "mlp_only_layers": []}
    return cls(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=ids["endoftext"],
        eos_token_id=ids["im_end"],
        pad_token_id=ids["endoftext"],
        dtype="float32",
        **extra,
    )


def init_model(config: Qwen3Config | Qwen3MoeConfig, seed: int) -> PreTrainedModel:
    """A freshly initialised float32 model (HF init, std 0.02), seeded: ``Qwen3ForCausalLM``, or
    ``Qwen3MoeForCausalLM`` for a ``Qwen3MoeConfig``."""
    torch.manual_seed(seed)
    cls = Qwen3MoeForCausalLM if isinstance(config, Qwen3MoeConfig) else Qwen3ForCausalLM
    return cls(config).float()


def train_target(
    model: Qwen3ForCausalLM,
    spec: TargetSpec,
    stream: np.ndarray,
    seed: int,
    compile_model: bool,
    device: str = "cpu",
    desc: str = "target",
) -> dict:
    """Next-token training on random windows of ``stream``. Returns {'train_loss_last', 'steps', 'compiled'}."""
    gen = torch.Generator().manual_seed(seed)
    opt = make_adamw(model.parameters(), spec.lr, spec.weight_decay)
    model.train()

    def step_loss(x: torch.Tensor) -> torch.Tensor:
        with autocast(device):
            return model(input_ids=x, labels=x).loss

    fn = step_loss
    compiled = False
    if compile_model:
        fn = torch.compile(step_loss)
        compiled = True
    losses = []
    bar = tqdm(range(spec.steps), desc=desc, unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr, spec.warmup_frac)
        x = random_windows(stream, spec.seq_len, spec.batch_size, gen).to(device)
        try:
            loss = fn(x)
        except Exception as exc:  # compiler missing or failing: fall back to eager, same maths
            if not compiled:
                raise
            tqdm.write(f"torch.compile failed ({type(exc).__name__}: {exc}); training eagerly")
            fn, compiled = step_loss, False
            loss = fn(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % 50 == 0 or step == spec.steps - 1:  # a host read every 50 steps, not every step
            bar.set_postfix(loss=f"{losses[-1].item():.3f}")
    model.eval()
    losses = torch.stack(losses).float().cpu().tolist()
    tail = losses[-max(1, len(losses) // 10) :]
    return {"train_loss_last": float(np.mean(tail)), "steps": spec.steps, "compiled": compiled}


@torch.no_grad()
def heldout_loss(model: Qwen3ForCausalLM, stream: np.ndarray, seq_len: int, max_tokens: int) -> dict:
    """Mean next-token cross-entropy (nats) and perplexity on held-out windows."""
    model.eval()
    device = next(model.parameters()).device
    windows = eval_windows(stream, seq_len, max_tokens).to(device)
    total, count = 0.0, 0
    for chunk in windows.split(8):
        logits = model(input_ids=chunk).logits[:, :-1].float()
        ce = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
        )
        total += ce.item()
        count += chunk[:, 1:].numel()
    loss = total / count
    return {"heldout_loss": loss, "heldout_ppl": math.exp(loss), "heldout_tokens": count}


def save_target(model: Qwen3ForCausalLM, out_dir: Path, tokenizer_dir: Path, ids: dict[str, int]) -> None:
    """Write the HF checkpoint (safetensors), tokenizer files and generation config into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["endoftext"],
        eos_token_id=[ids["im_end"], ids["endoftext"]],
        pad_token_id=ids["endoftext"],
        do_sample=False,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir / name, out_dir / name)
    # Readers differ on the dtype key: transformers 5 writes "dtype", older tools read "torch_dtype".
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float32"
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_target(path: Path) -> PreTrainedModel:
    """Load a saved target (dense or MoE, by its config's architecture) in float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def timed(fn, *args, **kwargs):
    """Run ``fn`` and return (result, seconds)."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
