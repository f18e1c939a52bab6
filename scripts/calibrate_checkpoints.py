#!/usr/bin/env python
"""Calibrate Graft's pruning thresholds for a target + EAGLE-3 head pair made by make_models.py.

    python scripts/calibrate_checkpoints.py --models models/default --budget 60 --topk 10 --depth 7 \
        [--fire-rate 0.3] [--out configs/default.yaml]

Graft's checkpoints compare c_d = exp(max cumulative draft log-prob at depth d) with a threshold
tau_d (paper Sec. 3.1, "calibrated checkpoint depths"). Thresholds are a property of the draft's
calibration, not of the method: the paper-style 0.35 / 0.25 / 0.15 suits 8B-scale heads whose
top-1 probability is often > 0.5, while our tiny heads spread their mass (quick head: median
top-1 probability 0.08), so those thresholds fire on every round.

This script estimates, on held-out text, c_d for every position as the product of the head's
top-1 probabilities over the first d unrolled draft steps (the training-time-test forward that
matches SGLang's draft forward, ``modelmaking.eagle3``), and sets tau_d to the ``fire-rate``
quantile of c_d: each checkpoint alone fires on about that share of rounds. Checkpoint depths and
kept draft nodes are the benchmark's (``sglang_patch.bench.methods.stage_checkpoints``: depths 1, 2
and depth - 1 keeping 8/60, 24/60 and 40/60 of the budget, the paper's 8 / 24 / 40 of 60).
Writes a GraftConfig YAML (validated) to ``--out`` or stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from sglang_patch.bench.methods import stage_checkpoints, stage_depths  # noqa: E402
from modelmaking.data import eval_windows  # noqa: E402
from modelmaking.eagle3 import load_draft  # noqa: E402
from modelmaking.features import target_features  # noqa: E402
from modelmaking.target import load_target  # noqa: E402


@torch.no_grad()
def confidence_samples(models: Path, depth: int, max_tokens: int = 16384, seq_len: int = 128) -> np.ndarray:
    """float64 ``[P, depth]``: per held-out position, the estimated c_d for d = 1..depth."""
    target = load_target(models / "target")
    draft, layers = load_draft(models / "draft", target.get_input_embeddings().weight.detach())
    windows = eval_windows(np.load(models / "data" / "eval.npy"), seq_len, max_tokens)
    rows = []
    for chunk in windows.split(8):
        aux, _ = target_features(target, chunk, layers)
        outs = draft(chunk, aux, depth)
        n = chunk.shape[1] - depth  # positions where every unrolled step is real
        top = torch.stack([o[:, :n].float().softmax(-1).amax(-1) for o in outs], dim=-1)  # [B, n, depth]
        rows.append(top.cumprod(dim=-1).reshape(-1, depth).double().numpy())
    return np.concatenate(rows)


def checkpoints_for(conf: np.ndarray, budget: int, depth: int, fire_rate: float) -> list[dict]:
    """The benchmark's checkpoint list, thresholds at the fire-rate quantile of c_d (4 significant
    digits, clamped to [1e-6, 0.999])."""
    thresholds = [float(f"{min(max(float(np.quantile(conf[:, d - 1], fire_rate)), 1e-6), 0.999):.4g}")
                  for d in stage_depths(depth)]
    return stage_checkpoints(budget, depth, thresholds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, required=True, help="make_models.py output directory")
    ap.add_argument("--budget", type=int, required=True, help="N, verify tokens incl. the root")
    ap.add_argument("--topk", type=int, required=True)
    ap.add_argument("--depth", type=int, required=True)
    ap.add_argument("--fire-rate", type=float, default=0.3, help="share of rounds each checkpoint fires on")
    ap.add_argument("--out", type=Path, default=None, help="YAML file to write (default: stdout)")
    args = ap.parse_args(argv)
    if not 0.0 < args.fire_rate < 1.0:
        ap.error("--fire-rate must be in (0, 1)")

    from graft_spec.config import GraftConfig

    conf = confidence_samples(args.models, args.depth)
    cps = checkpoints_for(conf, args.budget, args.depth, args.fire_rate)
    cfg = GraftConfig(num_draft_tokens=args.budget, topk=args.topk, depth=args.depth, checkpoints=cps)
    quantiles = {f"c_{d}": [round(float(np.quantile(conf[:, d - 1], q)), 4) for q in (0.1, 0.3, 0.5, 0.7, 0.9)]
                 for d in range(1, args.depth + 1)}
    print(json.dumps({"positions": int(conf.shape[0]), "c_d quantiles (10/30/50/70/90%)": quantiles}),
          file=sys.stderr)
    text = yaml.safe_dump({"num_draft_tokens": cfg.num_draft_tokens, "topk": cfg.topk, "depth": cfg.depth,
                           "checkpoints": [c.model_dump() for c in cfg.checkpoints]}, sort_keys=False)
    if args.out:
        args.out.write_text(f"# calibrated by scripts/calibrate_checkpoints.py on {args.models}\n{text}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
