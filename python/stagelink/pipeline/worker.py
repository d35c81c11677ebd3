"""A stage process: runs the stages of one `process` group of a pipeline.

Started by the coordinator as ``python -m stagelink.pipeline._entry SPEC.json PROCESS DIR``. One
thread receives control messages (ZeroMQ PULL on ``ipc://DIR/PROCESS.sock``); each stage runs its
requests on a pool of ``concurrency`` threads. Payloads between processes move through the relay
(the control message is sent before anything waits on the transfer); between stages of this
process they pass by reference (read-only, as the seed's LOCAL_OBJECT).
"""
from __future__ import annotations

import collections
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Dict, Optional

from .. import _core
from ..control import ControlMessage, Inbox, Outbox
from ..relay import Relay
from . import protocol as proto
from ._readonly import protect, unprotect
from ._wire import from_frame, small_frame
from .. import metrics as _metrics
from .. import trace as _trace
from . import observe
from .router import proc_for
from .spec import COORDINATOR, PipelineConfigError, PipelineSpec
from .stage import _SEEN_WINDOW, StageRuntime

SEND_TIMEOUT_S = 30.0
# Per edge, the hop latencies of the last _LAT_WINDOW messages (a ring: a long-lived pipeline keeps
# a bounded, recent window; stage.py keeps the finished request ids the same way).
_LAT_WINDOW = 20_000

def endpoint(spec: PipelineSpec, sock_dir: str, proc: str, bind: bool = False) -> str:
    """Where process `proc` of the pipeline whose private directory is `sock_dir` receives control
    messages: a shared-memory ring named after the directory (unique per pipeline) by default; a
    ZeroMQ ipc:// socket inside it (`control: ipc`); or tcp://ADDRESS:PORT (`control: tcp`), ADDRESS
    the process's host's (`hosts:`, else control.host) and PORT base_port + its place in file order
    (the coordinator first). With base_port 0, `bind` gives ADDRESS:0 (a free port) and the others
    are what the processes bound: the coordinator's in the spec it hands out, the stage processes'
    as they reported them (`peers`, sent to every process before the first request)."""
    t = spec.control.get("transport", "shm")
    if not bind and proc != COORDINATOR and proc in spec.control.get("peers", {}):
        return spec.control["peers"][proc]  # what it bound (base_port 0), or where it was started again
    if t == "ipc":
        return f"ipc://{sock_dir}/{proc}.sock"
    if t == "tcp":
        if spec.free_ports:
            if bind:
                return f"tcp://{spec.address_of(proc)}:0"
            known = spec.control.get("coordinator") if proc == COORDINATOR else spec.control.get("peers", {}).get(proc)
            if not known:
                raise _core.NotFoundError(f"the control endpoint of process '{proc}' is not known yet "
                                          "(control.base_port 0: stage processes report theirs at start-up)")
            return known
        order = [COORDINATOR] + list(spec.processes())
        return f"tcp://{spec.address_of(proc)}:{int(spec.control['base_port']) + order.index(proc)}"
    # A random word per process (spec.control["shm_names"], made by the coordinator, in the 0700
    # socket directory's spec file): another user who reads the coordinator's inbox name in
    # /dev/shm cannot guess and squat a stage's before that stage creates it.
    word = spec.control.get("shm_names", {}).get(proc, "")
    return f"shm://{os.path.basename(sock_dir)[:40]}-{proc}" + (f"-{word}" if word else "")


def open_inbox(spec: PipelineSpec, sock_dir: str, proc: str, secret: Optional[str]) -> Inbox:
    """Process `proc`'s inbox. With `control: tcp` it is a CURVE server admitting only the
    pipeline's own processes (their public keys are in the spec; `secret` is this one's)."""
    pubs = spec.control.get("curve_public")
    curve = {"secret_key": secret, "public_key": pubs[proc], "allowed_clients": sorted(pubs.values())} if pubs else None
    return Inbox(endpoint(spec, sock_dir, proc, bind=True), curve)


def open_outbox(spec: PipelineSpec, sock_dir: str, me: str, dest: str, secret: Optional[str]) -> Outbox:
    """An outbox from process `me` to process `dest`, a CURVE client expecting `dest`'s key."""
    pubs = spec.control.get("curve_public")
    curve = {"secret_key": secret, "public_key": pubs[me], "server_key": pubs[dest]} if pubs else None
    return Outbox(endpoint(spec, sock_dir, dest), curve)


