"""Connector: vLLM-Omni's OmniConnector contract over stagelink's C++ connectors."""
from __future__ import annotations

import abc
import logging
import os
import time
from typing import Optional

import numpy as np

from . import _core, _serde, kv
from ._lifetime import NativeOwner, track

log = logging.getLogger("stagelink")


class Loan:
    """A writable numpy array inside the producer's shared-memory arena.

    Fill ``loan.array`` in place, then ``connector.put(from, to, key, loan)``: nothing is copied.
    A loan that is never put returns its memory when dropped or closed.
    """

    def __init__(self, core_loan, shape, dtype):
        self._loan = core_loan
        raw = core_loan.region(0)
        self.array = raw.view(dtype).reshape(shape) if raw.size else np.empty(shape, dtype)

    @property
    def published(self) -> bool:
        return not self._loan.valid


class Connector(_core._Connector, NativeOwner):  # NativeOwner: with-blocks, close on collection
    """put/get/cleanup/health/close by key, as vLLM-Omni's OmniConnectorBase.

    ``put`` returns ``(success, size, metadata)``; ``get`` returns ``(data, size)`` or ``None``.
    Failures are logged and kept in ``last_error``; with ``extra={"strict": True}`` they raise
    `stagelink.StagelinkError` subclasses instead. A ``get`` that returns None sets
    ``last_error`` to why (``NotFoundError``: not put, or already read by every reader;
    ``TimeoutError``; ``CancelledError``), raised in strict mode; a call that works resets it.

    ``put`` and ``get`` are implemented in the native base class: numpy arrays, torch tensors,
    bytes-likes, trees of them and C++ producers' frames never enter a Python frame here. The
    methods below finish what they hand back: pickling, loans, unpickling and failures.

    ``put(from_stage, to_stage, put_key, data, *, readers=None, request_id=None) -> (success, size, metadata)``
        Publish ``data`` for ``readers`` gets (default 1); ``request_id`` ties it to a request
        (``cleanup(request_id)`` frees it). Native frames for arrays, tensors (any dtype), bytes and
        trees of them; ``Loan`` objects published in place; anything else pickled where allowed.

    ``get(from_stage, to_stage, get_key, metadata=None, timeout=None, *, zero_copy=False, device=None) -> (data, size) | None``
        With ``metadata`` (what put returned) a direct lookup; without, the key is waited for up to
        ``timeout`` s (None: ``extra.get_timeout_s``, else one attempt). ``zero_copy``: read-only
        views holding the slot until dropped (torch tensors whose in-place ops raise
        ``ReadOnlyInputError``); else a copy, the slot freed at once. ``device``: where torch tensors
        land (``"cpu"``, ``"cuda:N"``; None: where they came from).

    ``cleanup(request_id) -> int``, ``health() -> dict``, ``close()``: below.

    ``extra["allow_pickle"]`` (default true for the shared-memory connector, which only the same
    user can reach; false for connectors that cross hosts): with it off, a payload that would need
    pickle is refused at ``put`` and a received frame holding a pickle is refused at ``get``
    (``CorruptError``) instead of being unpickled.
    """

    #: vLLM-Omni: connectors that move raw registered buffers (RDMA) set this; shared memory does not.
    supports_raw_data: bool = False

    def __init__(self, name: str, extra: Optional[dict] = None):
        extra = dict(extra or {})
        self.name = name
        self.extra = extra
        self.strict = bool(extra.pop("strict", False))
        self.default_get_timeout = extra.get("get_timeout_s")
        #: vLLM-Omni's: the stage this connector serves (injected by the orchestrator; -1: not given).
        #: Its chunk adapter reads it.
        self.stage_id = extra.get("stage_id", -1)
        allow_pickle = bool(extra.get("allow_pickle", has_trait(name, "pickle_default")))
        native_extra = {k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool, type(None), dict, list))}
        super().__init__(name, native_extra, allow_pickle)
        self._ready = True
        track(self)  # closed at exit if still open then

    def __del__(self):
        if self.__dict__.get("_ready"):  # __init__ may have failed before the native part existed
            super().__del__()

    # -- what the native put/get hand back
    def _miss(self, e: BaseException):
        """A get that found nothing (not put yet, timed out, already read, cleaned up): None to the
        caller, as vLLM-Omni's; ``last_error`` says why, and strict mode raises it."""
        self.last_error = e
        if self.strict:
            raise e

    def _fail(self, op: str, e: BaseException):
        if self.strict:
            self.last_error = e
            raise e
        # Kept without its traceback: the frames would keep the failed call's payload alive.
        self.last_error = e.with_traceback(None)
        log.warning("%s %s failed: %s", self.name, op, e)

    def _put_slow(self, from_stage, to_stage, put_key, data, readers, request_id=None, why=""):
        """put of what has no native frame: a Loan, or an object to pickle (``why`` names the part
        that needs pickle)."""
        packed = kv.pack(data)  # a KV cache (transformers' DynamicCache): its tensors, natively
        if packed is not None:
            return _core._Connector.put(self, from_stage, to_stage, put_key, packed, readers=readers,
                                        request_id=request_id)
        try:
            if isinstance(data, Loan):
                size, meta = self._put_loan(from_stage, to_stage, put_key, data._loan, readers or 0, request_id)
            elif not self.allow_pickle:
                raise _core.InvalidArgumentError(
                    f"put of '{put_key}': a {why or type(data).__name__} has no native frame and allow_pickle "
                    "is off; send numpy arrays, torch tensors, bytes and dicts/lists of them, or set "
                    "extra.allow_pickle: true")
            else:
                kind, regions = _serde.encode(data)
                size, meta = self._put_parts(from_stage, to_stage, put_key, kind, regions, readers or 0, request_id)
            self.last_error = None
            return True, size, meta
        except Exception as e:  # noqa: BLE001 - as vLLM-Omni's: pickling runs the payload's own code
            # (__reduce__ may raise anything; a structure nested past the interpreter's recursion
            # limit raises RecursionError): the put fails, the caller gets (False, 0, None).
            self._fail("put", e)
            return False, 0, None

    def _reported(self, op: str, fn, *args) -> int:
        """A count-returning call under the contract: 0 and ``last_error`` (raised in strict mode)
        when it fails."""
        try:
            return fn(*args)
        except _core.StagelinkError as e:
            self._fail(op, e)
            return 0

    def _decode(self, get_key, kind, regions, size, zero_copy):
        """Unpickle what get read (a Python producer's pickle-5 stream and its buffers)."""
        try:
            return _serde.decode(kind, regions, zero_copy), size
        except Exception as e:  # a foreign or damaged pickle
            self._fail("get", _core.CorruptError(f"payload of '{get_key}' could not be unpickled: {e!r}"))
            return None

    # -- vLLM-Omni's base-class helpers
    @staticmethod
    def _make_key(key, from_stage, to_stage, separator: str = "@") -> str:
        """The internal key of ``key`` on an edge: ``f"{key}{separator}{from_stage}_{to_stage}"``."""
        return f"{key}{separator}{from_stage}_{to_stage}"

    @staticmethod
    def serialize_obj(obj) -> bytes:
        """``obj`` as one stagelink frame (native for arrays, tensors, bytes and trees of them, the
        format C++ reads; a pickle-5 frame otherwise). Returns bytes."""
        data = _core.encode_object(obj)
        if data is None:
            kind, regions = _serde.encode(obj)
            data = _core.encode_parts(kind, regions)
        return data

    @staticmethod
    def deserialize_obj(data) -> object:
        """What `serialize_obj` made (or any frame) back as an object. Raises CorruptError for
        bytes that are not a frame."""
        kind, obj = _core.decode_frame_parts(bytes(data))
        return _serde.decode(kind, obj, False)

    # -- the rest of the contract
    def get_with_deadline(self, from_stage, to_stage, get_key: str, metadata: Optional[dict] = None,
                          deadline: Optional[float] = None):
        """``get`` bounded by ``deadline``, an absolute ``time.monotonic()`` value (vLLM-Omni's
        contract; also accepted as a keyword). Returns ``(data, size)``, or ``None`` when the key
        is absent, failed, or the deadline passes first; an expired deadline returns ``None``
        without reading anything."""
        if deadline is None:
            raise TypeError("get_with_deadline() needs deadline= (an absolute time.monotonic() value)")
        remaining = float(deadline) - time.monotonic()
        if remaining <= 0:
            return None
        return self.get(from_stage, to_stage, get_key, metadata, timeout=remaining)

    def abandon_get(self, get_key: str) -> int:
        """Give up waiting for ``get_key``: every ``get`` of it blocked in this connector (another
        thread's) returns ``None`` at once. Returns how many were woken (0: none was waiting)."""
        return self._reported("abandon_get", self._abandon_get, str(get_key))

    # -- vLLM-Omni's arrival wake-ups: a receive loop sleeps until a put may have arrived
    def get_wakeup_generation(self) -> Optional[int]:
        """A snapshot to take before polling: a later ``put`` (by any process on this host, to any
        stage) moves it, see `wait_for_change`. ``None`` when this connector cannot signal
        arrivals (network connectors, a closed one, or ``VLLM_OMNI_SHM_WAKEUP=0`` as in vLLM-Omni):
        the caller keeps its timed poll."""
        if os.environ.get("VLLM_OMNI_SHM_WAKEUP", "1") == "0":
            return None
        return self._arrival_epoch()

    def wait_for_change(self, generation: int, *, timeout: float) -> bool:
        """Block (in the kernel, no polling) until a ``put`` since ``generation`` or ``timeout``
        seconds. Returns whether one came. A hint, as in vLLM-Omni: the key is still read with
        ``get``, and a put to another stage may wake this too."""
        return self._wait_arrival(int(generation), float(timeout))

    @property
    def _pending_keys(self) -> dict:
        """vLLM-Omni's: the keys this connector put that a reader may still get, oldest first (a
        dict of key -> None, as its OrderedDict). Read, taken by every reader, cancelled or closed:
        gone. Connectors that do not track them raise AttributeError."""
        keys = self._pending_key_list()
        if keys is None:
            raise AttributeError(f"{self.name} does not list pending keys")
        return dict.fromkeys(keys)

    @property
    def _metrics(self) -> dict:
        """vLLM-Omni's counters: ``puts``, ``gets``, ``bytes_transferred`` (from `health`)."""
        h = self.health()
        return {k: h.get(k, 0) for k in ("puts", "gets", "bytes_transferred")}

    def update_sender_info(self, sender_host: str, sender_zmq_port: int) -> None:
        """Transfer engines (vLLM-Omni's name): where a ``get`` without metadata asks for the key
        (the sender's side-channel host and port). Other connectors raise UnsupportedError."""
        self._update_sender_info(str(sender_host), int(sender_zmq_port))

    def sender_info(self) -> Optional[dict]:
        """Where a receiver reaches this connector's puts ahead of any put: the keys its put
        metadata carries (a transfer engine's ``source_host``, ``source_port``). ``None`` for
        connectors nothing connects to (shared memory, the store) or that cannot put."""
        return self._sender_info()

    def connect(self, sender_info: Optional[dict] = None, timeout: Optional[float] = 30.0) -> None:
        """Set up, before the first ``get``, the connections a get from the sender ``sender_info``
        describes (its `sender_info`, or any put's metadata; ``None``: the sender of
        `update_sender_info` or the config) would otherwise make on first use: the side
        channel and the UCX endpoints of both sides. The first get then costs what the next ones do
        (over TCP, milliseconds less). Connectors with nothing to connect return at once. Raises
        TimeoutError after ``timeout`` s, NotFoundError when no sender is known, and the transport's
        errors when the sender cannot be reached."""
        self._connect(sender_info, timeout)

    def reap_consumed(self) -> int:
        """Return the shared memory of puts that every reader has read (put also does this
        lazily). Returns how many puts were reclaimed."""
        return self._reported("reap_consumed", self._reap_consumed)

    def get_into(self, from_stage, to_stage, get_key: str, out, metadata: Optional[dict] = None,
                 timeout: Optional[float] = None) -> Optional[int]:
        """Copy the array (or bytes) put under ``get_key`` into ``out`` and free the slot.

        ``out``: a writable C-contiguous buffer (numpy array, bytearray, CPU torch tensor via
        ``.numpy()``) at least as large as the payload; reuse it across calls to avoid page faults.
        Returns the number of bytes written, or ``None`` when absent, timed out or failed.
        Pickled objects cannot be copied raw: use `get` for those.
        """
        if timeout is None:
            timeout = self.default_get_timeout
        try:
            return self._get_into_parts(from_stage, to_stage, get_key, metadata, timeout, out)
        except (_core.StagelinkError, TypeError, ValueError, BufferError) as e:
            self._fail("get_into", e)
            return None

    def loan(self, shape, dtype=np.uint8) -> Loan:
        """Reserve a numpy array of ``shape``/``dtype`` in shared memory to fill and then put."""
        dtype = np.dtype(dtype)
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        name = _serde._NP_TO_NAME.get(dtype)
        if name is None or not shape:
            raise TypeError(f"loan: dtype {dtype} and shape {shape}: a loan holds a numeric array of at least one dimension")
        return Loan(self._loan_array(name, list(shape)), shape, dtype)

    def cleanup(self, request_id: str) -> int:
        """Release every unread put of ``request_id``: the put whose key is ``request_id`` and the
        puts tied to it with ``put(..., request_id=request_id)``. Nothing else: ``cleanup("X")``
        never frees ``"X_1"`` unless it was tied to ``"X"``. Returns how many were released."""
        return self._reported("cleanup", self._cleanup, str(request_id))

    def cleanup_prefix(self, prefix: str) -> int:
        """vLLM-Omni's chunk cleanup: release this connector's unread puts whose key is ``prefix``
        followed by a chunk number (``cleanup_prefix("req_0_")`` frees ``req_0_0`` and
        ``req_0_1``, never ``req_0_10other`` or ``request_0_0``). Returns how many were released.
        Connectors that do not list their puts (network ones) raise UnsupportedError: tie chunk
        puts to their request with ``put(..., request_id=)`` and ``cleanup`` that instead."""
        keys = self._pending_key_list()
        if keys is None:
            raise _core.UnsupportedError(f"{self.name} does not list its puts: cleanup_prefix needs them; tie the "
                                         "chunks to their request with put(..., request_id=) and cleanup it")
        prefix = str(prefix)
        n = 0
        for key in dict.fromkeys(keys):
            rest = key[len(prefix):]
            if key.startswith(prefix) and rest.isascii() and rest.isdigit():
                n += self.cleanup(key)
        return n

    def health(self) -> dict:
        """This connector's state as vLLM-Omni's health() reports it (``status``, ``puts``,
        ``gets``, ``bytes_transferred``, ``errors``, ``timeouts``) with stagelink's additions: the
        arena's and the directory's use, what is outstanding, and each transport's own figures
        (pool, peers, CUDA arenas)."""
        return self._health()


