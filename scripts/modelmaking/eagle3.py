"""EAGLE-3 draft head: the checkpoint layout and the forward pass SGLang 0.5.23 runs for it.

SGLang loads the head with ``srt/models/llama_eagle3.py`` ``LlamaForCausalLMEagle3``. Our training
forward reproduces its inference maths (written from reading that file, not copied):

* ``fc``: ``[3*H_t] -> [H]`` projection of the three captured target hidden states, concatenated
  in ``eagle_aux_hidden_state_layer_ids`` order (llama_eagle3.py:163-167, applied at :247 only when
  the incoming hidden is not already ``H`` wide).
* the single decoder layer (``midlayer`` in the checkpoint, renamed ``layers.0`` at load,
  llama_eagle3.py:338-348), input-layer branch (:97-102): ``residual = h``;
  ``x = cat([input_layernorm(embed), hidden_norm(h)])`` (``2H`` wide) -> attention (q/k/v take
  ``2H``, :62-75; Llama attention: neox RoPE, no q/k norm, no bias) -> ``o_proj``;
  ``residual = attn + residual``; ``mlp(post_attention_layernorm(residual))``.
* final ``norm`` with the residual fused in (:263-265): ``out = mlp + residual``;
  logits = ``lm_head(norm(out))`` over the draft vocabulary; the hidden state fed back to the
  next draft step is the *pre-norm* ``out`` (``norm_output`` false, :267-269).
* token ids: draft id ``i`` maps to target id ``i + d2t[i]`` (llama_eagle3.py:350-352,
  ``hot_token_id``; eagle_worker_v2.py:757-758 maps top-k indices through it).
* ``embed_tokens`` is not in the checkpoint: SGLang replaces the draft embedding with the
  target's (eagle_worker_v2.py:363 ``set_embed``; llama.py:910-916), so training uses the
  frozen target embedding too.

Positions: SGLang's draft extend feeds token ``x[i+1]`` with target features of position ``i`` at
rotary position ``i``; draft decode step ``k`` (k>=1) sits at position ``t+k`` and attends to the
draft KV cache ``0..t`` (written from target features) plus the earlier draft steps' keys. The
training-time-test forward below uses exactly that attention pattern.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from .sizes import DraftSpec

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class DraftShape:
    """Shape of an EAGLE-3 head and the target it serves."""

    hidden_size: int  # H, equal to the target hidden size (so SGLang shares the embedding)
    target_hidden_size: int
    num_aux: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (as SGLang ``RMSNorm.forward_native``): ``[..., H]`` -> same."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary tables for int64 ``positions [T]``: cos, sin float32 ``[T, head_dim]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, T, D]`` by neox-style (half-split) rotary tables ``[T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read the ``2H`` concatenation (no bias, no q/k norm)."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.s = s
        in_dim = 2 * s.hidden_size
        self.q_proj = nn.Linear(in_dim, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The single draft decoder layer (checkpoint prefix ``midlayer.``)."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(s.hidden_size))
        self.hidden_norm = nn.Parameter(torch.ones(s.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(s.hidden_size))
        self.self_attn = Eagle3Attention(s)
        self.mlp = Eagle3MLP(s)


class Eagle3Draft(nn.Module):
    """EAGLE-3 head with SGLang's inference semantics; see the module docstring.

    Parameters are named so that ``checkpoint_state_dict`` yields the public checkpoint names.
    The token embedding (``embed [V, H]``, the target's) is held as a frozen buffer.
    """

    def __init__(self, s: DraftShape, embed: torch.Tensor, hot_ids: torch.Tensor):
        super().__init__()
        if embed.shape != (s.vocab_size, s.hidden_size):
            raise ValueError(f"embedding {tuple(embed.shape)} does not match vocab/hidden of {s}")
        if hot_ids.shape != (s.draft_vocab_size,):
            raise ValueError("hot_ids must have draft_vocab_size entries")
        self.s = s
        self.fc = nn.Linear(s.num_aux * s.target_hidden_size, s.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(s)
        self.norm = nn.Parameter(torch.ones(s.hidden_size))
        self.lm_head = nn.Linear(s.hidden_size, s.draft_vocab_size, bias=False)
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.register_buffer("hot_ids", hot_ids.long().clone(), persistent=False)

    # -- one draft step over all positions ------------------------------------------------------
    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q ``[B, nh, T, D]``, k/v ``[B, nkv, T, D]`` from the ``2H`` input ``x [B, T, 2H]``."""
        s, a = self.s, self.midlayer.self_attn
        B, T, _ = x.shape
        q = a.q_proj(x).view(B, T, s.num_attention_heads, s.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, T, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q, keys, vals) -> torch.Tensor:
        """Training-time-test attention for step ``len(keys)-1``.

        Query ``i`` attends to step-0 keys ``j <= i`` (the draft KV cache built from target
        features) and to the keys of steps ``1..k`` at the same index ``i`` (the draft's own
        earlier tokens on this branch). Returns ``[B, nh, T, D]``.
        """
        s = self.s
        rep = s.num_attention_heads // s.num_key_value_heads
        scale = s.head_dim**-0.5
        k0 = keys[0].repeat_interleave(rep, dim=1)
        v0 = vals[0].repeat_interleave(rep, dim=1)
        if len(keys) == 1:
            return F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
        T = q.shape[2]
        scores0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        diag_k = torch.stack([k.repeat_interleave(rep, dim=1) for k in keys[1:]], dim=-2)
        diag_v = torch.stack([v.repeat_interleave(rep, dim=1) for v in vals[1:]], dim=-2)
        scores_d = (q.unsqueeze(-2) * diag_k).sum(-1) * scale  # [B, nh, T, k]
        probs = torch.cat([scores0, scores_d], dim=-1).float().softmax(-1).to(q.dtype)
        out = probs[..., :T] @ v0
        out = out + (probs[..., T:].unsqueeze(-1) * diag_v).sum(-2)
        return out

    def step(self, token_embeds, hidden, cos, sin, keys, vals):
        """One draft step. ``token_embeds``/``hidden`` ``[B, T, H]`` -> (logits ``[B, T, Vd]``,
        pre-norm hidden ``[B, T, H]`` to feed back). Appends this step's k/v to ``keys``/``vals``."""
        s, layer = self.s, self.midlayer
        residual = hidden
        x = torch.cat(
            [
                rms_norm(token_embeds, layer.input_layernorm, s.rms_norm_eps),
                rms_norm(hidden, layer.hidden_norm, s.rms_norm_eps),
            ],
            dim=-1,
        )
        q, k, v = self._project(x, cos, sin)
        keys.append(k)
        vals.append(v)
        attn = self._attend(q, keys, vals)
        B, _, T, _ = attn.shape
        attn = layer.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        residual = attn + residual
        out = layer.mlp(rms_norm(residual, layer.post_attention_layernorm, s.rms_norm_eps)) + residual
        logits = self.lm_head(rms_norm(out, self.norm, s.rms_norm_eps))
        return logits, out

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Unrolled training-time-test forward.

        Args:
            input_ids: int64 ``[B, T]``, the sequence the target read.
            aux_hidden: float ``[B, T, num_aux * H_t]``, captured target states at each position.
            steps: number of draft steps ``K`` to unroll.

        Returns:
            ``K`` logits tensors ``[B, T, Vd]``. Step ``k`` at index ``i`` reads token
            ``input_ids[i+1+k]`` at rotary position ``i+k`` and predicts the token at ``i+2+k``;
            entries with ``i+1+k >= T`` are padding (their token embedding is zero).
        """
        B, T = input_ids.shape
        hidden = self.fc(aux_hidden)
        keys: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        outs = []
        base = torch.arange(T, device=input_ids.device)
        for k in range(steps):
            shifted = torch.zeros_like(input_ids)
            shifted[:, : T - 1 - k] = input_ids[:, 1 + k :]
            emb = F.embedding(shifted, self.embed)
            cos, sin = rope_cos_sin(base + k, self.s.head_dim, self.s.rope_theta)
            logits, hidden = self.step(emb, hidden, cos, sin, keys, vals)
            outs.append(logits)
        return outs

    # -- checkpoint ----------------------------------------------------------------------------
    def _named_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """Trainable tensors keyed by their public EAGLE-3 checkpoint names."""
        layer = self.midlayer
        named = {
            "fc.weight": self.fc.weight,
            "midlayer.input_layernorm.weight": layer.input_layernorm,
            "midlayer.hidden_norm.weight": layer.hidden_norm,
            "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
        }
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            named[f"midlayer.self_attn.{name}.weight"] = getattr(layer.self_attn, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            named[f"midlayer.mlp.{name}.weight"] = getattr(layer.mlp, name).weight
        return named

    def checkpoint_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors under the public EAGLE-3 names (no ``embed_tokens``), plus ``d2t``/``t2d``."""
        sd = {k: v.detach().float().contiguous().clone() for k, v in self._named_for_checkpoint().items()}
        sd["d2t"], sd["t2d"] = token_maps(self.hot_ids, self.s.vocab_size)
        return sd

    def load_checkpoint_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Inverse of ``checkpoint_state_dict``.

        Raises:
            ValueError: ``d2t`` disagrees with this head's ``hot_ids``.
            KeyError: a tensor is missing.
        """
        hot = sd["d2t"].long() + torch.arange(sd["d2t"].shape[0])
        if not torch.equal(hot, self.hot_ids):
            raise ValueError("checkpoint d2t does not match the draft vocabulary")
        with torch.no_grad():
            for name, tensor in self._named_for_checkpoint().items():
                tensor.copy_(sd[name])


def token_maps(hot_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``d2t`` int64 ``[Vd]`` with ``target_id = draft_id + d2t[draft_id]``, and ``t2d`` bool ``[V]``
    (True where a target id is in the draft vocabulary). ``hot_ids`` must be strictly increasing."""
    hot_ids = hot_ids.long()
    if hot_ids.numel() > 1 and not bool((hot_ids[1:] > hot_ids[:-1]).all()):
        raise ValueError("hot_ids must be strictly increasing")
    d2t = hot_ids - torch.arange(hot_ids.numel(), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[hot_ids] = True
    return d2t, t2d


def aux_layer_ids(num_layers: int) -> list[int]:
    """Low / middle / high target layers whose outputs feed the head.

    SGLang captures the *input* of decoder layer ``id + 1`` (= output of layer ``id``;
    qwen3.py:778-790 ``set_eagle3_layers_to_capture``), so ids must be ``<= num_layers - 2``.
    Hugging Face exposes the same tensor as ``hidden_states[id + 1]``.
    """
    if num_layers < 4:
        raise ValueError("need at least 4 target layers for three distinct aux layers")
    return [0, (num_layers - 2) // 2, num_layers - 2]


def draft_config(s: DraftShape, layer_ids: list[int], ids: dict[str, int]) -> dict:
    """``config.json`` of the head: a LlamaConfig with the EAGLE-3 keys SGLang reads."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": s.hidden_size,
        "target_hidden_size": s.target_hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": s.max_position_embeddings,
        "vocab_size": s.vocab_size,
        "draft_vocab_size": s.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": ids["endoftext"],
        "eos_token_id": ids["im_end"],
        "pad_token_id": ids["endoftext"],
        "dtype": "float32",
        "torch_dtype": "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(layer_ids),
            "use_aux_hidden_state": True,
        },
    }


def shape_from_config(cfg: dict) -> DraftShape:
    """``DraftShape`` from a head's ``config.json`` dict."""
    layer_ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    return DraftShape(
        hidden_size=cfg["hidden_size"],
        target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
        num_aux=len(layer_ids),
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        draft_vocab_size=cfg["draft_vocab_size"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        max_position_embeddings=cfg["max_position_embeddings"],
    )


def shape_for(spec: DraftSpec, target_cfg, num_aux: int) -> DraftShape:
    """``DraftShape`` for a draft spec and a target ``Qwen3Config``."""
    rope = getattr(target_cfg, "rope_parameters", None) or {}
    return DraftShape(
        hidden_size=target_cfg.hidden_size,
        target_hidden_size=target_cfg.hidden_size,
        num_aux=num_aux,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=spec.draft_vocab_size,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position_embeddings=target_cfg.max_position_embeddings,
    )


def save_draft(draft: Eagle3Draft, out_dir: Path, layer_ids: list[int], ids: dict[str, int]) -> None:
    """Write ``config.json`` and ``model.safetensors`` of the head into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(draft.checkpoint_state_dict(), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = draft_config(draft.s, layer_ids, ids)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_draft(path: Path, embed: torch.Tensor) -> tuple[Eagle3Draft, list[int]]:
    """Load a head saved by ``save_draft`` (or any public-layout EAGLE-3 head without fc norms).

    ``embed [V, H]`` is the target's embedding. Returns (draft in eval mode, aux layer ids).
    """
    cfg = json.loads((Path(path) / "config.json").read_text())
    sd = load_file(str(Path(path) / "model.safetensors"))
    shape = shape_from_config(cfg)
    hot = sd["d2t"].long() + torch.arange(sd["d2t"].shape[0])
    draft = Eagle3Draft(shape, embed, hot)
    draft.load_checkpoint_state_dict(sd)
    return draft.eval(), list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
