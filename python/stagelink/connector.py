"""Connector: vLLM-Omni's OmniConnector contract over stagelink's C++ connectors."""
from __future__ import annotations

import logging
import pickle
from typing import Optional

import numpy as np

from . import _core, _serde
from ._lifetime import NativeOwner

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
    :class:`stagelink.StagelinkError` subclasses instead.

    ``put`` and ``get`` are implemented in the native base class: a numpy array or a C++
    producer's frame never enters a Python frame here. The methods below finish what they hand
    back: pickling, loans, unpickling and failures.
    """

    def __init__(self, name: str, extra: Optional[dict] = None):
        extra = dict(extra or {})
        self.name = name
        self.extra = extra
        self.strict = bool(extra.pop("strict", False))
        self.default_get_timeout = extra.get("get_timeout_s")
        self.last_error: Optional[BaseException] = None
        native_extra = {k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool, type(None), dict, list))}
        super().__init__(name, native_extra)
        self._ready = True

    def __del__(self):
        if self.__dict__.get("_ready"):  # __init__ may have failed before the native part existed
            super().__del__()

    # -- what the native put/get hand back
    def _fail(self, op: str, e: BaseException):
        if self.strict:
            self.last_error = e
            raise e
        # Kept without its traceback: the frames would keep the failed call's payload alive.
        self.last_error = e.with_traceback(None)
        log.warning("%s %s failed: %s", self.name, op, e)

    def _put_slow(self, from_stage, to_stage, put_key, data, readers):
        """put of anything but a plain numpy array: a Loan, or an object to pickle."""
        try:
            if isinstance(data, Loan):
                size, meta = self._put_loan(from_stage, to_stage, put_key, data._loan, readers or 0)
            else:
                kind, regions = _serde.encode(data)
                size, meta = self._put_parts(from_stage, to_stage, put_key, kind, regions, readers or 0)
            return True, size, meta
        except (_core.StagelinkError, pickle.PicklingError, AttributeError, TypeError, ValueError, BufferError) as e:
            self._fail("put", e)
            return False, 0, None

    def _decode(self, get_key, kind, regions, size, zero_copy):
        """Unpickle what get read (a Python producer's pickle-5 stream and its buffers)."""
        try:
            return _serde.decode(kind, regions, zero_copy), size
        except Exception as e:  # a foreign or damaged pickle
            self._fail("get", _core.CorruptError(f"payload of '{get_key}' could not be unpickled: {e!r}"))
            return None

    # -- the rest of the contract
    def get_into(self, from_stage, to_stage, get_key: str, out, metadata: Optional[dict] = None,
                 timeout: Optional[float] = None) -> Optional[int]:
        """Copy the array (or bytes) put under ``get_key`` into ``out`` and free the slot.

        ``out``: a writable C-contiguous buffer (numpy array, bytearray, CPU torch tensor via
        ``.numpy()``) at least as large as the payload; reuse it across calls to avoid page faults.
        Returns the number of bytes written, or ``None`` when absent, timed out or failed.
        Pickled objects cannot be copied raw: use :meth:`get` for those.
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
        """Release every put of ``request_id`` (keys equal to it or starting with it + a separator)."""
        try:
            return self._cleanup(str(request_id))
        except _core.StagelinkError as e:
            self._fail("cleanup", e)
            return 0

    def health(self) -> dict:
        return self._health()


def create_connector(name: str, extra: Optional[dict] = None, **injected) -> Connector:
    """Create a connector by class name (``SharedMemoryConnector``, ...). ``injected`` fields
    (``role``, ``stage_id``, ...) are merged into ``extra`` as vLLM-Omni's orchestrator does."""
    merged = dict(extra or {})
    merged.update(injected)
    return Connector(name, merged)
