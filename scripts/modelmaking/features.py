"""What the target hands the EAGLE-3 head: captured aux hidden states and next-token logits."""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM


@torch.no_grad()
def target_features(
    target: Qwen3ForCausalLM, input_ids: torch.Tensor, layer_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target once over ``input_ids [B, T]``.

    Returns:
        aux: float32 ``[B, T, len(layer_ids) * H]``, the outputs of decoder layers ``layer_ids``
            concatenated in that order. HF's ``hidden_states[id + 1]`` is the input of layer
            ``id + 1``, the same residual-stream tensor SGLang captures for ``id``
            (``layers_to_capture = [id + 1 ...]``, qwen3.py:778-790).
        logits: float32 ``[B, T, V]``, the target's next-token logits.
    """
    out = target(input_ids=input_ids, output_hidden_states=True)
    hs = out.hidden_states
    if max(layer_ids) + 1 >= len(hs) - 1:
        raise ValueError(f"aux layer ids {layer_ids} reach the final (normed) hidden state")
    aux = torch.cat([hs[i + 1] for i in layer_ids], dim=-1).float()
    return aux, out.logits.float()
