"""C++ stages: a function in a shared library, called with the request's payload as a stagelink
frame through the C interface of include/stagelink/stage.hpp (`STAGELINK_STAGE`)."""
from __future__ import annotations

import ctypes
import os

from .. import _core
from ._wire import from_frame

_STREAM_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t)


class _Call(ctypes.Structure):  # stagelink_stage_call_v1
    _fields_ = [("abi_version", ctypes.c_uint32), ("request_id", ctypes.c_char_p), ("stage", ctypes.c_char_p),
                ("input", ctypes.POINTER(ctypes.c_uint8)), ("input_len", ctypes.c_size_t),
                ("stream", _STREAM_FN), ("stream_opaque", ctypes.c_void_p),
                ("output", ctypes.POINTER(ctypes.c_uint8)), ("output_len", ctypes.c_size_t),
                ("error", ctypes.c_char * 4096)]


_libc = ctypes.CDLL(None)
_libc.free.argtypes = [ctypes.c_void_p]


class CppStage:
    """Callable as a Python stage: fn(payload, ctx). The payload must be native (arrays, tensors,
    bytes and trees of them): C++ reads frames, not pickles."""

    def __init__(self, lib: str, symbol: str, stage: str):
        if not os.path.exists(lib):
            raise _core.NotFoundError(f"stage '{stage}': C++ stage library {lib} does not exist")
        try:
            self._lib = ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as e:
            raise _core.InvalidArgumentError(f"stage '{stage}': cannot load {lib}: {e}") from None
        try:
            self._fn = getattr(self._lib, symbol)
        except AttributeError:
            raise _core.NotFoundError(f"stage '{stage}': {lib} exports no '{symbol}' (STAGELINK_STAGE({symbol}, fn))") \
                from None
        self._fn.argtypes = [ctypes.POINTER(_Call)]
        self._fn.restype = ctypes.c_int
        self.name = f"{os.path.basename(lib)}:{symbol}"

    def __call__(self, payload, ctx):
        frame = _core.encode_object(payload)
        if frame is None:
            raise _core.InvalidArgumentError(f"C++ stage {self.name}: the payload holds objects without a native "
                                             "frame (C++ reads arrays, tensors, bytes and trees of them)")
        buf = (ctypes.c_uint8 * len(frame)).from_buffer_copy(frame)
        failure = []

        def on_stream(_opaque, data, n):
            try:
                ctx.stream(from_frame(ctypes.string_at(data, n)))
                return 0
            except BaseException as e:  # noqa: BLE001  aborted, or a bad chunk: the stage sees -1
                failure.append(e)
                return -1

        cb = _STREAM_FN(on_stream)
        call = _Call(abi_version=1, request_id=ctx.request_id.encode(), stage=ctx.stage.encode(), input=buf,
                     input_len=len(frame), stream=cb, stream_opaque=None)
        rc = self._fn(ctypes.byref(call))  # ctypes releases the GIL for the call
        if rc != 0:
            if failure:
                raise failure[0]
            raise RuntimeError(f"C++ stage {self.name}: {call.error.decode(errors='replace')}")
        try:
            out = ctypes.string_at(call.output, call.output_len)
        finally:
            _libc.free(ctypes.cast(call.output, ctypes.c_void_p))
        return from_frame(out)
