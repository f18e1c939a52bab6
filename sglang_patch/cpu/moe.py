"""Expert parallelism (``--ep-size``) on a plain CPU.

With ``--ep-size > 1`` and no all-to-all backend (``--moe-a2a-backend none``), SGLang 0.5.23 splits the
routed experts over the ranks and maps each token's top-k ids to this rank's local experts; the
mapping table is created on ``get_device()`` (``layers/moe/token_dispatcher/standard.py:231``).
``get_device`` (``srt/utils/common.py:1072``) knows the accelerators and out-of-tree platforms, and on
a plain CPU without SGLang's CPU engine raises ``RuntimeError("No accelerator ...")``.

`get_device_hook` answers ``"cpu"`` there, so the mapping lives on the CPU with the weights; the rest
of the expert-parallel forward (the unquantized MoE method's torch path, and the TP all-reduce of
the partial expert sums over gloo) runs unchanged.
"""

from __future__ import annotations

import torch

#: ``get_device`` (lru-cached; call sites import it by name, rebound by the HookRegistry).
TARGET = "sglang.srt.utils.common.get_device"


def get_device_hook(orig, device_id=None):
    """AROUND hook on ``get_device``: SGLang's answer, or ``"cpu"`` where it finds no accelerator.

    Returns:
        the device string (``"cpu"`` when SGLang raises ``RuntimeError`` for want of an accelerator).
    """
    try:
        return orig(device_id)
    except RuntimeError:
        return "cpu"


#: The torch MoE forward the unquantized method runs on a plain CPU (``unquant.py:1385``, imported at
#: call time, so the module attribute is what the call resolves).
NATIVE_TARGET = "sglang.srt.layers.moe.fused_moe_native.moe_forward_native"


def moe_forward_native_hook(orig, layer, x, topk_output, moe_runner_config):
    """AROUND hook on ``moe_forward_native`` (``layers/moe/fused_moe_native.py:61``): experts of other ranks.

    Under expert parallelism the dispatcher maps every top-k id to this rank's local experts and
    marks the others ``-1`` (``standard.py:267``); the torch forward scatters the ids into a count
    table and fails on ``-1``. Here each such slot goes to a local expert its token does not already
    use (the count table is a scatter of ones, fused_moe_native.py:77, so a token must not name an
    expert twice) with weight 0: it adds an exact ``0.0`` to the token's sum, and the other rank's
    partial sum brings that expert's contribution in the TP all-reduce. Without ``-1`` ids (no EP)
    the call is unchanged.

    Args:
        layer: the ``FusedMoE`` layer (``w13_weight [E_local, 2I, H]``).
        topk_output: ``StandardTopKOutput`` (``topk_weights float[T, k]``, ``topk_ids int[T, k]``, ...).
    Returns:
        the forward's output, ``[T, H]``.
    """
    ids = topk_output.topk_ids
    drop = ids < 0
    if bool(drop.any()):
        local = int(layer.w13_weight.shape[0])
        ids64 = ids.to(torch.int64)
        used = torch.zeros(ids.shape[0], local + 1, dtype=torch.bool, device=ids.device)
        used.scatter_(1, torch.where(drop, local, ids64), True)       # column `local`: the dropped slots
        used = used[:, :local]
        for j in range(ids.shape[1]):                                  # k is small (top-k)
            free = (~used).to(torch.int64).argmax(1)                   # first expert the token does not use
            ids64[:, j] = torch.where(drop[:, j], free, ids64[:, j])
            used[torch.arange(ids.shape[0], device=ids.device), free] |= drop[:, j]
        topk_output = topk_output._replace(topk_weights=topk_output.topk_weights.masked_fill(drop, 0.0),
                                           topk_ids=ids64.to(ids.dtype))
    return orig(layer, x, topk_output, moe_runner_config)
