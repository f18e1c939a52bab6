"""Simulate how far a sparse source's calibration lags a change of workload (graft_spec.calibration).

One retrieval source (the suffix index) proposes ``k ~ Poisson(rate)`` nodes a round, all in one bin
and one chain (they are accepted together, with probability ``p``). For ``--before`` rounds it is
accepted at ``--p-before``, then for ``--after`` rounds at ``--p-after``; the script drives the real
`Calibrator` (`GraftPlanner`'s, default config otherwise) and reports, over the ``--after`` rounds, the
mean estimate the rounds were priced with against the observed rate - the figure the benchmark's
calibration check reads per run. Each ``--half-life`` is one variant (0: the long window alone).

    python scripts/simulate_source_lag.py --half-life 0 16 --json bench_out/source_lag.json

Output: one JSON line per variant on stdout, and with ``--json`` a file ``{"args", "variants"}``
holding the same objects: ``half_life``, ``estimated``, ``observed``, ``miss`` (mean over
repetitions) and ``miss_sd`` (its standard deviation over repetitions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from graft_spec.calibration import MEMBER_SUFFIX, NUM_MEMBERS
from graft_spec.config import GraftConfig
from graft_spec.pipeline import GraftPlanner

KMAX = 6  # static tree width of the simulated rounds (root + up to KMAX - 1 suffix nodes)


def simulate(half_life: float, a: argparse.Namespace, seed: int) -> tuple[float, float]:
    """``(mean estimate, observed rate)`` of the source over the ``--after`` rounds of one repetition."""
    cfg = GraftConfig(num_draft_tokens=6, topk=2, depth=2, calibration={"source_half_life": half_life})
    cal = GraftPlanner(cfg, 50).calibrator
    node = int(cal.retrieval_bins(torch.tensor([[MEMBER_SUFFIX]]), torch.tensor([[3]]), torch.zeros(1, 1),
                                  torch.tensor([[8]]), torch.zeros(1, dtype=torch.bool)))
    rng = np.random.default_rng(seed)
    depth = torch.arange(KMAX)[None, :]
    totals = torch.zeros(3, dtype=torch.float64)
    for i in range(a.before + a.after):
        p = a.p_before if i < a.before else a.p_after
        k = min(int(rng.poisson(a.rate)), KMAX - 1)
        bins = torch.full((1, KMAX, NUM_MEMBERS), -1)
        bins[0, 1:1 + k, MEMBER_SUFFIX] = node
        on_path = torch.zeros(1, KMAX, dtype=torch.bool)
        on_path[0, 0] = True
        on_path[0, 1:1 + k] = bool(rng.random() < p)
        members, _ = cal.update(bins, on_path, depth, cal.estimates())
        if i >= a.before:
            totals += members[MEMBER_SUFFIX]
    t, e, h = totals.tolist()
    return e / t, h / t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--half-life", type=float, nargs="+", default=[0.0, 16.0])
    p.add_argument("--rate", type=float, default=0.8, help="mean nodes of the source per round")
    p.add_argument("--p-before", type=float, default=0.466)
    p.add_argument("--p-after", type=float, default=0.235)
    p.add_argument("--before", type=int, default=600, help="rounds at the old rate")
    p.add_argument("--after", type=int, default=220, help="rounds at the new rate (measured)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out = []
    for hl in a.half_life:
        runs = np.array([simulate(hl, a, seed) for seed in range(a.reps)])
        miss = runs[:, 0] - runs[:, 1]
        out.append({"half_life": hl, "estimated": float(runs[:, 0].mean()), "observed": float(runs[:, 1].mean()),
                    "miss": float(miss.mean()), "miss_sd": float(miss.std())})
        print(json.dumps(out[-1]))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "variants": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