class OmniConnectorBase(abc.ABC):
    """vLLM-Omni's base class: subclass it for a connector of your own and register it with
    `OmniConnectorFactory.register_connector`. ``put``, ``get``, ``cleanup``, ``health``
    and ``close`` are abstract; ``get_with_deadline`` raises NotImplementedError unless
    overridden; ``abandon_get`` and ``reap_consumed`` do nothing; the connector is a context
    manager and closes when collected; ``serialize_obj``/``deserialize_obj`` write and read
    stagelink frames. stagelink's own connectors count as its subclasses (``isinstance`` holds)."""

    supports_raw_data: bool = False

    @abc.abstractmethod
    def put(self, from_stage, to_stage, put_key, data):
        """Returns ``(success, serialized_size, metadata)``."""

    @abc.abstractmethod
    def get(self, from_stage, to_stage, get_key, metadata=None):
        """Returns ``(object, serialized_size)``, or None when there is nothing."""

    @abc.abstractmethod
    def cleanup(self, request_id):
        """Releases what ``request_id`` holds."""

    def get_with_deadline(self, from_stage, to_stage, get_key, metadata=None, *, deadline: float):
        raise NotImplementedError(f"{type(self).__name__} does not support deadline-aware receive")

    def abandon_get(self, get_key) -> None:
        """Nothing to retire by default."""

    def reap_consumed(self) -> None:
        """Nothing to release by default."""

    @abc.abstractmethod
    def health(self) -> dict:
        """Status and counters."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases everything; idempotent."""

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()

    serialize_obj = staticmethod(Connector.serialize_obj)
    deserialize_obj = staticmethod(Connector.deserialize_obj)
    _make_key = staticmethod(Connector._make_key)


