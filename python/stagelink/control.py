"""Control-plane messages of the pipeline runtime (SGLang-Omni's names), encoded by the C++ core.

    msg = ControlMessage("data_ready", "req-1", from_stage="thinker", to_stage="talker",
                         metadata=relay_op.metadata, chunk_id=3)
    wire = msg.to_bytes()                      # a small msgpack map
    msg = ControlMessage.from_bytes(wire)      # checked: malformed bytes raise CorruptError

Types: submit, data_ready, data_ack, complete, stream, shutdown, abort, abort_ack.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from . import _core

TYPES = ("submit", "data_ready", "data_ack", "complete", "stream", "shutdown", "abort", "abort_ack")


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

    def to_bytes(self) -> bytes:
        """Encode; raises InvalidArgumentError for an unknown type, a missing request id (all but
        shutdown) or a field over its limit (ids 256 bytes, error 64 KiB, body 64 MiB)."""
        return _core.control_encode(self.type, self.request_id or "", _s(self.from_stage), _s(self.to_stage),
                                    self.metadata, self.chunk_id, bool(self.is_done), self.error or "", self.body)

    @classmethod
    def from_bytes(cls, data) -> "ControlMessage":
        """Decode bytes from the wire; raises CorruptError naming the field at fault."""
        return cls(**_core.control_decode(data))


def _s(stage) -> str:
    return "" if stage is None else str(stage)
