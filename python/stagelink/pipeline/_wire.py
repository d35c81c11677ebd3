"""Small payloads inside the control message: a stagelink frame in its `body`, no relay slot.

A payload of native kinds (numpy arrays and scalars, torch tensors, bytes, str, numbers, None,
and dicts, lists, tuples of them) whose tensors, bytes and tree total at most `limit` bytes
travels this way (the control ring bounds what is in flight); anything larger, or anything else,
goes through the relay. The native encoder walks the object once and gives up before copying
anything when it is over the limit or needs pickle (a device tensor over it is never staged)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .. import _core, _serde


def small_frame(obj, limit: int) -> Optional[bytes]:
    """`obj` as one frame when it is small and native; None otherwise (use the relay)."""
    if limit <= 0 or (type(obj) is np.ndarray and obj.nbytes > limit):  # the common large case, at once
        return None
    return _core.encode_object(obj, limit)


def to_frame(obj) -> bytes:
    """A control body that must travel inline whatever its size (a process's figures): native
    kinds only, never pickle. Raises InvalidArgumentError for anything else."""
    data = _core.encode_object(obj)
    if data is None:
        raise _core.InvalidArgumentError(f"a {type(obj).__name__} has no native frame: not a control body")
    return data


def from_frame(data: bytes):
    """A control message's body back as an object. Native frames only: an honest sender never
    pickles one (`small_frame` and `to_frame` refuse), so a pickle frame is a forgery and is refused
    unread (CorruptError) whoever sent it, CURVE or not: unpickling it would run its code here."""
    kind, obj = _core.decode_frame_parts(data)
    if kind != _serde.KIND_OBJECT:
        raise _core.CorruptError("a control message's body is a pickle frame: refused unread "
                                 "(control bodies are native frames only)")
    return obj
