"""The pipeline runtime's control protocol: every message the coordinator and the stage processes
exchange, one wire type per meaning, each decoded here and nowhere else.

Requests (SGLang-Omni's message names; ControlMessage as it is, the hot path):

    submit      coordinator -> entry stage    a request: its payload in `body` or by relay (`metadata`)
    data_ready  stage -> stage                a payload for the next stage
    stream      stage -> stage / coordinator  a chunk (`chunk_id`), or the end of a stream (`is_done`)
    complete    terminal stage -> coordinator a result, or `error`: the request failed at `from_stage`
    abort       coordinator -> every process  drop the request everywhere
    abort_ack   stage process -> coordinator  done here

The runtime's lifecycle (typed below; decode() turns a ControlMessage into one of them):

    Progress    stage process -> coordinator  building stage X, importing module Y (start-up)
    Ready       stage process -> coordinator  started: its control endpoint and relay senders
    StartFailed stage process -> coordinator  could not start: the traceback
    Peers       coordinator -> stage process  every process's control endpoint (base_port 0)
    PeersKnown  stage process -> coordinator  it has them
    Connect     coordinator -> stage process  connect these relays to their senders now
    Connected   stage process -> coordinator  done; the edges it could not connect, as text
    Stats       stage process -> coordinator  at shutdown: its figures
    MetricsAsk  coordinator -> stage process  send your metrics now (a scrape of the pipeline's /metrics)
    MetricsReport stage process -> coordinator  its metrics tree's samples, answering MetricsAsk `seq`
    TraceAsk    coordinator -> stage process  send your trace spans now, and your clock (tracing on)
    TraceReport stage process -> coordinator  its spans, and its clock readings answering TraceAsk `seq`
    Shutdown    coordinator -> stage process  stop after in-flight work
    Launch      launcher -> its agent on a node  start this process: its spec and secrets (Ray)

Every lifecycle message is checked field by field when decoded: a field of the wrong kind raises
CorruptError naming it (the receive loops drop such a message and go on).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, List, Optional, Union

from .. import _core
from ..control import ControlMessage
from ._wire import from_frame, to_frame
from .spec import COORDINATOR




def _bad(m: ControlMessage, what: str) -> _core.CorruptError:
    return _core.CorruptError(f"control message '{m.type}' from '{m.from_stage}': {what}")


def _map(m: ControlMessage) -> dict:
    if m.metadata is None:
        return {}
    if not isinstance(m.metadata, dict):
        raise _bad(m, "metadata is not a map")
    return m.metadata


def _field(m: ControlMessage, md: dict, key: str, kind, default=None):
    v = md.get(key, default)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise _bad(m, f"'{key}' is not {getattr(kind, '__name__', kind)}")
    return v


@dataclass(frozen=True)
class Progress:
    """A stage process builds `building` (a stage name) and is importing `importing` (a module;
    empty: running the stage's factory). The first one starts its start-up clock."""
    TYPE: ClassVar[str] = "progress"
    proc: str
    building: str
    importing: str = ""

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=self.proc,
                              metadata={"building": self.building, "importing": self.importing})

    @classmethod
    def decode(cls, m: ControlMessage) -> "Progress":
        md = _map(m)
        return cls(m.from_stage or "", _field(m, md, "building", str, ""), _field(m, md, "importing", str, ""))


@dataclass(frozen=True)
class Ready:
    """A stage process started: where it receives control messages, [src, dst, info] of each
    edge it sends on whose receivers connect to it (transfer-engine side channels), and its pid
    on its host (a launcher that does not start it itself learns it here)."""
    TYPE: ClassVar[str] = "ready"
    proc: str
    endpoint: str
    senders: List[list] = field(default_factory=list)
    pid: int = 0

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=self.proc,
                              metadata={"endpoint": self.endpoint, "senders": list(self.senders), "pid": self.pid})

    @classmethod
    def decode(cls, m: ControlMessage) -> "Ready":
        md = _map(m)
        senders = _field(m, md, "senders", list, [])
        if not all(isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and isinstance(e[1], str)
                   for e in senders):
            raise _bad(m, "'senders' is not a list of [src, dst, info]")
        return cls(m.from_stage or "", _field(m, md, "endpoint", str, ""), senders, _field(m, md, "pid", int, 0))


