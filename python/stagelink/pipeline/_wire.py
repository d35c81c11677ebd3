"""Small payloads inside the control message: a stagelink frame in its `body`, no relay slot.

A payload of native kinds (numpy arrays and scalars, torch tensors in host memory, bytes, str,
numbers, None, and dicts, lists, tuples of them) whose arrays, tensors and bytes total at most
`limit` bytes travels this way (the
control ring bounds what is in flight); anything larger, or anything else, goes through the
relay."""
from __future__ import annotations

from typing import Optional

import numpy as np

from .. import _core, _serde

_SCALARS = (int, float, bool, type(None), np.generic)


def _is_torch(o) -> bool:
    """A torch tensor (or Parameter), told without importing torch."""
    t = type(o)
    return t.__module__.startswith("torch") and hasattr(o, "element_size") and hasattr(o, "nelement")


def _fits(obj, budget: int) -> int:
    """What is left of `budget` after `obj`, or -1 when it does not fit or is not a native kind."""
    stack, n = [obj], 0
    while stack:
        o = stack.pop()
        n += 1
        if n > 256:
            return -1
        if isinstance(o, np.ndarray):
            budget -= o.nbytes
        elif _is_torch(o):
            if o.device.type != "cpu":  # a device tensor: the relay stages it (docs/cuda.md)
                return -1
            budget -= o.nelement() * o.element_size()
        elif isinstance(o, (bytes, bytearray, str)):
            budget -= len(o)
        elif isinstance(o, _SCALARS):
            budget -= 8
        elif isinstance(o, dict):
            if not all(isinstance(k, str) for k in o):
                return -1
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
        else:
            return -1
        if budget < 0:
            return -1
    return budget


def small_frame(obj, limit: int) -> Optional[bytes]:
    """`obj` as one frame when it is small and native; None otherwise (use the relay)."""
    if limit <= 0 or _fits(obj, limit) < 0:
        return None
    return _core.encode_object(obj)


def from_frame(data: bytes):
    kind, obj = _core.decode_frame_parts(data)
    return _serde.decode(kind, obj, False)
