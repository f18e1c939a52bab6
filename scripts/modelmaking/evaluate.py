"""Held-out metrics of a target + EAGLE-3 head pair.

* ``teacher_forced_agreement``: on held-out corpus text, how often the head's step-``k`` argmax
  (mapped to target ids through ``d2t``) equals the target's greedy next token.
* ``greedy_chain``: on text the target itself generated greedily, a replay of chain speculative
  decoding (top-k 1, ``K`` draft steps, greedy verification) round by round; its
  ``accept_length`` (tokens per target verify, bonus included) is what SGLang reports as
  ``spec_accept_length`` for ``--speculative-eagle-topk 1 --speculative-num-steps K``.
"""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM

from .eagle3 import Eagle3Draft
from .features import target_features


@torch.no_grad()
def step_matches(target: Qwen3ForCausalLM, draft: Eagle3Draft, layer_ids: list[int], ids: torch.Tensor, steps: int) -> torch.Tensor:
    """bool ``[B, T, K]``: entry ``[b, i, k]`` is True when draft step ``k`` at index ``i`` (which
    predicts the token at ``i+2+k``) agrees with the target's argmax at ``i+1+k``. Indices with
    ``i+1+k >= T`` are False."""
    aux, logits = target_features(target, ids, layer_ids)
    top = logits.argmax(-1)
    B, T = ids.shape
    out = torch.zeros(B, T, steps, dtype=torch.bool, device=ids.device)
    for k, dl in enumerate(draft(ids, aux, steps)):
        n = T - 1 - k
        out[:, :n, k] = draft.hot_ids[dl[:, :n].argmax(-1)] == top[:, 1 + k :]
    return out


@torch.no_grad()
def teacher_forced_agreement(target, draft, layer_ids, windows: torch.Tensor, steps: int) -> list[float]:
    """Per-step top-1 agreement on ``windows [N, T]`` (each step over its valid indices)."""
    hits = [0] * steps
    counts = [0] * steps
    for chunk in windows.split(8):
        m = step_matches(target, draft, layer_ids, chunk, steps)
        T = chunk.shape[1]
        for k in range(steps):
            hits[k] += int(m[:, : T - 1 - k, k].sum())
            counts[k] += m[:, : T - 1 - k, k].numel()
    return [h / c for h, c in zip(hits, counts)]


@torch.no_grad()
def greedy_generate(target: Qwen3ForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Plain argmax continuation (no stop tokens, no logits processors): int64 ``[N, P + new_tokens]``."""
    out = target(input_ids=prompts, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    pieces = [prompts, nxt]
    for _ in range(new_tokens - 1):
        out = target(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        pieces.append(nxt)
    return torch.cat(pieces, dim=1)


def replay_chain(matches: torch.Tensor, prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """Count tokens and verify rounds of chain speculative decoding, as SGLang counts them.

    Args:
        matches: bool ``[T, K]`` from `step_matches` for one greedy sequence (prompt + output).
        prompt_len: ``P``; the prefill yields the first output token (no verify round).
        new_tokens: output length cap (``max_new_tokens``).

    Each round starts at index ``i`` (the draft KV cache covers ``0..i``), accepts the leading
    matching steps ``n`` plus the target's bonus token, and moves to ``i + n + 1``; the last round
    is cut at ``new_tokens``. Returns (completion tokens, verify rounds): SGLang's
    ``spec_accept_length`` is their ratio (``tokenizer_manager.py`` meta_info).
    """
    steps = matches.shape[1]
    tokens, rounds, i = 1, 0, prompt_len - 1
    while tokens < new_tokens:
        n = 0
        while n < steps and i < matches.shape[0] and bool(matches[i, n]):
            n += 1
        tokens += min(n + 1, new_tokens - tokens)
        rounds += 1
        i += n + 1
    return tokens, rounds


@torch.no_grad()
def greedy_chain(target, draft, layer_ids, prompts: torch.Tensor, new_tokens: int, steps: int) -> dict:
    """Replay chain speculative decoding on the target's own greedy continuations of ``prompts [N, P]``.

    Returns {'accept_length', 'step_agreement', 'rounds', 'tokens'}: completion tokens per verify
    round (bonus and prefill token included, as SGLang's ``spec_accept_length`` for
    ``--speculative-eagle-topk 1 --speculative-num-steps K``), per-step top-1 agreement along
    the greedy text, and the totals.
    """
    P = prompts.shape[1]
    seqs = greedy_generate(target, prompts, new_tokens)
    m = step_matches(target, draft, layer_ids, seqs, steps)
    T = seqs.shape[1]
    rounds = tokens = 0
    for b in range(seqs.shape[0]):
        t, r = replay_chain(m[b], P, new_tokens)
        tokens += t
        rounds += r
    gen = m[:, P - 1 :, :]
    agree = [float(gen[:, : T - P - k, k].float().mean()) for k in range(steps)]
    return {"accept_length": tokens / max(1, rounds), "step_agreement": agree, "rounds": rounds, "tokens": tokens}