@dataclass(frozen=True)
class StartFailed:
    """A stage process could not start: `error` is its traceback."""
    TYPE: ClassVar[str] = "ready"  # a `ready` carrying an error, as SGLang-Omni's
    proc: str
    error: str

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=self.proc, error=self.error[-60000:])


@dataclass(frozen=True)
class Peers:
    """Every stage process's control endpoint (control.base_port 0: each bound a free port)."""
    TYPE: ClassVar[str] = "peers"
    peers: Dict[str, str]

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=COORDINATOR, metadata={"peers": dict(self.peers)})

    @classmethod
    def decode(cls, m: ControlMessage) -> "Peers":
        peers = _field(m, _map(m), "peers", dict)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in peers.items()):
            raise _bad(m, "'peers' is not a map of process names to endpoints")
        return cls(peers)


@dataclass(frozen=True)
class PeersKnown:
    TYPE: ClassVar[str] = "peers_known"
    proc: str

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=self.proc)

    @classmethod
    def decode(cls, m: ControlMessage) -> "PeersKnown":
        return cls(m.from_stage or "")


@dataclass(frozen=True)
class Connect:
    """Connect the relays of these edges ([src, dst, sender info] each) within `timeout_s`."""
    TYPE: ClassVar[str] = "connect"
    edges: List[list]
    timeout_s: float

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=COORDINATOR,
                              metadata={"edges": list(self.edges), "timeout_s": float(self.timeout_s)})

    @classmethod
    def decode(cls, m: ControlMessage) -> "Connect":
        md = _map(m)
        edges = _field(m, md, "edges", list)
        if not all(isinstance(e, list) and len(e) == 3 for e in edges):
            raise _bad(m, "'edges' is not a list of [src, dst, info]")
        return cls(edges, float(_field(m, md, "timeout_s", (int, float), 10.0)))


@dataclass(frozen=True)
class Connected:
    TYPE: ClassVar[str] = "connected"
    proc: str
    errors: List[str] = field(default_factory=list)

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=self.proc, metadata={"errors": [str(e) for e in self.errors]})

    @classmethod
    def decode(cls, m: ControlMessage) -> "Connected":
        return cls(m.from_stage or "", [str(e) for e in _field(m, _map(m), "errors", list, [])])


@dataclass(frozen=True)
class Stats:
    """A stage process's figures at shutdown (Worker.stats()), as a native frame (never pickle)."""
    TYPE: ClassVar[str] = "stats"
    proc: str
    figures: dict

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=self.proc, body=to_frame(self.figures))

    @classmethod
    def decode(cls, m: ControlMessage) -> "Stats":
        if not m.body:
            raise _bad(m, "no figures")
        figures = from_frame(m.body)
        if not isinstance(figures, dict):
            raise _bad(m, "its figures are not a map")
        return cls(m.from_stage or "", figures)


@dataclass(frozen=True)
class MetricsAsk:
    TYPE: ClassVar[str] = "metrics_ask"
    seq: int

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=COORDINATOR, metadata={"seq": self.seq})

    @classmethod
    def decode(cls, m: ControlMessage) -> "MetricsAsk":
        return cls(_field(m, _map(m), "seq", int))


@dataclass(frozen=True)
class MetricsReport:
    """A stage process's metrics (stagelink.metrics.collect()), as a native frame (never pickle)."""
    TYPE: ClassVar[str] = "metrics"
    proc: str
    seq: int
    families: list

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=self.proc, metadata={"seq": self.seq},
                              body=to_frame(self.families))

    @classmethod
    def decode(cls, m: ControlMessage) -> "MetricsReport":
        seq = _field(m, _map(m), "seq", int)
        fams = from_frame(m.body) if m.body else None
        if not isinstance(fams, list) or not all(
                isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("labels"), list)
                and isinstance(f.get("samples"), list) and f.get("kind") in ("counter", "gauge", "histogram")
                for f in fams):
            raise _bad(m, "its metrics are not a list of families")
        return cls(m.from_stage or "", seq, fams)


