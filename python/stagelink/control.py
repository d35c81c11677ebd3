"""Control-plane messages of the pipeline runtime (SGLang-Omni's names), encoded by the C++ core.

    msg = ControlMessage("data_ready", "req-1", from_stage="thinker", to_stage="talker",
                         metadata=relay_op.metadata, chunk_id=3)
    wire = msg.to_bytes()                      # a small msgpack map
    msg = ControlMessage.from_bytes(wire)      # checked: malformed bytes raise CorruptError

Types: submit, data_ready, data_ack, complete, stream, shutdown, abort, abort_ack, ready (SGLang-Omni's),
and the pipeline runtime's lifecycle: progress, peers, peers_known, connect, connected, stats
(stagelink.pipeline.protocol gives each its typed fields).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from . import _core
from ._lifetime import NativeOwner, track

TYPES = ("submit", "data_ready", "data_ack", "complete", "stream", "shutdown", "abort", "abort_ack", "ready",
         "progress", "peers", "peers_known", "connect", "connected", "stats", "launch", "metrics_ask", "metrics", "trace")
#: The types that belong to no request (every other one must name its request).
NO_REQUEST = frozenset({"shutdown", "ready", "progress", "peers", "peers_known", "connect", "connected", "stats",
                        "launch", "metrics_ask", "metrics", "trace"})


@dataclass
class ControlMessage:
    type: str
    request_id: str = ""
    from_stage: Optional[str] = None
    to_stage: Optional[str] = None
    metadata: Any = None        # relay metadata: dicts, lists, str, numbers, bytes
    chunk_id: Optional[int] = None
    is_done: bool = False
    error: Optional[str] = None
    body: Optional[bytes] = None  # a small inline payload (a frame)
    traceparent: Optional[str] = None  # W3C trace context of a traced request (stagelink.trace)

    def to_bytes(self) -> bytes:
        """Encode; raises InvalidArgumentError for an unknown type, a missing request id (all but
        the NO_REQUEST types) or a field over its limit (ids 256 bytes, error 64 KiB, body 64 MiB)."""
        return _core.control_encode(self.type, self.request_id or "", _s(self.from_stage), _s(self.to_stage),
                                    self.metadata, self.chunk_id, bool(self.is_done), self.error or "", self.body,
                                    self.traceparent or "")

    @classmethod
    def from_bytes(cls, data) -> "ControlMessage":
        """Decode bytes from the wire; raises CorruptError naming the field at fault."""
        return cls(**_core.control_decode(data))


def _s(stage) -> str:
    return "" if stage is None else str(stage)


class Inbox(NativeOwner):  # NativeOwner: close(), closed, with-blocks, close on collection
    """Where a stage (or the coordinator) receives control messages: a ZeroMQ PULL socket bound on
    ``endpoint`` (``ipc:///path`` in a private directory on one host, ``tcp://host:port`` across
    hosts; port 0 picks a free one, see `endpoint`).

    ``curve``: ``{"secret_key": ..., "allowed_clients": [public keys]}`` (keys of
    `stagelink.curve_keypair`): only outboxes holding one of those keys connect, and every
    message is encrypted (CurveZMQ). Others are refused at the handshake and counted
    (`refused`). A pipeline gives its inboxes keys by itself (``control: tcp``)."""

    def __init__(self, endpoint: str, curve: Optional[dict] = None):
        self._native = _core._ControlInbox.bind(endpoint, curve)
        track(self)  # closed at exit if still open then

    @property
    def refused(self) -> int:
        """Peers refused at the CURVE handshake (a key not allowed)."""
        return self._native.refused

    @property
    def endpoint(self) -> str:
        return self._native.endpoint

    def recv(self, timeout: Optional[float] = None) -> ControlMessage:
        """The next message. ``timeout`` None waits forever (the thread sleeps in the kernel).
        Raises TimeoutError, CorruptError (a malformed message, dropped; the inbox goes on), or
        ClosedError after `close` (which also wakes a blocked recv)."""
        return ControlMessage(**self._native.recv(timeout))


class Outbox(NativeOwner):
    """Sends control messages to one `Inbox` (a ZeroMQ PUSH socket). ``close()`` delivers
    what is queued (at most 1 s for a peer that takes nothing), then releases the socket.
    ``curve``: ``{"secret_key": ..., "public_key": ..., "server_key": the inbox's public key}``."""

    def __init__(self, endpoint: str, curve: Optional[dict] = None):
        self._native = _core._ControlOutbox.connect(endpoint, curve)
        track(self)

    def send(self, msg: ControlMessage, timeout: Optional[float] = None) -> None:
        """Queue ``msg``; blocks while the peer's queue is full, up to ``timeout`` (None: forever)."""
        self._native.send(msg.type, msg.request_id or "", _s(msg.from_stage), _s(msg.to_stage), msg.metadata,
                          msg.chunk_id, bool(msg.is_done), msg.error or "", msg.body, timeout, msg.traceparent or "")


def private_socket_dir(tag: str = "stagelink") -> str:
    """A new 0700 directory for a pipeline's ipc sockets (under $XDG_RUNTIME_DIR, else /tmp);
    remove it with `remove_socket_dir`."""
    return _core.make_private_socket_dir(tag)


def remove_socket_dir(path: str) -> None:
    _core.remove_private_socket_dir(path)
