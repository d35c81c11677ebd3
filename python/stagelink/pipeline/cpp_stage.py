"""C++ stages: a function in a shared library, called with the request's payload as a stagelink
frame through the C interface of include/stagelink/stage.hpp (`STAGELINK_STAGE`)."""
from __future__ import annotations

import ctypes
import os

from .. import _core
from ._wire import from_frame

_STREAM_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t)
_CHUNK_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_double,
                             ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t))


class _Call(ctypes.Structure):  # stagelink_stage_call_v2 (version 1's fields, then the stream in)
    _fields_ = [("abi_version", ctypes.c_uint32), ("request_id", ctypes.c_char_p), ("stage", ctypes.c_char_p),
                ("input", ctypes.c_void_p), ("input_len", ctypes.c_size_t),
                ("stream", _STREAM_FN), ("stream_opaque", ctypes.c_void_p),
                ("output", ctypes.POINTER(ctypes.c_uint8)), ("output_len", ctypes.c_size_t),
                ("error", ctypes.c_char * 4096),
                ("next_chunk", _CHUNK_FN), ("chunk_opaque", ctypes.c_void_p)]


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
        frame = self._frame(payload, "payload")
        failure = []
        held = [None]  # the chunk frame the stage reads now (valid until its next call)

        def on_stream(_opaque, data, n):
            try:
                ctx.stream(from_frame(ctypes.string_at(data, n)))
                return 0
            except BaseException as e:  # noqa: BLE001  aborted, or a bad chunk: the stage sees -1
                failure.append(e)
                return -1

        def on_chunk(_opaque, timeout_s, frame_out, len_out):
            held[0] = None
            try:
                chunk = next(iter(ctx.chunks(None if timeout_s < 0 else timeout_s)), _END)
                if chunk is _END:
                    return 1
                held[0] = f = self._frame(chunk, "stream chunk")
                frame_out[0] = ctypes.cast(f, ctypes.c_void_p).value
                len_out[0] = len(f)
                return 0
            except BaseException as e:  # noqa: BLE001  the stage sees an error; the request fails with e
                failure.append(e)
                call.error = f"{type(e).__name__}: {e}".encode(errors="replace")[:4000]
                return -2 if isinstance(e, _core.TimeoutError) else -1

        cb, chunk_cb = _STREAM_FN(on_stream), _CHUNK_FN(on_chunk)
        call = _Call(abi_version=2, request_id=ctx.request_id.encode(), stage=ctx.stage.encode(),
                     input=ctypes.cast(frame, ctypes.c_void_p).value, input_len=len(frame), stream=cb,
                     stream_opaque=None, next_chunk=chunk_cb, chunk_opaque=None)
        rc = self._fn(ctypes.byref(call))  # ctypes releases the GIL for the call
        held[0] = None
        if rc != 0:
            if failure:
                raise failure[-1]
            raise RuntimeError(f"C++ stage {self.name}: {call.error.decode(errors='replace')}")
        try:
            out = ctypes.string_at(call.output, call.output_len)
        finally:
            _libc.free(ctypes.cast(call.output, ctypes.c_void_p))
        return from_frame(out)

    def _frame(self, obj, what: str) -> bytes:
        frame = _core.encode_object(obj)
        if frame is None:
            raise _core.InvalidArgumentError(f"C++ stage {self.name}: the {what} holds objects without a native "
                                             "frame (C++ reads arrays, tensors, bytes and trees of them)")
        return frame


_END = object()
