"""The stages of a stage process: a stage's inputs per request (payloads, stream chunks), when it
runs (on the receive thread or its pool), what it sends, and the context a stage function gets.
The process around them (control messages, relays, start-up) is worker.py."""
from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from .. import _core
from .. import trace as _trace
from . import observe
from .spec import COORDINATOR, PipelineConfigError, StageSpec, build_stage, resolve

if TYPE_CHECKING:
    from .worker import Worker

# Per stage and process, the last _SEEN_WINDOW finished or aborted request ids (a late message of
# one of them is dropped). Measured with scripts/soak: with windows of 200k (hop latencies) and 100k
# (these) the stage processes grew ~130 MiB in all before levelling off.
_SEEN_WINDOW = 10_000
# `inline: auto` (the default): a stage runs on the receive thread, with no handoff to a pool
# thread, once its last runs (AUTO_INLINE_MIN_RUNS at least, AUTO_INLINE_WINDOW at most) show it
# short and not blocking: their median CPU time (the running thread's, its sends included) at most
# AUTO_INLINE_NS, and the least time one of them spent off the CPU (wall time less CPU time) at
# most AUTO_INLINE_OFF_NS. A run on or off
# the CPU longer than AUTO_INLINE_MAX_NS starts the window again (the next requests go to the pool).
# An inline stage stays inline while that median is at most AUTO_INLINE_STAY_NS: on the pool the
# same runs cost more CPU (the toy's `enc`: 250-400 us inline, 0.6-1.9 ms on the pool with 8 in
# flight on 2 cores, where the copies of four processes meet), so one bound both ways made a
# stage whose runs neared it fall to the pool, which made its runs costlier and kept it there.
# A handoff cost ~70 us of CPU per request per stage (a thread woken, the GIL passed) in
# SGLang-Omni's toy pipeline, more than its stages' work. Wall time alone cannot judge it: with 8
# requests in flight on 2 cores a short stage on the pool waits for the GIL and the CPU (a third of
# the toy's 0.2 ms `dec` runs took over 0.5 ms), so a moving average of wall time kept the toy's
# stages on the pool for most of a run when the machine was slow, which made their runs slower
# still. CPU time is what a run costs the receive thread; a stage that blocks (a GPU sync, a
# sleep, a wait for a credit) is off the CPU in every run, where one only preempted or waiting for
# the GIL has some runs without it: the least of the window tells them apart. The median, not the
# first runs, decides: a new stage's first runs (imports, first torch calls) are slow.
AUTO_INLINE_NS = 500_000
AUTO_INLINE_STAY_NS = 1_000_000
AUTO_INLINE_OFF_NS = 250_000
AUTO_INLINE_MAX_NS = 5_000_000
AUTO_INLINE_WINDOW = 8
# Three runs, not the whole window, to decide the first time: a new pipeline's stages reach the
# receive thread by their 4th request (the 1 MiB toy: ~3.5 ms a request on the pool, 2.2 ms
# inline, one at a time). A stage that blocks is off the CPU in all three; one slow first run (a
# first torch call: 11 ms) starts them again.
AUTO_INLINE_MIN_RUNS = 3




class StreamError(RuntimeError):
    """An upstream stage failed while streaming to this one (its error text is the message)."""


class Aborted(_core.CancelledError):
    """The request was aborted; raised inside a stage by ctx.stream() and ctx.chunks()."""


class _Request:
    __slots__ = ("inputs", "started", "queue", "expect", "held", "done_srcs", "aborted", "cond", "n_streamed",
                 "stream_closed", "ctx", "done", "payload_in", "early", "t_ready", "tp", "run_tp")

    def __init__(self, lock):
        self.inputs: Dict[str, Any] = {}
        self.started = False
        # (src, kind, item, t_ns, traceparent, chunk id): chunks (and a callback stage's payload)
        self.queue: collections.deque = collections.deque()
        self.expect: Dict[str, int] = collections.defaultdict(int)  # next chunk id per source
        self.held: Dict[str, dict] = collections.defaultdict(dict)  # out-of-order chunks per source
        self.done_srcs: set = set()
        self.aborted = False
        self.cond = threading.Condition(lock)
        self.n_streamed: Dict[str, int] = collections.defaultdict(int)  # chunk ids sent per target
        self.stream_closed: set = set()
        self.ctx: Optional["StageContext"] = None  # callback stages: one context for every call
        self.done = False
        self.payload_in = False  # callback stages: every `next` source's payload has arrived
        self.early = 0  # bytes of chunks copied out of the relay before the stage could start
        self.t_ready = 0  # monotonic_ns when every input had arrived (its queueing starts)
        self.tp: Optional[str] = None  # traced: the context of its last input here (its run's parent)
        self.run_tp: Optional[str] = None  # traced: its run's context (what the run sends carries)


