"""Per-request traces: W3C trace context, spans, and the writers that turn them into a trace file
(Chrome JSON: Perfetto, chrome://tracing) or OpenTelemetry spans.

A traced request carries a ``traceparent`` (``00-<trace id>-<parent span id>-01``) in its control
messages and in its relay puts and gets. Every process that records (`set_recording`) keeps
the spans of sampled requests in one buffer in the C++ core, which the connectors and relays fill
too (a connector's ``put``/``get``, a relay's ``credit_wait``); `drain` takes them. The
pipeline runtime gathers every process's spans at the coordinator and writes them::

    with Pipeline.from_yaml("p.yaml", trace="run.trace.json") as p:   # or stagelink run --trace
        p.submit("r1", payload).result()
    # open run.trace.json in https://ui.perfetto.dev or chrome://tracing

Outside a pipeline (a process that uses connectors itself)::

    stagelink.trace.set_recording(True)
    with stagelink.trace.span("my-step", "app", parent=None) as s:    # a new sampled trace
        relay.put_async(x, request_id="r1", traceparent=s.traceparent)
    spans = stagelink.trace.drain()
    stagelink.trace.write_chrome("out.json", spans)

Times are CLOCK_MONOTONIC nanoseconds (``time.monotonic_ns()``), shared by the processes of a host.
"""
from __future__ import annotations

import importlib
import json
import os
import random
import re
import threading
import time
from typing import Dict, Iterable, List, NamedTuple, Optional

from . import _core

__all__ = ["Context", "parse", "format_traceparent", "new_traceparent", "set_recording", "recording", "span",
           "instant", "record_span", "drain", "ChromeTraceWriter", "write_chrome", "OtelExport", "boot_id"]


class Context(NamedTuple):
    trace_id: int   # 128 bits
    span_id: int    # the parent span (the one that made this context)
    sampled: bool


_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def parse(traceparent: Optional[str]) -> Optional[Context]:
    """A W3C traceparent of version 00, or None for anything else (a receiver ignores it)."""
    m = _TRACEPARENT.fullmatch(traceparent) if isinstance(traceparent, str) else None
    if m is None:
        return None
    tid, sid = int(m.group(1), 16), int(m.group(2), 16)
    if not tid or not sid:
        return None
    return Context(tid, sid, bool(int(m.group(3), 16) & 1))