def keyed_relay(cfg: dict, data_key: Optional[str]) -> dict:
    """A transfer-engine relay config with the pipeline's side-channel key (unless it names its
    own `extra.curve`): only the pipeline's processes reach its side channels."""
    extra = cfg.get("extra") or {}
    if not data_key or cfg.get("backend") != "ucx" or "curve" in extra:
        return cfg
    return dict(cfg, extra=dict(extra, curve={"secret_key": data_key}))


def _relay_bytes(md: dict) -> int:
    """The frame bytes a relay put moved, from its metadata: `size` (shared memory), `data_size`
    (the transfer engine, vLLM-Omni's name), else the payload's data (`transfer_info.size`)."""
    n = md.get("size") or md.get("data_size")
    if not isinstance(n, int):
        ti = md.get("transfer_info")
        n = ti.get("size") if isinstance(ti, dict) else 0
    return int(n) if isinstance(n, int) else 0


class Worker:
    def __init__(self, spec: PipelineSpec, proc: str, sock_dir: str, keys: Optional[dict] = None):
        self.spec, self.proc, self.dir = spec, proc, sock_dir
        keys = keys or {}
        self.secret = keys.get("control")  # this process's CURVE secret key (control: tcp)
        self.data_key = keys.get("data")  # the side-channel key of the pipeline's transfer-engine relays
        self.names = spec.processes()[proc]
        self.aborted: collections.OrderedDict = collections.OrderedDict()
        self.stages: Dict[str, StageRuntime] = {}
        self.relays: Dict[str, Relay] = {}  # by config: edges with the same config share one
        self.edge_relay: Dict[tuple, Relay] = {}
        self.outboxes: Dict[str, Outbox] = {}
        self.out_lock = threading.Lock()
        self.relay_lock = threading.Lock()
        self.stats_lock = threading.Lock()
        self.edges: Dict[str, observe.EdgeCounts] = {}  # by "SRC->DST", the edges it receives on
        self.inbox: Optional[Inbox] = None
        self.inline_limit = int(spec.settings.get("inline_bytes", 16384))
        self.host = spec.host_of(proc)
        # Stage replicas (router.py): each process group's processes, and the route of each
        # request this process saw (the replicas its messages go to), a bounded window.
        self.group_procs = {g: spec.group_procs(g) for g in spec.groups()}
        self.replicated = spec.replicated
        self.routes: collections.OrderedDict = collections.OrderedDict()

    # -- plumbing
    def relay(self, src: str, dst: str) -> Relay:
        r = self.edge_relay.get((src, dst))
        if r is None:
            r = self.edge_relay[(src, dst)] = self._relay_for(src, dst)
        return r

    def _relay_for(self, src: str, dst: str) -> Relay:
        cfg = keyed_relay(self.spec.relay_at(self.proc, src, dst), self.data_key)
        key = json.dumps(cfg, sort_keys=True)
        r = self.relays.get(key)
        if r is None:
            # Under a lock: two threads creating the same relay would leave one unreferenced,
            # and its close on collection would free puts that readers still need.
            with self.relay_lock:
                r = self.relays.get(key)
                if r is None:
                    r = self.relays[key] = Relay(cfg)
        return r

    def proc_of(self, stage: str, rid: str = "") -> str:
        """The process that runs `stage` for request `rid` (its route's replica)."""
        if not self.replicated:
            return COORDINATOR if stage == COORDINATOR else self.spec.stages[stage].process
        return proc_for(self.spec, self.group_procs, stage, self.routes.get(rid), rid)

    def learn_route(self, rid: str, md) -> None:
        """Keep the route a request's message carries (replicated pipelines only)."""
        route = md.get("route") if isinstance(md, dict) else None
        if isinstance(route, dict) and rid not in self.routes:
            self.routes[rid] = route
            if len(self.routes) > _SEEN_WINDOW:
                self.routes.popitem(last=False)

    def _with_route(self, rid: str, md: dict) -> dict:
        route = self.routes.get(rid) if self.replicated else None
        if route is not None:
            md["route"] = route
        return md

    def send(self, proc: str, msg: ControlMessage):
        with self.out_lock:
            ob = self.outboxes.get(proc)
            if ob is None:
                ob = self.outboxes[proc] = open_outbox(self.spec, self.dir, self.proc, proc, self.secret)
            ob.send(msg, timeout=SEND_TIMEOUT_S)

    def _edge(self, src, dst) -> observe.EdgeCounts:
        k = f"{src}->{dst}"
        e = self.edges.get(k)
        if e is None:
            with self.stats_lock:  # made once per edge; counted without a lock after
                e = self.edges.get(k)
                if e is None:
                    e = self.edges[k] = observe.EdgeCounts(self.spec.name, k, _LAT_WINDOW)
        return e

    def _put(self, rid, src, dst, obj, tp=None, chunk=None):
        """(metadata, body, traceparent) of a control message carrying `obj`: small native payloads
        inside the message (body), the rest through the relay (metadata). Traced (`tp`, the stage
        run's context): a span "put" ("put_chunk" for stream chunk `chunk`), whose context the
        message carries, so that the receiver's get is its child and the trace draws the hop."""
        t = time.monotonic_ns()
        sp = _trace.span("put" if chunk is None else "put_chunk", "stage", tp, rid, stage=src, to=dst,
                         flow_out=True, **({} if chunk is None else {"chunk": chunk})) if tp else _trace.NO_SPAN
        obj = unprotect(obj)  # a zero_copy input passed on: a plain tensor again
        body = small_frame(obj, self.inline_limit)
        if body is not None:
            sp.end(bytes=len(body), path="inline")
            return self._with_route(rid, {"t_ns": t}), body, sp.traceparent
        # Credits per receiving process: a slow replica holds back only its own edge.
        edge = self.proc_of(dst, rid) if self.replicated and dst != COORDINATOR else dst
        op = self.relay(src, dst).put_async(obj, request_id=rid, edge=edge, traceparent=sp.traceparent)
        md = dict(op.metadata)
        md["t_ns"] = t
        if sp is not _trace.NO_SPAN:
            sp.end(bytes=_relay_bytes(md), path="relay")
        return self._with_route(rid, md), None, sp.traceparent

    def read(self, src, dst, kind, item, t_ns, zero_copy=False, tp=None, rid="", chunk=None):
        """The payload a message carried: `kind` obj (by reference), body (a frame), relay (metadata;
        `zero_copy`: read-only views holding the relay slot until dropped). Traced (`tp`, the
        message's context: the sender's put): a span "get" ("get_chunk"), the end of the hop's arrow."""
        if kind == "early":  # copied out of the relay on arrival, counted then (StageRuntime.take_early)
            return item
        sp = _trace.NO_SPAN
        if tp and kind != "obj":
            sp = _trace.span("get" if chunk is None else "get_chunk", "stage", tp, rid, stage=dst, frm=src,
                             flow_in=_trace.flow_from(tp), path=kind, **({} if chunk is None else {"chunk": chunk}))
        if kind == "obj":
            obj = item
        elif kind == "body":
            obj = from_frame(item)
        else:
            obj = self.relay(src, dst).get_async(item, zero_copy=zero_copy, traceparent=sp.traceparent,
                                                 request_id=rid or None).result()
            if zero_copy:  # torch tensors over read-only shared memory: in-place ops raise, not SIGSEGV
                obj = protect(obj)
        sp.end()
        # A hop's latency is two readings of CLOCK_MONOTONIC, which only one machine shares:
        # across hosts it would be the difference of two boot times. Not measured there.
        self._edge(src, dst).count(len(item) if kind == "body" else _relay_bytes(item) if kind == "relay" else 0,
                                   time.monotonic_ns() - t_ns if self.same_host(src) else None)
        return obj

    def same_host(self, stage: str) -> bool:
        """Whether `stage` (or the coordinator) runs on this process's host."""
        return self.spec.stage_host(stage) == self.host

    def discard(self, src, dst, md):
        try:
            self.relay(src, dst).get_async(md, timeout=0)
        except _core.StagelinkError:
            pass

    # -- sending
    def send_data(self, rid, src, dst, obj, tp=None):
        if self.proc_of(dst, rid) == self.proc:
            t = time.monotonic_ns()
            self.read(src, dst, "obj", None, t)
            self.stages[dst].deliver_data(rid, src, obj, tp)
            return
        md, body, mtp = self._put(rid, src, dst, obj, tp)
        self.send(self.proc_of(dst, rid), ControlMessage("data_ready", rid, from_stage=src, to_stage=dst, metadata=md,
                                                         body=body, traceparent=mtp))

    def send_stream(self, rid, src, dst, cid, chunk, tp=None):
        st = self.stages.get(src)
        if st is not None:
            st.m_chunks.inc()
        if dst != COORDINATOR and self.proc_of(dst, rid) == self.proc:
            self.stages[dst].deliver_stream(rid, src, cid, "obj", chunk, False, "", time.monotonic_ns(), tp)
            return
        md, body, mtp = self._put(rid, src, dst, chunk, tp, chunk=cid)
        self.send(self.proc_of(dst, rid), ControlMessage("stream", rid, from_stage=src, to_stage=dst, metadata=md,
                                                         chunk_id=cid, body=body, traceparent=mtp))

    def send_stream_signal(self, rid, src, dst, cid, error, tp=None):
        if dst != COORDINATOR and self.proc_of(dst, rid) == self.proc:
            self.stages[dst].deliver_stream(rid, src, cid, "obj", None, True, error, time.monotonic_ns(), tp)
            return
        md = self._with_route(rid, {"t_ns": time.monotonic_ns()}) if self.replicated else None
        self.send(self.proc_of(dst, rid), ControlMessage("stream", rid, from_stage=src, to_stage=dst, chunk_id=cid,
                                                         is_done=True, error=error or None, metadata=md,
                                                         traceparent=tp))

    def send_result(self, rid, src, obj, tp=None):
        md, body, mtp = self._put(rid, src, COORDINATOR, obj, tp)
        self.send(COORDINATOR, ControlMessage("complete", rid, from_stage=src, to_stage=COORDINATOR, metadata=md,
                                              body=body, traceparent=mtp))

    def send_failure(self, rid, src, tb, tp=None):
        self.send(COORDINATOR, ControlMessage("complete", rid, from_stage=src, to_stage=COORDINATOR,
                                              error=tb[-60000:], traceparent=tp))

    # -- the receive loop
    def start(self, progress=None):
        """Bind the inbox, build the stages (`progress(stage)` before each: the coordinator's
        start-up timeout names what is still being built) and make every relay."""
        self.inbox = open_inbox(self.spec, self.dir, self.proc, self.secret)
        for n in self.names:
            if progress is not None:
                progress(n)
            try:
                self.stages[n] = StageRuntime(self.spec.stages[n], self)
            except PipelineConfigError as e:  # say which stage, where the message does not
                if f"'{n}'" not in str(e):
                    raise PipelineConfigError(f"stage '{n}': {e}") from None
                raise
        for n in self.names:  # every relay this process uses, before any request
            s = self.spec.stages[n]
            for src in s.sources + s.stream_sources + ([COORDINATOR] if n == self.spec.entry else []):
                self.relay(src, n)
            for dst in s.next + s.stream_to + ([COORDINATOR] if s.terminal else []):
                self.relay(n, dst)

    def sender_infos(self) -> list:
        """[src, dst, info] for each edge this process sends on whose relay a receiver connects to
        (UCX: its side channel's host and port); the coordinator hands them to the receivers."""
        out = []
        for n in self.names:
            s = self.spec.stages[n]
            for dst in s.next + s.stream_to + ([COORDINATOR] if s.terminal else []):
                info = self.relay(n, dst).sender_info()
                if info:
                    out.append([n, dst, info])
        return out

    def connect_relays(self, edges: list, timeout: float) -> list:
        """Connect the relays of the edges this process receives on to their senders ([src, dst,
        info] each), so the first request pays no connection set-up. Returns the errors, as text."""
        errors = []
        deadline = time.monotonic() + timeout
        for src, dst, info in edges:
            try:
                self.relay(src, dst).connect(info, timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # noqa: BLE001  reported to the coordinator, which fails the start
                errors.append(f"edge {src} -> {dst} (sender {info}): {type(e).__name__}: {e}")
        return errors

    def handle(self, m: ControlMessage) -> bool:
        t = m.type
        if self.replicated and t in ("submit", "data_ready", "stream"):
            self.learn_route(m.request_id, m.metadata)
        if t in ("submit", "data_ready"):
            st = self.stages.get(m.to_stage)
            if st is None:
                return True
            if m.request_id in self.aborted or m.request_id in st.finished:
                if not m.body:
                    self.discard(m.from_stage, m.to_stage, m.metadata)
                return True
            kind, item = ("body", m.body) if m.body else ("relay", m.metadata)
            md = m.metadata if isinstance(m.metadata, dict) else {}
            try:
                obj = self.read(m.from_stage, m.to_stage, kind, item, int(md.get("t_ns", 0) or 0), st.spec.zero_copy,
                                m.traceparent, m.request_id)
            except (_core.StagelinkError, ValueError, TypeError) as e:
                # Metadata the relay cannot use, a payload gone or damaged: that request fails
                # (named, with why); the receive loop goes on at once.
                self.send_failure(m.request_id, m.to_stage, f"stage {m.to_stage}: its input from {m.from_stage} "
                                                            f"could not be read: {type(e).__name__}: {e}")
                return True
            st.deliver_data(m.request_id, m.from_stage, obj, m.traceparent)
        elif t == "stream":
            st = self.stages.get(m.to_stage)
            if st is None:
                return True
            md = m.metadata
            t_ns = int(md.get("t_ns", 0)) if isinstance(md, dict) else time.monotonic_ns()
            kind, item = ("body", m.body) if m.body else ("relay", md) if not m.is_done else ("obj", None)
            if kind == "relay" and isinstance(md, dict) and not m.is_done and st.take_early(
                    m.request_id, _relay_bytes(md)):
                try:
                    item, kind = self.read(m.from_stage, m.to_stage, "relay", md, t_ns, False, m.traceparent,
                                           m.request_id, int(m.chunk_id or 0)), "early"
                except (_core.StagelinkError, ValueError, TypeError) as e:
                    self.send_failure(m.request_id, m.to_stage, f"stage {m.to_stage}: a stream chunk from "
                                                                f"{m.from_stage} could not be read: "
                                                                f"{type(e).__name__}: {e}")
                    return True
            if not st.deliver_stream(m.request_id, m.from_stage, int(m.chunk_id or 0), kind, item, m.is_done,
                                     m.error or "", t_ns, m.traceparent) and kind == "relay" and md is not None:
                self.discard(m.from_stage, m.to_stage, md)
        elif t == "abort":
            if m.traceparent:
                _trace.instant("abort", "stage", m.traceparent, m.request_id, process=self.proc)
            self.aborted[m.request_id] = True
            self.routes.pop(m.request_id, None)
            if len(self.aborted) > _SEEN_WINDOW:
                self.aborted.popitem(last=False)
            for st in self.stages.values():
                st.abort(m.request_id)
            for r in list(self.relays.values()):
                r.cleanup(m.request_id)
            self.send(COORDINATOR, ControlMessage("abort_ack", m.request_id, from_stage=self.proc))
        else:
            return self.handle_lifecycle(proto.decode(m))
        return True

    def handle_lifecycle(self, msg) -> bool:
        """A lifecycle message from the coordinator (protocol.py); False: shut down."""
        if isinstance(msg, proto.Peers):
            # control.base_port 0: every process's endpoint, before the first request; later, the
            # endpoint of a process started again (a restart, Pipeline.scale)
            peers = self.spec.control.setdefault("peers", {})
            for proc, ep in msg.peers.items():
                if peers.get(proc) != ep:
                    peers[proc] = ep
                    with self.out_lock:
                        old = self.outboxes.pop(proc, None)
                    if old is not None:
                        old.close()
            self.send(COORDINATOR, proto.PeersKnown(self.proc).encode())
        elif isinstance(msg, proto.Connect):  # transfer-engine relays: connect to their senders now
            errors = self.connect_relays(msg.edges, msg.timeout_s)
            self.send(COORDINATOR, proto.Connected(self.proc, errors).encode())
        elif isinstance(msg, proto.MetricsAsk):  # a scrape of the pipeline's /metrics
            for name, st in self.stages.items():
                observe.STAGE_IN_FLIGHT.set(name, value=len(st.reqs))
            self.send(COORDINATOR, proto.MetricsReport(self.proc, msg.seq, _metrics.collect()).encode())
        elif isinstance(msg, proto.TraceAsk):  # tracing: the spans so far, and this process's clock
            self.send(COORDINATOR, self.trace_report(msg.seq, msg.t0, time.monotonic_ns()).encode())
        elif isinstance(msg, proto.Shutdown):
            return False
        return True

    def trace_report(self, seq: int = 0, t0: int = 0, t1: int = 0) -> proto.TraceReport:
        spans = _trace.drain()
        return proto.TraceReport(self.proc, seq, t0, t1, time.monotonic_ns() if seq else 0, _trace.boot_id(),
                                 f"{socket.gethostname()}, pid {os.getpid()}", spans)

    def stats(self) -> dict:
        with self.stats_lock:
            edges = {k: v.figures() for k, v in list(self.edges.items())}
            refused = self.inbox.refused if self.inbox is not None and not self.inbox.closed else 0
            return {"process": self.proc, "pid": os.getpid(), "edges": edges, "control_refused": refused,
                    "stages": {n: {"runs": s.runs, "busy_s": s.busy_ns / 1e9, "inline_runs": s.inline_runs}
                               for n, s in self.stages.items()},
                    "relays": self.relay_figures()}

    def relay_figures(self) -> list:
        """Per relay of this process: its edges, puts and gets, and for a transfer engine how its
        gets reached their senders (connected ahead, over UCX, over the side channel)."""
        out = []
        for r in self.relays.values():
            h = r.health()
            c = h.get("connector") or {}
            f = {"edges": sorted(f"{s}->{d}" for (s, d), x in self.edge_relay.items() if x is r),
                 "backend": h.get("backend"), "puts": h.get("puts", 0), "gets": h.get("gets", 0)}
            f.update({k: c[k] for k in ("connects", "gets_over_ucx", "gets_over_side_channel") if k in c})
            out.append(f)
        return out

    def shutdown(self):
        deadline = time.monotonic() + self.spec.settings["shutdown_timeout_s"]
        for st in self.stages.values():
            for r in list(st.reqs.values()):
                with st.lock:
                    r.aborted = True
                    r.cond.notify_all()
            st.pool.shutdown(wait=False, cancel_futures=True)
        for st in self.stages.values():  # in-flight work ends (aborted above) before the relays go
            for th in list(getattr(st.pool, "_threads", ())):
                th.join(max(0.0, deadline - time.monotonic()))


class _StartProgress:
    """Tells the coordinator, while this process builds its stages, which stage it is building
    and which module the build is importing (sampled once a second from the main thread's stack),
    so that a start-up timeout says what was slow. The first report starts the coordinator's
    start-up clock for this process."""

    def __init__(self, coord: Outbox, proc: str):
        self.coord, self.proc = coord, proc
        self.stage = ""
        self.sent = None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.main = threading.get_ident()
        self.thread = threading.Thread(target=self._watch, name="stagelink-start-progress", daemon=True)

    def __call__(self, stage: str):
        self.stage = stage
        self._send()
        if not self.thread.is_alive():
            self.thread.start()

    def _importing(self) -> str:
        f = sys._current_frames().get(self.main)
        mod = ""
        while f is not None:  # the innermost module body running is what is being imported
            if f.f_code.co_name == "<module>":
                mod = f.f_globals.get("__name__") or f.f_code.co_filename
                break
            f = f.f_back
        if mod in ("__main__", "stagelink.pipeline._entry"):  # no import running: the factory itself
            return ""
        return str(mod)

    def _send(self):
        msg = proto.Progress(self.proc, self.stage, self._importing())
        with self.lock:
            if msg == self.sent or self.stop.is_set():
                return
            self.sent = msg
            try:
                self.coord.send(msg.encode(), timeout=5)
            except _core.StagelinkError:
                pass

    def _watch(self):
        while not self.stop.wait(1.0):
            self._send()

    def close(self):
        with self.lock:
            self.stop.set()
        # Joined, not left running: a daemon thread still holding the outbox at exit made
        # nanobind report it leaked on the way out of a start that failed.
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(5.0)


# The thread pools of the numeric libraries a stage may load (OpenMP under torch and numpy's BLAS).
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def effective_cpus() -> int:
    """CPUs this process may use: its affinity, bounded by a cgroup v2 CPU quota."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def share_cpus(spec: PipelineSpec, proc: str) -> int:
    """Give each numeric library of this stage process a share of the host's CPUs: the CPUs over
    the processes of the pipeline on this host (the coordinator counted on its own), at least 1.
    Left alone where the environment (the coordinator's, the host's or the stage's `env`) names a
    count. Each process sizing its OpenMP pool to the whole machine made every one spin-wait on
    every core after each torch op: with three stage processes on two cores, a stage making a 1 MiB
    tensor spent 1.2 ms of CPU per request, 80% of it OpenMP threads waiting for work."""
    host = spec.host_of(proc)
    here = sum(1 for p in spec.initial_processes() if spec.host_of(p) == host) + (0 if host else 1)
    n = max(1, effective_cpus() // max(1, here))
    for var in _THREAD_VARS:
        os.environ.setdefault(var, str(n))
    return n


def _die_with_parent():
    try:  # PR_SET_PDEATHSIG: the coordinator's death (even SIGKILL) ends this process
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def remote_args(proc: str) -> list:
    """The arguments of `python -m stagelink.pipeline._entry` for a process on another host. The
    spec travels on its stdin (`remote_spec_line`), never on the command line: it holds the
    stages' and hosts' `env`, stage `args` and connector `extra` with `${VAR}` expanded (a Redis
    password), which any user of either host reads in /proc/*/cmdline of `ssh` and the stage."""
    return ["--remote", "-", proc]


def remote_spec_line(spec: PipelineSpec, front: list, path: list) -> bytes:
    """The first line of a remote stage process's stdin: the spec and the coordinator's import
    path (`front`: the directories of the stages' own modules; `path`: its sys.path), as JSON."""
    return json.dumps({"spec": spec.to_dict(), "front": front, "path": path}).encode() + b"\n"


#: The exit status of a stage process whose stdin brought no key: the coordinator says why.
EXIT_NO_STDIN = 78
NO_STDIN = ("stdin was closed at start-up: the host's launch prefix must forward stdin (ssh does, unless -n; docker "
            "exec needs -i), which brings the process its CURVE key and tells it when the coordinator is gone")


def _read_keys(spec: PipelineSpec) -> dict:
    """This process's CURVE secret keys ({"control": ..., "data": ...}): the first line of its
    stdin, written by the coordinator (never on a command line, in the environment or a file)."""
    if not spec.control.get("keys_on_stdin"):
        return {}
    try:
        keys = json.loads(sys.stdin.buffer.readline())
        if not isinstance(keys, dict):
            raise ValueError
    except ValueError:
        print(f"stagelink worker: {NO_STDIN}", file=sys.stderr)
        sys.exit(EXIT_NO_STDIN)
    return keys


def _watch_stdin(gone: threading.Event):
    """A process started on another host ends when its stdin reaches end of file: the coordinator
    holds the other end (through `ssh`, or whatever `launch` is), so its exit, even by SIGKILL, or
    its killing the launcher, closes it. It reads the descriptor itself, not sys.stdin: a daemon
    thread blocked inside sys.stdin's buffer holds its lock, and the interpreter's exit, which
    flushes that buffer, then aborts the process ("could not acquire lock ... at interpreter
    shutdown": SIGABRT instead of a clean exit)."""
    def run():
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        gone.set()
    threading.Thread(target=run, name="stagelink-stdin-watch", daemon=True).start()


def raise_nofile() -> int:
    """Raise this process's soft limit on open descriptors to its hard limit (the soft one is 1024
    under many service managers) and return it. A stage process holds sockets to every peer,
    shared-memory mappings and whatever its stages open; a stranger's half-open connections must
    not run it out. Out of descriptors all the same, an open fails with EMFILE naming itself,
    and no reaper takes that for a dead process (proc_alive: unknown is alive)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if want == resource.RLIM_INFINITY:  # the kernel's own ceiling (fs.nr_open) bounds it
        try:
            with open("/proc/sys/fs/nr_open") as f:
                want = int(f.read())
        except (OSError, ValueError):
            want = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            return want
        except (ValueError, OSError):
            pass
    return soft


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    raise_nofile()
    gone = threading.Event()  # the coordinator is gone
    if argv and argv[0] == "--remote":
        _, _stdin, proc = argv
        try:  # the spec is the first line of stdin (remote_spec_line), the keys the second
            d = json.loads(sys.stdin.buffer.readline())
            if not isinstance(d, dict) or not isinstance(d.get("spec"), dict):
                raise ValueError
        except ValueError:
            print(f"stagelink worker: {NO_STDIN}", file=sys.stderr)
            sys.exit(EXIT_NO_STDIN)
        spec, sock_dir = PipelineSpec.from_dict(d["spec"]), ""
        # The coordinator's import path, where its directories exist here: the stages' own
        # directories in front, the rest behind this interpreter's own (another host's Python
        # may differ, and must keep its own standard library first).
        sys.path[:0] = [p for p in dict.fromkeys(d["front"]) if os.path.isdir(p) and p not in sys.path]
        sys.path.extend(p for p in dict.fromkeys(d["path"]) if os.path.isdir(p) and p not in sys.path)
        keys = _read_keys(spec)
        _watch_stdin(gone)
    else:
        spec_path, proc, sock_dir = argv
        with open(spec_path) as f:
            spec = PipelineSpec.from_dict(json.load(f))
        keys = _read_keys(spec)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the coordinator's to handle
    # SIGTERM (systemd stops a unit's whole cgroup, `kill`): leave as on shutdown, freeing the
    # inbox and relay memory, instead of dying with them left in /dev/shm. Waits run handlers.
    terminated = []

    def _on_term(signum, frame):
        terminated.append(signum)
        raise _Terminated()
    signal.signal(signal.SIGTERM, _on_term)
    sys.setswitchinterval(0.0002)  # a thread woken by a message gets the GIL in 0.2 ms, not 5
    ppid = os.getppid()
    os.environ.update(spec.env_of(proc))  # before any stage, torch or UCX reads it
    share_cpus(spec, proc)
    w = Worker(spec, proc, sock_dir, keys)
    if spec.control.get("trace"):  # the pipeline traces (some of) its requests: keep their spans
        _trace.set_recording(True)
    coord = open_outbox(spec, sock_dir, proc, COORDINATOR, keys.get("control"))
    progress = _StartProgress(coord, proc)
    try:
        w.start(progress)
        progress.close()
        if gone.is_set():  # /dev/null, or a launcher that does not forward it: it would end at once
            raise RuntimeError(NO_STDIN)
    except BaseException as e:  # noqa: BLE001  reported to the coordinator, which rolls back
        progress.close()
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        coord.send(proto.StartFailed(proc, tb).encode(), timeout=5)
        coord.close()
        return 1
    coord.send(proto.Ready(proc, w.inbox.endpoint, w.sender_infos(), os.getpid()).encode(), timeout=5)
    orphaned = False
    try:
        while not terminated:
            try:
                m = w.inbox.recv(timeout=1.0)
            except _Terminated:
                break
            except _core.TimeoutError:
                if os.getppid() != ppid or gone.is_set():  # orphaned (the coordinator is gone)
                    orphaned = True
                    break
                continue
            except _core.CorruptError as e:
                print(f"stagelink worker {proc}: dropped a malformed control message: {e}", file=sys.stderr)
                continue
            try:
                if not w.handle(m):
                    break
            except _Terminated:
                break
            except Exception:  # noqa: BLE001  one bad message must not end the process
                print(f"stagelink worker {proc}: handling {m.type} of '{m.request_id}':\n{traceback.format_exc()}",
                      file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, lambda *_: terminated.append(signal.SIGTERM))  # a second one: keep cleaning
        w.shutdown()
        try:
            if not orphaned and not terminated:  # nobody would read the figures: do not wait to send them
                if spec.control.get("trace"):  # the last spans, before the figures the coordinator waits for
                    coord.send(w.trace_report().encode(), timeout=5)
                coord.send(proto.Stats(proc, w.stats()).encode(), timeout=5)
        except _core.StagelinkError:
            pass
        for r in w.relays.values():
            r.close()
        for ob in w.outboxes.values():
            ob.close()
        coord.close()
        w.inbox.close()
    return 128 + signal.SIGTERM if terminated else 0


class _Terminated(BaseException):
    """Raised by the SIGTERM handler to end the receive loop (not an Exception: stage code's
    `except Exception` must not swallow it)."""


if __name__ == "__main__":
    sys.exit(main())
