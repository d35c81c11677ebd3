"""The coordinator: starts a pipeline's stage processes, submits requests, collects results and
stream chunks, aborts, and notices stages that die.

    with stagelink.Pipeline.from_yaml("examples/omni_pipeline.yaml") as p:
        fut = p.submit("req-1", {"audio": samples})
        for chunk in p.stream("req-1"):      # what the terminal stage streams (ctx.stream)
            play(chunk)
        result = fut.result(timeout=60)
"""
from __future__ import annotations

import collections
import dataclasses
import json
import queue
import secrets
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Deque, Dict, List, Optional

from .. import _core
from .. import metrics as _metrics
from .. import trace as _trace
from ..control import ControlMessage, Inbox, Outbox, private_socket_dir, remove_socket_dir
from ..relay import Relay
from . import observe
from . import protocol as proto
from ._wire import from_frame, small_frame
from .launcher import LaunchError, Launcher, StageProcess, make_launcher
from .placement import PlacementError
from .router import Membership, Router, proc_for
from .spec import COORDINATOR, PipelineSpec, load_pipeline
from .stage import _SEEN_WINDOW
from .tracing import TraceGatherer, make_sinks
from .worker import _LAT_WINDOW, EXIT_NO_STDIN, NO_STDIN, _relay_bytes, keyed_relay, open_inbox, open_outbox


class StageError(RuntimeError):
    """A stage raised while handling a request: ``stage`` names it, ``remote_traceback`` is its
    traceback (also the message's tail)."""

    def __init__(self, stage: str, tb: str):
        last = tb.strip().splitlines()[-1] if tb.strip() else "failed"
        super().__init__(f"stage '{stage}' failed: {last}\n--- traceback in stage '{stage}' ---\n{tb}")
        self.stage, self.remote_traceback = stage, tb


class StageDiedError(_core.PeerDeadError):
    """A stage process died; every request in flight fails with this, naming it."""


class PipelineStartError(_core.StagelinkError):
    """A stage process could not start; every process already started was stopped. `config_error`:
    the one-line reason where the pipeline file is at fault (a stage module that cannot be
    imported, a misspelt factory, a factory that needs `args:`), else None."""

    def __init__(self, message: str, config_error: Optional[str] = None):
        super().__init__(message)
        self.config_error = config_error


def config_error_of(tb: str) -> Optional[str]:
    """The message of a PipelineConfigError that ended a stage process's start (its traceback's
    last line), or None where something else did."""
    last = tb.strip().splitlines()[-1] if tb.strip() else ""
    for prefix in ("stagelink.pipeline.spec.PipelineConfigError: ", "PipelineConfigError: "):
        if last.startswith(prefix):
            return last[len(prefix):]
    return None


_END = object()
# Runs of one request at most, where replicas die under it (retry: true).
_MAX_ATTEMPTS = 3


#: Finished request ids remembered (at least the stages' window of ids whose late messages they drop).
_FINISHED_WINDOW = 2 * _SEEN_WINDOW


class _Req:
    __slots__ = ("future", "t0", "t_first", "chunks", "n_chunks", "acks", "done", "on_chunk", "rid", "attempt",
                 "payload", "skip", "base", "gen", "span")

    def __init__(self, rid: str = "", gen: int = 0):
        self.rid = rid        # the caller's request id
        # What its messages carry: the caller's id; "ID#G" where the caller used ID before (its
        # G-th reuse, since the stages drop late messages of ids that finished); "BASE~N" for its
        # run N (retry).
        self.gen = gen
        self.base = rid if not gen else f"{rid}#{gen}"
        self.attempt = 0      # runs again after a replica died (retry: true)
        self.payload = None   # kept for such a run where one may happen
        self.skip = 0         # stream chunks the caller already has from an earlier attempt
        self.future: Future = Future()
        self.t0 = time.monotonic()
        self.t_first: Optional[float] = None
        self.chunks: "queue.Queue" = queue.Queue()
        self.n_chunks = 0
        self.acks: set = set()
        self.done = False
        self.on_chunk = None
        self.span = _trace.NO_SPAN  # traced: its "request" span (submit to end), the parent of the rest