class StageContext:
    """What a stage function gets beside its payload.

    ``request_id``, ``stage``, ``state`` (a dict kept across a callback stage's calls);
    ``stream(chunk)`` sends a chunk to every ``stream_to`` target (a
    terminal stage's chunks go to the coordinator: ``Pipeline.stream``); ``chunks(timeout)``
    iterates the chunks streamed to this stage, in order, until every source is done (raising
    StreamError if one failed); ``aborted`` says whether to stop early."""

    def __init__(self, stage: "StageRuntime", rid: str, req: _Request):
        self.stage, self.request_id = stage.spec.name, rid
        self._rt, self._req = stage, req
        self.state: dict = {}  # per request, for callback stages (on_chunk/finish)

    @property
    def aborted(self) -> bool:
        """Whether the request was aborted (the client's abort, a deadline, a failed stage): a long
        stage checks it and returns early."""
        return self._req.aborted

    def stream(self, chunk, targets: Optional[List[str]] = None) -> None:
        """Send ``chunk`` (anything a connector carries) to every ``stream_to`` target of this stage,
        or to ``targets`` (a subset); a terminal stage's chunks go to the client
        (``Pipeline.stream``). Raises `Aborted` once the request is aborted."""
        if self._req.aborted:
            raise Aborted(f"request '{self.request_id}' was aborted")
        self._rt.send_chunk(self.request_id, self._req, chunk, targets)

    def chunks(self, timeout: Optional[float] = None):
        """The chunks streamed to this stage for this request, in order, until every source has
        finished; waits up to ``timeout`` seconds for each (None: the stage's ``chunk_timeout_s``, else
        the request timeout).
        Raises `StreamError` when a source failed, `Aborted` when the request was aborted."""
        return self._rt.iter_chunks(self.request_id, self._req, timeout)