OmniConnectorBase.register(Connector)


class OmniSerializer:
    """vLLM-Omni's serializer names over stagelink frames: ``serialize(obj) -> bytes`` and
    ``deserialize(data)`` (numpy arrays, torch tensors, strided views included, and trees of
    them natively; pickle-5 for other objects)."""

    serialize = staticmethod(Connector.serialize_obj)
    deserialize = staticmethod(Connector.deserialize_obj)


class OmniConnectorFactory:
    """vLLM-Omni's factory: ``create_connector(ConnectorSpec)``; ``register_connector(name,
    constructor)`` adds a connector class of your own (``constructor(extra)``), which takes
    precedence over a built-in of the same name (``supports_dual`` is accepted for vLLM-Omni's
    callers: every stagelink connector serves both directions); ``list_registered_connectors()``
    names them all."""

    _registry: dict = {}

    @classmethod
    def register_connector(cls, name: str, constructor, *, supports_dual: bool = False) -> None:
        cls._registry[str(name)] = constructor

    @classmethod
    def list_registered_connectors(cls) -> list:
        return sorted(set(_core.registered_connectors()) | set(cls._registry))

    @classmethod
    def create_connector(cls, spec):
        name, extra = spec.name, dict(getattr(spec, "extra", None) or {})
        if name in cls._registry:
            return cls._registry[name](extra)
        return create_connector(name, extra)


