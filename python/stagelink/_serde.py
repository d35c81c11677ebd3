"""Python objects <-> frame regions.

Kinds of payload (region 0 is always the small part, the rest travel out of band):
  RAW     bytes-like data, one region, no pickling.
  PICKLE  anything else: region 0 the pickle-5 stream, then one region per out-of-band buffer
          (numpy arrays, torch tensors, bytearrays, objects with __dlpack__), written once,
          straight into shared memory.
A plain C-contiguous numpy array never comes here: the native layer puts it as one typed tensor
(what a C++ producer sends too) and hands back a finished array (KIND_OBJECT).
"""
from __future__ import annotations

import io
import pickle
import sys
import warnings

import numpy as np

KIND_PICKLE = 0
KIND_RAW = 1
KIND_OBJECT = -1  # built by the native layer: a numpy array, or the tree of a C++ producer

_NP_TO_NAME = {
    np.dtype(np.uint8): "uint8", np.dtype(np.int8): "int8", np.dtype(np.uint16): "uint16",
    np.dtype(np.int16): "int16", np.dtype(np.uint32): "uint32", np.dtype(np.int32): "int32",
    np.dtype(np.uint64): "uint64", np.dtype(np.int64): "int64", np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.bool_): "bool",
    np.dtype(np.complex64): "complex64", np.dtype(np.complex128): "complex128",
}


def _rebuild_torch(buf, dtype_name: str, shape):
    import torch

    dtype = getattr(torch, dtype_name)
    if len(buf) == 0 if hasattr(buf, "__len__") else memoryview(buf).nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    arr = np.frombuffer(buf, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only zero-copy views: torch warns, we document it
        t = torch.from_numpy(arr)
    return t.view(dtype).reshape(shape)


def _torch_reduce(t):
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach().contiguous()
    flat = t.reshape(-1).view(__import__("torch").uint8)
    return _rebuild_torch, (pickle.PickleBuffer(flat.numpy()), str(t.dtype).replace("torch.", ""), tuple(t.shape))


class _Pickler(pickle.Pickler):
    """Adds out-of-band pickling for torch tensors and other DLPack objects."""

    def reducer_override(self, obj):  # noqa: D401
        tp = type(obj)
        if tp.__module__ == "torch" and tp.__name__ in ("Tensor", "Parameter"):
            return _torch_reduce(obj)
        if not isinstance(obj, np.ndarray) and hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
            try:
                return np.from_dlpack(obj).__reduce_ex__(5)
            except Exception:  # not host memory: fall back to the object's own pickling
                return NotImplemented
        return NotImplemented


def encode(data):
    """Returns (kind, regions)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return KIND_RAW, [data]
    bufs: list = []
    if "torch" in sys.modules or _has_dlpack(data):
        f = io.BytesIO()
        _Pickler(f, protocol=5, buffer_callback=bufs.append).dump(data)
        stream = f.getbuffer()
    else:
        stream = pickle.dumps(data, protocol=5, buffer_callback=bufs.append)
    regions = [stream]
    for b in bufs:
        try:
            regions.append(b.raw())
        except BufferError:  # non-contiguous: one copy to make it contiguous
            regions.append(memoryview(bytes(b)))
    return KIND_PICKLE, regions


def _has_dlpack(obj) -> bool:
    return hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray)


def decode(kind: int, regions, zero_copy: bool):
    if kind == KIND_OBJECT:
        return regions
    if kind == KIND_RAW:
        r = regions[0]
        return memoryview(r) if zero_copy else r
    if kind == KIND_PICKLE:
        return pickle.loads(regions[0], buffers=regions[1:])
    raise ValueError(f"unknown payload kind {kind}")
