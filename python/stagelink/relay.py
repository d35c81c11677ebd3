"""The relay: SGLang-Omni's asynchronous buffer API over stagelink's transports.

    relay = stagelink.Relay({"backend": "shm", "credits": 8, "slot_size_mb": 16})
    op = relay.put_async(tensor, request_id="req-1")        # a credit of the edge, then the copy
    outbox.send(ControlMessage("data_ready", "req-1", metadata=op.metadata))  # notify first ...
    op.wait(timeout=5)                                       # ... then wait until it was read
    # receiver (any process on the host):
    got = relay.get_async(metadata, request_id="req-1")
    got.wait(timeout=5); data = got.result()

Credits are per edge (``dst_rank`` or ``edge=``), every credit wait ends after ``timeout_s``
(``ExhaustedError``), one put takes one credit however many tensors it holds, and a credit comes
back when every reader released the data, at ``cleanup(request_id)`` or at ``close()``: an
operation dropped without ``wait`` loses nothing and leaks nothing. Backends: ``shm`` (the
shared-memory arena, one slot per credit, reused), ``local`` (same process; Python objects by
reference, read-only by convention, as the seed's LOCAL_OBJECT), ``connector`` (any connector by
class name).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

from . import _core, _serde
from ._lifetime import NativeOwner


class RelayOperation:
    """A put or get in flight: ``metadata`` (what the receiver's ``get_async`` needs),
    ``wait(timeout)`` and, for gets, ``result()``.

    Also usable as SGLang-Omni's asynchronous API: ``op = await relay.put_async(...)`` (the
    operation is awaitable and gives itself) and ``await op.wait_for_completion(timeout=...)``
    (the wait runs in the loop's executor, so the event loop is not blocked)."""

    __slots__ = ("_op", "_result", "_size")

    def __await__(self):
        if False:  # a generator that returns at once: `await op` is `op`
            yield
        return self

    def __init__(self, op=None, result=None, size=0):
        self._op = op
        self._result = result
        self._size = size

    @property
    def metadata(self) -> Any:
        return self._op.metadata if self._op is not None else None

    def wait(self, timeout: Optional[float] = None) -> None:
        """Put: until every reader released the data (its credit is back). Get: returns at once
        (the data is here). ``timeout`` None waits forever. Raises TimeoutError, CancelledError
        (``cleanup`` before it was read) or ClosedError."""
        if self._op is not None:
            self._op.wait(timeout)

    async def wait_for_completion(self, timeout: Optional[float] = None) -> None:
        """The seed's awaitable wait: ``await op.wait_for_completion(timeout=5)``. Same errors as
        :meth:`wait`; synchronous callers use :meth:`wait`."""
        if self._op is None or self.done():
            return self.wait(0) if self._op is not None else None
        import asyncio
        await asyncio.get_running_loop().run_in_executor(None, self.wait, timeout)

    def done(self) -> bool:
        return self._op.done() if self._op is not None else True

    def result(self) -> Any:
        """The object a get read (a put's result is None)."""
        return self._result

    @property
    def size(self) -> int:
        return self._size


class Relay(NativeOwner):  # NativeOwner: close(), closed, with-blocks, close on collection
    """``config``: the seed's RelayConfig keys (``slot_size_mb``, ``credits``, ``rank``,
    ``world_size``, ``device``) plus ``backend`` (shm | local | connector), ``connector``,
    ``extra`` (the connector's) and ``timeout_s`` (credit and get waits, default 30). Unknown keys
    raise InvalidArgumentError. ``allow_pickle``: objects with no native frame are pickled (and
    read back) only when true."""

    def __init__(self, config: Optional[dict] = None, allow_pickle: bool = True, **kw):
        config = dict(config or {}, **kw)
        self.backend = config.get("backend", "shm")
        self.timeout_s = float(config.get("timeout_s", 30))
        self.allow_pickle = allow_pickle
        if self.backend == "local":
            self._native = None
            self._local = _LocalRelay(int(config.get("credits", 8)), self.timeout_s)
            # Validated like the others (unknown keys, bad values) though nothing native runs.
            _core._Relay(dict(config, backend="local"), allow_pickle).close()
        else:
            self._native = _core._Relay(config, allow_pickle)

    def put_async(self, data, request_id: Optional[str] = None, dst_rank: Optional[int] = None, *,
                  edge: Optional[str] = None, readers: int = 1) -> RelayOperation:
        """Publish ``data`` (numpy arrays, torch tensors, bytes, trees of them; other objects are
        pickled where allowed) for ``readers`` gets. Takes a credit of the edge (``edge``, else
        ``dst_rank``), waiting up to ``timeout_s`` (ExhaustedError after it). Returns at once
        after the copy; the operation's ``metadata`` goes into the control message."""
        if self._native is None:
            return self._local.put(data, request_id, edge if edge is not None else f"rank{dst_rank}", readers)
        n = self._live()
        e = edge or ""
        op = n._put_obj(data, request_id, dst_rank, e, readers)
        if op is None:
            if not self.allow_pickle:
                raise _core.InvalidArgumentError(
                    f"relay put of a {type(data).__name__}: no native frame and allow_pickle is off")
            kind, regions = _serde.encode(data)
            op = n._put_parts(kind, regions, request_id, dst_rank, e, readers)
        return RelayOperation(op)

    def get_async(self, metadata, dest=None, request_id: Optional[str] = None, *,
                  timeout: Optional[float] = None, zero_copy: bool = False) -> RelayOperation:
        """Read what ``put_async`` published, given its ``metadata``. ``dest``: a writable
        buffer (numpy array, bytearray, CPU torch tensor's ``.numpy()``) the payload's one array
        is copied into (one memcpy); otherwise ``result()`` is the object. ``zero_copy``: arrays
        are read-only views that hold the slot until dropped. Raises CorruptError for metadata
        that is not a relay's, NotFoundError when it was already read by every reader or cleaned
        up, InvalidArgumentError for a ``dest`` that is too small."""
        if dest is not None and not _is_buffer(dest) and hasattr(dest, "numpy"):
            dest = dest.numpy()  # a CPU torch tensor: its memory, as numpy sees it
        if self._native is None:
            obj = self._local.get(metadata)
            if dest is not None:
                _copy_into(obj, dest)
            return RelayOperation(None, obj, 0)
        n = self._live()
        if dest is not None:
            size = n._get_into(metadata, dest, request_id, timeout)
            return RelayOperation(None, dest, size)
        kind, obj, size = n._get_found(metadata, request_id, timeout, zero_copy)
        if kind != _serde.KIND_OBJECT:
            obj = _serde.decode(kind, obj, zero_copy)
        return RelayOperation(None, obj, size)

    def cleanup(self, request_id: str) -> int:
        """Release every unread put of ``request_id`` (on this host, for shm) and the credits
        this relay holds for them. Returns how many were released."""
        if self._native is None:
            return self._local.cleanup(str(request_id))
        return self._live().cleanup(str(request_id))

    def health(self) -> dict:
        if self._native is None:
            return self._local.health()
        return self._native.health()

    def close(self) -> None:
        if self.__dict__.get("_local") is not None:
            self._local.close()
        super().close()

    def _live(self):
        if self._native.closed:
            raise _core.ClosedError("relay is closed")
        return self._native


def _is_buffer(obj) -> bool:
    try:
        memoryview(obj)
        return True
    except TypeError:
        return False


def _copy_into(obj, dest):
    import numpy as np
    src = np.asarray(obj).reshape(-1).view(np.uint8)
    dst = np.asarray(memoryview(dest)).reshape(-1).view(np.uint8)
    if src.nbytes > dst.nbytes:
        raise _core.InvalidArgumentError(f"relay get: {src.nbytes} bytes do not fit the destination's {dst.nbytes}")
    dst[:src.nbytes] = src


# The same-process backend: Python objects by reference (the seed's LOCAL_OBJECT), one table per
# process shared by every local relay, with the same credit rules as the native backends.
_TABLE: dict = {}
_TABLE_LOCK = threading.Condition()
_NEXT = [1]


class _LocalRelay:
    def __init__(self, credits: int, timeout_s: float):
        self.credits, self.timeout_s = credits, timeout_s
        self.inflight: dict = {}   # edge -> set of item ids
        self.closed = False
        self.puts = self.gets = 0

    def put(self, data, request_id, edge, readers):
        deadline = time.monotonic() + self.timeout_s
        with _TABLE_LOCK:
            while True:
                if self.closed:
                    raise _core.ClosedError("relay is closed")
                live = self.inflight[edge] = {k for k in self.inflight.get(edge, ()) if k in _TABLE}
                if len(live) < self.credits:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _core.ExhaustedError(f"relay: no credit for edge '{edge}' after {self.timeout_s} s: all "
                                               f"{self.credits} are held by unread puts; is the receiver reading?")
                _TABLE_LOCK.wait(_slice(left))
            key = _NEXT[0]
            _NEXT[0] += 1
            flag = [False]  # set by cleanup: the op's wait says cancelled
            _TABLE[key] = [data, readers, str(request_id) if request_id is not None else None, self, flag]
            live.add(key)
            self.puts += 1
        return RelayOperation(_LocalOp(key, {"local": key, "pid": _pid()}, flag))

    def get(self, metadata):
        if not isinstance(metadata, dict) or "local" not in metadata:
            raise _core.CorruptError("relay metadata lacks 'local' (not from a local relay put?)")
        if metadata.get("pid") != _pid():
            raise _core.InvalidArgumentError("local relay metadata from another process; the local backend is same-process only")
        with _TABLE_LOCK:
            item = _TABLE.get(metadata["local"])
            if item is None:
                raise _core.NotFoundError(f"local relay item {metadata['local']} is gone (read or cleaned up)")
            item[1] -= 1
            if item[1] == 0:
                del _TABLE[metadata["local"]]
                _TABLE_LOCK.notify_all()
            self.gets += 1
            return item[0]

    def cleanup(self, rid):
        with _TABLE_LOCK:
            gone = [k for k, v in _TABLE.items() if v[2] == rid]
            for k in gone:
                _TABLE.pop(k)[4][0] = True
            _TABLE_LOCK.notify_all()
        return len(gone)

    def health(self):
        with _TABLE_LOCK:
            return {"backend": "local", "status": "closed" if self.closed else "healthy", "puts": self.puts,
                    "gets": self.gets, "credits": self.credits,
                    "credits_in_use": {e: sum(k in _TABLE for k in s) for e, s in self.inflight.items()}}

    def close(self):
        with _TABLE_LOCK:
            self.closed = True
            for k in [k for k, v in _TABLE.items() if v[3] is self]:
                del _TABLE[k]
            _TABLE_LOCK.notify_all()


class _LocalOp:
    def __init__(self, key, metadata, flag):
        self.key, self.metadata, self.flag = key, metadata, flag

    def done(self):
        with _TABLE_LOCK:
            return self.key not in _TABLE

    def wait(self, timeout):
        if timeout is not None and timeout != timeout:
            raise _core.InvalidArgumentError("timeout must be a number of seconds or None, not NaN")
        deadline = None if timeout is None or timeout >= 1e9 else time.monotonic() + timeout
        with _TABLE_LOCK:
            while self.key in _TABLE:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise _core.TimeoutError(f"relay put not read after {timeout} s")
                _TABLE_LOCK.wait(_slice(left))
            if self.flag[0]:
                raise _core.CancelledError("relay put cancelled (cleanup) before it was read")


def _slice(left):
    """A Condition.wait timeout: None for none or an infinite one (Condition.wait refuses those
    past its limit with OverflowError)."""
    return None if left is None or left > 1e6 else left


def _pid():
    import os
    return os.getpid()
