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

from typing import Any, Optional

from . import _core, _serde
from ._lifetime import NativeOwner, track


def default_allow_pickle(config: dict) -> bool:
    """Whether a relay of ``config`` unpickles by default: only where the payload cannot come from
    another host or another user (shared memory is owner-checked; ``local`` is one process)."""
    backend = config.get("backend", "shm")
    if backend in ("shm", "local"):
        return True
    if backend == "connector":
        from .connector import has_trait
        extra = config.get("extra") or {}
        name = config.get("connector", "SharedMemoryConnector")
        return bool(extra.get("allow_pickle", has_trait(name, "pickle_default")))
    return False


class RelayOperation:
    """A put or get in flight: ``metadata`` (what the receiver's ``get_async`` needs),
    ``wait(timeout)`` and, for gets, ``result()``.

    Also usable as SGLang-Omni's asynchronous API: ``op = await relay.put_async(...)`` (the
    operation is awaitable and gives itself) and ``await op.wait_for_completion(timeout=...)``
    (the wait runs in the loop's executor, so the event loop is not blocked)."""

    __slots__ = ("_op", "_result", "_size", "_failed")

    def __await__(self):
        if False:  # a generator that returns at once: `await op` is `op`
            yield
        return self

    def __init__(self, op=None, result=None, size=0):
        self._op = op
        self._result = result
        self._size = size
        self._failed = None

    @property
    def metadata(self) -> Any:
        return self._op.metadata if self._op is not None else None

    def wait(self, timeout: Optional[float] = None) -> None:
        """Put: until every reader released the data (its credit is back). Get: returns at once
        (the data is here). ``timeout`` None waits forever. Raises TimeoutError, CancelledError
        (``cleanup`` before it was read), ClosedError, or what `mark_receiver_failed` was
        given."""
        if self._failed is not None:
            raise self._failed
        if self._op is not None:
            self._op.wait(timeout)

    def mark_receiver_done(self) -> None:
        """SGLang-Omni's receiver acknowledgement, which its put waits for. Here a put completes
        by itself once every reader released the data (across processes, no message needed), so
        an acknowledgement relayed by the control plane changes nothing; it is accepted."""

    def mark_receiver_failed(self, exc: BaseException) -> None:
        """The receiver could not take the data: a put still unread is withdrawn (its slot and
        credit come back at once) and `wait` / `wait_for_completion` raise ``exc``.
        The first failure reported is kept."""
        if self._failed is None:
            self._failed = exc
        if self._op is not None:  # a put (native or local); a get has none
            self._op.withdraw()

    async def wait_for_completion(self, timeout: Optional[float] = 30.0) -> None:
        """SGLang-Omni's awaitable wait, with its contract: ``await op.wait_for_completion()``
        waits up to ``timeout`` seconds (30 by default; None: no limit) for the put to be
        consumed. A put not consumed in time is withdrawn (its slot and credit come back at once,
        a later get of it fails) and ``TimeoutError`` ("was not consumed in time") is raised.
        Otherwise the same errors as `wait`, which keeps an unread put on timeout; a get
        returns at once. The wait runs in the loop's executor: the event loop is not blocked."""
        if self._failed is not None:
            raise self._failed
        if self._op is None or self.done():
            return self.wait(0) if self._op is not None else None
        import asyncio
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.wait, timeout)
        except _core.TimeoutError:
            if self._op.withdraw():
                back = ("its slot and credit are back" if self._op.done() else
                        "its slot and credit come back when the reader already reading it is done")
                raise _core.TimeoutError(f"relay put {self._name()} was not consumed in time ({timeout} s); it was "
                                         f"withdrawn: {back}") from None
            self.wait(0)  # read just as the wait ended: done after all

    def _name(self) -> str:
        md = self.metadata
        if isinstance(md, dict):
            return repr(md.get("relay_key", md.get("local", "")))
        return ""

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
    ``world_size``, ``device``) plus ``backend`` (shm | local | ucx | connector), ``connector``,
    ``extra`` (the connector's), ``timeout_s`` (credit and get waits, default 30) and
    ``engine_id`` (SGLang-Omni's sender name, in every put's metadata). Unknown keys raise
    InvalidArgumentError. ``allow_pickle`` (the argument, or the config's ``allow_pickle`` key):
    objects with no native frame are pickled (and read back) only when true. Unset, it is true
    only where both ends are the same user on one host (``shm``, ``local``, and ``connector`` over
    the shared-memory connector) and false where a payload can come from another host (``ucx``,
    network connectors): unpickling runs code the sender chose. ``device`` and ``engine_id`` are
    attributes, as SGLang-Omni's relays have them (its stage code reads ``relay.device``)."""

    def __init__(self, config: Optional[dict] = None, allow_pickle: Optional[bool] = None, **kw):
        config = dict(config or {}, **kw)
        configured = config.pop("allow_pickle", None)
        if allow_pickle is None:
            allow_pickle = default_allow_pickle(config) if configured is None else bool(configured)
        self.backend = config.get("backend", "shm")
        self.timeout_s = float(config.get("timeout_s", 30))
        self.allow_pickle = allow_pickle
        self.device = config.get("device", "cpu")
        self.engine_id = config.get("engine_id", "")
        self._native = _core._Relay(config, allow_pickle)
        track(self)  # closed at exit if still open then

    def put_async(self, data, request_id: Optional[str] = None, dst_rank: Optional[int] = None,
                  receiver_id: Optional[str] = None, *, edge: Optional[str] = None, readers: int = 1,
                  traceparent: Optional[str] = None) -> RelayOperation:
        """Publish ``data`` (numpy arrays, torch tensors, bytes, trees of them; other objects are
        pickled where allowed) for ``readers`` gets. Takes a credit of the edge (``edge``, else
        SGLang-Omni's ``receiver_id``, else ``dst_rank``), waiting up to ``timeout_s``
        (ExhaustedError after it). Returns at once after the copy; the operation's ``metadata``
        goes into the control message. ``traceparent``: a W3C trace context (stagelink.trace); when
        it is sampled and this process records traces, a wait for a credit and the put are spans."""
        if edge is None and receiver_id is not None:
            edge = f"receiver:{receiver_id}"
        n = self._live()
        e = edge or ""
        tp = traceparent or ""
        if self.backend == "local":  # the object itself, by reference (the seed's LOCAL_OBJECT)
            return RelayOperation(n._put_ref(data, request_id, dst_rank, e, readers, _nbytes(data), tp))
        op = n._put_obj(data, request_id, dst_rank, e, readers, tp)
        if op is None:
            if not self.allow_pickle:
                raise _core.InvalidArgumentError(
                    f"relay put of a {type(data).__name__}: no native frame and allow_pickle is off")
            kind, regions = _serde.encode(data)
            op = n._put_parts(kind, regions, request_id, dst_rank, e, readers, tp)
        return RelayOperation(op)

    def put_many_async(self, segments, total_size: int, request_id: Optional[str] = None,
                       dst_rank: Optional[int] = None, receiver_id: Optional[str] = None, *,
                       edge: Optional[str] = None, readers: int = 1,
                       traceparent: Optional[str] = None) -> RelayOperation:
        """SGLang-Omni's segmented put: ``segments`` is a list of ``(offset, tensor)`` (CPU torch
        tensors of any dtype, numpy arrays or bytes-likes, contiguous), written as their bytes at
        their offsets into one uint8 payload of ``total_size`` bytes (zeros between) straight
        into the relay's shared memory: one copy, no concatenation first. A receiver reads it as
        any put (``get_async(metadata, dest_tensor=uint8[total_size])``). Credits and errors as
        `put_async`; InvalidArgumentError for segments that overlap or end past
        ``total_size``."""
        if edge is None and receiver_id is not None:
            edge = f"receiver:{receiver_id}"
        total_size = int(total_size)
        parts = [(int(off), _byte_view(t)) for off, t in segments]
        if total_size < 0 or any(off < 0 for off, _ in parts):
            raise _core.InvalidArgumentError(f"relay put_many_async: total_size ({total_size}) and offsets must not "
                                             "be negative")
        return RelayOperation(self._live()._put_segments(parts, total_size, request_id, dst_rank, edge or "", readers,
                                                         traceparent or ""))

    def get_async(self, metadata, dest=None, request_id: Optional[str] = None, *, dest_tensor=None,
                  timeout: Optional[float] = None, zero_copy: bool = False,
                  traceparent: Optional[str] = None) -> RelayOperation:
        """Read what ``put_async`` published, given its ``metadata``. ``dest`` (SGLang-Omni's
        ``dest_tensor``): a writable buffer (numpy array, bytearray, contiguous torch tensor of any
        dtype, CPU or CUDA) the payload's one array is copied into, as bytes (one copy); otherwise
        ``result()`` is the object. ``zero_copy``: arrays are read-only views that hold the slot
        until dropped. Raises CorruptError for metadata that is not a relay's, NotFoundError when
        it was already read by every reader or cleaned up, InvalidArgumentError for a ``dest``
        that is too small. ``traceparent``: as `put_async`'s (the connector's get is a span)."""
        if dest is None:
            dest = dest_tensor
        tp = traceparent or ""
        if dest is not None and not _is_buffer(dest) and hasattr(dest, "numpy") and not _is_cuda(dest):
            dest = _tensor_memory(dest)
        n = self._live()
        if dest is not None and (self.backend == "local" or _is_cuda(dest) or
                                 (isinstance(metadata, dict) and metadata.get("cuda_ipc"))):
            # The object (by reference on the local backend; a tensor on its GPU for a payload left
            # there), then one copy into dest: device to device, to the host or back for CUDA.
            kind, obj, size = n._get_found(metadata, request_id, timeout, False, tp)
            if kind != _serde.KIND_OBJECT:
                obj = _serde.decode(kind, obj, False)
            _copy_into(obj, dest)
            return RelayOperation(None, dest, _nbytes(obj))
        if dest is not None:
            size = n._get_into(metadata, dest, request_id, timeout, tp)
            return RelayOperation(None, dest, size)
        kind, obj, size = n._get_found(metadata, request_id, timeout, zero_copy, tp)
        if kind != _serde.KIND_OBJECT:
            obj = _serde.decode(kind, obj, zero_copy)
        return RelayOperation(None, obj, size)

    def sender_info(self) -> Optional[dict]:
        """Where another process's relay of this backend reaches this one's puts (``ucx``: the
        ``source_host`` and ``source_port`` of its side channel); ``None`` where nothing needs
        connecting (``shm``, ``local``)."""
        return self._native.sender_info()

    def connect(self, sender_info, timeout: Optional[float] = None) -> None:
        """Connect to the relay ``sender_info`` describes (its `sender_info`, or one of its
        puts' metadata) before the first ``get_async`` from it, which then costs what the next ones
        do (a UCX relay's first get from a sender otherwise connects: milliseconds over TCP).
        Within ``timeout`` (default ``timeout_s``). Nothing to do for ``shm`` and ``local``."""
        self._live()._connect(sender_info, timeout)

    def cleanup(self, request_id: str) -> int:
        """Withdraw this relay's own unread puts of ``request_id``: their slots and credits come
        back and their waits raise CancelledError. Other relays' puts of the request (another
        stage's, another receiver's) are left alone. Returns how many were withdrawn."""
        return self._live().cleanup(str(request_id))

    def health(self) -> dict:
        return self._native.health()

    def _live(self):
        if self._native.closed:
            raise _core.ClosedError("relay is closed")
        return self._native


class _TypedRelay(Relay):
    """A relay of one backend with SGLang-Omni's constructor: ``(engine_id, slot_size_mb, credits,
    device)``, then stagelink's keywords."""

    _backend, _slot_size_mb, _credits = "shm", 16, 8

    def __init__(self, engine_id: str = "", slot_size_mb: Optional[float] = None, credits: Optional[int] = None,
                 device: str = "cpu", *, timeout_s: float = 30, extra: Optional[dict] = None, rank: int = 0,
                 world_size: int = 0, allow_pickle: Optional[bool] = None):
        config = {"backend": self._backend, "engine_id": str(engine_id), "device": device,
                  "slot_size_mb": self._slot_size_mb if slot_size_mb is None else slot_size_mb,
                  "credits": self._credits if credits is None else credits, "timeout_s": timeout_s,
                  "rank": rank, "world_size": world_size}
        if extra is not None:
            config["extra"] = extra
        super().__init__(config, allow_pickle=allow_pickle)


class ShmRelay(_TypedRelay):
    """SGLang-Omni's ``ShmRelay(engine_id, slot_size_mb=64, credits=2, device="cpu")``: the
    shared-memory relay with its defaults (one arena of ``slot_size_mb * credits``, reused)."""
    _backend, _slot_size_mb, _credits = "shm", 64, 2


class LocalRelay(_TypedRelay):
    """The same-process relay (Python objects by reference)."""
    _backend = "local"


class UcxRelay(_TypedRelay):
    """The cross-host relay over the transfer engine (UCX: RDMA or TCP); ``extra`` takes its keys."""
    _backend = "ucx"


# SGLang-Omni's registry: relay type name -> class. create_relay looks types up here;
# register_relay adds (or replaces) one.
RELAY_REGISTRY: dict = {"shm": ShmRelay, "local": LocalRelay, "ucx": UcxRelay}
_SGLANG_ONLY = ("nccl", "cuda_ipc", "mooncake", "nixl")


def register_relay(name: str):
    """SGLang-Omni's decorator, ``@register_relay("mine") class MyRelay(...)``: ``create_relay("mine",
    ...)`` then makes a ``MyRelay``. Registering a name again replaces it (logged)."""
    def decorator(cls):
        if name in RELAY_REGISTRY:
            import logging
            logging.getLogger("stagelink").warning("relay type '%s' is already registered; replacing it", name)
        RELAY_REGISTRY[name] = cls
        return cls
    return decorator


def create_relay(relay_type: str, **kwargs) -> Relay:
    """SGLang-Omni's factory, ``create_relay("shm", engine_id="e0", slot_size_mb=64, credits=2)``:
    an instance of the class registered for ``relay_type`` (``shm`` -> `ShmRelay`, with
    SGLang-Omni's 64 MiB slots and 2 credits; ``local`` -> `LocalRelay`; ``ucx`` ->
    `UcxRelay`; or one of yours, `register_relay`). As there, keyword arguments the
    class's constructor does not take are left out (all are passed to one taking ``**kwargs``).
    An unknown type is a ``ValueError``; SGLang-Omni's ``nccl``, ``cuda_ipc``, ``mooncake`` and
    ``nixl`` relays, unless registered, are `stagelink.UnsupportedError` (``ucx`` is
    stagelink's cross-host relay)."""
    cls = RELAY_REGISTRY.get(relay_type)
    if cls is None and relay_type in _SGLANG_ONLY:
        raise _core.UnsupportedError(f"relay type '{relay_type}' is SGLang-Omni's; stagelink's relays are shm "
                                     f"(same host), local (same process) and ucx (across hosts, RDMA or TCP)")
    if cls is None:
        raise ValueError(f"Unknown relay type: '{relay_type}'. Available types: {sorted(RELAY_REGISTRY)}")
    import inspect
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params and k != "self"}
    return cls(**kwargs)


def _is_buffer(obj) -> bool:
    try:
        memoryview(obj)
        return True
    except TypeError:
        return False


def _tensor_memory(t):
    """A CPU torch tensor's own memory as a numpy array (written in place): as its dtype, or as
    bytes for one numpy lacks (bfloat16, float8)."""
    t = t.detach()
    if not t.is_contiguous():
        raise _core.InvalidArgumentError("relay get: a destination tensor must be contiguous")
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        import torch
        return t.reshape(-1).view(torch.uint8).numpy()


def _byte_view(obj):
    """A contiguous object's bytes as a flat uint8 numpy view (no copy): a CPU torch tensor of any
    dtype, a numpy array, a bytes-like."""
    import numpy as np
    if not _is_buffer(obj) and hasattr(obj, "numpy"):
        obj = _tensor_memory(obj)
    arr = np.asarray(memoryview(obj))
    if not arr.flags.c_contiguous:
        raise _core.InvalidArgumentError("relay put_many_async: a segment must be contiguous")
    return arr.reshape(-1).view(np.uint8)


def _nbytes(obj) -> int:
    """The bytes a destination needs for ``obj`` (SGLang-Omni's transfer_info.size): an array's or
    a tensor's data, a bytes-like's length; 0 for other objects."""
    n = getattr(obj, "nbytes", None)
    if isinstance(n, int):
        return n
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):  # a torch tensor
        return int(obj.element_size() * obj.numel())
    try:
        return memoryview(obj).nbytes
    except TypeError:
        return 0


