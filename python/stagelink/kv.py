"""KV caches as users hold them, through every connector without hand flattening or pickle.

- A list or tuple of per-layer ``(key, value)`` tensor pairs, and a dict of tensors, are native
  frames already: they travel as they are and come back as they went (tuples as tuples).
- transformers' ``DynamicCache`` (its full-attention layers) is sent as its per-layer pairs, with a
  mark that the receiver's ``get`` turns back into a ``DynamicCache`` ready to decode with. A cache
  may be the payload itself or a value of a payload dict (``{"past_key_values": cache, ...}``). A
  cache this module does not know (sliding-window or static layers, quantized caches) is pickled as
  before, where ``allow_pickle`` permits.

With ``get(..., zero_copy=True)`` the tensors view the shared memory (read-only: an in-place write
raises `stagelink.ReadOnlyInputError`); a ``DynamicCache``'s decode only concatenates onto them,
which makes new tensors, so a zero-copy cache decodes as it is.

C++ readers see the marked form: ``{"__stagelink_kv__": {PATH: "DynamicCache"}, "value": V}``,
where ``PATH`` is ``""`` for the payload itself or a key of the payload dict, and the cache at
that place in ``V`` is its list of ``[key, value]`` pairs.
"""
from __future__ import annotations

from typing import Any, Optional

MARK = "__stagelink_kv__"
_DYNAMIC = "DynamicCache"


def _is_dynamic_cache(obj) -> bool:
    tp = type(obj)
    return tp.__name__ == _DYNAMIC and tp.__module__.startswith("transformers")


def pairs(cache) -> Optional[list]:
    """A transformers ``DynamicCache``'s per-layer ``[key, value]`` pairs (the tensors themselves,
    not copies), or None when it has layers this module cannot rebuild as they were."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # transformers 4.x
        keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
        if keys is None or values is None:
            return None
        return [[k, v] for k, v in zip(keys, values)]
    out = []
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer" or getattr(layer, "keys", None) is None:
            return None  # sliding-window, static, quantized or empty layers: not ours to rebuild
        out.append([layer.keys, layer.values])
    return out


def dynamic_cache(layer_pairs) -> Any:
    """A transformers ``DynamicCache`` holding ``layer_pairs`` (``[(key, value), ...]``, one per
    layer), the tensors themselves."""
    from transformers import DynamicCache
    cache = DynamicCache()
    make_layer = getattr(cache, "layer_class_to_replicate", None)
    if make_layer is None or not hasattr(cache, "layers"):  # transformers 4.x: update() keeps the tensors
        for i, (k, v) in enumerate(layer_pairs):
            cache.update(k, v, i)
        return cache
    # transformers 5: update() concatenates onto an empty tensor, a copy of every layer (and the end
    # of a zero-copy view); so each layer is made and handed its tensors as they are. Its
    # lazy_initialization makes two empty tensors per layer (15 us); where it sets only the fields
    # below (5.x's DynamicLayer), they are set directly (1.4 us a layer).
    # A zero-copy get's tensors are read-only views (a torch subclass): reading their dtype and
    # device went through its __torch_function__, 128 calls for 32 layers (a 1 MiB cache's get:
    # 0.71-0.84 ms zero-copy against 0.31 copying). Only reads here: the subclass is left out.
    import torch
    direct = None
    with torch._C.DisableTorchFunctionSubclass():
        for k, v in layer_pairs:
            layer = make_layer()
            if direct:
                layer.__dict__.update(dtype=k.dtype, device=k.device, is_initialized=True)
            else:
                layer.lazy_initialization(k, v)
                direct = set(vars(layer)) == _LAYER_FIELDS
            layer.keys, layer.values = k, v
            cache.layers.append(layer)
    return cache


_LAYER_FIELDS = {"keys", "values", "dtype", "device", "is_initialized"}


def pack(data) -> Optional[dict]:
    """``data`` with its DynamicCaches (the payload, or values of a payload dict) as marked pairs;
    None when there is nothing to mark."""
    if _is_dynamic_cache(data):
        p = pairs(data)
        return None if p is None else {MARK: {"": _DYNAMIC}, "value": p}
    if type(data) is dict and MARK not in data:
        marks, value = {}, None
        for key, item in data.items():
            if isinstance(key, str) and _is_dynamic_cache(item):
                p = pairs(item)
                if p is None:
                    return None
                if value is None:
                    value = dict(data)
                value[key] = p
                marks[key] = _DYNAMIC
        if marks:
            return {MARK: marks, "value": value}
    return None


def unpack(obj):
    """What `pack` made, rebuilt (the connectors' get calls it for a dict holding the mark)."""
    marks = obj.get(MARK)
    if not isinstance(marks, dict) or "value" not in obj:
        return obj
    value = obj["value"]
    for path, kind in marks.items():
        if kind != _DYNAMIC:
            continue
        if path == "":
            return dynamic_cache(value)
        value[path] = dynamic_cache(value[path])
    return value