@dataclass(frozen=True)
class TraceAsk:
    """Send the spans recorded since the last ask. `t0`: the coordinator's CLOCK_MONOTONIC when it
    sent this (an NTP-style exchange: the answer's readings give this process's clock offset)."""
    TYPE: ClassVar[str] = "trace"
    seq: int
    t0: int

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=COORDINATOR, metadata={"seq": self.seq, "t0": self.t0})


_SPAN_FIELDS = (("name", str), ("cat", str), ("start_ns", int), ("end_ns", int), ("trace_id", str), ("span_id", str),
                ("parent_id", str), ("request_id", str), ("args", dict), ("tid", int))


@dataclass(frozen=True)
class TraceReport:
    """A stage process's spans (stagelink.trace.drain()) as a native frame, with its clock: `t1` when
    it received TraceAsk `seq` (whose `t0` it echoes), `t2` when it sent this; `boot` its host's boot
    id (the same as the coordinator's: one CLOCK_MONOTONIC, no offset). `seq` 0: sent unasked (at
    shutdown), no clock readings. `label`: its host and pid, for the trace's process names."""
    TYPE: ClassVar[str] = "trace"
    proc: str
    seq: int
    t0: int
    t1: int
    t2: int
    boot: str
    label: str
    spans: list

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=self.proc, body=to_frame(self.spans),
                              metadata={"seq": self.seq, "t0": self.t0, "t1": self.t1, "t2": self.t2,
                                        "boot": self.boot, "label": self.label})

    @classmethod
    def decode(cls, m: ControlMessage) -> Union["TraceAsk", "TraceReport"]:
        md = _map(m)
        if m.from_stage == COORDINATOR:
            return TraceAsk(_field(m, md, "seq", int), _field(m, md, "t0", int))
        spans = from_frame(m.body) if m.body else []
        if not isinstance(spans, list) or not all(
                isinstance(sp, dict) and all(isinstance(sp.get(k), t) for k, t in _SPAN_FIELDS) for sp in spans):
            raise _bad(m, "its spans are not a list of spans")
        return cls(m.from_stage or "", _field(m, md, "seq", int), _field(m, md, "t0", int, 0),
                   _field(m, md, "t1", int, 0), _field(m, md, "t2", int, 0), _field(m, md, "boot", str, ""),
                   _field(m, md, "label", str, ""), spans)


@dataclass(frozen=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, from_stage=COORDINATOR)

    @classmethod
    def decode(cls, m: ControlMessage) -> "Shutdown":
        return cls()


@dataclass(frozen=True)
class Launch:
    """What a launcher's agent on another node (ray_launcher's actor) needs to start process
    `proc`: the lines its stdin begins with (the spec, then the secret keys). Sent only over a
    CURVE socket the agent bound for the launcher's key alone."""
    TYPE: ClassVar[str] = "launch"
    proc: str
    lines: bytes

    def encode(self) -> ControlMessage:
        return ControlMessage(self.TYPE, to_stage=self.proc, body=self.lines)

    @classmethod
    def decode(cls, m: ControlMessage) -> "Launch":
        if not m.to_stage or not m.body:
            raise _bad(m, "no process or no lines")
        return cls(m.to_stage, bytes(m.body))


Lifecycle = Union[Progress, Ready, StartFailed, Peers, PeersKnown, Connect, Connected, Stats, MetricsAsk,
                  MetricsReport, TraceAsk, TraceReport, Shutdown, Launch]

_DECODERS = {c.TYPE: c.decode for c in (Progress, Peers, PeersKnown, Connect, Connected, Stats, MetricsAsk,
                                        MetricsReport, TraceReport, Shutdown, Launch)}

#: The wire types of requests (ControlMessage as it is).
REQUEST_TYPES = frozenset({"submit", "data_ready", "stream", "complete", "abort", "abort_ack"})


def decode(m: ControlMessage) -> Optional[Lifecycle]:
    """The typed lifecycle message `m` is; None for a request message (REQUEST_TYPES) or one this
    runtime does not use (data_ack). Raises CorruptError naming the field at fault."""
    if m.type == "ready":
        return StartFailed(m.from_stage or "", m.error) if m.error else Ready.decode(m)
    d = _DECODERS.get(m.type)
    return d(m) if d is not None else None
