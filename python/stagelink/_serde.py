"""Python objects that have no native frame <-> pickle-5 regions.

numpy arrays, torch tensors, bytes-likes and trees of dicts (str keys), lists, tuples, str, int,
float, bool and None never come here: the native layer writes them as frames a C++ stage reads
too, and rebuilds them on get (KIND_OBJECT). Anything else is pickled (protocol 5): region 0 is
the stream, then one region per out-of-band buffer (numpy arrays, torch tensors, bytearrays,
objects with __dlpack__ inside the object), written once, straight into shared memory.
"""
from __future__ import annotations

import io
import pickle
import sys
import warnings

import numpy as np

KIND_PICKLE = 0
KIND_OBJECT = -1  # built by the native layer

_NP_TO_NAME = {
    np.dtype(np.uint8): "uint8", np.dtype(np.int8): "int8", np.dtype(np.uint16): "uint16",
    np.dtype(np.int16): "int16", np.dtype(np.uint32): "uint32", np.dtype(np.int32): "int32",
    np.dtype(np.uint64): "uint64", np.dtype(np.int64): "int64", np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.bool_): "bool",
    np.dtype(np.complex64): "complex64", np.dtype(np.complex128): "complex128",
}


def _rebuild_torch(buf, dtype_name: str, shape, requires_grad=False, parameter=False):
    import torch

    dtype = getattr(torch, dtype_name)
    if memoryview(buf).nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only zero-copy views: torch warns, we document it
            t = torch.from_numpy(arr)
        t = t.view(dtype).reshape(shape)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _torch_reduce(t):
    import torch

    param = isinstance(t, torch.nn.Parameter)
    rg = bool(t.requires_grad)
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    flat = t.reshape(-1).view(torch.uint8)
    return _rebuild_torch, (pickle.PickleBuffer(flat.numpy()), str(t.dtype).replace("torch.", ""), tuple(t.shape),
                            rg, param)


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
    """Returns (KIND_PICKLE, regions): the pickle-5 stream, then its out-of-band buffers."""
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
    if kind == KIND_PICKLE:
        return pickle.loads(regions[0], buffers=regions[1:])
    raise ValueError(f"unknown payload kind {kind}")