class SharedMemoryConnector(Connector):
    """Shared memory on this host (the default; no service). ``SharedMemoryConnector(config)``
    as vLLM-Omni's: ``config`` is the connector's ``extra`` map."""

    def __init__(self, config: Optional[dict] = None):
        super().__init__("SharedMemoryConnector", config)


class TransferEngineConnector(Connector):
    """UCX (RDMA or TCP) between hosts: a registered pool per sender, receivers pull. Its ``get``
    returns objects as every connector's does (``supports_raw_data`` stays false: no
    ``ManagedBuffer`` to release)."""

    def __init__(self, config: Optional[dict] = None):
        super().__init__(type(self).__name__, config)


class MooncakeTransferEngineConnector(TransferEngineConnector):
    """vLLM-Omni's name and config (``host``, ``zmq_port``, ``memory_pool_size``, ...) for the
    transfer engine, on stagelink's UCX engine."""


class StoreConnector(Connector):
    """Payloads through Redis or Redis Cluster (``url``/``host``/``port``), woken by notification."""

    def __init__(self, config: Optional[dict] = None):
        super().__init__("StoreConnector", config)


#: The classes ``create_connector`` makes by name (vLLM-Omni's code constructs them directly too).
_CLASSES = {c.__name__: c for c in (SharedMemoryConnector, TransferEngineConnector,
                                    MooncakeTransferEngineConnector, StoreConnector)}