class Pipeline:
    """A running pipeline: one process per ``process`` group of the file's stages.

    ``submit(request_id, payload)`` returns a ``concurrent.futures.Future`` of the terminal
    stage's result; ``stream(request_id)`` iterates what the terminal stage streams;
    ``abort(request_id)`` drops the request everywhere and waits for every process to confirm;
    ``close()`` stops every process and removes every socket and shared-memory slot (also run by
    ``with`` and, as a last resort, at interpreter exit)."""

    def __init__(self, spec: PipelineSpec, *, python: Optional[str] = None, env: Optional[dict] = None,
                 metrics_port: Optional[int] = None, metrics_host: str = "127.0.0.1", trace: Optional[str] = None,
                 trace_sample: Optional[float] = None, otel=None):
        # Its own control settings: with base_port 0 the ports this run got are written there.
        # (and where a placement engine puts each process: its hosts and placement, this run's).
        self.spec = spec = dataclasses.replace(spec, control=dict(spec.control), hosts=dict(spec.hosts),
                                               placed=dict(spec.placed))
        self.settings = spec.settings
        # Traces (trace.py, tracing.py): which requests are traced, and where their spans go.
        self.trace_sample = float(spec.settings.get("trace_sample", 1.0) if trace_sample is None else trace_sample)
        if not 0.0 <= self.trace_sample <= 1.0:
            raise _core.InvalidArgumentError(f"trace_sample must be in [0, 1], got {self.trace_sample}")
        self._tracer: Optional[TraceGatherer] = None
        if trace or otel:
            self._tracer = TraceGatherer(make_sinks(trace, otel))
            spec.control["trace"] = True  # the stage processes keep the spans of traced requests
            _trace.set_recording(True)
        self._lock = threading.Condition()
        self._reqs: Dict[str, _Req] = {}  # by the id its messages carry (its attempt's)
        self._attempt_of: Dict[str, str] = {}  # caller's id -> the id its messages carry, where not its own
        # Caller ids of finished requests -> the reuse count of the last (a window as long as the
        # stages' own window of finished ids, whose late messages they drop).
        self._finished_ids: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._aborting: Dict[str, _Req] = {}  # abort() waiting for acknowledgements
        self._closed = False
        self._broken: Optional[BaseException] = None
        self._procs: Dict[str, StageProcess] = {}  # by the launcher (launcher.py)
        self._members = Membership(spec)  # the stage processes by (group, replica), and the dead
        self._router = Router(self._members)  # which replica runs which request
        self._starting: Dict[str, float] = {}  # processes started while running -> when
        self._held: list = []  # requests to run again once a restarting stage is back
        self._scale_lock = threading.Lock()  # one scale() at a time
        self._retiring: set = set()  # processes scale() told to stop: their exit is no death
        # Requests may run again where a stage marked retry has replicas or restarts: keep payloads.
        self._may_retry = any(s.retry and (max(s.replicas, s.max_replicas) > 1 or s.max_restarts)
                              for s in spec.stages.values())
        self._ready: Dict[str, Optional[str]] = {}
        self._stats: Dict[str, dict] = {}
        self._metrics_seq = 0
        self._metrics_in: Dict[str, tuple] = {}  # process -> (seq, families) of its last MetricsReport
        self._metrics_lock = threading.Lock()  # one gathering at a time
        self.metrics_server: Optional[_metrics.MetricsServer] = None
        # The per-request metrics of this pipeline, found once (no lookup per request).
        self._m_result = {k: observe.REQUESTS.labels(spec.name, k) for k in ("ok", "failed", "aborted")}
        self._m_e2e = observe.REQUEST_SECONDS.labels(spec.name)
        self._m_first = observe.FIRST_CHUNK_SECONDS.labels(spec.name)
        # The terminal stage's edge to this process, counted here as stage processes count theirs.
        self._edge_in = observe.EdgeCounts(spec.name, f"{spec.terminal}->{COORDINATOR}", _LAT_WINDOW)
        self._outboxes: Dict[str, Outbox] = {}
        self._out_lock = threading.Lock()
        # The last settings.completed_window finished requests (request_id, e2e_s, ttfc_s, chunks):
        # a window, so that a long-lived service does not grow by a record per request for ever;
        # completed_count counts them all.
        self.completed: Deque[dict] = collections.deque(maxlen=max(1, int(self.settings["completed_window"])))
        self.completed_count = 0
        self._dir = private_socket_dir(("stagelink-" + "".join(c if c.isalnum() or c in "-_" else "_"
                                                                 for c in spec.name))[:48])
        self._inbox: Optional[Inbox] = None
        self._relay: Optional[Relay] = None     # to the entry stage (requests)
        self._relay_in: Optional[Relay] = None  # from the terminal stage (results, streamed chunks)
        self._thread: Optional[threading.Thread] = None
        self._launcher: Optional[Launcher] = None
        t0 = time.monotonic()
        # Sweep what crashed processes of earlier runs left in shared memory (only the dead's).
        _core.shm_reap("/dev/shm")
        try:
            # First where each process runs: a placement engine (Ray) decides it now, and the
            # relays (`auto`), addresses and keys below depend on it.
            try:
                self._launcher = make_launcher(spec, self._dir, python or sys.executable, env)
            except (LaunchError, PlacementError) as err:
                raise PipelineStartError(str(err)) from None
            # CURVE keys: with control: tcp a key pair per process (the public keys travel in the
            # spec); with transfer-engine edges one key the pipeline's side channels share. Each
            # process gets its secret keys on its stdin.
            self._keys: Dict[str, dict] = {}
            ctl = spec.control.get("transport") == "tcp" and spec.control.get("curve", True)
            data = (_core.curve_keypair()[1] if any(spec.relay_for(a, b).get("backend") == "ucx"
                                                    for a, b, _ in spec.edges()) else None)
            pubs = {}
            for proc in [COORDINATOR] + list(spec.processes()):
                self._keys[proc] = {"data": data}
                if ctl:
                    pubs[proc], self._keys[proc]["control"] = _core.curve_keypair()
            if pubs:
                spec.control["curve_public"] = pubs
            if ctl or data:
                spec.control["keys_on_stdin"] = True
            if spec.control.get("transport", "shm") == "shm":  # unguessable control-ring names
                spec.control["shm_names"] = {p: secrets.token_hex(8) for p in [COORDINATOR] + list(spec.processes())}
            self._inbox = open_inbox(spec, self._dir, COORDINATOR, self._keys[COORDINATOR].get("control"))
            if spec.free_ports:
                spec.control["coordinator"] = self._inbox.endpoint  # the port it got, for the stages
            # Requests go out on the entry's edge, results come in on the terminal stage's: one
            # relay, or two where they differ (`relay: auto` with one end on another host).
            out_cfg = keyed_relay(spec.relay_at(COORDINATOR, COORDINATOR, spec.entry), data)
            in_cfg = keyed_relay(spec.relay_at(COORDINATOR, spec.terminal, COORDINATOR), data)
            self._relay = Relay(out_cfg)
            self._relay_in = self._relay if in_cfg == out_cfg else Relay(in_cfg)
            self._start()
        except BaseException:
            self._teardown(kill=True)
            raise
        self.startup_s = time.monotonic() - t0
        self._thread = threading.Thread(target=self._loop, name="stagelink-coordinator", daemon=True)
        self._thread.start()
        if metrics_port is not None:  # one scrape target for the whole pipeline (metrics())
            try:
                self.metrics_server = _metrics.serve_metrics(metrics_port, metrics_host, source=self.metrics)
            except BaseException:  # the port taken, an address not ours: nothing left running
                self._teardown(kill=True)
                raise

    @classmethod
    def from_yaml(cls, path, **kw) -> "Pipeline":
        """Load, check (PipelineConfigError) and start the pipeline of a YAML file."""
        return cls(load_pipeline(path), **kw)

    from_config = from_yaml  # a dict works too

    # -- start-up and shutdown
    def _start(self):
        self._launcher.refresh()  # the spec is complete now (keys, endpoints, names)
        for proc in self.spec.initial_processes():
            try:
                self._launch(proc)
            except LaunchError as err:
                raise PipelineStartError(str(err)) from None
        # Each process has settings.startup_timeout_s from when it starts building its stages (its
        # first report: importing their modules, torch among them, is most of a start-up) or,
        # until then, from its launch. Reports say which stage it builds and what that imports.
        limit = self.settings["startup_timeout_s"]
        launched = time.monotonic()
        began: Dict[str, float] = {}
        doing: Dict[str, proto.Progress] = {}
        senders: list = []  # [src, dst, sender_info] of the transfer-engine relays, from the processes
        while len(self._ready) < len(self._procs):
            now = time.monotonic()
            late = [p for p in self._procs if p not in self._ready and now - began.get(p, launched) > limit]
            if late:
                raise PipelineStartError("; ".join(self._slow_start(p, doing.get(p), now - began.get(p, launched))
                                                   for p in late) + f" (settings.startup_timeout_s: {limit:g} s)")
            msg = self._recv_lifecycle(0.2, set(self._ready))
            if isinstance(msg, proto.Progress):
                began.setdefault(msg.proc, time.monotonic())
                doing[msg.proc] = msg
            elif isinstance(msg, proto.StartFailed):
                raise PipelineStartError(f"stage process '{msg.proc}' (stages "
                                         f"{self.spec.processes().get(msg.proc)}) could not start:\n{msg.error}",
                                         config_error_of(msg.error))
            elif isinstance(msg, proto.Ready):
                self._ready[msg.proc] = msg.endpoint or None
                self._procs[msg.proc].ready(msg.pid) if msg.proc in self._procs else None
                senders += msg.senders
        deadline = time.monotonic() + limit  # the steps after every process is ready
        if self.spec.free_ports:
            self._share_endpoints(deadline)
        self._connect_relays(senders, deadline)

    def _launch(self, proc: str) -> None:
        """Start stage process `proc` through the launcher, its CURVE secret keys one JSON line on
        its stdin (never argv, env or a file)."""
        keys = self._keys[proc] if self.spec.control.get("keys_on_stdin") else None
        p = self._launcher.launch(proc, json.dumps(keys).encode() + b"\n" if keys else None)
        with self._lock:
            self._procs[proc] = p

    def _relaunch(self, proc: str) -> None:
        """Start `proc` again while the pipeline runs (a restart, or Pipeline.scale): a fresh
        control endpoint where the old one may be a dead process's (shm rings get a new name);
        it joins when it says it is ready (_joined)."""
        if self.spec.control.get("transport", "shm") == "shm":
            self.spec.control["shm_names"][proc] = secrets.token_hex(8)
            self._launcher.refresh()
        with self._lock:
            self._members.set(proc, "starting")
            self._starting[proc] = time.monotonic()
            self._ready.pop(proc, None)
        try:
            self._launch(proc)
        except LaunchError as e:
            with self._lock:
                self._members.set(proc, "dead", str(e))
                self._starting.pop(proc, None)
            print(f"stagelink coordinator: {e}", file=sys.stderr)

    def _joined(self, msg) -> None:
        """A process started while the pipeline runs said it is ready (or could not start): every
        other process learns its endpoint (Peers), then it takes requests."""
        with self._lock:
            if self._members.state.get(msg.proc) != "starting":
                return
            self._starting.pop(msg.proc, None)
            if isinstance(msg, proto.StartFailed):
                self._members.set(msg.proc, "dead", "could not start")
                print(f"stagelink coordinator: process '{msg.proc}' could not start:\n{msg.error}", file=sys.stderr)
                self._lock.notify_all()
                gone = not self._members.alive(self._members.key(msg.proc)[0])
        if isinstance(msg, proto.StartFailed):
            if gone and self._broken is None:
                self._break(StageDiedError(f"stage process '{msg.proc}' could not start again:\n{msg.error}"))
            return
        with self._lock:
            self._ready[msg.proc] = msg.endpoint
            self._procs[msg.proc].ready(msg.pid) if msg.proc in self._procs else None
            self.spec.control.setdefault("peers", {})[msg.proc] = msg.endpoint
            others = [p for p in self._live_procs() if p != msg.proc]
        with self._out_lock:  # the coordinator's own outbox to it: to the new endpoint
            old = self._outboxes.pop(msg.proc, None)
        if old is not None:
            old.close()
        for proc in others:
            try:
                self._send(proc, proto.Peers({msg.proc: msg.endpoint}).encode(), 5.0)
            except _core.StagelinkError:
                pass
        with self._lock:
            self._members.set(msg.proc, "alive")
            self._lock.notify_all()
            held, self._held = (self._held, []) if not self._restarting_groups() else ([], self._held)
        self._resubmit(held)  # what waited for it (a stage with no other replica)

    def scale(self, stage: str, n: int, timeout: Optional[float] = None) -> List[str]:
        """Grow or shrink `stage` (its process group) to `n` running replicas while requests run,
        losing none: new replicas take requests once ready; retired ones (the highest numbered)
        take no new requests, finish what they hold, then stop. Returns the processes running
        after. `n` is at most the stage's `max_replicas`. Raises TimeoutError when a new replica
        is not ready within settings.startup_timeout_s (`timeout`), or a retired one still holds
        requests after settings.request_timeout_s."""
        if stage not in self.spec.stages:
            raise _core.NotFoundError(f"no stage '{stage}' (stages: {', '.join(self.spec.stages)})")
        group = self.spec.stages[stage].process
        procs = self._members.procs[group]
        if not isinstance(n, int) or not 1 <= n <= len(procs):
            raise _core.InvalidArgumentError(f"scale('{stage}', {n!r}): replicas must be in [1, {len(procs)}] "
                                             f"(its max_replicas)")
        with self._scale_lock:
            running = self._members.running(group)
            grow = [p for p in procs if p not in running][:max(0, n - len(running))]
            shrink = sorted(running, key=lambda p: self._members.key(p)[1])[n:] if n < len(running) else []
            for p in grow:
                self._relaunch(p)
            if grow:
                limit = self.settings["startup_timeout_s"] if timeout is None else timeout
                deadline = time.monotonic() + limit
                with self._lock:
                    while any(self._members.state[p] == "starting" for p in grow):
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise _core.TimeoutError(f"scale('{stage}', {n}): {[p for p in grow if self._members.state[p] == 'starting']} "
                                                     f"not ready within {limit:g} s")
                        self._lock.wait(min(left, 0.1))
                bad = [p for p in grow if self._members.state[p] != "alive"]
                if bad:
                    raise PipelineStartError(f"scale('{stage}', {n}): {bad} could not start "
                                             f"({[self._members.why.get(p, '') for p in bad]})")
            if shrink:
                self._retire(shrink, self.settings["request_timeout_s"] if timeout is None else timeout)
            return self._members.running(group)

    def _retire(self, procs: List[str], limit: float) -> None:
        """Drain `procs` (no new requests; wait until they hold none), then stop them."""
        deadline = time.monotonic() + limit
        with self._lock:
            for p in procs:
                self._members.set(p, "draining")
            while True:
                load = self._router.in_flight()
                if all(load.get(p, 0) == 0 for p in procs):
                    break
                if time.monotonic() >= deadline:
                    for p in procs:
                        self._members.set(p, "alive")
                    raise _core.TimeoutError(f"replicas {procs} still hold requests after {limit:g} s")
                self._lock.wait(0.05)
        with self._lock:  # they exit now: an end, not a death (_check leaves them to this)
            self._retiring.update(procs)
        for p in procs:
            try:
                self._send(p, proto.Shutdown().encode(), 5.0)
            except _core.StagelinkError:
                pass
        stop_by = time.monotonic() + self.settings["shutdown_timeout_s"]
        for p in procs:
            h = self._procs[p]
            if h.wait(max(0.0, stop_by - time.monotonic())) is None:
                h.kill()
            with self._lock:
                self._members.set(p, "stopped")
                self._retiring.discard(p)
            with self._out_lock:
                ob = self._outboxes.pop(p, None)
            if ob is not None:
                ob.close()

    def _recv_lifecycle(self, timeout: float, started: set):
        """The next lifecycle message (protocol.decode) within `timeout`, or None (a timeout, a
        request's message, a malformed one); a stage process that exited, other than those in
        `started`, fails the start."""
        try:
            m = self._inbox.recv(timeout=timeout)
            return proto.decode(m)
        except _core.TimeoutError:
            self._raise_if_one_exited(started)
        except _core.CorruptError as e:
            print(f"stagelink coordinator: dropped a malformed control message: {e}", file=sys.stderr)
        return None

    def _slow_start(self, proc: str, doing: Optional[proto.Progress], waited: float) -> str:
        stages = self.spec.processes()[proc]
        if not doing:
            return (f"stage process '{proc}' (stages {stages}) did not begin building its stages within "
                    f"{waited:.0f} s of its launch (the interpreter or `import stagelink` did not finish)")
        stage = doing.building
        factory = self.spec.stages[stage].factory if stage in self.spec.stages else "?"
        what = f"importing '{doing.importing}'" if doing.importing else "running its factory"
        return (f"stage process '{proc}' did not start within {waited:.0f} s of beginning to build its stages: "
                f"stage '{stage}' ({factory}) was still {what}")

    def _connect_relays(self, senders, deadline):
        """Transfer-engine relays: each receiving process connects to its senders now (side
        channel, UCX endpoints both ways), so the first requests do not pay for it (milliseconds
        per pair of processes over TCP), and a sender it cannot reach fails the start naming the
        edge instead of the first request."""
        info = self._relay.sender_info()
        if info:
            senders = senders + [[COORDINATOR, self.spec.entry, info]]
        by_proc: Dict[str, list] = {}
        for src, dst, info in senders:  # every replica of a receiving stage connects
            for proc in [COORDINATOR] if dst == COORDINATOR else self.spec.replica_procs(dst):
                if proc == COORDINATOR or proc in self._procs:  # replicas started with the pipeline
                    by_proc.setdefault(proc, []).append([src, dst, info])
        if not by_proc:
            return
        limit = f"within {self.settings['startup_timeout_s']} s (settings.startup_timeout_s)"
        for proc, edges in by_proc.items():
            if proc != COORDINATOR:
                left = max(0.1, deadline - time.monotonic())
                self._send(proc, proto.Connect(edges, left).encode(), left)
        for src, dst, info in by_proc.pop(COORDINATOR, []):  # the results' relay: connected from here
            try:
                self._relay_in.connect(info, timeout=max(0.1, deadline - time.monotonic()))
            except _core.StagelinkError as e:
                raise PipelineStartError(f"the coordinator could not connect the relay of edge {src} -> {dst} "
                                         f"to its sender {info}: {e}") from None
        done = set()
        while len(done) < len(by_proc):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PipelineStartError(f"stage processes {sorted(set(by_proc) - done)} did not connect their "
                                         f"relays {limit}")
            msg = self._recv_lifecycle(min(left, 0.2), set())
            if isinstance(msg, proto.Connected):
                if msg.errors:
                    raise PipelineStartError(f"stage process '{msg.proc}' could not connect its relays to "
                                             "their senders:\n  " + "\n  ".join(msg.errors))
                done.add(msg.proc)

    def _share_endpoints(self, deadline):
        """control.base_port 0: every stage process bound a free port and said which; tell them all,
        and wait until each has it before any request can make one send to another."""
        peers = dict(self._ready)
        self.spec.control["peers"] = peers
        for proc in peers:
            self._send(proc, proto.Peers(peers).encode(), max(0.1, deadline - time.monotonic()))
        known = set()
        while len(known) < len(peers):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PipelineStartError(f"stage processes {sorted(set(peers) - known)} did not confirm the "
                                         f"pipeline's endpoints within {self.settings['startup_timeout_s']} s "
                                         "(settings.startup_timeout_s)")
            msg = self._recv_lifecycle(min(left, 0.2), set())
            if isinstance(msg, proto.PeersKnown):
                known.add(msg.proc)

    def _raise_if_one_exited(self, except_for):
        for proc, p in self._procs.items():
            if proc not in except_for and p.poll() is not None:
                why = f": {NO_STDIN}" if p.returncode == EXIT_NO_STDIN else ""
                raise PipelineStartError(f"stage process '{proc}' (stages {self.spec.processes()[proc]}) "
                                         f"exited during start-up: {p.how()}{why}") from None

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop every stage process (in-flight requests fail with ClosedError), gather their
        figures, remove sockets and shared memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        timeout = self.settings["shutdown_timeout_s"] if timeout is None else timeout
        for proc in self._procs:
            try:
                self._send(proc, proto.Shutdown().encode(), 1.0)
            except _core.StagelinkError:
                pass
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self._stats) < len(self._procs) and time.monotonic() < deadline:
                if all(p.poll() is not None for p in list(self._procs.values())):
                    break
                self._lock.wait(0.05)
        self._teardown(kill=False, deadline=deadline)

    def _teardown(self, kill: bool, deadline: Optional[float] = None):
        self._closed = True
        if self.metrics_server is not None:
            self.metrics_server.close()
        deadline = deadline or time.monotonic()
        for p in self._procs.values():
            p.end_input()  # another host's: end of file ends it there
        for p in self._procs.values():
            if p.wait(max(0.0, deadline - time.monotonic()) if not kill else 0.5) is None:
                p.kill()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        err = _core.ClosedError("pipeline closed")
        with self._lock:
            for rid, r in list(self._reqs.items()):
                self._finish_locked(rid, r, error=err)
        for ob in self._outboxes.values():
            ob.close()
        self._outboxes.clear()
        if self._relay_in is not None and self._relay_in is not self._relay:
            self._relay_in.close()
        if self._relay is not None:
            self._relay.close()
        if self._inbox is not None:
            self._inbox.close()
        if self._launcher is not None:
            self._launcher.close()
        if self._tracer is not None:  # every span gathered by now (stage processes send theirs before Stats)
            self._tracer.close()
        remove_socket_dir(self._dir)
        if any(p.returncode not in (0, None) for p in self._procs.values()):
            _core.shm_reap("/dev/shm")  # a stage died: reclaim what it held, now that nobody else uses it

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self._closed:
                self.close(timeout=2.0)
        except Exception:  # noqa: BLE001  interpreter exit
            pass

    # -- requests
    def submit(self, request_id: str, payload: Any, on_chunk=None, traceparent: Optional[str] = None) -> Future:
        """Start a request at the entry stage. Returns a Future of the terminal stage's result;
        it fails with StageError (a stage raised), StageDiedError, TimeoutError
        (settings.request_timeout_s), CancelledError (abort) or ClosedError. ``on_chunk``: called
        (on the coordinator's thread) with each chunk the terminal stage streams, instead of
        queueing them for `stream`. ``traceparent``: the caller's W3C trace context (an HTTP
        request's, vLLM's): with tracing on, the request's spans join that trace, and it is traced
        when that context is sampled (else at ``trace_sample``)."""
        rid = str(request_id)
        with self._lock:
            if self._closed:
                raise _core.ClosedError("pipeline closed")
            if self._broken is not None:
                raise self._broken
            if rid in self._reqs or rid in self._attempt_of:
                raise _core.InvalidArgumentError(f"request '{rid}' is already in flight")
            used = self._finished_ids.get(rid)
            r = _Req(rid, 0 if used is None else used + 1)
            self._reqs[r.base] = r
            if r.base != rid:
                self._attempt_of[rid] = r.base
            r.on_chunk = on_chunk
            if self._may_retry:
                r.payload = payload
            if self._tracer is not None:
                ctx = _trace.parse(traceparent)  # the caller's decision where it gave a valid one (W3C)
                if ctx.sampled if ctx is not None else _trace.sample(self.trace_sample):
                    r.span = _trace.span("request", "pipeline", traceparent if ctx else None, rid,
                                         pipeline=self.spec.name)
        try:
            self._send_submit(r.base, r, payload)
        except BaseException as e:
            with self._lock:
                self._finish_locked(r.base, r, error=e)
            raise
        return r.future

    def _send_submit(self, wire: str, r: _Req, payload) -> None:
        """Route request attempt `wire` (replicas: the least loaded of each stage) and send it to
        its entry stage's process. A stage whose every process is starting again (max_restarts)
        is waited for, up to settings.startup_timeout_s (never on the receive thread, which is what
        learns that it is ready)."""
        with self._lock:
            if self._starting and threading.current_thread() is not self._thread:  # a restart under way
                deadline = time.monotonic() + self.settings["startup_timeout_s"]
                while self._restarting_groups() and not self._closed and time.monotonic() < deadline:
                    self._lock.wait(0.05)
            try:
                route = self._router.route(wire)
            except LookupError as e:
                raise StageDiedError(f"request '{r.rid}': {e}") from None
        t = time.monotonic_ns()
        entry = proc_for(self.spec, self._members.procs, self.spec.entry, route, wire)
        sp = (_trace.span("put", "pipeline", r.span.traceparent, wire, to=self.spec.entry, flow_out=True)
              if r.span.traceparent else _trace.NO_SPAN)
        body = small_frame(payload, int(self.settings.get("inline_bytes", 16384)))
        if body is None:
            edge = entry if route else self.spec.entry  # credits per receiving replica
            md = dict(self._relay.put_async(payload, request_id=wire, edge=edge, traceparent=sp.traceparent).metadata)
        else:
            md = {}
        sp.end()
        md["t_ns"] = t
        if route:
            md["route"] = route
        self._send(entry, ControlMessage("submit", wire, from_stage=COORDINATOR, to_stage=self.spec.entry,
                                         metadata=md, body=body, traceparent=sp.traceparent), 30.0)

    def stream(self, request_id: str, timeout: Optional[float] = None):
        """Iterate the chunks the terminal stage streams for ``request_id`` until it completes.
        ``timeout``: the longest wait for one chunk (TimeoutError). A failed request raises its
        error at the end."""
        with self._lock:
            r = self._reqs.get(self._attempt_of.get(str(request_id), str(request_id)))
        if r is None:
            raise _core.NotFoundError(f"request '{request_id}' is not in flight (submit it first)")
        while True:
            try:
                item = r.chunks.get(timeout=timeout)
            except queue.Empty:
                raise _core.TimeoutError(f"no chunk of '{request_id}' for {timeout} s") from None
            if item is _END:
                exc = r.future.exception() if r.future.done() else None
                if exc is not None:
                    raise exc
                return
            yield item

    def abort(self, request_id: str, timeout: Optional[float] = None) -> bool:
        """Drop ``request_id`` in every stage (running stages see ``ctx.aborted``; their slots,
        credits and held chunks are released) and wait until every process confirmed. Returns
        True when all did within ``timeout`` (settings.abort_timeout_s)."""
        rid = str(request_id)
        timeout = self.settings["abort_timeout_s"] if timeout is None else timeout
        with self._lock:
            rid = self._attempt_of.get(rid, rid)  # the attempt its messages now carry
            r = self._reqs.get(rid)
            if r is None:
                r = _Req()  # not ours any more: still clean up everywhere
            else:
                _trace.instant("abort", "pipeline", r.span.traceparent, rid)
                self._finish_locked(rid, r, error=_core.CancelledError(f"request '{r.rid}' aborted"))
            r.acks = set()
            self._aborting[rid] = r
        try:
            self._broadcast_abort(rid, r.span.traceparent)
            deadline = time.monotonic() + timeout
            with self._lock:
                while len(r.acks) < len(self._live_procs()) and time.monotonic() < deadline:
                    self._lock.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                ok = len(r.acks) >= len(self._live_procs())
        finally:
            with self._lock:
                self._aborting.pop(rid, None)
        self._relay.cleanup(rid)
        return ok

    def _live_procs(self):
        return [p for p, h in list(self._procs.items())
                if h.poll() is None and self._members.state[p] in ("alive", "draining")]

    def _broadcast_abort(self, rid, tp: Optional[str] = None):
        for proc in self._live_procs():
            try:
                self._send(proc, ControlMessage("abort", rid, from_stage=COORDINATOR, traceparent=tp), 5.0)
            except _core.StagelinkError:
                pass

    def in_flight(self) -> int:
        with self._lock:
            return len(self._reqs)

    def stats(self) -> Dict[str, dict]:
        """Per-process figures gathered at close (edges: bytes, messages, per-hop latencies;
        `control_refused`: peers its control inbox refused at the CURVE handshake, control: tcp)."""
        return dict(self._stats)

    def metrics(self, timeout: float = 2.0) -> list:
        """The pipeline's metrics now, as stagelink.metrics.collect() gives a process's: this
        process's (the coordinator's: requests, deaths, its relays) and, asked over the control
        plane, every live stage process's on every host, each sample labelled with its `process`
        (coordinator for this one). A process that does not answer within `timeout` is left out
        and its stagelink_pipeline_process_up is 0. What `metrics_port` serves."""
        with self._metrics_lock:
            self._metrics_seq += 1
            seq = self._metrics_seq
            procs = [p for p in self._live_procs() if self._members.state[p] == "alive"]
            asked = []
            for proc in procs:
                try:
                    self._send(proc, proto.MetricsAsk(seq).encode(), min(timeout, 1.0))
                    asked.append(proc)
                except _core.StagelinkError:
                    pass
            deadline = time.monotonic() + timeout
            with self._lock:
                while (any(self._metrics_in.get(p, (0,))[0] != seq for p in asked)
                       and time.monotonic() < deadline and not self._closed):
                    self._lock.wait(min(0.05, max(0.0, deadline - time.monotonic())))
                got = {p: self._metrics_in[p][1] for p in asked if self._metrics_in.get(p, (0,))[0] == seq}
            name = self.spec.name
            observe.REQUESTS_IN_FLIGHT.set(name, value=self.in_flight())
            for proc in self.spec.processes():
                if proc in procs or self._members.state.get(proc) in ("dead",):
                    observe.PROCESS_UP.set(name, proc, value=1 if proc in got else 0)
            parts = [_metrics.with_labels(_metrics.collect(), {"process": COORDINATOR})]
            parts += [_metrics.with_labels(f, {"process": p}) for p, f in sorted(got.items())]
            return _metrics.merge(*parts)

    def process_ids(self) -> Dict[str, int]:
        """{process name: pid} of the stage processes this coordinator started and that still run
        (for a stage on another host, the pid of its launcher here, e.g. ssh)."""
        return {p: h.pid for p, h in list(self._procs.items()) if h.poll() is None}  # list: scale() may add

    def coordinator_edges(self) -> Dict[str, dict]:
        """The edge from the terminal stage to this process (its result and streamed chunks):
        {"TERMINAL->coordinator": {bytes, messages, lat_ns}}, as stats() has each process's."""
        return {f"{self.spec.terminal}->{COORDINATOR}": self._edge_in.figures()}

    def _count_in(self, m: ControlMessage):
        md = m.metadata if isinstance(m.metadata, dict) else {}
        t = md.get("t_ns")
        one_clock = isinstance(t, int) and t and not self.spec.stage_host(self.spec.terminal)  # one host
        self._edge_in.count(len(m.body) if m.body else _relay_bytes(md), time.monotonic_ns() - t if one_clock else None)

    # -- the receive thread
    def _send(self, proc, msg, timeout):
        with self._out_lock:
            ob = self._outboxes.get(proc)
            if ob is None:
                ob = self._outboxes[proc] = open_outbox(self.spec, self._dir, COORDINATOR, proc,
                                                        self._keys[COORDINATOR].get("control"))
            ob.send(msg, timeout=timeout)

    def _finish_locked(self, rid, r: _Req, result=None, error=None):
        if r.done:
            return
        if self._closed and error is None:
            # Closing: the stages abort what they run, so a result arriving now may lack streamed
            # chunks its stage never sent (seen in a soak: 3 of 4 audio chunks). Not a success.
            error = _core.ClosedError("pipeline closed while the request was finishing")
        r.done = True
        self._reqs.pop(rid, None)
        self._router.done(rid)
        if self._attempt_of.get(r.rid) == rid:
            self._attempt_of.pop(r.rid, None)
        if r.rid:
            self._finished_ids[r.rid] = r.gen
            self._finished_ids.move_to_end(r.rid)
            if len(self._finished_ids) > _FINISHED_WINDOW:
                self._finished_ids.popitem(last=False)
        r.payload = None
        if r.span is not _trace.NO_SPAN:
            r.span.end(result="ok" if error is None else "aborted" if isinstance(error, _core.CancelledError)
                       else "failed", chunks=r.n_chunks, **({"error": str(error)[:500]} if error is not None else {}))
        if error is not None:
            self._m_result["aborted" if isinstance(error, _core.CancelledError) else "failed"].inc()
            r.future.set_exception(error)
        else:
            self._m_result["ok"].inc()
            self._m_e2e.observe(time.monotonic() - r.t0)
            r.future.set_result(result)
            self.completed_count += 1
            self.completed.append({"request_id": r.rid or rid, "e2e_s": time.monotonic() - r.t0,
                                   "ttfc_s": (r.t_first - r.t0) if r.t_first is not None else None,
                                   "chunks": r.n_chunks})
        r.chunks.put(_END)
        self._lock.notify_all()

    def _loop(self):
        last_check = 0.0
        while True:
            try:
                m = self._inbox.recv(timeout=0.1)
            except _core.TimeoutError:
                m = None
            except _core.ClosedError:
                return
            except _core.CorruptError:
                continue
            if m is not None:
                try:
                    self._handle(m)
                except Exception as e:  # noqa: BLE001  keep the coordinator alive
                    print(f"stagelink coordinator: handling {m.type}: {e!r}", file=sys.stderr)
            now = time.monotonic()
            if now - last_check > 0.1:
                last_check = now
                self._check()
                if self._tracer is not None and not self._closed and self._tracer.due(now):
                    self._gather_traces()
            if self._closed and (len(self._stats) >= len(self._procs)
                                 or all(p.poll() is not None for p in list(self._procs.values()))):
                return

    def _handle(self, m: ControlMessage):
        if m.type not in proto.REQUEST_TYPES:
            msg = proto.decode(m)
            if isinstance(msg, proto.Stats):
                with self._lock:
                    self._stats[msg.proc] = msg.figures
                    self._lock.notify_all()
            elif isinstance(msg, proto.TraceReport):
                if self._tracer is not None:
                    self._tracer.report(msg, time.monotonic_ns())
            elif isinstance(msg, proto.MetricsReport):
                with self._lock:
                    self._metrics_in[msg.proc] = (msg.seq, msg.families)
                    self._lock.notify_all()
            elif isinstance(msg, (proto.Ready, proto.StartFailed)):
                self._joined(msg)
            return
        if m.type == "abort_ack":
            with self._lock:
                r = self._aborting.get(m.request_id)
                if r is not None:
                    r.acks.add(m.from_stage)
                    self._lock.notify_all()
            return
        with self._lock:
            r = self._reqs.get(m.request_id)
        if r is None:  # finished, aborted or unknown: release what it carried
            if not m.body and isinstance(m.metadata, dict) and "relay_key" in m.metadata:
                try:
                    self._relay_in.get_async(m.metadata, timeout=0)
                except _core.StagelinkError:
                    pass
            return
        if m.type == "stream":
            if m.is_done:
                return
            obj = self._read_in(m, r)
            self._count_in(m)
            if r.skip:  # the caller has this chunk from the attempt before (a replica died)
                r.skip -= 1
                return
            if r.t_first is None:
                r.t_first = time.monotonic()
                self._m_first.observe(r.t_first - r.t0)
            r.n_chunks += 1
            if r.on_chunk is not None:
                r.on_chunk(obj)
            else:
                r.chunks.put(obj)
        elif m.type == "complete":
            if m.error:
                with self._lock:
                    self._finish_locked(m.request_id, r, error=StageError(m.from_stage, m.error))
                self._broadcast_abort(m.request_id, r.span.traceparent)  # release what other stages hold of it
                self._relay.cleanup(m.request_id)
                return
            obj = self._read_in(m, r)
            self._count_in(m)
            with self._lock:
                self._finish_locked(m.request_id, r, result=obj)

    def _read_in(self, m: ControlMessage, r: _Req):
        """A result or streamed chunk the terminal stage sent (traced: a span "get", the end of
        the hop's arrow)."""
        sp = _trace.NO_SPAN
        if m.traceparent and r.span is not _trace.NO_SPAN:
            sp = _trace.span("get" if m.type == "complete" else "get_chunk", "pipeline", m.traceparent, m.request_id,
                             frm=m.from_stage, flow_in=_trace.flow_from(m.traceparent),
                             **({"chunk": m.chunk_id} if m.type == "stream" else {}))
        try:
            return from_frame(m.body) if m.body else self._relay_in.get_async(
                m.metadata, request_id=m.request_id, traceparent=sp.traceparent).result()
        finally:
            sp.end()

    def _gather_traces(self) -> None:
        """Ask every live stage process for its spans (answers arrive as TraceReports); write this
        process's own."""
        for proc in self._live_procs():
            try:
                self._send(proc, self._tracer.ask().encode(), 1.0)
            except _core.StagelinkError:
                pass
        self._tracer.local()

    def trace_clocks(self) -> Dict[str, dict]:
        """Tracing: per stage process, its clock's offset to this one's and the bound on that
        estimate (ns); `same_host` where they share CLOCK_MONOTONIC (no estimate needed)."""
        return self._tracer.clocks() if self._tracer is not None else {}

    def _break(self, err: BaseException) -> None:
        """A stage has no process left: every request in flight fails with `err`, and so will
        every later submit."""
        with self._lock:
            self._broken = err
            self._held = []
            for rid, r in list(self._reqs.items()):
                self._finish_locked(rid, r, error=err)

    def _will_restart(self, proc: str) -> bool:
        st = self.spec.stages[self.spec.groups()[self._members.key(proc)[0]][0]]
        return not self._closed and self._members.restarts[proc] < st.max_restarts

    def _restarting_groups(self) -> List[str]:
        """Groups with no process taking requests and one starting again. Under the lock."""
        return [g for g, ps in self._members.procs.items()
                if not self._members.alive(g) and any(self._members.state[p] == "starting" for p in ps)]

    def _replica_died(self, proc: str, p: StageProcess, group: str, replica: int) -> None:
        """A replica died while others of its group live: it gets no more requests; those it held
        run again on the others where every stage of its group is `retry: true` (from the entry
        stage, under a new attempt id; stream chunks the caller has are not repeated), else fail
        naming stage, replica and process."""
        stages = self.spec.groups()[group]
        why = f"{p.where}) died: {p.how()}"
        retry = all(self.spec.stages[n].retry for n in stages)
        again, failed = [], []
        with self._lock:
            self._members.set(proc, "dead", why)
            # A group of one process: every request in flight passes it.
            held = self._router.holders(group, replica) if self._members.replicated(group) else list(self._reqs)
            for wire in held:
                r = self._reqs.get(wire)
                if r is None or r.done:
                    continue
                if retry and r.attempt < _MAX_ATTEMPTS and r.payload is not None:
                    self._reqs.pop(wire)
                    self._router.done(wire)
                    r.attempt += 1
                    r.skip = r.n_chunks
                    new = f"{r.base}~{r.attempt}"
                    self._reqs[new] = r
                    self._attempt_of[r.rid] = new
                    again.append((wire, new, r))
                else:
                    failed.append(wire)
                    self._finish_locked(wire, r, error=StageDiedError(
                        f"request '{r.rid}': replica {replica} of stages {', '.join(stages)} (process '{proc}', "
                        f"{why}" + ("" if retry else "; not run again (retry: false)")))
        print(f"stagelink coordinator: process '{proc}' (replica {replica} of {', '.join(stages)}, {why}; "
              f"{len(again)} request(s) run again, {len(failed)} failed", file=sys.stderr)
        for old in failed:
            self._broadcast_abort(old)
            self._relay.cleanup(old)
        for old, _, _ in again:
            self._broadcast_abort(old)  # what the other stages hold of the attempt before
            self._relay.cleanup(old)
        st = self.spec.stages[stages[0]]
        if again:
            observe.RETRIES.inc(self.spec.name, by=len(again))
        if self._will_restart(proc):
            self._members.restarts[proc] += 1
            observe.RESTARTS.inc(self.spec.name, proc)
            print(f"stagelink coordinator: starting '{proc}' again (restart {self._members.restarts[proc]} of "
                  f"{st.max_restarts})", file=sys.stderr)
            self._relaunch(proc)
        with self._lock:  # no replica of its stage left to run them on: they wait for the restart
            if self._restarting_groups():
                self._held += again
                return
        self._resubmit(again)

    def _resubmit(self, again) -> None:
        for _, new, r in again:
            try:
                self._send_submit(new, r, r.payload)
            except BaseException as e:  # noqa: BLE001  that request fails; the others go on
                with self._lock:
                    self._finish_locked(new, r, error=e)

    def placement(self) -> Dict[str, str]:
        """Where each stage process runs (every replica it may have), in words: "this host",
        "host 'gpu2'", "Ray node 10.0.0.6"."""
        return {p: self._launcher.describe(p) for p in self.spec.processes()}

    def replicas(self) -> Dict[str, dict]:
        """Per stage process (every replica a stage may have): its group, replica number, state
        (alive, starting, draining, stopped, dead), `alive` (takes requests), requests in flight,
        restarts, and how it died."""
        with self._lock:
            load = self._router.in_flight()
            out = {}
            for p, (g, i) in ((p, self._members.key(p)) for g in self._members.procs for p in self._members.procs[g]):
                st = self._members.state[p]
                out[p] = {"group": g, "replica": i, "state": st, "alive": st == "alive", "in_flight": load.get(p, 0),
                          "restarts": self._members.restarts[p], "died": self._members.why.get(p)}
            return out

    def _check(self):
        if self._closed:
            return
        for proc, p in list(self._procs.items()):
            state = self._members.state[proc]
            if p.poll() is None:
                if state == "starting" and time.monotonic() - self._starting.get(proc, time.monotonic()) > \
                        self.settings["startup_timeout_s"]:
                    p.kill()  # reported below, next round, as a start that failed
                continue
            if state in ("dead", "stopped") or proc in self._retiring:
                continue
            observe.DEATHS.inc(self.spec.name, proc)
            group, replica = self._members.key(proc)
            if state == "starting":  # died before it was ready: it held nothing
                with self._lock:
                    self._starting.pop(proc, None)
                    self._members.set(proc, "dead", f"{p.where}) died while starting: {p.how()}")
                    self._lock.notify_all()
                if not self._members.alive(group) and self._broken is None:  # nothing left to run its stages
                    self._break(StageDiedError(f"stage process '{proc}' (stages "
                                               f"{', '.join(self.spec.processes()[proc])}, {p.where}) died while "
                                               f"starting again: {p.how()}"))
                continue
            # Others carry on, or it will be started again: only its requests are touched.
            if [i for i in self._members.alive(group) if i != replica] or self._will_restart(proc):
                self._replica_died(proc, p, group, replica)
                continue
            with self._lock:  # dead now: counted and reported once, not at every check
                self._members.set(proc, "dead", f"{p.where}) died: {p.how()}")
            if self._broken is None:
                self._break(StageDiedError(f"stage process '{proc}' (stages "
                                           f"{', '.join(self.spec.processes()[proc])}, {p.where}) died: "
                                           f"{p.how()}"))
                # What the dead process held is reclaimed by the survivors' reaping.
        limit = self.settings["request_timeout_s"]
        now = time.monotonic()
        with self._lock:
            late = [(rid, r) for rid, r in self._reqs.items() if now - r.t0 > limit]
            for rid, r in late:
                self._finish_locked(rid, r, error=_core.TimeoutError(
                    f"request '{r.rid or rid}' not complete after {limit} s (settings.request_timeout_s)"))
        for rid, _ in late:
            self._broadcast_abort(rid)


