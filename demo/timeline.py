"""What the demo observed over time: the pair's status (from the API) and the engine's own
counters (GetStats), sampled once a second, plus the marks the demo itself sets (drift starts)."""

from __future__ import annotations

import calendar
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from specpair._proto import engine_pb2, engine_pb2_grpc


@dataclass
class Sample:
    t: float
    version: str                       # what the engine reports it serves ("" when unreachable)
    speculating: bool | None
    counters: dict[str, tuple[int, int]]   # category -> cumulative (drafted, accepted)
    phase: str
    serving_version: str
    live_acceptance: float | None       # what the operator computed for its window


@dataclass
class Timeline:
    samples: list[Sample] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)     # the demo's own steps
    history: list[dict[str, Any]] = field(default_factory=list)      # the pair's status.history

    def mark(self, label: str) -> None:
        self.marks.append((time.time(), label))

    def acceptance_points(self, bin_seconds: float = 4.0) -> list[tuple[float, float, int, str]]:
        """(time, acceptance, drafted tokens, version) per bin, from counter differences.
        A counter that went down is a new pod: differences restart from its first sample."""
        points: list[tuple[float, float, int, str]] = []
        bin_start, drafted, accepted, version = None, 0, 0, ""
        for prev, cur in zip(self.samples, self.samples[1:]):
            if not cur.version or prev.version != cur.version:
                # Another pod (or none): a bin never mixes two releases.
                if drafted:
                    points.append(((bin_start + prev.t) / 2, accepted / drafted, drafted, version))
                bin_start, drafted, accepted = None, 0, 0
                continue
            d = a = 0
            for cat, (cd, ca) in cur.counters.items():
                pd, pa = prev.counters.get(cat, (0, 0))
                if cd < pd:          # restarted pod
                    pd, pa = 0, 0
                d, a = d + cd - pd, a + ca - pa
            if bin_start is None:
                bin_start = prev.t
            drafted, accepted, version = drafted + d, accepted + a, cur.version
            if cur.t - bin_start >= bin_seconds:
                if drafted:
                    points.append(((bin_start + cur.t) / 2, accepted / drafted, drafted, version))
                bin_start, drafted, accepted = cur.t, 0, 0
        if drafted and bin_start is not None:     # the last, partial bin (the final answers)
            points.append(((bin_start + self.samples[-1].t) / 2, accepted / drafted, drafted, version))
        return points

    def speculation_off_spans(self) -> list[tuple[float, float]]:
        """(start, end) of each stretch where the serving pod said it was not speculating (the
        operator's SpeculationOff, between its probes). Unreachable samples neither start nor end
        a stretch: a pod being replaced says nothing about speculation."""
        spans: list[tuple[float, float]] = []
        start = last = None
        for s in self.samples:
            if not s.version or s.speculating is None:
                continue
            if s.speculating is False:
                start = s.t if start is None else start
                last = s.t
            elif start is not None:
                spans.append((start, s.t))
                start = None
        if start is not None:
            spans.append((start, last))
        return spans

    def history_events(self) -> list[tuple[float, str, dict[str, Any]]]:
        out = []
        for h in self.history:
            try:
                t = calendar.timegm(time.strptime(h["time"][:19], "%Y-%m-%dT%H:%M:%S"))
            except (KeyError, ValueError):
                continue
            out.append((float(t), h.get("action", ""), h))
        return out


class Sampler:
    """Samples the pair's status and the serving pod's counters once a period. `address` is
    asked every time: a restarted or rolled pod has another pod IP."""

    def __init__(self, timeline: Timeline, address: Callable[[], str | None],
                 read_pair: Callable[[], dict[str, Any] | None], period: float = 1.0):
        self.timeline, self.address, self.read_pair, self.period = timeline, address, read_pair, period
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="timeline", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(5)

    def _loop(self) -> None:
        channel, at = None, None
        try:
            while not self.stop_event.is_set():
                try:
                    address = self.address()
                except Exception:  # noqa: BLE001 - the API may be busy; sample without the engine
                    address = None
                if address != at:
                    if channel is not None:
                        channel.close()
                    channel = grpc.insecure_channel(address) if address else None
                    at = address
                self.take(engine_pb2_grpc.EngineStub(channel) if channel is not None else None)
                self.stop_event.wait(self.period)
        finally:
            if channel is not None:
                channel.close()

    def take(self, stub: Any) -> None:
        try:
            obj = self.read_pair() or {}
        except Exception:  # noqa: BLE001
            obj = {}
        status = obj.get("status") or {}
        version, speculating, counters = "", None, {}
        if stub is not None:
            try:
                stats = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=2)
                version, speculating = stats.version, stats.speculating
                counters = {cat: (int(c.cumulative.num_draft_tokens), int(c.cumulative.num_accepted_tokens))
                            for cat, c in stats.categories.items()}
            except grpc.RpcError:
                pass  # no pod yet, or one being replaced
        self.timeline.samples.append(Sample(time.time(), version, speculating, counters, status.get("phase", ""),
                                            str(status.get("servingVersion", "")), status.get("acceptance")))
        if status.get("history"):
            self.timeline.history = list(status["history"])