def describe_connector(name: str) -> Optional[dict]:
    """The descriptor of connector ``name`` (a name or an alias), as the C++ core registered it:
    ``{name, aliases, traits, schema, python, doc}``; ``traits`` holds ``host_local`` (its data
    reaches only this host's processes of this user), ``side_channel`` (a sender serves a side
    channel its receivers reach: vLLM-Omni's role-bound connectors), ``pickle_default``,
    ``device_slots``, ``lookup_gets`` and ``python_made``. None for a name the core does not know
    (a connector registered only in Python, through `OmniConnectorFactory`)."""
    return _core.connectors().get(name)


def has_trait(name: str, trait: str) -> bool:
    """Whether connector ``name`` has ``trait`` (`describe_connector`); False for a name the
    core does not know: such a connector's data is taken to cross hosts."""
    d = describe_connector(name)
    return d is not None and trait in d["traits"]


def create_connector(name: str, extra: Optional[dict] = None, **injected):
    """Create a connector by class name (``SharedMemoryConnector``, ...). ``injected`` fields
    (``role``, ``stage_id``, ...) are merged into ``extra`` as vLLM-Omni's orchestrator does.
    An unknown name raises `stagelink.NotFoundError`, which is also a ``ValueError``."""
    merged = dict(extra or {})
    merged.update(injected)
    d = describe_connector(name)
    if d is not None and d["python"]:  # made here (Mooncake's store drives Mooncake's Python client)
        import importlib
        module, cls_name = d["python"].split(":")
        return getattr(importlib.import_module(module), cls_name)(merged, name)
    cls = _CLASSES.get(name)
    return cls(merged) if cls is not None else Connector(name, merged)