class StageRuntime:
    def __init__(self, spec: StageSpec, worker: "Worker"):
        self.spec, self.w = spec, worker
        base = os.path.dirname(os.path.abspath(worker.spec.source)) if worker.spec.source != "<dict>" else os.getcwd()
        self.obj, self.fn = build_stage(spec, base)
        # A callback stage (on_chunk(chunk, ctx), on_payload(payload, ctx) optional, finish(payload,
        # ctx)): driven by its inputs as they arrive, on the thread that delivers them, no thread of
        # its own. Chunks are handled whether or not the payload is there yet; finish runs once
        # every stream has ended and the payload (if any `next` feeds the stage) has arrived.
        self.on_chunk = getattr(self.obj, "on_chunk", None)
        self.on_payload = getattr(self.obj, "on_payload", None)
        self.finish = getattr(self.obj, "finish", None)
        if self.on_chunk is not None:
            if not spec.stream_sources or not callable(self.finish):
                raise PipelineConfigError(f"stage '{spec.name}': an on_chunk stage must be fed by a stream "
                                          "(stream_to names it) and needs finish(payload, ctx)")
        self.merge = resolve(spec.merge) if spec.merge else None
        self.pool = ThreadPoolExecutor(spec.concurrency, thread_name_prefix=f"stage-{spec.name}")
        self.lock = threading.Lock()
        self.reqs: Dict[str, _Request] = {}
        self.finished: collections.OrderedDict = collections.OrderedDict()  # rids done here (late messages dropped)
        self.stream_targets = spec.stream_to or ([COORDINATOR] if spec.terminal else [])
        self.runs = 0
        self.busy_ns = 0
        # This stage's metrics, found once (counted per run and per chunk: no lookup then).
        self.m_runs, self.m_failures, self.m_run_s, self.m_queue_s, self.m_chunks = (
            m.labels(spec.name) for m in (observe.STAGE_RUNS, observe.STAGE_FAILURES, observe.STAGE_RUN_SECONDS,
                                          observe.STAGE_QUEUE_SECONDS, observe.STAGE_CHUNKS))
        # inline: auto (None): inline once its window says short (AUTO_INLINE_NS, above). A
        # stage that reads streams only when every stream has ended before it starts (ctx.chunks()
        # then never waits for the receive thread it would be running on).
        self.auto = spec.inline is None
        self.stream_srcs = frozenset(spec.stream_sources)
        # inline: auto's window: the last runs' CPU and off-CPU times, and its verdict on them
        self.run_cpu: collections.deque = collections.deque(maxlen=AUTO_INLINE_WINDOW)
        self.run_off: collections.deque = collections.deque(maxlen=AUTO_INLINE_WINDOW)
        self.short = False
        # It was inline until a run started the window again: it comes back under the bound to
        # stay, not the one to get in (one run preempted for 5 ms under load would otherwise
        # leave a stage of 0.5-1 ms runs on the pool for good). A stage that blocks still does
        # not: it is off the CPU in every run.
        self.was_short = False
        self.inline_runs = 0
        self.early_bytes = 0  # chunks held copied for requests not started yet (settings.early_chunk_bytes)
        self.early_limit = int(worker.spec.settings.get("early_chunk_bytes", 256 << 20))

    # -- inputs
    def _state(self, rid) -> Optional[_Request]:
        if rid in self.finished or rid in self.w.aborted:
            return None
        r = self.reqs.get(rid)
        if r is None:
            r = self.reqs[rid] = _Request(self.lock)
        return r

    def deliver_data(self, rid: str, src: str, obj, tp: Optional[str] = None) -> None:
        with self.lock:
            r = self._state(rid)
            # (a callback stage's `started` says a thread is draining its inputs, not that it ran)
            if r is None or (r.payload_in if self.on_chunk is not None else r.started):
                return
            r.inputs[src] = obj
            if tp:
                r.tp = tp
            need = self.spec.sources or [COORDINATOR]
            if not all(s in r.inputs for s in need):
                return
            if self.on_chunk is not None:  # a callback stage: on_payload now, finish once streams end
                r.payload_in = True
                if r.ctx is None:
                    r.ctx = StageContext(self, rid, r)
                r.queue.append((None, "payload", None, 0, None, None))
            else:
                r.started = True
                r.t_ready = time.monotonic_ns()
            inline = self.spec.inline or (self.auto and self.short and self.stream_srcs <= r.done_srcs)
        if self.on_chunk is not None:
            self._on_chunks(rid, r)
        elif inline:
            self.inline_runs += 1
            self._run(rid, r)  # on the receive thread: no handoff (see StageSpec.inline)
        else:
            self.pool.submit(self._run, rid, r)

    def deliver_stream(self, rid: str, src: str, chunk_id: int, kind: str, item, is_done: bool, error: str,
                       t_ns: int, tp: Optional[str] = None) -> bool:
        """Queue a chunk (held as relay metadata until the stage reads it: the sender's credits
        are the back-pressure). Returns False when the request is no longer here."""
        start = False
        with self.lock:
            r = self._state(rid)
            if r is None:
                return False
            r.held[src][chunk_id] = (kind, item, is_done, error, t_ns, tp)
            if tp and r.tp is None:
                r.tp = tp
            while r.expect[src] in r.held[src]:  # in chunk order per source
                cid = r.expect[src]
                k, it, done, err, t, ctp = r.held[src].pop(cid)
                r.expect[src] += 1
                if done:
                    r.done_srcs.add(src)
                    if err:
                        r.queue.append((src, "error", err, t, ctp, cid))
                else:
                    r.queue.append((src, k, it, t, ctp, cid))
            r.cond.notify_all()
            if self.on_chunk is not None:
                if r.ctx is None:
                    r.ctx = StageContext(self, rid, r)
            elif not self.spec.sources and not r.started:
                r.started = start = True
        if self.on_chunk is not None:
            self._on_chunks(rid, r)
        elif start:
            self.pool.submit(self._run, rid, r)
        return True

    def take_early(self, rid: str, nbytes: int) -> bool:
        """Whether a chunk of `nbytes` for `rid` should be copied out of the relay now: its stage
        waits for a payload too and has not started, so the chunk would hold a credit of the edge
        the payload may need (the toy pipeline's `enc` streams its chunks, then sends its payload,
        to `dec`). Copied chunks of requests not started are bounded by settings.early_chunk_bytes;
        past it they stay in the relay (the sender's credits are the back-pressure)."""
        if not self.spec.sources or self.on_chunk is not None:
            return False
        with self.lock:
            r = self._state(rid)
            if r is None or r.started or self.early_bytes + nbytes > self.early_limit:
                return False
            self.early_bytes += nbytes
            r.early += nbytes
            return True

    def _payload(self, r: _Request):
        """A stage's payload: its one source's, or with several (fan-in) merge({source: payload})."""
        if not self.spec.sources and self.spec.stream_sources:
            return None
        ins = r.inputs
        if len(self.spec.sources) > 1:
            return self.merge(dict(ins)) if self.merge else dict(ins)
        return next(iter(ins.values())) if ins else None

    def iter_chunks(self, rid: str, r: _Request, timeout: Optional[float]):
        if timeout is None:  # how long a stream may stall at this stage: its own limit, else the request's
            s = self.w.spec.settings
            timeout = s.get("chunk_timeout_s") or s["request_timeout_s"]
        srcs = self.stream_srcs
        while True:
            with self.lock:
                deadline = time.monotonic() + timeout
                while not r.queue and not r.aborted and not srcs <= r.done_srcs:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise _core.TimeoutError(f"stage '{self.spec.name}': no stream chunk of '{rid}' for {timeout} s")
                    r.cond.wait(left)
                if r.aborted:
                    raise Aborted(f"request '{rid}' was aborted")
                if not r.queue:
                    return
                src, kind, item, t_ns, tp, cid = r.queue.popleft()
            if kind == "error":
                raise StreamError(f"stage '{src}' failed while streaming to '{self.spec.name}': {item}")
            yield self.w.read(src, self.spec.name, kind, item, t_ns, self.spec.zero_copy, tp, rid, cid)

    # -- running
    def _run(self, rid: str, r: _Request):
        ctx = r.ctx or StageContext(self, rid, r)
        t0, c0 = time.monotonic_ns(), time.thread_time_ns()
        sp = _trace.span("run", "stage", r.tp, rid, stage=self.spec.name) if r.tp else _trace.NO_SPAN
        r.run_tp = sp.traceparent
        failed = None
        try:
            self._complete(rid, r, self.fn(self._payload(r), ctx))
        except BaseException as e:  # noqa: BLE001  a stage's failure fails only its request
            failed = e
            self._failed(rid, r, e)
        finally:
            if sp is not _trace.NO_SPAN:
                sp.end(**({"error": f"{type(failed).__name__}: {failed}"[:500]} if failed is not None else {}))
                if r.t_ready:
                    _trace.record_span("queue", "stage", r.tp, r.t_ready, t0, rid, stage=self.spec.name)
            took = time.monotonic_ns() - t0
            self.busy_ns += took
            self.runs += 1
            self.m_runs.inc()
            self.m_run_s.observe(took / 1e9)
            if r.t_ready:  # (counted after the run: not part of its time, nor of inline: auto's)
                self.m_queue_s.observe((t0 - r.t_ready) / 1e9)
            if self.auto:
                self._judge(time.thread_time_ns() - c0, took)
            self._finish(rid, r)

    def _judge(self, cpu_ns: int, wall_ns: int) -> None:
        """inline: auto's verdict after a run (see AUTO_INLINE_NS); pool threads run it at once."""
        off = max(0, wall_ns - cpu_ns)
        with self.lock:
            if off > AUTO_INLINE_MAX_NS or cpu_ns > AUTO_INLINE_MAX_NS:
                self.run_cpu.clear()
                self.run_off.clear()
                self.short = False
                return
            self.run_cpu.append(cpu_ns)
            self.run_off.append(off)
            limit = AUTO_INLINE_STAY_NS if self.short or self.was_short else AUTO_INLINE_NS
            n = len(self.run_cpu)
            median = sorted(self.run_cpu)[n // 2]
            self.short = n >= AUTO_INLINE_MIN_RUNS and min(self.run_off) <= AUTO_INLINE_OFF_NS and median <= limit
            if self.short:
                self.was_short = True
            elif n >= AUTO_INLINE_MIN_RUNS and median > AUTO_INLINE_STAY_NS:
                self.was_short = False  # it grew: back to the bound to get in

    def _complete(self, rid: str, r: _Request, result):
        """Send what a request produced here: end its streams, then its result downstream."""
        if r.aborted:
            return
        for t in self.stream_targets:
            if t not in r.stream_closed:
                self.w.send_stream_signal(rid, self.spec.name, t, r.n_streamed[t], "", r.run_tp)
        if self.spec.terminal:
            self.w.send_result(rid, self.spec.name, result, r.run_tp)
        else:
            per = result.targets if isinstance(result, PerTarget) else None
            for t in self.spec.next:
                self.w.send_data(rid, self.spec.name, t, per[t] if per is not None else result, r.run_tp)

    def _failed(self, rid: str, r: _Request, e: BaseException):
        if isinstance(e, Aborted) or r.aborted:
            return
        self.m_failures.inc()
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        for t in self.stream_targets:
            if t != COORDINATOR and t not in r.stream_closed:
                self.w.send_stream_signal(rid, self.spec.name, t, r.n_streamed[t], tb[-2000:] or repr(e), r.run_tp)
        self.w.send_failure(rid, self.spec.name, tb, r.run_tp)

    def _on_chunks(self, rid: str, r: _Request):
        """Callback stages (on_chunk/on_payload/finish): handle every input that is ready, in
        order, on the thread that delivered it; once every stream has ended and the payload (if
        any) has arrived, finish() gives the result."""
        srcs = self.stream_srcs
        need_payload = bool(self.spec.sources)
        with self.lock:
            if r.started:  # another thread is draining this request: it will see these chunks too
                return
            r.started = True
        t0 = time.monotonic_ns()
        # A span per stretch of callbacks (this thread handling what had arrived)
        sp = _trace.span("run", "stage", r.tp, rid, stage=self.spec.name, callbacks=True) if r.tp else _trace.NO_SPAN
        if sp is not _trace.NO_SPAN:
            r.run_tp = sp.traceparent
        try:
            while True:
                with self.lock:
                    if r.aborted or r.done:
                        r.started = False
                        return
                    if not r.queue:
                        if not srcs <= r.done_srcs or (need_payload and not r.payload_in):
                            r.started = False
                            return
                        r.done = True
                        break
                    src, kind, item, t_ns, tp, cid = r.queue.popleft()
                if kind == "error":
                    raise StreamError(f"stage '{src}' failed while streaming to '{self.spec.name}': {item}")
                if kind == "payload":
                    if self.on_payload is not None:
                        self.on_payload(self._payload(r), r.ctx)
                    continue
                self.on_chunk(self.w.read(src, self.spec.name, kind, item, t_ns, self.spec.zero_copy, tp, rid, cid),
                              r.ctx)
            self._complete(rid, r, self.finish(self._payload(r) if need_payload else None, r.ctx))
        except BaseException as e:  # noqa: BLE001
            r.done = True
            self._failed(rid, r, e)
        finally:
            sp.end()
            took = time.monotonic_ns() - t0
            self.busy_ns += took
            self.m_run_s.observe(took / 1e9)
        self.runs += 1
        self.m_runs.inc()
        self._finish(rid, r)

    @staticmethod
    def _let_go(r: _Request):
        """Drop what a finished or aborted request holds: its inputs (a zero_copy one holds a relay
        slot and its edge's credit) and its context, which refers back to it (a cycle only the
        cycle collector would have broken, holding both for as long)."""
        r.inputs = {}
        r.ctx = None

    def _finish(self, rid: str, r: _Request):
        with self.lock:
            self.early_bytes -= r.early
            r.early = 0
            self._let_go(r)
            self.reqs.pop(rid, None)
            self.finished[rid] = True
            if len(self.finished) > _SEEN_WINDOW:
                self.finished.popitem(last=False)
            left = list(r.queue)
            r.queue.clear()
        for src, kind, item, *_ in left:  # chunks the stage did not read: released, not leaked
            if kind == "relay":
                self.w.discard(src, self.spec.name, item)

    def send_chunk(self, rid: str, r: _Request, chunk, targets):
        for t in targets or self.stream_targets:
            if t not in self.stream_targets:
                raise _core.InvalidArgumentError(f"stage '{self.spec.name}' does not stream to '{t}'")
            cid = r.n_streamed[t]
            r.n_streamed[t] += 1
            self.w.send_stream(rid, self.spec.name, t, cid, chunk, r.run_tp)

    def abort(self, rid: str):
        with self.lock:
            r = self.reqs.pop(rid, None)
            if r is not None:
                r.aborted = True
                r.cond.notify_all()
                self.early_bytes -= r.early
                r.early = 0
                self._let_go(r)
                left = list(r.queue)
                r.queue.clear()
            else:
                left = []
        for src, kind, item, *_ in left:
            if kind == "relay":
                self.w.discard(src, self.spec.name, item)


class PerTarget:
    """Returned by a stage with several ``next`` targets: each target gets its own payload
    (``PerTarget({"talker": a, "logger": b})``); a plain return value goes to every target."""

    def __init__(self, targets: dict):
        self.targets = dict(targets)
