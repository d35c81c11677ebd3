"""MessageQueue: one writer, many readers (vLLM's ``shm_broadcast.MessageQueue`` API).

    writer = stagelink.MessageQueue(n_reader=3, n_local_reader=2)   # rank 2 is remote (TCP)
    handle = writer.export_handle()                                   # picklable, send it to readers
    reader = stagelink.MessageQueue.create_from_handle(handle, rank)  # in each reader process
    writer.wait_until_ready(timeout=60); reader.wait_until_ready()
    writer.enqueue({"step": 1, "x": np.ones(4)}); obj = reader.dequeue(timeout=5)

Local readers share a ring in shared memory (no copy, no socket; messages larger than a chunk go
through a shared-memory overflow area); remote readers receive the same messages, in the same
order, over ZeroMQ. Timeouts raise :class:`stagelink.TimeoutError` naming the readers behind;
``shutdown()`` wakes every blocked side with :class:`stagelink.CancelledError`.
"""
from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any, Optional, Sequence


from . import _core, _serde
from ._lifetime import NativeOwner

log = logging.getLogger("stagelink")


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
    """The writer side; readers come from :meth:`create_from_handle`.

    ``n_reader`` readers in all, ``n_local_reader`` of them on this host (ranks
    ``local_reader_ranks``: any distinct numbers, by default ``0 .. n_local_reader-1``), the
    others connect over TCP to ``connect_ip`` (None: this host's address, the socket bound on
    every interface, as vLLM). ``max_chunk_bytes`` x ``max_chunks`` is the ring.
    ``enable_shm_tensor_arena`` is accepted for vLLM's callers: arrays and tensors always travel
    as typed regions in shared memory here. Beyond vLLM's arguments:
    ``overflow_bytes`` (shared memory for messages larger than a chunk), ``warn_interval_s``
    (a blocked writer logs the readers it waits for), ``drop_dead_readers`` (go on without a
    reader whose process died instead of raising :class:`stagelink.PeerDeadError`), ``spin_us``
    (spin before sleeping in the kernel).
    """

    def __init__(self, n_reader: int, n_local_reader: int, local_reader_ranks: Optional[Sequence[int]] = None,
                 max_chunk_bytes: int = 10 << 20, max_chunks: int = 10, connect_ip: Optional[str] = None,
                 enable_shm_tensor_arena: bool = True, *, remote_port: int = 0, overflow_bytes: int = 64 << 20,
                 warn_interval_s: float = 60.0, drop_dead_readers: bool = False, spin_us: int = 50,
                 shm_dir: str = "/dev/shm", _core_mq=None):
        self.max_chunk_bytes = int(max_chunk_bytes)
        if _core_mq is not None:
            self._q = _core_mq
            return
        ranks = list(local_reader_ranks) if local_reader_ranks is not None else list(range(n_local_reader))
        self._q = _core._MessageQueue.create(
            int(n_reader), int(n_local_reader), [int(r) for r in ranks], int(max_chunk_bytes), int(max_chunks),
            connect_ip or "", int(remote_port), int(overflow_bytes), float(warn_interval_s),
            bool(drop_dead_readers), int(spin_us), shm_dir)

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> "MessageQueue":
        """Attach reader ``rank``: through shared memory when ``rank`` is one of the handle's
        ``local_reader_ranks``, otherwise over TCP (``-1``: a remote-only reader)."""
        data = handle.data if isinstance(handle, Handle) else bytes(handle)
        info = _core.mq_handle_info(data)
        q = MessageQueue(0, 0, max_chunk_bytes=info["chunk_bytes"] or (10 << 20),
                         _core_mq=_core._MessageQueue.create_from_handle(data, int(rank)))
        return q

    @staticmethod
    def create_from_process_group(pg, max_chunk_bytes: int, max_chunks: int, writer_rank: int = 0,
                                  **kwargs) -> "MessageQueue":
        """vLLM's: the group's ``writer_rank`` writes, every other rank reads (through shared memory
        on the writer's host, over TCP elsewhere). Every rank of ``pg`` calls it; it returns once
        every reader is attached. Needs ``torch.distributed``."""
        dist = _torch_distributed()
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        global_ranks = dist.get_process_group_ranks(pg)
        hosts = [None] * world
        dist.all_gather_object(hosts, _host_id(), group=pg)
        local = [r for r in range(world) if r != writer_rank and hosts[r] == hosts[writer_rank]]
        if rank == writer_rank:
            q = MessageQueue(world - 1, len(local), local, max_chunk_bytes, max_chunks, **kwargs)
            dist.broadcast_object_list([q.export_handle()], src=global_ranks[writer_rank], group=pg)
        else:
            got = [None]
            dist.broadcast_object_list(got, src=global_ranks[writer_rank], group=pg)
            q = MessageQueue.create_from_handle(got[0], rank)
        q.wait_until_ready()
        return q

    @staticmethod
    def create_from_process_group_single_reader(pg, max_chunk_bytes: int, max_chunks: int, reader_rank: int = 0,
                                                **kwargs):
        """The other direction: every rank but ``reader_rank`` writes a queue of its own with one
        reader, ``reader_rank``. Returns ``(queue, handles)``: on a writer its queue, on the reader
        a list with one reader queue per writer rank (``None`` at its own index); ``handles`` is
        every writer's handle by group rank. Needs ``torch.distributed``."""
        dist = _torch_distributed()
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        hosts = [None] * world
        dist.all_gather_object(hosts, _host_id(), group=pg)
        mine = None
        if rank != reader_rank:
            same = hosts[rank] == hosts[reader_rank]
            mine = MessageQueue(1, 1 if same else 0, [reader_rank] if same else [], max_chunk_bytes, max_chunks,
                                **kwargs)
        handles = [None] * world
        dist.all_gather_object(handles, mine.export_handle() if mine else None, group=pg)
        if rank == reader_rank:
            readers = [None if h is None else MessageQueue.create_from_handle(h, reader_rank) for h in handles]
            dist.barrier(group=pg)
            return readers, handles
        dist.barrier(group=pg)
        mine.wait_until_ready()
        return mine, handles

    def export_handle(self) -> Handle:
        return Handle(self._q.export_handle())

    @property
    def is_writer(self) -> bool:
        return self._q.is_writer

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
        """The next message, in order. ``timeout`` None (or ``indefinite``) waits forever; else
        :class:`stagelink.TimeoutError` after ``timeout`` seconds. After ``shutdown()``:
        :class:`stagelink.CancelledError`."""
        kind, regions = self._q.dequeue_parts(None if indefinite else timeout)
        return _serde.decode(kind, regions, False)

    @contextlib.contextmanager
    def acquire_write(self, timeout: Optional[float] = None):
        """vLLM's: yields a writable buffer of ``max_chunk_bytes`` bytes; what is in it when the
        block ends is sent to every reader (nothing is sent if the block raises). Readers take it
        with :meth:`acquire_read` (or :meth:`dequeue`, as a memoryview)."""
        buf = bytearray(self.max_chunk_bytes)
        view = memoryview(buf)
        yield view
        view.release()
        self.enqueue(memoryview(buf), timeout)

    @contextlib.contextmanager
    def acquire_read(self, timeout: Optional[float] = None, indefinite: bool = False):
        """vLLM's: yields the next message's buffer (read-only) for the duration of the block:
        what a writer's :meth:`acquire_write` filled, or the bytes of a bytes-like message. A
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
        """True once :meth:`shutdown` ran here or (readers) the writer shut the queue down."""
        return self._q.shutting_down

    def broadcast_object(self, obj: Any = None, timeout: Optional[float] = None) -> Any:
        """vLLM's helper: the writer enqueues ``obj`` and returns it; a reader returns what it dequeues."""
        if self.is_writer:
            self.enqueue(obj, timeout)
            return obj
        return self.dequeue(timeout)

    def drop_reader(self, rank: int) -> None:
        """Writer: stop waiting for local reader ``rank`` (dead or too slow)."""
        self._q.drop_reader(int(rank))

    def shutdown(self) -> None:
        """Wake every blocked reader and writer with CancelledError (a reader: only itself).
        Messages already enqueued are still delivered."""
        self._q.shutdown()

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


def _host_id() -> str:
    """What tells processes on one host apart from those on others (shared memory reaches them)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
