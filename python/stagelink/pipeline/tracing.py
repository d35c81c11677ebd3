"""The coordinator's end of a pipeline's traces: it asks every stage process for the spans it
recorded (protocol.TraceAsk, every `every_s` while tracing, and once more at shutdown), estimates
each process's clock offset from the same exchange, and hands the spans to the writers
(stagelink.trace: a Chrome trace file, OpenTelemetry).

Clocks: processes on the coordinator's host share its CLOCK_MONOTONIC (the same boot id): no
offset. For a process on another host each exchange is an NTP-style sample: the coordinator sends
at t0, the process receives at t1 and answers at t2, the answer arrives at t3; the offset is
((t1 - t0) + (t2 - t3)) / 2 and its error at most half the round trip (t3 - t0) - (t2 - t1). The
sample with the smallest round trip so far is kept (tens of microseconds on a LAN)."""
from __future__ import annotations

import os
import queue
import socket
import threading
import time
from typing import Dict, List, Optional, Tuple

from .. import trace as _trace
from . import protocol as proto
from .spec import COORDINATOR


class TraceGatherer:
    def __init__(self, sinks: list, every_s: float = 1.0):
        self.sinks = sinks
        self.every_s = every_s
        self.boot = _trace.boot_id()
        self.clock: Dict[str, Tuple[int, int]] = {}  # process -> (round trip, offset) of its best sample
        self.label = f"{socket.gethostname()}, pid {os.getpid()}"
        self.seq = 0
        self.next_at = 0.0
        self.spans = 0  # spans written (every process)
        self.closed = False
        self.lock = threading.Lock()
        # The writers run on a thread of their own: encoding and writing spans (or an exporter's
        # HTTP call) must not hold up the coordinator's receive loop.
        self._q: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._write, name="stagelink-trace-writer", daemon=True)
        self._thread.start()

    def due(self, now: float) -> bool:
        if now < self.next_at:
            return False
        self.next_at = now + self.every_s
        return True

    def ask(self) -> proto.TraceAsk:
        self.seq += 1
        return proto.TraceAsk(self.seq, time.monotonic_ns())

    def offset(self, proc: str) -> int:
        c = self.clock.get(proc)
        return c[1] if c is not None else 0

    def report(self, msg: proto.TraceReport, t3: int) -> None:
        with self.lock:
            if msg.boot and msg.boot == self.boot:
                self.clock[msg.proc] = (0, 0)
            elif msg.seq and msg.t0 and msg.t1 and msg.t2:
                rtt = (t3 - msg.t0) - (msg.t2 - msg.t1)
                best = self.clock.get(msg.proc)
                if rtt >= 0 and (best is None or rtt < best[0]):
                    self.clock[msg.proc] = (rtt, ((msg.t1 - msg.t0) + (msg.t2 - t3)) // 2)
            self._add(msg.proc, msg.spans, self.offset(msg.proc), msg.label)

    def local(self) -> None:
        """This process's own spans (the coordinator's, and its relays' and connectors')."""
        with self.lock:
            self._add(COORDINATOR, _trace.drain(), 0, self.label)

    def _add(self, proc: str, spans: list, offset: int, label: str) -> None:
        if not spans or self.closed:
            return
        self.spans += len(spans)
        self._q.put((proc, spans, offset, label))

    def _write(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            for s in self.sinks:
                try:
                    s.add(*item)
                except Exception as e:  # noqa: BLE001  a collector gone must not stop the pipeline
                    print(f"stagelink: trace export to {type(s).__name__} failed: {e!r}")

    def clocks(self) -> Dict[str, dict]:
        """Per process: its clock offset to the coordinator's and the bound on its error (ns)."""
        with self.lock:
            return {p: {"offset_ns": off, "error_ns": rtt // 2, "same_host": rtt == 0 and off == 0}
                    for p, (rtt, off) in self.clock.items()}

    def close(self) -> None:
        if self.closed:
            return
        self.local()
        self.closed = True
        self._q.put(None)
        self._thread.join()  # every span written before the files close
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001
                print(f"stagelink: closing trace export {type(s).__name__} failed: {e!r}")


def make_sinks(path: Optional[str], otel) -> List:
    """The writers of `Pipeline(trace=path, otel=...)`: otel True (OTLP, configured by the
    OTEL_EXPORTER_OTLP_* variables) or a SpanExporter of the caller's."""
    sinks: list = []
    if path:
        sinks.append(_trace.ChromeTraceWriter(os.fspath(path)))
    if otel:
        sinks.append(_trace.OtelExport(None if otel is True else otel))
    return sinks
