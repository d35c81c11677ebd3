"""MessageQueue: one writer, many readers (vLLM's ``shm_broadcast.MessageQueue`` API).

    writer = stagelink.MessageQueue(n_reader=3, n_local_reader=2)   # rank 2 is remote (TCP)
    handle = writer.export_handle()                                   # picklable, send it to readers
    reader = stagelink.MessageQueue.create_from_handle(handle, rank)  # in each reader process
    writer.wait_until_ready(timeout=60); reader.wait_until_ready()
    writer.enqueue({"step": 1, "x": np.ones(4)}); obj = reader.dequeue(timeout=5)

Local readers share a ring in shared memory (no copy, no socket; messages larger than a chunk go
through a shared-memory overflow area); remote readers receive the same messages, in the same
order, over ZeroMQ. Timeouts raise `stagelink.TimeoutError` naming the readers behind;
``shutdown()`` wakes every blocked side with `stagelink.CancelledError`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Any, Optional, Sequence


from . import _core, _serde
from ._lifetime import NativeOwner, track

log = logging.getLogger("stagelink")

# vLLM's module constants, read at each wait (so they can be changed at run time). A reader that
# has waited this long for a message (and is not ``indefinite``) logs it, naming the writer.
VLLM_RINGBUFFER_WARNING_INTERVAL = float(os.environ.get("VLLM_RINGBUFFER_WARNING_INTERVAL", 60))
# The longest a reader's wait stays in the kernel before it returns to Python (signals such as
# Ctrl-C are handled there) when no timeout ends it sooner.
SHM_READER_RECHECK_INTERVAL_MS = 200
# How often a busy reader's wait returns (see _SpinCondition.wait).
_BUSY_WAIT_MS = 1


class Handle:
    """What a reader needs to attach (segment names, remote address): small and picklable.

    vLLM's ``Handle`` fields are readable: ``local_reader_ranks``, ``buffer_handle``
    (``(n_local_reader, max_chunk_bytes, max_chunks, ring name)``, or None without local readers),
    ``local_subscribe_addr`` (None: local readers use shared memory only), ``remote_subscribe_addr``
    (None without remote readers) and ``remote_addr_ipv6``.
    """

    __slots__ = ("data", "_info")

    def __init__(self, data: bytes):
        self.data = bytes(data)
        self._info = _core.mq_handle_info(self.data)  # validates it too

    def __reduce__(self):
        return (Handle, (self.data,))

    def __repr__(self):
        return (f"<stagelink.mq.Handle local_reader_ranks={self.local_reader_ranks} "
                f"remote_subscribe_addr={self.remote_subscribe_addr!r}>")

    @property
    def local_reader_ranks(self) -> list:
        return list(self._info["local_reader_ranks"])

    @property
    def n_reader(self) -> int:
        return self._info["n_reader"]

    @property
    def buffer_handle(self):
        i = self._info
        if not i["ring_name"]:
            return None
        return (len(i["local_reader_ranks"]), i["chunk_bytes"], i["max_chunks"], i["ring_name"])

    @property
    def local_subscribe_addr(self):
        return None

    @property
    def remote_subscribe_addr(self):
        return self._info["remote_addr"] or None

    @property
    def remote_addr_ipv6(self) -> bool:
        return self._info["remote_addr"].startswith("tcp://[")


class MessageQueue(NativeOwner):
    """The writer side; readers come from `create_from_handle`.

    ``n_reader`` readers in all, ``n_local_reader`` of them on this host (ranks
    ``local_reader_ranks``: any distinct numbers, by default ``0 .. n_local_reader-1``), the
    others connect over TCP to ``connect_ip`` (None: this host's address, the socket bound on
    every interface, as vLLM). ``max_chunk_bytes`` x ``max_chunks`` is the ring.
    ``enable_shm_tensor_arena`` is accepted for vLLM's callers: arrays and tensors always travel
    as typed regions in shared memory here. Beyond vLLM's arguments:
    ``overflow_bytes`` (shared memory for messages larger than a chunk), ``warn_interval_s``
    (a blocked writer logs the readers it waits for), ``drop_dead_readers`` (go on without a
    reader whose process died instead of raising `stagelink.PeerDeadError`), ``spin_us``
    (spin before sleeping in the kernel), ``curve`` (remote readers authenticated and encrypted:
    ``{"secret_key_file": PATH}`` or ``{"secret_key": ...}``, plus ``allowed_clients``; default
    from ``STAGELINK_CURVE_SECRET_FILE``, a key file every process of the deployment shares).
    Without keys, remote readers are authenticated and encrypted all the same, with a key pair
    this writer makes and puts in `export_handle`: only the handle's holders can subscribe.

    The remote-reader socket binds ``connect_ip`` (else this host's address) only, never every
    interface. A remote reader unpickles only what comes over an authenticated queue, unless it
    is made with ``allow_pickle=True`` (or ``STAGELINK_MQ_ALLOW_PICKLE=1``): numpy arrays,
    torch tensors, bytes and trees of them need no pickle.
    """

    def __init__(self, n_reader: int, n_local_reader: int, local_reader_ranks: Optional[Sequence[int]] = None,
                 max_chunk_bytes: int = 10 << 20, max_chunks: int = 10, connect_ip: Optional[str] = None,
                 enable_shm_tensor_arena: bool = True, *, remote_port: int = 0, overflow_bytes: int = 64 << 20,
                 warn_interval_s: float = 60.0, drop_dead_readers: bool = False, spin_us: int = 50,
                 shm_dir: str = "/dev/shm", curve: Optional[dict] = None, _core_mq=None):
        self.max_chunk_bytes = int(max_chunk_bytes)
        # vLLM's fields: the queue's shape and which side this is (create_from_handle sets a
        # reader's own).
        self.n_reader, self.n_local_reader = int(n_reader), int(n_local_reader)
        self.n_remote_reader = self.n_reader - self.n_local_reader
        self.local_reader_rank = -1  # a local reader's index among the local readers
        self._allow_pickle = True  # a remote reader's is set by create_from_handle
        if _core_mq is not None:
            self._q = _core_mq
            track(self)  # closed at exit if still open then
            return
        ranks = list(local_reader_ranks) if local_reader_ranks is not None else list(range(n_local_reader))
        self._q = _core._MessageQueue.create(
            int(n_reader), int(n_local_reader), [int(r) for r in ranks], int(max_chunk_bytes), int(max_chunks),
            connect_ip or "", int(remote_port), int(overflow_bytes), float(warn_interval_s),
            bool(drop_dead_readers), int(spin_us), shm_dir,
            _default_curve(curve) if self.n_remote_reader > 0 else None)
        track(self)

    @staticmethod
    def create_from_handle(handle: Handle, rank: int, *, curve: Optional[dict] = None,
                           allow_pickle: Optional[bool] = None) -> "MessageQueue":
        """Attach reader ``rank``: through shared memory when ``rank`` is one of the handle's
        ``local_reader_ranks``, otherwise over TCP (``-1``: a remote-only reader). A remote reader
        of a queue given CURVE keys needs ``curve`` (its keys, and ``server_key`` where the writer's
        key is not the shared one; default from ``STAGELINK_CURVE_SECRET_FILE``). The writer's key is
        then never taken from the handle: one naming another key, or none, is refused
        (PermissionDeniedError). A writer given no keys (the default) makes a key pair for its
        readers and puts it in its handle: whoever holds the handle may subscribe, nobody else."""
        data = handle.data if isinstance(handle, Handle) else bytes(handle)
        info = _core.mq_handle_info(data)
        local = list(info["local_reader_ranks"])
        remote = int(rank) not in local
        keys = _default_curve(curve) if remote else None  # given keys refuse a handle naming none
        q = MessageQueue(info["n_reader"], len(local), max_chunk_bytes=info["chunk_bytes"] or (10 << 20),
                         _core_mq=_core._MessageQueue.create_from_handle(data, int(rank), keys))
        q.local_reader_rank = local.index(int(rank)) if int(rank) in local else -1
        if remote:  # only an authenticated writer's pickles, unless asked for
            if allow_pickle is None:
                allow_pickle = bool(keys) or os.environ.get("STAGELINK_MQ_ALLOW_PICKLE", "") == "1"
            q._allow_pickle = bool(allow_pickle)
        q._spin_condition  # a local reader's reads go through vLLM's SpinCondition loop (dequeue)
        return q

    @staticmethod
    def create_from_process_group(pg, max_chunk_bytes: int, max_chunks: int, writer_rank: int = 0,
                                  external_writer_handle: Optional[Handle] = None, blocking: bool = True,
                                  **kwargs) -> "MessageQueue":
        """vLLM's: the group's ``writer_rank`` writes, every other rank reads (through shared memory
        on the writer's host, over TCP elsewhere). Every rank of ``pg`` calls it; with
        ``blocking`` it returns once every reader is attached (without, each side calls
        `wait_until_ready` later). ``external_writer_handle``: the queue already exists
        elsewhere; ``writer_rank`` attaches to it with its group rank and hands that handle on, so
        the group reads the same queue. ``pg``: a ``torch.distributed`` process group, or an
        object with vLLM's ``StatelessProcessGroup`` interface (``rank``, ``world_size``,
        ``broadcast_obj``, ``all_gather_obj``), which needs no ``torch.distributed``."""
        g = _Group(pg)
        hosts = g.all_gather(_host_id())
        local = [r for r in range(g.world) if r != writer_rank and hosts[r] == hosts[writer_rank]]
        if g.rank == writer_rank:
            if external_writer_handle is not None:
                q = MessageQueue.create_from_handle(external_writer_handle, g.rank)
            else:
                q = MessageQueue(g.world - 1, len(local), local, max_chunk_bytes, max_chunks, **kwargs)
            g.broadcast(q.export_handle(), writer_rank)
        else:
            q = MessageQueue.create_from_handle(g.broadcast(None, writer_rank), g.rank)
        if blocking:
            q.wait_until_ready()
        return q

    @staticmethod
    def create_from_process_group_single_reader(pg, max_chunk_bytes: int, max_chunks: int, reader_rank: int = 0,
                                                blocking: bool = False, **kwargs):
        """The other direction: every rank but ``reader_rank`` writes a queue of its own with one
        reader, ``reader_rank``. Returns ``(queue, handles)``: on a writer its queue, on the reader
        a list with one reader queue per writer rank (``None`` at its own index); ``handles`` is
        every writer's handle by group rank. ``pg`` as for `create_from_process_group`.
        ``blocking`` is vLLM's argument; the reader attaches before this returns on any rank,
        so the writers' queues are ready either way."""
        g = _Group(pg)
        hosts = g.all_gather(_host_id())
        mine = None
        if g.rank != reader_rank:
            same = hosts[g.rank] == hosts[reader_rank]
            mine = MessageQueue(1, 1 if same else 0, [reader_rank] if same else [], max_chunk_bytes, max_chunks,
                                **kwargs)
        handles = g.all_gather(mine.export_handle() if mine else None)
        if g.rank == reader_rank:
            readers = [None if h is None else MessageQueue.create_from_handle(h, reader_rank) for h in handles]
            g.barrier()
            return readers, handles
        g.barrier()
        mine.wait_until_ready()
        return mine, handles

    def export_handle(self) -> Handle:
        return Handle(self._q.export_handle())

    @property
    def is_writer(self) -> bool:
        return self._q.is_writer

    # vLLM's names for which side this is
    @property
    def _is_writer(self) -> bool:
        return self.is_writer

    @property
    def _is_local_reader(self) -> bool:
        return self.local_reader_rank >= 0

    @property
    def _is_remote_reader(self) -> bool:
        return not self.is_writer and self.local_reader_rank < 0

    @property
    def rank(self) -> int:
        return self._q.rank

    def wait_until_ready(self, timeout: Optional[float] = None) -> None:
        """Writer: until every reader attached or subscribed (raises TimeoutError naming the
        missing ranks). Readers: returns at once (they are ready when attached)."""
        self._q.wait_until_ready(timeout)

    def enqueue(self, obj: Any, timeout: Optional[float] = None) -> None:
        """Send ``obj`` (any picklable object; arrays and buffers travel out of band) to every
        reader. Blocks while the ring is full; ``timeout`` None waits forever (warning every
        ``warn_interval_s``)."""
        if self._q.enqueue_obj(obj, timeout):
            return  # a native frame: arrays, tensors, bytes and trees of them, no pickling
        kind, regions = _serde.encode(obj)
        self._q.enqueue_parts(kind, regions, timeout)

    def dequeue(self, timeout: Optional[float] = None, indefinite: bool = False) -> Any:
        """The next message, in order. ``timeout`` None waits for ever; else
        `stagelink.TimeoutError` after ``timeout`` seconds. As in vLLM, a local reader that
        waits longer than ``VLLM_RINGBUFFER_WARNING_INTERVAL`` logs it (every interval), unless
        ``indefinite`` (a worker waiting for work); ``indefinite`` does not lift the timeout.
        After ``shutdown()``: `stagelink.CancelledError` ("cancelled")."""
        if timeout is not None:
            timeout = float(timeout)
            if timeout != timeout:
                raise _core.InvalidArgumentError("timeout must be a number of seconds or None, not NaN")
            if timeout >= 1e9:  # infinity: for ever
                timeout = None
        q = self._q
        sc = self.__dict__.get("_sc")
        if sc is None or not sc.is_reader:  # the writer (an error) or a remote reader
            kind, regions = q.dequeue_parts(timeout)
        else:
            if "wait" in sc.__dict__ or not (indefinite or (timeout is not None and
                                                            timeout < VLLM_RINGBUFFER_WARNING_INTERVAL)):
                # vLLM's read loop: its SpinCondition's wait is watched or replaced (vLLM's tests
                # count its calls), or a wait this long is logged. Otherwise one wait in C++.
                if not q.wait_message(0):
                    self._wait_message(sc, timeout, indefinite)
                timeout = 0
            kind, regions = q.dequeue_parts(timeout)
            sc.last_read = time.monotonic()  # record_read()
        if kind != _serde.KIND_OBJECT and not self._allow_pickle:
            _core.count_pickle_refused()
            raise _core.CorruptError("a message holding a pickle from an unauthenticated remote writer: refused unread "
                                     "(give the queue CURVE keys, or create_from_handle(..., allow_pickle=True))")
        return _serde.decode(kind, regions, False)

    class ReadTimeoutWithWarnings:
        """vLLM's: a read's deadline and its warning times. `timeout_ms` is how long the next
        wait may sleep (the time to the deadline, at most ``SHM_READER_RECHECK_INTERVAL_MS``, and
        when warning at most ``VLLM_RINGBUFFER_WARNING_INTERVAL``); past the deadline it raises
        ``TimeoutError``. `should_warn` says when a warning is due."""

        def __init__(self, timeout: Optional[float], should_warn: bool) -> None:
            self.started = time.monotonic()
            self.timeout = timeout
            self.deadline = float("inf") if timeout is None else self.started + timeout
            self.warning_wait_time_ms = VLLM_RINGBUFFER_WARNING_INTERVAL * 1000 if should_warn else None
            self._should_warn = should_warn
            self.n_warning = 1

        def timeout_ms(self) -> int:
            wait_ms = SHM_READER_RECHECK_INTERVAL_MS
            if self.warning_wait_time_ms is not None:
                wait_ms = min(wait_ms, self.warning_wait_time_ms)
            if self.timeout is None:
                return wait_ms
            time_left_ms = int((self.deadline - time.monotonic()) * 1000)
            if time_left_ms <= 0:
                raise TimeoutError
            return min(wait_ms, time_left_ms)

        def should_warn(self) -> bool:
            if self._should_warn and time.monotonic() - self.started >= VLLM_RINGBUFFER_WARNING_INTERVAL * self.n_warning:
                self.n_warning += 1
                return True
            return False

    def _wait_message(self, sc: "_SpinCondition", timeout: Optional[float], indefinite: bool) -> None:
        """vLLM's reader loop: ``sc.wait`` until the next message is there, this side is shut down,
        or the deadline passed (the dequeue that follows then raises, saying which)."""
        q = self._q
        observed = "wait" in sc.__dict__
        read_timeout = self.ReadTimeoutWithWarnings(None if timeout is None else max(0.0, float(timeout)),
                                                    should_warn=not indefinite)
        while True:
            try:
                wait_ms = max(1, read_timeout.timeout_ms())  # an interval set to 0 must not spin
            except TimeoutError:
                return
            if observed:
                sc.wait(timeout_ms=wait_ms)
            else:  # the same, without the busy mode's short slices: nothing counts them
                q.wait_message(wait_ms / 1000)
            if q.wait_message(0) or q.shutting_down:
                return
            if read_timeout.should_warn():
                log.info("No available shared memory broadcast block found in %d seconds: message queue reader "
                         "rank %s has waited %.1f s for message %s (the writer is alive; it is not sending)",
                         VLLM_RINGBUFFER_WARNING_INTERVAL, self.rank, time.monotonic() - read_timeout.started,
                         q.stats().get("messages"))

    @contextlib.contextmanager
    def acquire_write(self, timeout: Optional[float] = None):
        """vLLM's: yields a writable buffer of ``max_chunk_bytes`` bytes; what is in it when the
        block ends is sent to every reader (nothing is sent if the block raises). Readers take it
        with `acquire_read` (or `dequeue`, as a memoryview)."""
        buf = bytearray(self.max_chunk_bytes)
        view = memoryview(buf)
        yield view
        view.release()
        self.enqueue(memoryview(buf), timeout)

    @contextlib.contextmanager
    def acquire_read(self, timeout: Optional[float] = None, indefinite: bool = False):
        """vLLM's: yields the next message's buffer (read-only) for the duration of the block:
        what a writer's `acquire_write` filled, or the bytes of a bytes-like message. A
        message that is an object is yielded as that object."""
        msg = self.dequeue(timeout, indefinite)
        if isinstance(msg, (bytes, bytearray, memoryview)):
            view = memoryview(msg).toreadonly()
            try:
                yield view
            finally:
                view.release()
        else:
            yield msg

    @property
    def shutting_down(self) -> bool:
        """True once `shutdown` ran here or (readers) the writer ended the queue."""
        return self._q.shutting_down

    @property
    def _spin_condition(self) -> "_SpinCondition":
        """vLLM's ``SpinCondition`` of this side: a local reader's read loop calls its
        `_SpinCondition.wait` (vLLM's tests count those calls and steer ``last_read`` /
        ``busy_loop_s``). Here every wait sleeps in the kernel until the writer publishes, so the
        busy / idle modes change how often the wait returns, not the CPU it burns."""
        sc = self.__dict__.get("_sc")
        if sc is None:
            sc = self.__dict__["_sc"] = _SpinCondition(self._is_local_reader, self._q)
        return sc

    def broadcast_object(self, obj: Any = None, timeout: Optional[float] = None) -> Any:
        """vLLM's helper: the writer enqueues ``obj`` and returns it; a reader returns what it dequeues."""
        if self.is_writer:
            self.enqueue(obj, timeout)
            return obj
        return self.dequeue(timeout)

    def drop_reader(self, rank: int) -> None:
        """Writer: stop waiting for local reader ``rank`` (dead or too slow)."""
        self._q.drop_reader(int(rank))

    def shutdown(self, everyone: bool = False) -> None:
        """vLLM's: this side's blocked call, and its later ones, end with
        `stagelink.CancelledError` ("cancelled"); the other side is not touched (a reader
        shut down by its own monitor thread, as vLLM's workers do). ``everyone`` (writer): the
        queue ends for every reader too, once each has read what was enqueued before; closing the
        writer (or losing it) does the same."""
        self._q.shutdown(bool(everyone))

    def stats(self) -> dict:
        return self._q.stats()

    @property
    def _native(self):
        return self.__dict__.get("_q")


def _torch_distributed():
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - exercised where torch is absent
        raise _core.UnsupportedError(
            "create_from_process_group needs torch.distributed (pip install torch); "
            "or build the queue with MessageQueue(...) and send export_handle() to the readers") from e
    if not dist.is_available() or not dist.is_initialized():
        raise _core.InvalidArgumentError("create_from_process_group: torch.distributed is not initialized "
                                         "(call torch.distributed.init_process_group first)")
    return dist


def _default_curve(curve: Optional[dict]) -> Optional[dict]:
    """The queue's CURVE keys: ``curve``, else a key file named by STAGELINK_CURVE_SECRET_FILE."""
    if curve is not None:
        return curve
    path = os.environ.get("STAGELINK_CURVE_SECRET_FILE")
    return {"secret_key_file": path} if path else None


class _SpinCondition:
    """vLLM's ``SpinCondition``: its fields and calls, over this queue's futex wait. A reader is
    *busy* for ``busy_loop_s`` after each read (vLLM spins then; here each wait returns within
    1 ms) and *idle* after that (one wait until a message, the timeout or a shutdown). Both
    sleep in the kernel and wake as soon as the writer publishes: no mode burns a core."""

    def __init__(self, is_reader: bool, q=None):
        self.is_reader = is_reader
        self._q = q
        self.last_read = time.monotonic() if is_reader else 0
        self.busy_loop_s = 1 if is_reader else 0

    def record_read(self) -> None:
        self.last_read = time.monotonic()

    def wait(self, timeout_ms: Optional[int] = None) -> None:
        """Return once the next message may be there, this side was shut down, or after
        ``timeout_ms`` (None: ``SHM_READER_RECHECK_INTERVAL_MS``); within 1 ms while busy."""
        if not self.is_reader:
            raise _core.InvalidArgumentError("only a local reader waits on the SpinCondition")
        ms = SHM_READER_RECHECK_INTERVAL_MS if timeout_ms is None else max(0, timeout_ms)
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            ms = min(ms, _BUSY_WAIT_MS)
        self._q.wait_message(ms / 1000)

    def cancel(self) -> None:
        """vLLM wakes an idle reader with it; a reader here is woken by ``shutdown()``."""

    def notify(self) -> None:
        """vLLM's writer pings its readers with it; ``enqueue`` here wakes them itself."""


class _Group:
    """The collectives the queue's constructors need, over a ``torch.distributed`` group or over
    an object with vLLM's ``StatelessProcessGroup`` interface (a TCPStore, no global state)."""

    def __init__(self, pg):
        if hasattr(pg, "broadcast_obj") and hasattr(pg, "all_gather_obj"):
            self._pg, self._dist = pg, None
            self.rank, self.world = int(pg.rank), int(pg.world_size)
            return
        dist = _torch_distributed()
        self._pg, self._dist = pg, dist
        self.rank, self.world = dist.get_rank(pg), dist.get_world_size(pg)
        self._global = dist.get_process_group_ranks(pg)

    def all_gather(self, obj):
        if self._dist is None:
            return list(self._pg.all_gather_obj(obj))
        out = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self._pg)
        return out

    def broadcast(self, obj, src: int):
        if self._dist is None:
            return self._pg.broadcast_obj(obj, src)
        box = [obj]
        self._dist.broadcast_object_list(box, src=self._global[src], group=self._pg)
        return box[0]

    def barrier(self):
        if self._dist is None:
            self._pg.barrier()
        else:
            self._dist.barrier(group=self._pg)


def _host_id() -> str:
    """What tells processes on one host apart from those on others (shared memory reaches them)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
