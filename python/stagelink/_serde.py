"""Python objects <-> frame regions.

Kinds of payload (region 0 is always the small part, the rest travel out of band):
  RAW     bytes-like data, one region, no pickling.
  ARRAY   a numpy array: region 0 a tiny (dtype, shape) header, region 1 the array's bytes.
  PICKLE  anything else: region 0 the pickle-5 stream, then one region per out-of-band buffer
          (numpy arrays, torch tensors, bytearrays, objects with __dlpack__), written once,
          straight into shared memory.
"""
from __future__ import annotations

import io
import pickle
import sys
import warnings

import numpy as np

KIND_PICKLE = 0
KIND_RAW = 1
KIND_ARRAY = 2
KIND_NATIVE = -1  # a frame from a C++ producer

_NP_TO_NAME = {
    np.dtype(np.uint8): "uint8", np.dtype(np.int8): "int8", np.dtype(np.uint16): "uint16",
    np.dtype(np.int16): "int16", np.dtype(np.uint32): "uint32", np.dtype(np.int32): "int32",
    np.dtype(np.uint64): "uint64", np.dtype(np.int64): "int64", np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.bool_): "bool",
    np.dtype(np.complex64): "complex64", np.dtype(np.complex128): "complex128",
}
_NAME_TO_NP = {v: k for k, v in _NP_TO_NAME.items()}


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
    """Returns (kind, regions, dtypes, shapes)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return KIND_RAW, [data], None, None
    if type(data) is np.ndarray and data.dtype in _NP_TO_NAME and data.flags.c_contiguous:
        hdr = pickle.dumps((data.dtype.str, data.shape), protocol=5)
        return KIND_ARRAY, [hdr, data if data.ndim else data.reshape(1)], [None, _NP_TO_NAME[data.dtype]], [None, data.shape or (1,)]
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
    return KIND_PICKLE, regions, None, None


def _has_dlpack(obj) -> bool:
    return hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray)


def decode(kind: int, regions, zero_copy: bool):
    if kind == KIND_RAW:
        r = regions[0]
        return memoryview(r) if zero_copy else r
    if kind == KIND_ARRAY:
        dtype, shape = pickle.loads(regions[0])
        arr = np.frombuffer(regions[1], dtype=np.dtype(dtype))
        return arr.reshape(shape)
    if kind == KIND_PICKLE:
        return pickle.loads(regions[0], buffers=regions[1:])
    if kind == KIND_NATIVE:
        return _native(regions)
    raise ValueError(f"unknown payload kind {kind}")


def _native(tree):
    if isinstance(tree, tuple) and len(tree) == 3 and isinstance(tree[1], str):
        region, dtype, shape = tree
        npdt = _NAME_TO_NP.get(dtype)
        if npdt is None:  # bfloat16: no numpy dtype; raw bytes with its shape
            return np.frombuffer(region, dtype=np.uint8)
        return np.frombuffer(region, dtype=npdt).reshape(shape)
    if isinstance(tree, dict):
        return {k: _native(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_native(v) for v in tree]
    return tree