def format_traceparent(trace_id: int, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def new_id() -> int:
    return _core.trace_new_id()


def new_traceparent(sampled: bool = True) -> str:
    """The context of a new trace's root (its span id is the root span's)."""
    return format_traceparent((new_id() << 64) | new_id(), new_id(), sampled)


def set_recording(on: bool) -> None:
    """Whether this process keeps the spans of sampled requests (off by default)."""
    _core.trace_set_recording(bool(on))


def recording() -> bool:
    return _core.trace_recording()


def boot_id() -> str:
    """This host's boot id: processes that share it share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Span:
    """A span being timed (see `span`): ``traceparent`` is the context its children carry."""
    __slots__ = ("name", "cat", "trace_id", "span_id", "parent_id", "request_id", "args", "start_ns")

    def __init__(self, name, cat, ctx: Context, request_id, args, span_id=None):
        self.name, self.cat, self.request_id, self.args = name, cat, request_id, args
        self.trace_id, self.parent_id = ctx.trace_id, ctx.span_id
        self.span_id = span_id or new_id()
        self.start_ns = time.monotonic_ns()

    @property
    def traceparent(self) -> str:
        return format_traceparent(self.trace_id, self.span_id)

    def end(self, **more) -> None:
        if more:
            self.args = dict(self.args or {}, **more)
        _record(self.name, self.cat, self.start_ns, time.monotonic_ns(), self.trace_id, self.span_id, self.parent_id,
                self.request_id, self.args)

    def __enter__(self):
        return self

    def __exit__(self, et, ev, tb):
        self.end(**({"error": f"{et.__name__}: {ev}"[:500]} if et is not None else {}))


class _NoSpan:
    """What `span` gives for an untraced call: nothing recorded, no context passed on."""
    __slots__ = ()
    traceparent = None

    def end(self, **more):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


NO_SPAN = _NoSpan()


def _record(name, cat, start, end, trace_id, span_id, parent_id, rid, args):
    _core.trace_record(name, cat, start, end, trace_id >> 64, trace_id & 0xFFFFFFFFFFFFFFFF, span_id, parent_id,
                       rid or "", args)


def span(name: str, cat: str, parent: Optional[str], request_id: str = "", **args):
    """A span under ``parent`` (a traceparent; None starts a new sampled trace) when this process
    records and the parent is sampled; else `NO_SPAN`, which costs nothing and passes no
    context on. Use as ``with span(...) as s:`` or ``s = span(...); ...; s.end()``."""
    if not _core.trace_recording():
        return NO_SPAN
    ctx = parse(parent) if parent is not None else Context((new_id() << 64) | new_id(), 0, True)
    if ctx is None or not ctx.sampled:
        return NO_SPAN
    return Span(name, cat, ctx, request_id, args or None)


def instant(name: str, cat: str, parent: Optional[str], request_id: str = "", **args) -> None:
    """A point in time under ``parent`` (an abort, a chunk's arrival), when traced."""
    ctx = parse(parent) if parent is not None and _core.trace_recording() else None
    if ctx is None or not ctx.sampled:
        return
    t = time.monotonic_ns()
    _record(name, cat, t, t, ctx.trace_id, new_id(), ctx.span_id, request_id, dict(args, instant=True))


def record_span(name: str, cat: str, parent: Optional[str], start_ns: int, end_ns: int, request_id: str = "",
                **args) -> None:
    """A span already timed (``start_ns``..``end_ns``, CLOCK_MONOTONIC) under ``parent``, when traced."""
    ctx = parse(parent) if parent is not None and _core.trace_recording() else None
    if ctx is None or not ctx.sampled:
        return
    _record(name, cat, start_ns, end_ns, ctx.trace_id, new_id(), ctx.span_id, request_id, args or None)


def flow_from(traceparent: Optional[str]) -> Optional[str]:
    """The span id (16 hex) a message's traceparent names: the put that sent it, whose arrow
    ("transfer") ends at the get that reads it."""
    ctx = parse(traceparent)
    return f"{ctx.span_id:016x}" if ctx is not None else None


def drain() -> List[dict]:
    """Every span this process recorded since the last drain, as dicts: name, cat, start_ns, end_ns,
    trace_id (32 hex), span_id and parent_id (16 hex; "" for a root), request_id, args, tid."""
    out = []
    for name, cat, s, e, hi, lo, sid, pid, rid, args, tid in _core.trace_drain():
        out.append({"name": name, "cat": cat, "start_ns": s, "end_ns": e, "trace_id": f"{hi:016x}{lo:016x}",
                    "span_id": f"{sid:016x}", "parent_id": f"{pid:016x}" if pid else "", "request_id": rid,
                    "args": args or {}, "tid": tid})
    return out


def sample(rate: float) -> bool:
    """Whether a new request is traced at sampling rate ``rate`` (0..1)."""
    return rate >= 1.0 or (rate > 0.0 and random.random() < rate)


# -- writers

class ChromeTraceWriter:
    """Writes spans as a Chrome trace (JSON array format), which Perfetto and chrome://tracing open:
    one track per process and thread, ``X`` slices for spans, ``i`` marks for instants, and a
    flow arrow ("transfer") from each put to the get that read it.

    Spans arrive per process (`add`) with that process's clock offset to the writer's
    (``offset_ns``: its CLOCK_MONOTONIC minus ours; 0 on this host). Events are appended as they
    come, so a trace cut short (a crash) still opens; `close` ends the array."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "w", encoding="utf-8")
        self._f.write("[\n")
        self._first = True
        self._pids: Dict[str, int] = {}
        self._lock = threading.Lock()
        self.events = 0

    def _emit(self, ev: dict) -> None:
        self._emit_all([ev])

    def _emit_all(self, evs: list) -> None:
        if not evs:
            return
        text = json.dumps(evs, separators=(",", ":"))[1:-1]  # one line per batch
        self._f.write(("" if self._first else ",\n") + text)
        self._first = False
        self.events += len(evs)

    def process(self, proc: str, label: str = "") -> int:
        """The trace's pid of process ``proc`` (named once, with ``label``: host and pid)."""
        pid = self._pids.get(proc)
        if pid is None:
            pid = self._pids[proc] = len(self._pids) + 1
            self._emit({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                        "args": {"name": f"{proc} ({label})" if label else proc}})
            self._emit({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        return pid

    def add(self, proc: str, spans: Iterable[dict], offset_ns: int = 0, label: str = "") -> None:
        with self._lock:
            if self._f is None:
                return
            pid = self.process(proc, label)
            evs = []
            for s in spans:
                args = dict(s.get("args") or {})
                instant_ = args.pop("instant", False)
                flow_in = args.pop("flow_in", None)
                flow_out = args.pop("flow_out", None)
                args.update(request_id=s["request_id"], trace_id=s["trace_id"], span_id=s["span_id"],
                            parent_id=s["parent_id"])
                ts = (s["start_ns"] - offset_ns) / 1e3
                ev = {"name": s["name"], "cat": s["cat"], "pid": pid, "tid": s["tid"], "ts": ts, "args": args}
                if instant_:
                    ev.update(ph="i", s="t")
                else:
                    ev.update(ph="X", dur=max(0.0, (s["end_ns"] - s["start_ns"]) / 1e3))
                evs.append(ev)
                # A hop: the put's slice starts the arrow, the get's ends it (ids: the put's span id).
                if flow_out:
                    evs.append({"ph": "s", "name": "transfer", "cat": "flow", "id": f"0x{s['span_id']}",
                                "pid": pid, "tid": s["tid"], "ts": (s["end_ns"] - offset_ns) / 1e3 - 0.001})
                if flow_in:
                    evs.append({"ph": "f", "bp": "e", "name": "transfer", "cat": "flow", "id": f"0x{flow_in}",
                                "pid": pid, "tid": s["tid"], "ts": ts})
            self._emit_all(evs)
            self._f.flush()

    def close(self) -> None:
        with self._lock:
            if self._f is None:
                return
            self._f.write("\n]\n")
            self._f.close()
            self._f = None


def write_chrome(path: str, spans: Iterable[dict], proc: Optional[str] = None) -> None:
    """Write one process's spans (`drain`) as a Chrome trace."""
    w = ChromeTraceWriter(path)
    try:
        w.add(proc or f"pid {os.getpid()}", spans)
    finally:
        w.close()


class OtelExport:
    """Hands spans to an OpenTelemetry ``SpanExporter`` (``stagelink[otel]``) with their own ids,
    so that a caller's trace (its traceparent given to ``submit``) and stagelink's are one.
    ``exporter``: a SpanExporter; None: OTLP over HTTP, configured by the OTEL_EXPORTER_OTLP_*
    environment variables. Times become epoch nanoseconds (this host's wall clock)."""

    def __init__(self, exporter=None, service_name: str = "stagelink"):
        try:
            from opentelemetry.sdk.resources import Resource
            importlib.import_module("opentelemetry.sdk.trace")
        except ImportError as e:
            raise _core.InvalidArgumentError("OpenTelemetry export needs opentelemetry-sdk: "
                                             "pip install 'stagelink[otel]'") from e
        if exporter is None:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as e:
                raise _core.InvalidArgumentError("OTLP export needs opentelemetry-exporter-otlp-proto-http: "
                                                 "pip install 'stagelink[otel]'") from e
            exporter = OTLPSpanExporter()
        self.exporter = exporter
        self.resource = Resource.create({"service.name": service_name})
        self._wall = time.time_ns() - time.monotonic_ns()

    def add(self, proc: str, spans: Iterable[dict], offset_ns: int = 0, label: str = "") -> None:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, TraceFlags
        from opentelemetry.trace.status import Status, StatusCode
        out = []
        for s in spans:
            tid = int(s["trace_id"], 16)
            ctx = SpanContext(tid, int(s["span_id"], 16), is_remote=False, trace_flags=TraceFlags(1))
            parent = (SpanContext(tid, int(s["parent_id"], 16), is_remote=True, trace_flags=TraceFlags(1))
                      if s["parent_id"] else None)
            args = {k: v for k, v in (s.get("args") or {}).items()
                    if k not in ("flow_in", "flow_out", "instant") and isinstance(v, (str, bool, int, float))}
            attrs = dict(args, **{"stagelink.process": proc, "stagelink.request_id": s["request_id"],
                                  "stagelink.category": s["cat"]})
            err = args.get("error")
            out.append(ReadableSpan(
                name=s["name"], context=ctx, parent=parent, resource=self.resource, attributes=attrs,
                start_time=s["start_ns"] - offset_ns + self._wall, end_time=s["end_ns"] - offset_ns + self._wall,
                status=Status(StatusCode.ERROR, str(err)) if err else Status(StatusCode.UNSET)))
        if out:
            self.exporter.export(out)

    def close(self) -> None:
        try:
            self.exporter.force_flush()
        except Exception:  # noqa: BLE001  an exporter without it, or a collector gone
            pass
        self.exporter.shutdown()


# -- reading a trace back (stagelink trace show)

def load_chrome(path: str) -> List[dict]:
    """The spans of a Chrome trace this module wrote (a trace cut short, without its closing
    bracket, too): dicts of name, cat, proc, tid, ts_us, dur_us, instant, args."""
    with open(path, encoding="utf-8") as f:
        text = f.read().rstrip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    events = json.loads(text)
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    out = []
    for e in events:
        if e.get("ph") in ("X", "i"):
            out.append({"name": e["name"], "cat": e.get("cat", ""), "proc": procs.get(e["pid"], str(e["pid"])),
                        "tid": e.get("tid", 0), "ts_us": float(e["ts"]), "dur_us": float(e.get("dur", 0.0)),
                        "instant": e["ph"] == "i", "args": e.get("args") or {}})
    return out


def requests_of(spans: List[dict]) -> Dict[str, List[dict]]:
    """The spans of each request (by request_id), in start order."""
    per: Dict[str, List[dict]] = {}
    for s in spans:
        per.setdefault(s["args"].get("request_id", ""), []).append(s)
    for v in per.values():
        v.sort(key=lambda s: s["ts_us"])
    per.pop("", None)
    return per


def tree_lines(spans: List[dict]) -> List[tuple]:
    """One request's spans as (depth, span) in tree order (children by start time)."""
    by_id = {s["args"].get("span_id"): s for s in spans}
    kids: Dict[str, list] = {}
    roots = []
    for s in spans:
        p = s["args"].get("parent_id") or ""
        (kids.setdefault(p, []) if p in by_id else roots).append(s)
    out: list = []

    def walk(s, d):
        out.append((d, s))
        for c in kids.get(s["args"].get("span_id"), []):
            walk(c, d + 1)
    for r in roots:
        walk(r, 0)
    return out


_COLOURS = {"request": "#57606a", "run": "#1f6feb", "queue": "#bf8700", "put": "#8250df", "put_chunk": "#8250df",
            "get": "#1a7f37", "get_chunk": "#1a7f37", "relay.credit_wait": "#d1242f"}


def svg_timeline(spans: List[dict], title: str = "") -> str:
    """One request's spans (requests_of()[id]) as an SVG timeline: a lane per process, a row per
    nesting level, each span a bar labelled with its name (what the trace viewer shows, in a file
    the docs can hold)."""
    from html import escape
    spans = [s for s in spans if not s["name"].startswith("connector.")]
    t0 = min(s["ts_us"] for s in spans)
    t1 = max(s["ts_us"] + s["dur_us"] for s in spans)
    width, left, row_h = 960, 110, 18
    scale = (width - left - 10) / max(1.0, t1 - t0)
    # Depth within each process's lane: a span nests under its parent only where that parent is
    # in the same process (a get under its sender's put starts its lane's top row).
    by_id = {s["args"].get("span_id"): s for s in spans}
    depth: Dict[int, int] = {}
    for _, s in tree_lines(spans):
        p = by_id.get(s["args"].get("parent_id"))
        depth[id(s)] = depth.get(id(p), 0) + 1 if p is not None and p["proc"] == s["proc"] else 0
    procs: List[str] = []
    for s in spans:
        p = s["proc"].split(" ")[0]
        if p not in procs:
            procs.append(p)
    lanes, y = {}, 30
    for p in procs:
        rows = 1 + max(depth.get(id(s), 0) for s in spans if s["proc"].split(" ")[0] == p)
        lanes[p] = (y, rows)
        y += rows * row_h + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y + 40}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="8" y="18" font-size="13" font-weight="bold">{escape(title)}</text>']
    for p, (ly, rows) in lanes.items():
        out.append(f'<rect x="0" y="{ly - 3}" width="{width}" height="{rows * row_h + 6}" fill="#f6f8fa"/>')
        out.append(f'<text x="8" y="{ly + 12}" font-weight="bold">{escape(p)}</text>')
    for s in spans:
        ly, _ = lanes[s["proc"].split(" ")[0]]
        x = left + (s["ts_us"] - t0) * scale
        yy = ly + depth.get(id(s), 0) * row_h
        if s["instant"]:
            out.append(f'<path d="M{x:.1f},{yy} l5,8 l-5,8 l-5,-8 z" fill="#d1242f"><title>{escape(s["name"])}'
                       f'</title></path>')
            continue
        w = max(1.0, s["dur_us"] * scale)
        c = _COLOURS.get(s["name"], "#57606a")
        label = s["name"] + (f' {s["args"]["chunk"]}' if "chunk" in s["args"] else "")
        out.append(f'<rect x="{x:.1f}" y="{yy}" width="{w:.1f}" height="{row_h - 3}" fill="{c}" rx="2">'
                   f'<title>{escape(label)}: {s["dur_us"] / 1e3:.3f} ms</title></rect>')
        if w > 7 * len(label):
            out.append(f'<text x="{x + 3:.1f}" y="{yy + 11}" fill="white">{escape(label)}</text>')
    ticks = 5
    for i in range(ticks + 1):
        x = left + (width - left - 10) * i / ticks
        out.append(f'<text x="{x:.1f}" y="{y + 14}" text-anchor="middle" fill="#57606a">'
                   f'{(t1 - t0) * i / ticks / 1e3:.2f} ms</text>')
    lx = left
    for name, c in (("request", "#57606a"), ("queue", "#bf8700"), ("run", "#1f6feb"), ("put", "#8250df"),
                    ("get", "#1a7f37"), ("credit wait", "#d1242f")):
        out.append(f'<rect x="{lx}" y="{y + 22}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{lx + 14}" y="{y + 31}">{name}</text>')
        lx += 30 + 7 * len(name)
    out.append("</svg>")
    return "\n".join(out)
