"""Train the EAGLE-3 head on the frozen target's features (soft labels, training-time test)."""

from __future__ import annotations

import numpy as np
import torch
from tqdm import tqdm
from transformers import Qwen3ForCausalLM

from .data import random_windows
from .device import autocast
from .eagle3 import Eagle3Draft, shape_for
from .features import target_features
from .schedule import lr_at, make_adamw
from .sizes import DraftSpec


def choose_draft_vocab(stream: np.ndarray, vocab_size: int, draft_vocab_size: int, always: list[int]) -> torch.Tensor:
    """The ``draft_vocab_size`` most frequent token ids of the training stream (ties: lower id),
    always including ``always`` (special tokens). Returns sorted int64 ``[Vd]``."""
    if draft_vocab_size > vocab_size:
        raise ValueError("draft vocabulary larger than target vocabulary")
    counts = np.bincount(stream.astype(np.int64), minlength=vocab_size).astype(np.float64)
    counts[always] = np.inf
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count desc, then id asc
    return torch.from_numpy(np.sort(order[:draft_vocab_size])).long()


def init_draft(target: Qwen3ForCausalLM, spec: DraftSpec, layer_ids: list[int], hot_ids: torch.Tensor, seed: int) -> Eagle3Draft:
    """A head whose untrained output is the target's logit lens at the highest aux layer.

    ``fc`` selects the last aux block (identity), ``o_proj``/``down_proj`` start at zero so the layer
    begins as a pass-through, ``lm_head`` starts from the target's output rows of the draft
    vocabulary and ``norm`` from the target's final norm.
    """
    torch.manual_seed(seed)
    cfg = target.config
    shape = shape_for(spec, cfg, len(layer_ids))
    embed = target.get_input_embeddings().weight.detach()
    draft = Eagle3Draft(shape, embed, hot_ids)
    H = shape.hidden_size
    with torch.no_grad():
        for lin in (draft.midlayer.self_attn.q_proj, draft.midlayer.self_attn.k_proj, draft.midlayer.self_attn.v_proj,
                    draft.midlayer.mlp.gate_proj, draft.midlayer.mlp.up_proj):
            lin.weight.normal_(0.0, 0.02)
        draft.midlayer.self_attn.o_proj.weight.zero_()
        draft.midlayer.mlp.down_proj.weight.zero_()
        draft.fc.weight.normal_(0.0, 0.002)
        draft.fc.weight[:, (len(layer_ids) - 1) * H :] += torch.eye(H, device=draft.fc.weight.device)
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[hot_ids])
        draft.norm.copy_(target.model.norm.weight)
    return draft


def ttt_loss(
    draft: Eagle3Draft, input_ids: torch.Tensor, aux: torch.Tensor, target_logits: torch.Tensor,
    steps: int, decay: float,
) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy of the unrolled draft against the target.

    Step ``k`` at index ``i`` is scored against the target's distribution at index ``i+1+k``
    restricted to the draft vocabulary (mass outside it is dropped, as in EAGLE-3), weight
    ``decay**k``. Returns (loss scalar, float32 ``[K]`` per-step top-1 agreement, no grad).
    """
    T = input_ids.shape[1]
    target_p = target_logits.log_softmax(-1)[..., draft.hot_ids].exp()  # [B, T, Vd]
    target_top = target_logits.argmax(-1)  # [B, T]
    outs = draft(input_ids, aux, steps)
    total, norm, agree = 0.0, 0.0, []  # agreement stays a tensor: no graph break under compile
    for k, logits in enumerate(outs):
        n = T - 1 - k
        logp = logits[:, :n].float().log_softmax(-1)
        loss_k = -(target_p[:, 1 + k :] * logp).sum(-1).mean()
        w = decay**k
        total = total + w * loss_k
        norm += w
        with torch.no_grad():
            pred = draft.hot_ids[logits[:, :n].argmax(-1)]
            agree.append((pred == target_top[:, 1 + k :]).float().mean())
    return total / norm, torch.stack(agree).detach()


def train_draft(
    draft: Eagle3Draft, target: Qwen3ForCausalLM, layer_ids: list[int], spec: DraftSpec,
    stream: np.ndarray, seed: int, compile_model: bool, device: str = "cpu", desc: str = "draft",
) -> dict:
    """Train ``draft`` in place. Returns {'train_loss_last', 'train_agreement_last', 'steps', 'compiled'}."""
    gen = torch.Generator().manual_seed(seed)
    opt = make_adamw(draft.parameters(), spec.lr, spec.weight_decay)
    target.eval()
    draft.train()

    def step_fn(x, aux, logits):
        with autocast(device):
            return ttt_loss(draft, x, aux, logits, spec.ttt_steps, spec.step_weight_decay)

    fn, compiled = step_fn, False
    if compile_model:
        fn, compiled = torch.compile(step_fn), True
    losses, agrees = [], []
    bar = tqdm(range(spec.steps), desc=desc, unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec.steps, spec.lr, spec.warmup_frac)
        x = random_windows(stream, spec.seq_len, spec.batch_size, gen).to(device)
        with autocast(device):
            aux, logits = target_features(target, x, layer_ids)
        try:
            loss, agree = fn(x, aux, logits)
        except Exception as exc:  # compiler missing or failing: fall back to eager, same maths
            if not compiled:
                raise
            tqdm.write(f"torch.compile failed ({type(exc).__name__}: {exc}); training eagerly")
            fn, compiled = step_fn, False
            loss, agree = fn(x, aux, logits)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        agrees.append(agree)
        if step % 50 == 0 or step == spec.steps - 1:  # a host read every 50 steps, not every step
            bar.set_postfix(loss=f"{losses[-1].item():.3f}", top1=f"{agrees[-1][0].item():.2f}")
    draft.eval()
    losses = torch.stack(losses).float().cpu().tolist()
    agrees = torch.stack(agrees).float().cpu().tolist()
    tail = max(1, len(losses) // 10)
    return {
        "train_loss_last": float(np.mean(losses[-tail:])),
        "train_agreement_last": [float(v) for v in np.mean(agrees[-tail:], axis=0)],
        "steps": spec.steps,
        "compiled": compiled,
    }
