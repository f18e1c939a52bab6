"""The batch-aware verify budget: how many tokens each request of a decode round verifies.

Speculation pays while the tokens it gains are worth more than the verify (and draft) compute it
adds; with many requests in the batch the verify forward stops being memory-bound and every extra
node costs real time. `BatchBudget` treats the batch as one budget: each round it picks one verify
width ``w`` for all requests from a small fixed set (``GraftConfig.verify_widths``, e.g.
``(1, 12, 24)``; width 1 is a plain decode step), the one with the most expected tokens per second:

    value(w) = sum over requests of E_i[accept length | w]  /  t(batch-size bucket, w)

* **Gain, in the calibrated currency.** ``E_i[accept | w] = 1 + c * gain_i(w)`` where ``gain_i(w)``
  is the sum of the calibrated estimates of the ``w - 1`` best candidates of the request's last
  speculative round (`graft_spec.merge.merge_select`'s gain curve, priced for every width from one
  candidate pool; `graft_spec.pipeline.RoundStats.expected`; a request without one yet gets the mean
  of the observed curves, an exact mean over the first rounds: a plain round prices nothing, so a
  prior of "no gain" would never be revised), and ``c`` the running ratio of observed accepted
  nodes to the gain each speculative round was *chosen* on. The curve a round is chosen on is an
  earlier round's, and rounds are chosen where it is high, so on top of a biased calibration ``c``
  also corrects that lag and that selection bias (compared with the round's own curve instead, the
  budget kept choosing 24-wide rounds at near break-even). A request that opted out of speculation
  gains 1 whatever ``w``.
* **Cost, measured on the serving device.** ``t(bucket, w)``: the median of the last `TIME_WINDOW`
  wall times of rounds run at width ``w`` with a batch in the same power-of-two size bucket, measured
  by the engine adapter between round launches (no device read: under the overlap scheduler the
  launch period is the round time). A median, not a moving average: a launch-to-launch time
  sometimes spans an idle gap or a first-use warm-up, and one such sample must not price a width
  out for the rest of a run. A (bucket, width) with fewer than
  ``min_samples`` measurements is priced by a cost model fitted on all the others
  (`BatchBudget.cost_model`: the bucket's plain-round time + a draft cost + a verify cost per extra
  token), so a new batch size is not explored width by width: the base width is measured in every
  bucket, further widths only until the model can be fitted, and after that a width runs when its
  predicted value wins (and is then measured). A width that is not the current best is re-measured
  once every ``explore_every`` rounds of the bucket if its value is within ``explore_margin`` of
  the best's, or, whatever its value, once it has not run for ``explore_stale`` rounds of the
  bucket; such a stale width's earlier times are dropped for the fresh one. Without that, a width
  priced by times from another phase of the load (a first use, a busy machine) would never be
  measured again: plain rounds priced high kept a batch at width 12 for good where plain ones were
  faster, and a wide width is the only source of fresh evidence for its correction.
* **Static shapes.** The width is uniform over the batch and comes from a fixed set, so each width
  is one CUDA-graph capture set (built at startup by the engine adapter); per-request allocation
  inside a round is by selection (a request whose candidates are worth little gets padding, which
  costs the same compute). Ragged per-request widths (SGLang's ``supports_ragged_verify``) are not
  used: SGLang 0.5.23 wires them for DSPARK only.

Source: the batch as one budgeted super-tree is ECHO's idea (arXiv 2604.09603, SGLang PR #33295);
switching the verify shape per round reuses SGLang's adaptive runtime states
(``speculative/adaptive_runtime_state.py``), which SGLang itself only uses for chains.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, Hashable, Optional, Sequence, Tuple

import numpy as np

from .config import BatchBudgetConfig

__all__ = ["BatchBudget", "size_bucket"]

#: bounds of the observed / predicted correction factor
_CORRECTION_RANGE = (0.2, 1.5)
#: weight of the newest round in the correction factor and in the mean gain curve
_GAIN_EMA = 0.05
#: pseudo accepted nodes at the global correction behind every per-(bucket, width) correction
_WIDTH_PSEUDO_NODES = 8.0
#: Round times kept per (batch-size bucket, width); their median is the width's cost.
TIME_WINDOW = 16
#: per round since a request's gain curve was observed, the weight left on it against the mean curve
_STALE_DECAY = 0.9
#: speculative request-rounds over which the correction's evidence weight ramps from 0 to 1: the
#: first rounds are priced by a calibrator at its priors, and their promise says nothing about the
#: calibrator that follows (a correction frozen low by cold rounds, refreshed only by speculative
#: rounds, would keep a request plain for good)
_WARM_REQUEST_ROUNDS = 128
#: pseudo accepted nodes at ratio 1 behind the global correction
_GLOBAL_PSEUDO_NODES = 2.0


def _shrunk_ratio(predicted: float, observed: float, pseudo: float, prior: float) -> float:
    """Observed / predicted accepted nodes with ``pseudo`` nodes at ratio ``prior``, clamped to
    ``_CORRECTION_RANGE``."""
    lo, hi = _CORRECTION_RANGE
    return float(min(hi, max(lo, (observed + pseudo * prior) / (predicted + pseudo))))


def _add_evidence(sums: Tuple[float, float], predicted: float, observed: float) -> Tuple[float, float]:
    """Decayed sums (predicted, observed) with a request-round added: the newest ~1 / _GAIN_EMA
    request-rounds weigh most."""
    return (1 - _GAIN_EMA) * sums[0] + predicted, (1 - _GAIN_EMA) * sums[1] + observed


def size_bucket(batch_size: int) -> int:
    """The power of two >= ``batch_size`` (round times are kept per bucket)."""
    return 1 << max(0, int(batch_size) - 1).bit_length()


@dataclass
class _Timing:
    window: Deque[float]
    samples: int = 0                # measurements in all (a restart keeps the count)
    last_round: int = 0
    seconds: float = 0.0            # median of the window (0 before any sample), kept by `add`

    def add(self, seconds: float) -> None:
        """One measured round; the median is recomputed here, once, not on every read."""
        self.window.append(seconds)
        self.samples += 1
        self.seconds = statistics.median(self.window)   # a few floats: no array round trip

    def restart(self) -> None:
        """Drop the window's measurements (they describe an earlier phase of the load); the next
        `add` alone sets the median. The count stays: a width measured ``min_samples`` times is
        priced by its own times, not explored again in a burst."""
        self.window.clear()


@dataclass
class _Choice:
    width: int
    batch_size: int
    reason: str                      # "explore", "best", "opt-out", "schedule", "fixed", or a plain() reason
    values: Dict[int, float] = field(default_factory=dict)


class BatchBudget:
    """Host-side chooser of each decode round's verify width (pure Python / numpy, no device).

    Args:
        widths: the allowed per-request verify widths, strictly increasing, root included.
        config: `BatchBudgetConfig` (exploration and averaging).
    Raises:
        ValueError: empty or unsorted ``widths``, or a ``config.schedule`` width outside them.
    """

    def __init__(self, widths: Sequence[int], config: Optional[BatchBudgetConfig] = None):
        widths = tuple(int(w) for w in widths)
        if not widths or list(widths) != sorted(set(widths)) or widths[0] < 1:
            raise ValueError(f"BatchBudget: widths={list(widths)} must be strictly increasing, >= 1")
        self.widths = widths
        self.config = config or BatchBudgetConfig()
        if set(self.config.schedule) - set(widths):
            raise ValueError(f"BatchBudget: schedule={list(self.config.schedule)} has widths outside {list(widths)}")
        self._col = {w: i for i, w in enumerate(widths)}
        self._timing: Dict[Tuple[int, int], _Timing] = {}
        self._rounds: Dict[int, int] = {}
        self._curve: Dict[Hashable, np.ndarray] = {}
        self._mean_curve = np.ones(len(widths))   # population mean of the observed curves
        self._mean_n = 0
        self._predicted = 0.0         # decayed sum of predicted accepted nodes (bonus excluded) per request-round
        self._age: Dict[Hashable, int] = {}          # per request: rounds since its curve was observed
        self._by_width: Dict[Tuple[int, int], Tuple[float, float]] = {}   # (bucket, width): chosen-on, observed
        # per request: ((bucket, width), gain) its pending speculative rounds were chosen on
        self._decided: Dict[Hashable, Deque[Tuple[Tuple[int, int], float]]] = {}
        self._observed = 0.0
        self.rounds_by_width: Dict[int, int] = {w: 0 for w in widths}
        self.rounds_by_reason: Dict[str, int] = {}
        #: wall seconds spent and tokens emitted per (batch-size bucket, width): what a width's rounds
        #: realised at each batch size (`summary` also sums them per width)
        self.seconds_by_bucket: Dict[Tuple[int, int], float] = {}
        self.tokens_by_bucket: Dict[Tuple[int, int], int] = {}
        self.last: Optional[_Choice] = None
        self._scheduled = 0           # rounds taken from ``config.schedule``
        self._model: Optional[Tuple[float, float]] = None
        self._model_dirty = False
        self._catch_up: Dict[int, _Timing] = {}   # bucket -> deferred catch-up seconds per plain round
        self.catch_up_seconds = 0.0

    # ------------------------------------------------------------------ decisions
    @property
    def correction(self) -> float:
        """Observed / predicted accepted nodes over recent speculative rounds, with
        ``_GLOBAL_PSEUDO_NODES`` at ratio 1 (1 before any); the first ``_WARM_REQUEST_ROUNDS``
        request-rounds enter with a weight ramping from 0 to 1 (the calibrator is still at its priors)."""
        return _shrunk_ratio(self._predicted, self._observed, _GLOBAL_PSEUDO_NODES, 1.0)

    def width_correction(self, bucket: int, width: int) -> float:
        """The correction of rounds at ``width`` for batches in ``bucket``: their own observed /
        chosen-on nodes, shrunk toward the global `correction` by ``_WIDTH_PSEUDO_NODES`` pseudo
        nodes. Per width because the rounds a width is chosen for differ: on sampled chat a 24-wide
        round realised 38 tokens/s against 51 for plain ones while 12-wide ones realised 75."""
        pred, obs = self._by_width.get((bucket, width), (0.0, 0.0))
        return _shrunk_ratio(pred, obs, _WIDTH_PSEUDO_NODES, self.correction)

    def expected_accept(self, rids: Sequence[Hashable], speculate: Sequence[bool],
                        bucket: Optional[int] = None) -> np.ndarray:
        """``float64[B, W]``: each request's expected accept length at every width, corrected by
        `width_correction` for ``bucket`` (None: by the global `correction`)."""
        out = np.ones((len(rids), len(self.widths)))
        c = np.array([self.correction if bucket is None else self.width_correction(bucket, w) for w in self.widths])
        for i, (rid, spec) in enumerate(zip(rids, speculate)):
            if spec:
                curve = self._gain_curve(rid)
                out[i] = 1.0 + c * np.maximum(curve - 1.0, 0.0)
        out[:, [self._col[w] for w in self.widths if w <= 1]] = 1.0
        return out

    def choose(self, rids: Sequence[Hashable], speculate: Optional[Sequence[bool]] = None) -> int:
        """The verify width of the next round for a batch of these requests.

        Args:
            rids: request ids of the batch, row order.
            speculate: per request False = opted out of speculation (default all True).
        Returns:
            one of `widths`.
        """
        speculate = [True] * len(rids) if speculate is None else [bool(s) for s in speculate]
        for rid in rids:
            if rid in self._age:
                self._age[rid] += 1
        if not self.config.enabled and any(speculate):   # fixed N (a plain round only for opted-out batches)
            return self._pick(self.widths[-1], len(rids), "fixed")
        width = self._choose(rids, speculate)
        if width > 1:  # what this decision expects, for the correction (`observe`)
            col, key = self._col[width], (size_bucket(len(rids)), width)
            for rid, spec in zip(rids, speculate):
                gain = float(self._gain_curve(rid)[col]) - 1.0 if spec else 0.0
                self._decided.setdefault(rid, deque()).append((key, max(gain, 0.0)))
        return width

    def _gain_curve(self, rid: Hashable) -> np.ndarray:
        """The request's last observed gain curve, moved toward the population mean by
        ``_STALE_DECAY`` per round since it was observed: a curve is refreshed only by a speculative
        round, so without the decay a request whose last tree was poor stays at width 1 for good."""
        own = self._curve.get(rid)
        if own is None:
            return self._mean_curve
        return self._mean_curve + (own - self._mean_curve) * _STALE_DECAY ** self._age.get(rid, 0)

    def _choose(self, rids: Sequence[Hashable], speculate: Sequence[bool]) -> int:
        bs = len(rids)
        if not any(speculate):
            return self._pick(self.widths[0], bs, "opt-out")
        if self.config.schedule:
            self._scheduled += 1
            return self._pick(self.config.schedule[(self._scheduled - 1) % len(self.config.schedule)], bs, "schedule")
        bucket = size_bucket(bs)
        r = self._rounds[bucket] = self._rounds.get(bucket, 0) + 1
        cfg = self.config
        base = self.widths[0]
        if self._time(bucket, base).samples < cfg.min_samples:      # the base width first (cheap)
            return self._pick(base, bs, "explore")
        model = self.cost_model()
        if model is None:  # not enough measured widths to predict one: measure this bucket's own
            pending = [w for w in reversed(self.widths) if self._time(bucket, w).samples < cfg.min_samples]
            if pending:
                return self._pick(min(pending, key=lambda w: self._time(bucket, w).samples), bs, "explore")
        gains = self.expected_accept(rids, speculate, bucket).sum(axis=0)
        values = {w: float(gains[self._col[w]] / max(self.cost(bucket, w, model), 1e-9)) for w in self.widths}
        best = max(self.widths, key=lambda w: (values[w], -w))
        if r % cfg.explore_every == 0:
            near = [w for w in self.widths if w != best and (values[w] >= (1.0 - cfg.explore_margin) * values[best]
                                                            or self._stale(self._time(bucket, w), r))]
            if near:
                stale = min(near, key=lambda w: self._time(bucket, w).last_round)
                return self._pick(stale, bs, "explore", values)
        return self._pick(best, bs, "best", values)

    def plain(self, batch_size: int, reason: str) -> int:
        """Width 1 for a round the engine must run plain whatever the gains (``reason``: e.g. a
        request that needs the engine's exact decode step); counted like a chosen round."""
        return self._pick(self.widths[0], batch_size, reason)

    def cost(self, bucket: int, width: int, model: Optional[Tuple[float, float]] = None) -> float:
        """Seconds of one round at ``width`` for a batch in ``bucket``: the median of its own
        measurements once it has ``min_samples``, else the `cost_model` prediction from the bucket's
        base-width time (0 when neither exists). The base width itself is always priced by its own
        measurements, however few. A plain (width-1) round also owes its share of the deferred draft
        catch-up (`catch_up_time`)."""
        t = self._time(bucket, width)
        base = self._time(bucket, self.widths[0])
        owed = self._owed(bucket) if width == 1 else 0.0   # the draft extends a plain round defers
        if width == self.widths[0] or t.samples >= self.config.min_samples or model is None or not base.samples:
            return t.seconds + owed   # the base width is always its own measurement (never the model's)
        draft, per_token = model
        return base.seconds + (draft if self.widths[0] == 1 else 0.0) + per_token * bucket * (width - self.widths[0])

    def cost_model(self) -> Optional[Tuple[float, float]]:
        """``(draft seconds, verify seconds per extra token)``: the least-squares fit, over every
        measured (bucket, width > base) pair, of ``t(bucket, w) - t(bucket, base) = draft +
        per_token * bucket * (w - base)`` (``draft`` is 0 when the base width drafts too; both >= 0).
        None until two distinct token counts are measured (one cannot separate the two terms). One
        width measured on a small batch prices every batch size, so a bucket is not explored width
        by width (a wide round at a large batch costs several plain ones)."""
        if self._model_dirty:
            self._model_dirty = False
            self._model = None
            base, need = self.widths[0], self.config.min_samples
            x, y = [], []
            for (bucket, w), t in self._timing.items():
                b0 = self._timing.get((bucket, base))
                if w != base and t.samples >= need and b0 is not None and b0.samples >= need:
                    x.append(float(bucket * (w - base)))
                    y.append(t.seconds - b0.seconds)
            if len(set(x)) >= 2:   # closed-form least squares (runs every round: no numpy call)
                through_zero = (sum(a * b for a, b in zip(x, y)) / sum(a * a for a in x), 0.0)   # no draft term
                per_token, draft = through_zero
                if base == 1:
                    mx, my = sum(x) / len(x), sum(y) / len(y)
                    per_token = (sum((a - mx) * (b - my) for a, b in zip(x, y))
                                 / sum((a - mx) ** 2 for a in x))
                    draft = my - per_token * mx
                    if per_token < 0:
                        per_token, draft = 0.0, my
                    if draft < 0:
                        per_token, draft = through_zero
                self._model = (max(float(draft), 0.0), max(float(per_token), 0.0))
        return self._model

    def _pick(self, width: int, bs: int, reason: str, values: Optional[dict] = None) -> int:
        self.last = _Choice(width, bs, reason, values or {})
        self.rounds_by_width[width] += 1
        self.rounds_by_reason[reason] = self.rounds_by_reason.get(reason, 0) + 1
        return width

    def _owed(self, bucket: int) -> float:
        """Deferred catch-up seconds per plain round for ``bucket``: the median of its last
        `TIME_WINDOW` catch-ups once ``min_samples`` are measured, else 0. A catch-up is measured
        only after plain rounds, so a slow first one (a first use) priced into plain rounds at once
        could keep the budget from ever running plain rounds again to replace it."""
        t = self._catch_up.get(bucket)
        return t.seconds if t is not None and t.samples >= self.config.min_samples else 0.0

    def _stale(self, t: _Timing, now: int) -> bool:
        """Whether the width timed by ``t`` has not run for ``explore_stale`` rounds of its bucket
        (``now``: the bucket's round count)."""
        return now - t.last_round >= self.config.explore_stale

    def _time(self, bucket: int, width: int) -> _Timing:
        t = self._timing.get((bucket, width))
        if t is None:
            t = self._timing[(bucket, width)] = _Timing(deque(maxlen=TIME_WINDOW))
        return t

    # ------------------------------------------------------------------ measurements
    def round_time(self, width: int, batch_size: int, seconds: float) -> None:
        """A measured round: ``width`` per request, ``batch_size`` requests, ``seconds`` of wall time
        (launch to next launch)."""
        if width not in self._col or seconds <= 0:
            return
        bucket = size_bucket(batch_size)
        t = self._time(bucket, width)
        now = self._rounds.get(bucket, 0)
        if t.samples and self._stale(t, now):
            t.restart()   # re-measured after a long pause: the fresh time replaces the earlier ones
        t.add(float(seconds))
        self.seconds_by_bucket[(bucket, width)] = self.seconds_by_bucket.get((bucket, width), 0.0) + float(seconds)
        self._model_dirty = True
        t.last_round = now

    def catch_up_time(self, batch_size: int, rounds: int, seconds: float) -> None:
        """A deferred draft catch-up (sglang_patch/deferred_draft.py) of ``batch_size`` requests that
        covered ``rounds`` plain rounds took ``seconds``. It is kept out of the round times (the
        caller starts the round's clock after it) and charged to plain rounds instead: it is work
        those plain rounds deferred, while it runs before the first drafting round after them and
        was timed as part of that round. Per plain round it is charged as a stretch as long as the
        window (``max(widths)`` rounds, the most a request waits) pays it, whatever it covered: a
        catch-up is mostly one draft extend's fixed cost, so a plain round between speculative ones
        pays a whole extend, and charging that would make plain rounds dearer the more the budget
        speculated. A choice of width 1 is a choice to leave speculation, and leaving it makes the
        stretch."""
        if rounds <= 0 or seconds <= 0:
            return
        bucket = size_bucket(batch_size)
        t = self._catch_up.get(bucket)
        if t is None:
            t = self._catch_up[bucket] = _Timing(deque(maxlen=TIME_WINDOW))
        t.add(float(seconds) / max(rounds, self.widths[-1]))   # as a full stretch pays it
        self.catch_up_seconds += float(seconds)

    def observe(self, rids: Sequence[Hashable], expected: Optional[np.ndarray],
                accept_lens: Sequence[int], width: Optional[int] = None) -> None:
        """A verified round's host results.

        Args:
            rids: the round's request ids (row order).
            expected: ``float[B, W + 1]`` `RoundStats.expected` (expected accept length at every width,
                then at the width verified), or None for a plain round.
            accept_lens: per request the tokens the round emitted (bonus included).
            width: the round's verify width (its tokens are counted in ``tokens_by_bucket`` for the
                batch-size bucket of ``len(accept_lens)`` requests; None = not counted).
        """
        if width in self._col:
            key = (size_bucket(len(accept_lens)), width)
            self.tokens_by_bucket[key] = self.tokens_by_bucket.get(key, 0) + int(sum(accept_lens))
        if expected is None:
            return
        expected = np.asarray(expected, dtype=np.float64)
        for i, rid in enumerate(rids):
            curve = expected[i, : len(self.widths)]
            self._curve[rid] = curve
            self._age[rid] = 0
            # an exact mean over the first 1 / _GAIN_EMA curves, a moving average after: starting
            # an EMA at "no gain" kept new requests at width 1, where no curve is ever observed
            self._mean_n += 1
            self._mean_curve += max(1.0 / self._mean_n, _GAIN_EMA) * (curve - self._mean_curve)
            # the correction compares the observed nodes with the gain the width was *chosen* on (the
            # request's curve of an earlier round), which also carries the lag of that curve and the
            # selection bias of choosing on it; the round's own curve where no decision was recorded
            decided = self._decided.get(rid)
            key, predicted = decided.popleft() if decided else (None, max(expected[i, -1] - 1.0, 0.0))
            observed = max(accept_lens[i] - 1, 0)
            w = min(1.0, self._mean_n / _WARM_REQUEST_ROUNDS)              # evidence weight (warm-up ramp)
            self._predicted, self._observed = _add_evidence((self._predicted, self._observed),
                                                            w * predicted, w * observed)
            if key is not None:
                self._by_width[key] = _add_evidence(self._by_width.get(key, (0.0, 0.0)), w * predicted, w * observed)

    @staticmethod
    def _per_width(by_bucket: Dict[Tuple[int, int], float], width: int) -> float:
        """A per-(bucket, width) count summed over the buckets, for ``width`` (0 when it never ran)."""
        return sum(v for (_, w), v in by_bucket.items() if w == width)

    def forget(self, rid: Hashable) -> None:
        """Drop a finished request's gain curve."""
        self._curve.pop(rid, None)
        self._decided.pop(rid, None)
        self._age.pop(rid, None)

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict:
        """The ``/server_info`` view: widths, rounds per width and per reason, wall seconds spent and
        tokens emitted per width and per batch-size bucket x width (``"16x12"``; their ratio: the
        realised tokens/s of the budget's choices, at each batch size apart), the
        last choice, the corrections (global and per bucket x width), the measured round times
        (ms) per batch-size bucket and width and the fitted `cost_model` (ms; None before it fits)."""
        times: Dict[str, Dict[str, float]] = {}
        for (bucket, w), t in sorted(self._timing.items()):
            if t.samples:
                times.setdefault(str(bucket), {})[str(w)] = round(t.seconds * 1e3, 3)
        last = self.last
        model = self.cost_model()
        return {"widths": list(self.widths), "rounds_by_width": {str(k): v for k, v in self.rounds_by_width.items()},
                "rounds_by_reason": dict(self.rounds_by_reason),
                "seconds_by_width": {str(w): round(self._per_width(self.seconds_by_bucket, w), 3)
                                     for w in self.widths},
                "tokens_by_width": {str(w): self._per_width(self.tokens_by_bucket, w) for w in self.widths},
                "seconds_by_bucket_width": {f"{b}x{w}": round(v, 3)
                                            for (b, w), v in sorted(self.seconds_by_bucket.items())},
                "tokens_by_bucket_width": {f"{b}x{w}": v for (b, w), v in sorted(self.tokens_by_bucket.items())},
                "last_width": last.width if last else None, "last_batch_size": last.batch_size if last else None,
                "last_batch_tokens": last.width * last.batch_size if last else None,
                "last_reason": last.reason if last else None, "correction": round(self.correction, 4),
                "width_correction": {f"{b}x{w}": round(self.width_correction(b, w), 4)
                                     for (b, w) in sorted(self._by_width)},
                "round_ms": times, "tracked_requests": len(self._curve),
                "catch_up_ms_per_plain_round": {str(b): round(self._owed(b) * 1e3, 3) for b in sorted(self._catch_up)},
                "catch_up_seconds": round(self.catch_up_seconds, 3),
                "cost_model": (None if model is None else
                               {"draft_ms": round(model[0] * 1e3, 3), "per_token_ms": round(model[1] * 1e3, 4)})}
