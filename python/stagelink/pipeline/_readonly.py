"""Read-only torch tensors for `zero_copy` stages and `Connector.get(..., zero_copy=True)`.

A `zero_copy` stage's inputs are views of the relay's shared memory, mapped read-only. numpy
arrays say so (`writeable` False); torch has no read-only tensors, so an in-place op there
(`x.mul_(2)`, ordinary model code) wrote to a read-only page and the stage process died with
SIGSEGV. Such tensors are handed to the stage as `ReadOnlyInputTensor`, a torch subclass whose
in-place ops raise `ReadOnlyInputError` (failing that request, with what to do instead) before
touching memory. Views of it stay protected; anything computed from it is a plain tensor again,
so only the input and its views pay the subclass's dispatch.
"""
from __future__ import annotations

import sys

_CLS = None

# In-place dunders (x += y and friends) and item assignment.
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"})
# Trailing-underscore methods that change no element.
_HARMLESS = frozenset({"requires_grad_", "retain_grad", "share_memory_", "record_stream"})


class ReadOnlyInputError(RuntimeError):
    """An in-place write to a `zero_copy` input (shared memory, mapped read-only)."""


def _writes(func) -> bool:
    w = _WRITES.get(func)
    if w is None:
        name = getattr(func, "__name__", "")
        w = _WRITES[func] = name in _INPLACE_DUNDERS or (
            name.endswith("_") and not name.startswith("__") and name not in _HARMLESS)
    return w


_WRITES: dict = {}  # func -> whether it writes its first argument (asked once per function)


def _cls():
    global _CLS
    if _CLS is None:
        import torch

        numpy_fn = torch.Tensor.numpy

        class ReadOnlyInputTensor(torch.Tensor):
            """A zero_copy input: a view of read-only shared memory. In-place ops raise."""

            @classmethod
            def __torch_function__(cls, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = kwargs.get("out")
                hit = (args and _writes(func) and isinstance(args[0], cls)) or (out is not None and (
                    isinstance(out, cls) or (isinstance(out, (tuple, list)) and any(isinstance(o, cls) for o in out))))
                if hit:
                    raise ReadOnlyInputError(
                        f"{getattr(func, '__name__', func)}: this tensor is a zero_copy input, a view of read-only "
                        "shared memory (a relay's or a connector's slot); .clone() it before writing to it, or get it "
                        "without zero_copy (a stage: drop zero_copy from it)")
                with torch._C.DisableTorchFunctionSubclass():
                    result = func(*args, **kwargs)
                if func is numpy_fn and hasattr(result, "flags"):
                    result.flags.writeable = False
                    return result
                return _rewrap(result, args, cls, torch)

        _CLS = ReadOnlyInputTensor
    return _CLS


def _ptrs(args, cls, out):
    for a in args:
        if isinstance(a, cls):
            try:
                out.add(a.untyped_storage().data_ptr())
            except RuntimeError:
                pass
        elif isinstance(a, (list, tuple)):
            _ptrs(a, cls, out)
    return out


def _rewrap(result, args, cls, torch):
    """Outputs that share memory with a protected input (views) stay protected; new ones are
    plain tensors."""
    if type(result) is torch.Tensor:
        for a in args:  # the common case: a protected tensor among the arguments themselves
            if isinstance(a, cls):
                if torch._C._is_alias_of(result, a):
                    return result.as_subclass(cls)
            elif isinstance(a, (list, tuple)):
                break
        else:
            return result
        try:  # protected tensors inside lists (torch.cat((x, y)) returns new memory, but stack views ...)
            if result.device.type == "cpu" and result.untyped_storage().data_ptr() in _ptrs(args, cls, set()):
                return result.as_subclass(cls)
        except RuntimeError:
            pass
        return result
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in result):
        return type(result)(_rewrap(r, args, cls, torch) for r in result) if type(result) in (tuple, list) else result
    return result


def protect(obj):
    """`obj` (a received payload) with its CPU torch tensors as ReadOnlyInputTensor."""
    torch = sys.modules.get("torch")
    if torch is None:
        return obj
    return _walk(obj, lambda t: t.as_subclass(_cls()) if type(t) is torch.Tensor else t, torch)


def protect_tensor(t):
    """One received CPU or GPU tensor as a ReadOnlyInputTensor (a Parameter or subclass as it is):
    what the decoder calls on each torch tensor of a zero_copy get."""
    return t.as_subclass(_cls()) if type(t) is sys.modules["torch"].Tensor else t


def unprotect(obj):
    """`obj` (a stage's output) with protected tensors as plain tensors again, so that they travel
    as native frames (the encoder takes torch.Tensor itself)."""
    torch = sys.modules.get("torch")
    if torch is None or _CLS is None:
        return obj
    return _walk(obj, lambda t: t.as_subclass(torch.Tensor) if isinstance(t, _CLS) else t, torch)


# Items no tensor hides in: a list or tuple of only these (token ids, audio samples, strings) is
# returned as it is, checked in C (set.issuperset over map(type, ...)) instead of one Python call per
# item (a list of 300 ids: ~5 us instead of ~140 us).
_LEAVES = frozenset({int, float, bool, str, bytes, type(None)})


def _walk(obj, fn, torch):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) is dict:
        return {k: _walk(v, fn, torch) for k, v in obj.items()}
    if type(obj) is list:
        return obj if _LEAVES.issuperset(map(type, obj)) else [_walk(v, fn, torch) for v in obj]
    if type(obj) is tuple:
        return obj if _LEAVES.issuperset(map(type, obj)) else tuple(_walk(v, fn, torch) for v in obj)
    return obj
