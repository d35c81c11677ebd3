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

import logging
from typing import Any, Optional, Sequence


from . import _core, _serde
from ._lifetime import NativeOwner

log = logging.getLogger("stagelink")


class Handle:
    """What a reader needs to attach (segment names, remote address): small and picklable."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = bytes(data)

    def __reduce__(self):
        return (Handle, (self.data,))

    def __repr__(self):
        return f"<stagelink.mq.Handle {len(self.data)} bytes>"


class MessageQueue(NativeOwner):
    """The writer side; readers come from :meth:`create_from_handle`.

    ``n_reader`` readers in all, ``n_local_reader`` of them on this host (ranks
    ``local_reader_ranks``, by default ``0 .. n_local_reader-1``), the others connect over TCP to
    ``connect_ip``. ``max_chunk_bytes`` x ``max_chunks`` is the ring. Beyond vLLM's arguments:
    ``overflow_bytes`` (shared memory for messages larger than a chunk), ``warn_interval_s``
    (a blocked writer logs the readers it waits for), ``drop_dead_readers`` (go on without a
    reader whose process died instead of raising :class:`stagelink.PeerDeadError`), ``spin_us``
    (spin before sleeping in the kernel).
    """

    def __init__(self, n_reader: int, n_local_reader: int, local_reader_ranks: Optional[Sequence[int]] = None,
                 max_chunk_bytes: int = 10 << 20, max_chunks: int = 10, connect_ip: Optional[str] = None, *,
                 remote_port: int = 0, overflow_bytes: int = 64 << 20, warn_interval_s: float = 60.0,
                 drop_dead_readers: bool = False, spin_us: int = 50, shm_dir: str = "/dev/shm", _core_mq=None):
        if _core_mq is not None:
            self._q = _core_mq
            return
        ranks = list(local_reader_ranks) if local_reader_ranks is not None else list(range(n_local_reader))
        self._q = _core._MessageQueue.create(
            int(n_reader), int(n_local_reader), [int(r) for r in ranks], int(max_chunk_bytes), int(max_chunks),
            connect_ip or "127.0.0.1", int(remote_port), int(overflow_bytes), float(warn_interval_s),
            bool(drop_dead_readers), int(spin_us), shm_dir)

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> "MessageQueue":
        """Attach reader ``rank`` (local through shared memory, or remote over TCP)."""
        data = handle.data if isinstance(handle, Handle) else bytes(handle)
        return MessageQueue(0, 0, _core_mq=_core._MessageQueue.create_from_handle(data, int(rank)))

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

    def dequeue(self, timeout: Optional[float] = None) -> Any:
        """The next message, in order. ``timeout`` None waits forever."""
        kind, regions = self._q.dequeue_parts(timeout)
        return _serde.decode(kind, regions, False)

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
