"""Graft's serving statistics for every engine adapter: host accumulators, the server-info view and
the ``graft:*`` Prometheus series.

Everything here is fed from host data only. SGLang: each round's accepted sources, accept lengths and
calibration counts travel from the device as a ``DeviceAuxiliaryOutput`` that SGLang copies with its
own result copy (``managers/auxiliary_output.py``), so reading them costs the decode loop nothing.
vLLM: the chain step records each step's accepted chain tokens once the committed tokens arrive
(vllm_worker/step.py), in prometheus_client's default registry.

With SGLang's ``--enable-metrics`` the series below are registered in the scheduler process; SGLang runs
``prometheus_client`` in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher before the
schedulers start, ``utils/common.py:2825``), so they appear on the server's ``/metrics`` next to
SGLang's own ``sglang:*`` series (``observability/metrics_collector.py``):

| series | type | labels | what |
|---|---|---|---|
| ``graft:accepted_tokens_total`` | counter | source = a source name (sources.py) or bonus | emitted tokens by origin |
| ``graft:accept_length`` | histogram | | tokens per request per speculative round (bonus included) |
| ``graft:verified_nodes_total`` | counter | depth | verified tree nodes per depth |
| ``graft:accepted_nodes_total`` | counter | depth | of those, on the accepted path |
| ``graft:calibration_trials_total`` | counter | member = a member source name (sources.py) | verified nodes each source proposed |
| ``graft:calibration_estimated_total`` | counter | member | sum of their estimated acceptance |
| ``graft:calibration_hits_total`` | counter | member | how many were accepted |
| ``graft:draft_forwards_total`` | counter | outcome = run, skipped | eager draft forwards (stop gate) |
| ``graft:verify_rounds_total`` | counter | width | decode rounds per verify width (batch budget; 1 = plain decode) |
| ``graft:batch_verify_tokens`` | gauge | | verify tokens of the last round (batch size x width) |
| ``graft:verify_width`` | gauge | | verify width per request of the last round |
| ``graft:round_failures_total`` | counter | stage | contained failures of graft's own round code (SGLang: sglang_patch/containment.py) |

Mean estimated vs observed acceptance of a member = ``estimated_total / trials_total`` vs
``hits_total / trials_total``; acceptance per depth = ``accepted_nodes / verified_nodes``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

import numpy as np

from .sources import NUM_MEMBERS, SOURCE_NAMES

ACCEPT_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 48, 64, 128)


class GraftStats:
    """Cumulative host statistics of one scheduler, optionally mirrored to Prometheus.

    Args:
        prometheus: register the ``graft:*`` series (SGLang's ``--enable-metrics``).
    Attributes:
        accepted: accepted tokens by source (draft / retrieved / padding) plus ``bonus``.
        accept_length_counts: {accept length: rounds}.
        calibration: per member source [trials, sum of estimates, hits, sum over rounds of
            (hits - sum of estimates)^2]; `summary` gives the mean estimate's error's standard error
            with the round as the cluster (``stderr`` = sqrt of that sum / trials): a round's nodes
            share a path, so a chain of 20 nodes from one wrong match is one outcome, not 20.
        depth: per depth [verified nodes, accepted nodes].
        draft_forwards: {"run": n, "skipped": n}.
        verify_widths: {width: decode rounds} (batch budget); last_batch_tokens: the last round's
            batch size x width.
    """

    def __init__(self, prometheus: bool = False):
        self.accepted: Dict[str, int] = {name: 0 for name in (*SOURCE_NAMES, "bonus")}
        self.accept_length_counts: Dict[int, int] = {}
        self.calibration: Dict[str, List[float]] = {m: [0.0, 0.0, 0.0, 0.0] for m in SOURCE_NAMES[:NUM_MEMBERS]}
        self.depth: Dict[int, List[float]] = {}
        self.draft_forwards: Dict[str, int] = {"run": 0, "skipped": 0}
        self.verify_widths: Dict[int, int] = {}
        self.last_batch_tokens = 0
        self._prom = _Prometheus() if prometheus else None

    def record_round(self, sources: Sequence[Sequence[int]], members, depths) -> None:
        """One verified round, from its `graft_spec.pipeline.RoundStats` copied to the host.

        Args:
            sources: per request the ``SOURCE_*`` of each accepted non-root node, -1 after the path.
            members: ``[B, NUM_MEMBERS, 3]`` (host tensor or nested lists) the round's (trials, sum of
                estimates, hits) per request and member, summed here over the requests (the round
                is the cluster of the calibration's standard error).
            depths: ``[B, D + 1, 2]`` the round's (verified, accepted) nodes per request and depth
                (column 0 unused), summed here over the requests.
        """
        members = np.asarray(members, dtype=np.float64).sum(0).tolist()
        depths = np.asarray(depths, dtype=np.float64).sum(0).tolist()
        for row in sources:
            accepted = [int(s) for s in row if s >= 0]
            for s in accepted:
                self.accepted[SOURCE_NAMES[s]] += 1
            self.accepted["bonus"] += 1
            n = len(accepted) + 1
            self.accept_length_counts[n] = self.accept_length_counts.get(n, 0) + 1
            if self._prom:
                for s in accepted:
                    self._prom.accepted.labels(source=SOURCE_NAMES[s]).inc()
                self._prom.accepted.labels(source="bonus").inc()
                self._prom.accept_length.observe(n)
        for name, (t, e, h) in zip(SOURCE_NAMES[:NUM_MEMBERS], members):
            if t:
                c = self.calibration[name]
                c[0] += t
                c[1] += e
                c[2] += h
                c[3] += (h - e) ** 2    # the round is the cluster: its nodes' outcomes are correlated
                if self._prom:
                    self._prom.cal_trials.labels(member=name).inc(t)
                    self._prom.cal_estimated.labels(member=name).inc(e)
                    self._prom.cal_hits.labels(member=name).inc(h)
        for d, (t, h) in enumerate(depths):
            if d and t:
                c = self.depth.setdefault(d, [0.0, 0.0])
                c[0] += t
                c[1] += h
                if self._prom:
                    self._prom.verified.labels(depth=str(d)).inc(t)
                    self._prom.accepted_nodes.labels(depth=str(d)).inc(h)

    def count_draft_forward(self, ran: bool) -> None:
        key = "run" if ran else "skipped"
        self.draft_forwards[key] += 1
        if self._prom:
            self._prom.draft_forwards.labels(outcome=key).inc()

    def record_failure(self, stage: str) -> None:
        """A contained failure of graft's round code in ``stage`` (the ``graft:round_failures_total``
        series; the engine adapter keeps the counts, sglang_patch/containment.py)."""
        if self._prom:
            self._prom.failures.labels(stage=stage).inc()

    def record_plain(self, batch_size: int) -> None:
        """One plain round (verify width 1) of ``batch_size`` requests: each emitted one token, the
        target's, and nothing was verified (accept length 1)."""
        self.accepted["bonus"] += batch_size
        self.accept_length_counts[1] = self.accept_length_counts.get(1, 0) + batch_size
        if self._prom:
            self._prom.accepted.labels(source="bonus").inc(batch_size)

    def record_width(self, width: int, batch_size: int) -> None:
        """A decode round launched with ``width`` verify tokens per request for ``batch_size`` requests."""
        self.verify_widths[width] = self.verify_widths.get(width, 0) + 1
        self.last_batch_tokens = width * batch_size
        if self._prom:
            self._prom.verify_rounds.labels(width=str(width)).inc()
            self._prom.batch_tokens.set(self.last_batch_tokens)
            self._prom.width.set(width)

    def summary(self) -> dict:
        """The ``/server_info`` view: counts, and estimated vs observed acceptance per member and depth."""
        cal = {m: {"trials": int(t), "estimated": (e / t if t else None), "observed": (h / t if t else None),
                   "sq_error": sq, "stderr": (math.sqrt(sq) / t if t else None)}
               for m, (t, e, h, sq) in self.calibration.items()}
        depth = {d: {"verified": int(t), "observed": h / t} for d, (t, h) in sorted(self.depth.items()) if t}
        return {"accepted_tokens": dict(self.accepted),
                "accept_length_hist": dict(sorted(self.accept_length_counts.items())),
                "calibration": cal, "acceptance_by_depth": depth, "draft_forwards": dict(self.draft_forwards),
                "verify_widths": {str(k): v for k, v in sorted(self.verify_widths.items())},
                "last_batch_verify_tokens": self.last_batch_tokens}


