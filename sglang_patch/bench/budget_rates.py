"""What the batch budget's speculative rounds earned against its own plain rounds (standard library only).

A benchmark row's ``budget`` view carries the tokens emitted and wall seconds spent per batch-size
bucket x width (``tokens_by_bucket_width`` / ``seconds_by_bucket_width``, keys ``"16x12"``: the
`graft_spec.budget.BatchBudget` counters, launch-to-launch round times). `speculation_net_seconds`
prices every speculative round's tokens at the rate the same server's plain rounds realised at the
same batch-size bucket: the time the speculative rounds took beyond what plain rounds would have
needed for their tokens. Negative: speculating saved time; positive: it cost time. It compares the
budget with its own alternative (stepping aside), not with a server without speculation. The
deferred draft catch-ups are in neither time (the worker starts a round's clock after its
catch-up), so the plain rate leaves out work plain rounds defer and the net leans, if anything,
against speculating.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

__all__ = ["speculation_net_seconds"]


def speculation_net_seconds(budget: Dict[str, Any], runs: int = 1) -> Optional[Dict[str, float]]:
    """Seconds per run the speculative rounds took beyond plain rounds' time for the same tokens.

    Args:
        budget: a row's ``budget`` view (`sglang_patch.bench.__main__._budget_view`, summed over
            runs in a merged row), with ``tokens_by_bucket_width`` and ``seconds_by_bucket_width``.
        runs: the runs the counts are summed over (the result is per run).
    Returns:
        ``{"net_s": seconds per run (negative: saved), "covered": share of the speculative rounds'
        seconds in buckets that also ran plain rounds, the only ones priced}``, or None when the view
        has no per-bucket counts or no speculative round ran.
    Raises:
        ValueError: ``runs`` < 1.
    """
    if runs < 1:
        raise ValueError(f"runs={runs}: must be >= 1")
    tokens = budget.get("tokens_by_bucket_width") or {}
    seconds = budget.get("seconds_by_bucket_width") or {}
    spec = {}   # speculative (bucket x width) key -> (its seconds, the same bucket's plain key)
    for key, s in seconds.items():
        bucket, width = key.split("x")
        if int(width) > 1 and s > 0:
            spec[key] = (s, f"{bucket}x1")
    if not spec:
        return None
    net = covered = 0.0
    for key, (s, plain) in spec.items():
        if seconds.get(plain, 0) > 0 and tokens.get(plain, 0) > 0:
            net += s - tokens.get(key, 0) * seconds[plain] / tokens[plain]
            covered += s
    return {"net_s": net / runs, "covered": covered / sum(s for s, _ in spec.values())}