def _is_cuda(obj) -> bool:
    return bool(getattr(obj, "is_cuda", False))


def _copy_into(obj, dest):
    if _is_cuda(obj) or _is_cuda(dest):  # torch's copy: device to device, device to host or back
        import torch
        src = obj if isinstance(obj, torch.Tensor) else torch.as_tensor(memoryview(obj)).view(torch.uint8)
        dst = dest if isinstance(dest, torch.Tensor) else torch.from_numpy(_byte_view(dest))
        src = src.detach().contiguous().reshape(-1).view(torch.uint8)
        if not dst.is_contiguous():
            raise _core.InvalidArgumentError("relay get: a destination tensor must be contiguous")
        dst = dst.detach().reshape(-1).view(torch.uint8)
        if src.numel() > dst.numel():
            raise _core.InvalidArgumentError(f"relay get: {src.numel()} bytes do not fit the destination's {dst.numel()}")
        dst[:src.numel()].copy_(src)
        return
    import numpy as np
    if not _is_buffer(obj) and hasattr(obj, "numpy"):  # a torch tensor (any dtype)
        obj = _tensor_memory(obj.contiguous())
    src = np.asarray(obj).reshape(-1).view(np.uint8)
    dst = np.asarray(memoryview(dest)).reshape(-1).view(np.uint8)
    if src.nbytes > dst.nbytes:
        raise _core.InvalidArgumentError(f"relay get: {src.nbytes} bytes do not fit the destination's {dst.nbytes}")
    dst[:src.nbytes] = src