class _Prometheus:
    """The ``graft:*`` series (see the module docstring); prometheus_client is imported here, after
    SGLang has set ``PROMETHEUS_MULTIPROC_DIR``."""

    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram

        self.accepted = Counter("graft:accepted_tokens", "Emitted tokens by origin", ["source"])
        self.accept_length = Histogram("graft:accept_length", "Tokens per request per verify round",
                                       buckets=ACCEPT_LENGTH_BUCKETS)
        self.verified = Counter("graft:verified_nodes", "Verified tree nodes per depth", ["depth"])
        self.accepted_nodes = Counter("graft:accepted_nodes", "Accepted tree nodes per depth", ["depth"])
        self.cal_trials = Counter("graft:calibration_trials", "Verified nodes per proposing source", ["member"])
        self.cal_estimated = Counter("graft:calibration_estimated", "Sum of estimated acceptance", ["member"])
        self.cal_hits = Counter("graft:calibration_hits", "Accepted nodes per proposing source", ["member"])
        self.draft_forwards = Counter("graft:draft_forwards", "Eager draft forwards", ["outcome"])
        self.verify_rounds = Counter("graft:verify_rounds", "Decode rounds per verify width", ["width"])
        self.batch_tokens = Gauge("graft:batch_verify_tokens", "Verify tokens of the last round",
                                  multiprocess_mode="mostrecent")
        self.width = Gauge("graft:verify_width", "Verify width per request of the last round",
                           multiprocess_mode="mostrecent")
        self.failures = Counter("graft:round_failures", "Contained failures of graft's round code", ["stage"])


def prometheus_enabled() -> bool:
    """SGLang's ``--enable-metrics`` for this process (False outside a configured server)."""
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:  # noqa: BLE001 - no runtime context (tests)
        return False

