"""Python payloads as native frames (no pickle): trees, bytes, numpy, torch of every dtype and
route, lists of ids and floats packed, None, damaged frames raising only stagelink errors, and
allow_pickle."""
import hashlib
import multiprocessing as mp
import os
import random

import numpy as np
import pytest

import stagelink
from stagelink import _core
from shm_util import shm


# ---- payloads: native frames, no pickle ----

def roundtrip(c, data, zero_copy=False, key="k"):
    ok, size, meta = c.put(0, 1, key, data)
    assert ok, c.last_error
    got = c.get(0, 1, key, meta, zero_copy=zero_copy)
    assert got is not None, c.last_error
    return got[0], meta


def cpp_view(meta):
    return _core._frame_as_cpp_sees_it(meta["inline"])


def test_trees_bytes_and_numpy_travel_without_pickle(ns):
    tree = {"hidden": np.arange(12, dtype=np.float32).reshape(3, 4), "ids": list(range(300)), "t": (1, "a", None),
            "nested": [{"x": 1.5, "flag": True}, (b"raw", bytearray(b"ba"))], "big": 2 ** 63 + 5, "neg": -3,
            "scalar": np.array(2.5), "npscalar": np.float32(1.5), "s": "h\u00e9llo"}
    with shm(ns, allow_pickle=False) as c:  # nothing here may need pickle
        got, meta = roundtrip(c, tree)
        assert got.keys() == tree.keys()
        assert np.array_equal(got["hidden"], tree["hidden"]) and got["hidden"].dtype == np.float32
        assert got["ids"] == tree["ids"] and type(got["ids"]) is list
        assert got["t"] == (1, "a", None) and type(got["t"]) is tuple
        assert got["nested"][0] == {"x": 1.5, "flag": True}
        assert type(got["nested"][1]) is tuple and got["nested"][1][0] == b"raw"
        assert type(got["nested"][1][0]) is bytes and type(got["nested"][1][1]) is bytearray
        assert got["big"] == 2 ** 63 + 5 and got["neg"] == -3 and got["s"] == "h\u00e9llo"
        assert isinstance(got["scalar"], np.ndarray) and got["scalar"].shape == () and got["scalar"] == 2.5
        assert type(got["npscalar"]) is np.float32 and got["npscalar"] == 1.5
        # What a C++ stage reads: the same tree, tensors typed, no pickle anywhere.
        view = cpp_view(meta)
        assert "pickle" not in (view["ext"] or {})
        assert view["tree"]["ids"] == list(range(300))
        assert view["tree"]["hidden"][0] == "float32" and view["tree"]["hidden"][1] == (3, 4)
        assert view["tree"]["nested"][1][0] == ("uint8", (3,), b"raw")
        for data in (b"x" * 300000, bytearray(b"y" * 10), memoryview(b"z" * 5)):
            got, _ = roundtrip(c, data)
            assert type(got) is type(data) and bytes(got) == bytes(data)
        got, _ = roundtrip(c, b"q" * 300000, zero_copy=True)
        assert isinstance(got, memoryview) and got.readonly and got.tobytes() == b"q" * 300000
        ro = np.arange(10)
        ro.flags.writeable = False
        got, _ = roundtrip(c, ro)
        assert not got.flags.writeable and np.array_equal(got, ro)
        got, _ = roundtrip(c, np.arange(20).reshape(4, 5)[:, 1])  # strided: copied contiguous
        assert np.array_equal(got, [1, 6, 11, 16])
        assert roundtrip(c, np.arange(10))[0].flags.writeable


def test_large_bytes_and_bytearrays_come_back_whole(ns):
    """A get of 8 MiB or more into a new bytes or bytearray maps its fresh pages ahead of the copy,
    and from 64 MiB copies the two halves in two threads: every byte lands where it belongs, at
    sizes that are not a whole number of pages, and the object is the type that was put."""
    with shm(ns, arena_bytes=160 << 20) as c:
        for n, kind in ((8 << 20, bytes), ((40 << 20) + 4093, bytearray), ((72 << 20) + 12345, bytes)):
            data = kind(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes())
            got, _ = roundtrip(c, data)
            assert type(got) is kind and len(got) == n
            assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
            del got, data


def test_lists_of_ids_travel_packed_and_come_back_as_they_were(ns):
    """Lists and tuples of 16 or more ints of 31 bits (|v| < 2^30) travel as one packed block of 1,
    2 or 4 bytes per value, signed where one is negative; a C++ stage reads them as lists of
    integers. Anything else in the list (a bool, a huge int, a float) sends it item by item, each
    item as it was."""
    cases = [list(range(300)), tuple(range(16)), [255] * 16, [256] * 16, [65535] * 20, [65536] * 20,
             [2 ** 30 - 1] * 16, list(range(15)), [1] * 15 + [True], [1] * 15 + [-1], [1] * 15 + [2 ** 40],
             [1] * 15 + [1.5], [True] * 20, [-1] * 20, [-128, 127] * 8, [-129, 127] * 8, [-32768, 32767] * 8,
             [-32769, 5] * 8, [-(2 ** 30) + 1, 2 ** 30 - 1] * 8, [-100] + list(range(40)) + [-7],
             {"ids": [7] * 40, "codes": (3,) * 25, "nested": [[9] * 16, (1, 2)]}]
    # Seeded random lists of each 1- and 2-byte width, at lengths around the writer's vector steps
    # (8 and 16 values narrowed at a time) and their tails: every value back at its place.
    rng = random.Random(20261126)
    cases += [[rng.randrange(lo, hi) for _ in range(n)] for lo, hi in ((0, 256), (0, 65536), (-128, 128), (-32768, 32768))
              for n in (16, 17, 23, 24, 31, 32, 33, 100)]
    with shm(ns, allow_pickle=False) as c:
        for obj in cases:
            got, meta = roundtrip(c, obj)
            assert got == obj and type(got) is type(obj), obj
            if isinstance(obj, dict):
                assert type(got["codes"]) is tuple and type(got["nested"][1]) is tuple
                assert cpp_view(meta)["tree"]["ids"] == [7] * 40
                continue
            assert [type(x) for x in got] == [type(x) for x in obj], obj
            if not any(isinstance(x, (bool, float)) or abs(x) >= 2 ** 30 for x in obj):
                assert list(cpp_view(meta)["tree"]) == list(obj), obj  # a C++ stage's view
        for other in (["tok"] * 20, [{"k": 1}] * 16, [None] * 16, [[1, 2]] * 16):  # not ints: item by item
            assert roundtrip(c, other)[0] == other
        # Packed: 4 bytes per vocabulary-sized id where msgpack takes 5; 1 per -1 padding, not 2.
        _, meta = roundtrip(c, [151645] * 1000)
        assert meta["size"] < 4600, meta["size"]
        _, padded = roundtrip(c, [-100] * 1000)
        assert padded["size"] < 1600, padded["size"]


def test_lists_of_floats_travel_packed_and_keep_every_bit(ns):
    """Lists and tuples of 16 or more floats travel as one block of 8-byte doubles: -0.0, NaN,
    the infinities kept; a C++ stage reads a list of doubles. An int among them keeps the list
    item by item, so the int stays an int."""
    import math
    special = [-0.0, float("nan"), float("inf"), -float("inf"), 5e-324, 1.7976931348623157e308, 0.1]
    cases = [[0.5] * 16, special * 3, tuple(x / 7 for x in range(40)), [1.5] * 15, [1.0] * 15 + [2], [2] + [1.0] * 20,
             [1.0] * 15 + [True], {"audio_data": [0.25] * 64, "modality": "audio", "t": (1.5,) * 16}]

    def same(a, b):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))

    with shm(ns, allow_pickle=False) as c:
        for obj in cases:
            got, meta = roundtrip(c, obj)
            assert type(got) is type(obj), obj
            if isinstance(obj, dict):
                assert got == obj and type(got["t"]) is tuple
                assert cpp_view(meta)["tree"]["audio_data"] == [0.25] * 64
                continue
            assert [type(x) for x in got] == [type(x) for x in obj], obj
            assert all(same(a, b) for a, b in zip(got, obj)), (obj, got)
            if all(type(x) is float for x in obj):
                assert all(same(a, b) for a, b in zip(cpp_view(meta)["tree"], obj))  # a C++ stage's view
        # Packed: 8 bytes per value where msgpack takes 9.
        _, meta = roundtrip(c, [0.1] * 1000)
        assert meta["size"] < 8600, meta["size"]


def test_torch_tensors_keep_what_they_are(ns):
    torch = pytest.importorskip("torch")
    with shm(ns, allow_pickle=False) as c:
        for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool,
                   torch.complex64, torch.float64, torch.int8):
            t = (torch.arange(24) % 2 if dt is torch.bool else torch.arange(24)).to(dt).reshape(2, 3, 4)
            got, meta = roundtrip(c, t)
            assert isinstance(got, torch.Tensor) and got.dtype == dt and got.shape == t.shape
            assert torch.equal(got, t), dt
        assert cpp_view(meta)["tree"][0] == "int8"  # a C++ stage sees a typed tensor
        p = torch.nn.Parameter(torch.ones(3, 2))
        got, _ = roundtrip(c, p)
        assert type(got) is torch.nn.Parameter and got.requires_grad and torch.equal(got.detach(), p.detach())
        g = torch.ones(4, requires_grad=True) * 2
        got, _ = roundtrip(c, g)
        assert got.requires_grad and type(got) is torch.Tensor and torch.equal(got.detach(), g.detach())
        assert not roundtrip(c, torch.ones(2))[0].requires_grad
        z = torch.tensor([1 + 2j, 3 - 1j])
        got, _ = roundtrip(c, z.conj())  # a lazy conjugate view: resolved, not refused
        assert torch.equal(got, torch.tensor([1 - 2j, 3 + 1j])) and not got.is_conj()
        got, _ = roundtrip(c, torch.tensor([1 + 2j]).conj().imag)  # a negative view
        assert torch.equal(got, torch.tensor([-2.0]))
        got, _ = roundtrip(c, torch.arange(12).reshape(3, 4).t())  # non-contiguous
        assert torch.equal(got, torch.arange(12).reshape(3, 4).t())
        got, _ = roundtrip(c, torch.tensor(5.0))
        assert got.shape == () and got.item() == 5.0
        big = torch.randn(1 << 18).to(torch.bfloat16)
        got, _ = roundtrip(c, {"hidden": big, "ids": list(range(300))}, zero_copy=True)
        assert torch.equal(got["hidden"], big) and got["ids"] == list(range(300))


def test_a_put_made_while_another_is_being_encoded_leaves_both_whole(ns):
    # Regression: reading a torch tensor's fields runs an active TorchFunctionMode's Python code
    # in the middle of the put's encode; a put made from there reused the thread's encode buffer
    # and the outer put, reported ok, reached its reader corrupt.
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    with shm(ns) as c:
        inner = {"inner": "x" * 100, "ids": list(range(50))}
        nested = []

        class PutsFromInside(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if len(nested) < 3:
                    nested.append(f"inner{len(nested)}")
                    assert c.put(0, 1, nested[-1], inner)[0]
                return func(*args, **(kwargs or {}))

        want = {"a": "hello" * 10, "t": torch.arange(6.0), "b": list(range(40)), "u": ("x", 2), "c": "tail"}
        with PutsFromInside():
            ok, _, meta = c.put(0, 1, "outer", want)
        assert ok and nested, "the mode never ran: the test tests nothing"
        got = c.get(0, 1, "outer", meta)
        assert got is not None, c.last_error
        got = got[0]
        assert torch.equal(got.pop("t"), want["t"]) and got == {k: v for k, v in want.items() if k != "t"}
        for k in nested:
            assert c.get(0, 1, k, None)[0] == inner

        # After the encode, before the frame is written: a request id whose str() puts.
        class PutsWhenNamed:
            def __str__(self):
                assert c.put(0, 1, "named", inner)[0]
                return "req-9"

        want2 = {"a": "y" * 30, "b": list(range(20, 60))}
        ok, _, meta = c.put(0, 1, "outer2", want2, request_id=PutsWhenNamed())
        assert ok and c.get(0, 1, "outer2", meta)[0] == want2 and c.get(0, 1, "named", None)[0] == inner


def test_torch_through_dlpack_every_dtype_shape_and_a_held_slot(ns):
    """Tensors travel through DLPack both ways (torch's C exchange API where it has one): every
    dtype a frame carries, empty and 0-d shapes, inline and shared-memory sizes; a zero-copy torch
    view holds its slot until it is dropped, exactly as a numpy view does."""
    torch = pytest.importorskip("torch")
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16, torch.int32,
              torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128]
    dtypes += [d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64")) if d is not None]
    with shm(ns, allow_pickle=False) as c:
        for dt in dtypes:
            for shape in ((0, 4), (5, 0), (1,), (2, 1, 3, 1, 2), (300, 257)):  # the last one is past inline size
                n = int(np.prod(shape))
                src = torch.arange(n) % (2 if dt is torch.bool else 100)
                t = src.to(dt).reshape(shape)
                for zc in (False, True):
                    got, _ = roundtrip(c, t, zero_copy=zc)
                    # zero_copy: a view of read-only memory, whose in-place ops raise (a Tensor subclass)
                    assert (type(got) is torch.Tensor) != zc and isinstance(got, torch.Tensor), (dt, shape, zc)
                    assert got.dtype == dt and got.shape == t.shape, (dt, shape)
                    assert torch.equal(got, t), (dt, shape, zc)
    with shm(ns, arena_bytes=4 << 20, put_timeout_s=0.2) as c, shm(ns) as r:
        t = torch.full((3 << 20,), 9, dtype=torch.uint8)
        ok, _, meta = c.put(0, 1, "a", t)
        view, _ = r.get(0, 1, "a", meta, zero_copy=True)
        assert view[123] == 9
        ok, _, _ = c.put(0, 1, "b", t)  # the arena is still held by the view
        assert not ok and isinstance(c.last_error, stagelink.ExhaustedError)
        del view
        assert c.put(0, 1, "b", t)[0], c.last_error


def test_fp8_fp4_and_complex32_tensors_travel_native(ns, mq_clean):
    """FP8 (weights, KV caches), FP4 and complex32 tensors are native frames like any other torch
    dtype: with pickle off (the network connectors' default) they used to be refused ("a dtype
    without a native frame"). A C++ stage sees the dtype by name; the bytes come back exact."""
    torch = pytest.importorskip("torch")
    names = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex32",
             "float4_e2m1fn_x2")
    dtypes = [(n, getattr(torch, n)) for n in names if hasattr(torch, n)]
    assert dtypes
    raw = lambda t: t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t.contiguous().view(torch.int32)  # noqa: E731

    def same(a, b):
        return isinstance(a, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw(a), raw(b))

    with shm(ns, allow_pickle=False) as c:
        for name, dt in dtypes:
            for shape in ((4, 8), (0, 3), (), (700, 300)):  # the last one is past the inline size
                n = int(np.prod(shape))
                bits = torch.randint(0, 256, (n * dt.itemsize,), dtype=torch.uint8)
                t = bits.view(dt).reshape(shape)
                for zc in (False, True):
                    got, meta = roundtrip(c, {"kv": t, "layer": 3}, zero_copy=zc)
                    assert same(got["kv"], t), (name, shape, zc)
                    assert got["layer"] == 3
            got, meta = roundtrip(c, bits[:64].view(dt))
            assert cpp_view(meta)["tree"][0] == name  # a C++ stage sees the dtype by name
        nc = torch.randint(0, 256, (16, 8), dtype=torch.uint8).view(torch.float8_e4m3fn).t()  # non-contiguous
        assert same(roundtrip(c, nc)[0], nc)
    w = stagelink.MessageQueue(1, 1)
    r = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
    try:
        w.wait_until_ready(10)
        t = torch.randint(0, 256, (3, 5), dtype=torch.uint8).view(torch.float8_e5m2)
        w.enqueue({"codes": t})
        assert same(r.dequeue(timeout=5)["codes"], t)
    finally:
        r.close()
        w.close()


@pytest.mark.parametrize("routes", [(True, True), (False, True), (False, False)],
                         ids=["exchange-api", "dlpack-capsules", "numpy-route"])
def test_every_torch_dtype_on_the_routes_an_older_torch_leaves(ns, routes):
    """Before torch 2.10 there is no DLPack exchange API, and older DLPack imports lack float8:
    tensors then take the attribute route on put and DLPack capsules or the numpy route (an
    integer array viewed as the dtype) on get. Every dtype must come back exact on each."""
    torch = pytest.importorskip("torch")
    names = ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
             "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
             "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex32", "float4_e2m1fn_x2")
    was = _core._torch_routes(*routes)
    try:
        with shm(ns, allow_pickle=False) as c:
            for name in names:
                dt = getattr(torch, name, None)
                if dt is None:
                    continue
                width = dt.itemsize
                for shape in ((3, 4), (0,), (300, 256)):  # the last one past the inline size
                    n = int(np.prod(shape))
                    raw = torch.randint(0, 2 if dt is torch.bool else 256, (n * width,), dtype=torch.uint8)
                    t = raw.to(torch.bool).reshape(shape) if dt is torch.bool else raw.view(dt).reshape(shape)
                    for zc in (False, True):
                        got, _ = roundtrip(c, {"t": t, "p": torch.nn.Parameter(t, requires_grad=False)},
                                           zero_copy=zc)
                        for k in ("t", "p"):
                            g = got[k]
                            assert g.dtype == dt and g.shape == t.shape, (name, routes, k)
                            if n:  # (an empty tensor's strides are its own business)
                                assert torch.equal(g.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), \
                                    (name, shape, routes, zc)
                        assert type(got["p"]) is torch.nn.Parameter
    finally:
        _core._torch_routes(*was)


def test_lists_of_ids_of_every_size_and_sign(ns):
    """Lists of ints are packed and rebuilt without a call per item (ids up to 2^18 share one int
    object per value): every width and sign still comes back as the same values."""
    ids = list(range(-40, 300)) + [65535, 65536, 70000, (1 << 18) - 1, 1 << 18, 1 << 31, (1 << 32) - 1, 1 << 32,
                                   (1 << 63) - 1, -(1 << 63), -129, -32769, -(1 << 31) - 1]
    with shm(ns, allow_pickle=False) as c:
        for data in (ids, tuple(ids), {"ids": ids, "nested": [ids[:5], (7, [8, 1 << 40])]}):
            got, _ = roundtrip(c, data)
            assert got == data and type(got) is type(data)
        ok, _, _ = c.put(0, 1, "huge", [1 << 64])  # beyond 64 bits: needs pickle, refused here
        assert not ok and isinstance(c.last_error, stagelink.InvalidArgumentError)


def test_none_is_a_payload_everywhere(ns):
    """None is a value a stage may send (vLLM's writers enqueue it; a stage may put it): every
    entry point takes it, natively, and gives it back, distinct from "nothing there"."""
    with shm(ns, allow_pickle=False) as c:
        ok, size, meta = c.put(0, 1, "none", None)
        assert ok and size > 0, c.last_error
        assert c.get(0, 1, "none", meta) == (None, size)
        assert c.get(0, 1, "none") is None  # read once: now nothing is there
    assert stagelink.Connector.deserialize_obj(stagelink.Connector.serialize_obj(None)) is None
    w = stagelink.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    r = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
    try:
        w.wait_until_ready(10)
        w.enqueue(None)
        assert w.broadcast_object(None) is None
        assert r.dequeue(timeout=5) is None and r.broadcast_object(timeout=5) is None
    finally:
        r.close()
        w.close()
    with stagelink.Relay({"extra": {"namespace": ns}, "timeout_s": 1, "credits": 2}) as rel:
        op = rel.put_async(None, request_id="r", edge="e")
        assert rel.get_async(op.metadata).result() is None
        op.wait(1)


def test_floats_stay_floats(ns):
    """Regression: msgpack-c packs a whole-number double as an int, so 2.0 came back as 2 and -0.0
    as 0, in the connectors, the queue and the control plane's metadata alike."""
    data = {"t": 2.0, "z": [0.0, -0.0], "big": 2.0 ** 53, "neg": -1.0, "half": 0.5}
    with shm(ns, allow_pickle=False) as c:
        got, _ = roundtrip(c, data)
    assert got == data and all(type(x) is float for x in [got["t"], *got["z"], got["big"], got["neg"]])
    assert str(got["z"][1]) == "-0.0"
    back = stagelink.Connector.deserialize_obj(stagelink.Connector.serialize_obj([3.0]))
    assert back == [3.0] and type(back[0]) is float


def test_a_payload_that_cannot_be_sent_fails_the_put_whatever_it_raises(ns):
    """vLLM-Omni's contract: a put that fails returns (False, 0, None). Pickling runs the payload's
    own code, which may raise anything; a structure nested past the recursion limit raised
    RecursionError out of put here."""
    class Refuses:
        def __reduce__(self):
            raise KeyError("not today")
    deep = 1
    for _ in range(100000):
        deep = [deep]
    with shm(ns) as c:
        for data, err in ((deep, RecursionError), (Refuses(), KeyError), (lambda: 1, Exception)):
            assert c.put(0, 1, "k", data) == (False, 0, None)
            assert isinstance(c.last_error, err), c.last_error
        assert c.put(0, 1, "k", [1.0])[0]  # and the connector goes on
    with shm(ns, allow_pickle=False) as c:
        assert c.put(0, 1, "k", deep) == (False, 0, None)
        assert isinstance(c.last_error, stagelink.InvalidArgumentError), c.last_error


def test_a_malformed_ext_is_corrupt(ns):
    """The frame's ext (what a Python object was: torch, tuples, flags) is read from its bytes as
    they are: anything malformed there is CorruptError, never a wrong object."""
    with shm(ns, strict=True) as c:
        ok, _, meta = c.put(0, 1, "k", (1, 2))
        assert ok and b"\x81\xa2tu\x91\x00" in meta["inline"]  # ext {"tu": [0]}
        forged = dict(meta, inline=meta["inline"].replace(b"\x81\xa2tu\x91\x00", b"\x81\xa2tu\x91\xc0"))
        with pytest.raises(stagelink.CorruptError, match="ext"):
            c.get(0, 1, "k", forged)


def test_dict_keys_come_back_right_through_the_key_cache(ns):
    """Decoded dict keys of up to 32 bytes come from a 256-slot cache of strs: keys that share a
    slot, non-ASCII keys, the empty key and longer keys all come back as they were."""
    keys = [f"k{i}" for i in range(1000)] + ["", "\u00e9t\u00e9", "\u65e5\u672c", "x" * 32, "y" * 33, "\U0001f600"]
    tree = {k: i for i, k in enumerate(keys)}
    with shm(ns) as c:
        for rnd in range(3):  # the later rounds read the keys back from the cache
            ok, _, meta = c.put(0, 1, f"k{rnd}", tree)
            got = c.get(0, 1, f"k{rnd}", meta)[0]
            assert got == tree and list(got) == keys
            assert all(type(k) is str for k in got)


def test_a_string_that_is_not_utf8_is_corrupt(ns):
    """Regression: a frame (or a message queue handle) whose string is not UTF-8 raised
    UnicodeDecodeError from deep inside the decoder instead of stagelink's CorruptError."""
    frame = _core.encode_object({"caf\u00e9": "\u00e9t\u00e9"})
    assert frame.count(b"\xc3\xa9") == 3
    for i in range(3):  # the key, then each character of the value
        bad = frame.replace(b"\xc3\xa9", b"\xff\xfe", i + 1).replace(b"\xff\xfe", b"\xc3\xa9", i)
        with pytest.raises(stagelink.CorruptError, match="UTF-8"):
            _core.decode_frame_parts(bad)
    with shm(ns, strict=True) as c:
        ok, _, meta = c.put(0, 1, "k", {"caf\u00e9": 1})
        with pytest.raises(stagelink.CorruptError, match="UTF-8"):
            c.get(0, 1, "k", dict(meta, inline=meta["inline"].replace(b"\xc3\xa9", b"\xc3\x28")))


def test_a_torch_payload_where_torch_is_missing_is_unsupported_not_an_import_error(ns):
    """Regression (found running the suite on Python 3.12 without torch): a frame holding a torch
    tensor, read where torch cannot be imported, raised ModuleNotFoundError out of get, which the
    connector contract does not catch. It is UnsupportedError, reported as get's other failures."""
    import subprocess
    import sys
    torch = pytest.importorskip("torch")
    frame = _core.encode_object({"h": torch.ones(3)})
    child = f"""
import sys
sys.modules["torch"] = None  # import torch raises ImportError, as where it is not installed
import stagelink
from stagelink import _core
try:
    _core.decode_frame_parts({frame!r})
except stagelink.UnsupportedError as e:
    assert "torch" in str(e), e
else:
    raise SystemExit("decoded without torch")
with stagelink.create_connector("SharedMemoryConnector", {{"namespace": "{ns}x"}}) as c:
    ok, _, meta = c.put(0, 1, "k", b"x")
    assert c.get(0, 1, "k", dict(meta, inline={frame!r})) is None
    assert isinstance(c.last_error, stagelink.UnsupportedError), c.last_error
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def _mutations(rng, data, n):
    """n damaged copies of data: truncated, or 1-4 bytes set to a random, edge or bit-flipped value."""
    for _ in range(n):
        f = bytearray(data)
        if rng.random() < 0.2:
            yield bytes(f[:rng.randrange(len(f))])
            continue
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(f))
            f[i] = rng.choice([rng.randrange(256), 0, 0xFF, 0x7F, 0x80, f[i] ^ (1 << rng.randrange(8))])
        yield bytes(f)


def test_damaged_frames_and_handles_raise_only_stagelink_errors(mq_clean):
    """Frames arrive from other processes and hosts (store, transfer engine, queue) and handles are
    passed around: every damage is a StagelinkError (or decodes to some object), never another
    exception, a crash or a read out of bounds. A seeded fuzz over every kind of leaf."""
    import random
    rng = random.Random(20261123)
    objs = [np.arange(12, dtype=np.float32).reshape(3, 4), b"abc" * 10, {"t": (1, 2.5, None, True, "x\u00e9")},
            {"ids": list(range(300)), "b": bytearray(b"zz"), "m": memoryview(b"mv")},
            [np.float32(1.5), np.arange(5)[::2], np.zeros((0, 3))], {"a": [[1, [2, (3,)]], {"k": -7}], "u": 2**63 + 5},
            {"vocab": [151645, 7] * 20, "codes": tuple(range(256, 290)), "pad": [-1, 5] * 10},  # packed id lists
            {"audio": [0.5, -0.0] * 10, "t": (float("nan"),) * 16}]  # packed float lists
    try:
        import torch
        objs += [torch.ones(5, dtype=torch.bfloat16), torch.nn.Parameter(torch.ones(2)), torch.tensor(3.0),
                 {"c": torch.ones(2, dtype=torch.cfloat), "g": torch.ones(2, requires_grad=True)}]
    except ImportError:
        pass
    others = []
    # STAGELINK_FUZZ_ROUNDS: more damaged copies per object, for a deeper run on an extension built
    # with the sanitizers (./scripts/test-sanitizers --python).
    rounds = int(os.environ.get("STAGELINK_FUZZ_ROUNDS", "1500"))
    for obj in objs:
        frame = _core.encode_object(obj)
        assert frame is not None, obj
        for bad in _mutations(rng, frame, rounds):
            # Python's reader (objects), then C++'s (the Value tree a C++ stage gets).
            for read in (_core.decode_frame_parts, _core._frame_as_cpp_sees_it):
                try:
                    read(bad)
                except stagelink.StagelinkError:
                    pass
                except Exception as e:  # noqa: BLE001 - what this test looks for
                    others.append((read.__name__, type(e).__name__, str(e)[:80], bad))
    mq = stagelink.MessageQueue(2, 1, max_chunk_bytes=1024, max_chunks=4)
    try:
        for bad in _mutations(rng, mq.export_handle().data, 2 * rounds):
            try:
                stagelink.mq.Handle(bad)
            except stagelink.StagelinkError:
                pass
            except Exception as e:  # noqa: BLE001
                others.append((type(e).__name__, str(e)[:80], bad))
    finally:
        mq.close()
    assert not others, others[:5]


def test_a_frame_marking_an_integer_tensor_as_requiring_gradients_is_corrupt():
    """Regression (found by the deeper fuzz on the sanitizer build): a damaged frame whose tensor
    kind says requires_grad (or a Parameter requiring it) for an integer tensor raised torch's
    RuntimeError from get instead of CorruptError."""
    torch = pytest.importorskip("torch")
    frame = _core.encode_object(torch.ones(2, dtype=torch.int32))
    kinds = b"\xa2tk\x91\x01"  # ext "tk": [torch]
    assert frame.count(kinds) == 1
    for flags in (0x11, 0x31):  # | requires_grad; | requires_grad | Parameter
        bad = frame.replace(kinds, kinds[:-1] + bytes([flags]))
        with pytest.raises(stagelink.CorruptError, match="int32 as requiring gradients"):
            _core.decode_frame_parts(bad)
    got = _core.decode_frame_parts(frame.replace(kinds, kinds[:-1] + b"\x21"))[1]  # a Parameter without
    assert type(got) is torch.nn.Parameter and not got.requires_grad  # gradients: allowed, as torch does


def test_the_queue_keeps_types_too(mq_clean):
    torch = pytest.importorskip("torch")
    w = stagelink.MessageQueue(1, 1)
    r = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
    try:
        w.wait_until_ready(5)
        ro = np.arange(5)
        ro.flags.writeable = False
        msg = {"p": torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)), "t": (1, 2), "b": b"x", "ro": ro}
        w.enqueue(msg)
        got = r.dequeue(timeout=5)
        assert type(got["p"]) is torch.nn.Parameter and got["p"].dtype == torch.bfloat16
        assert got["t"] == (1, 2) and got["b"] == b"x" and not got["ro"].flags.writeable
        w.enqueue({1, 2})  # no native frame: pickled
        assert r.dequeue(timeout=5) == {1, 2}
    finally:
        r.close()
        w.close()


def test_allow_pickle_off_refuses_at_put_and_at_get(ns):
    with shm(ns) as producer, shm(ns, allow_pickle=False) as strict_reader:
        ok, _, meta = producer.put(0, 1, "obj", {"s": {1, 2}})  # a set needs pickle; allowed here
        assert ok and cpp_view(meta)["ext"]["pickle"] == 0
        assert strict_reader.get(0, 1, "obj", meta) is None
        assert isinstance(strict_reader.last_error, stagelink.CorruptError)
        assert "allow_pickle" in str(strict_reader.last_error)
        ok, _, _ = strict_reader.put(0, 1, "obj2", {"s": {1, 2}})
        assert not ok and isinstance(strict_reader.last_error, stagelink.InvalidArgumentError)
        assert "set" in str(strict_reader.last_error) and "allow_pickle" in str(strict_reader.last_error)
        ok, _, meta = producer.put(0, 1, "obj3", {"s": {1, 2}})
        assert producer.get(0, 1, "obj3", meta)[0] == {"s": {1, 2}}  # default on: unpickled


def test_a_cuda_tensor_comes_back_on_its_device(ns):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (runs on the GPU machine)")
    with shm(ns) as c:
        t = torch.arange(1 << 16, dtype=torch.bfloat16, device="cuda").reshape(256, 256)
        got, meta = roundtrip(c, {"h": t, "p": torch.nn.Parameter(torch.ones(3, device="cuda"))})
        assert got["h"].device == t.device and got["h"].dtype == torch.bfloat16 and torch.equal(got["h"], t)
        assert type(got["p"]) is torch.nn.Parameter and got["p"].is_cuda


def test_a_frame_whose_flags_lie_is_corrupt_not_an_overrun(ns):
    """Regression: a frame flagging a 4 KiB tensor as 0-d made get copy it into a one-element array."""
    with shm(ns, strict=True) as c:
        ro = np.arange(512, dtype=np.float64)
        ro.flags.writeable = False
        ok, _, meta = c.put(0, 1, "k", ro)
        assert ok and b"\xa2tk\x91\x08" in meta["inline"]  # ext {"tk": [read-only]}
        forged = dict(meta, inline=meta["inline"].replace(b"\xa2tk\x91\x08", b"\xa2tk\x91\x48"))  # + 0-d
        with pytest.raises(stagelink.CorruptError, match="0-d"):
            c.get(0, 1, "k", forged)
        for kind in (0x41, 0x49):  # torch 0-d, read-only torch 0-d
            forged = dict(meta, inline=meta["inline"].replace(b"\xa2tk\x91\x08", b"\xa2tk\x91" + bytes([kind])))
            if pytest.importorskip("torch"):
                with pytest.raises(stagelink.CorruptError, match="0-d"):
                    c.get(0, 1, "k", forged)


def test_a_tree_changed_by_its_own_leaves_is_not_misread(ns):
    """A torch leaf runs Python code (here a TorchFunctionMode) that grows the list being put: the
    native walk notices (its items moved) and the object is pickled as it then is, never misread."""
    torch = pytest.importorskip("torch")
    from torch.overrides import TorchFunctionMode

    box = [torch.ones(2)]

    class Grow(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if len(box) < 200:
                box.extend([0] * 100)  # reallocates the list's item array
            return func(*args, **(kwargs or {}))

    with shm(ns) as c, Grow():
        ok, _, meta = c.put(0, 1, "k", box)
    assert ok, c.last_error
    with shm(ns) as r:
        got = r.get(0, 1, "k", meta)
    assert got is not None and len(got[0]) == len(box) and torch.equal(got[0][0], torch.ones(2))


def _inline_producer(ns, q):
    with shm(ns) as c:
        q.put(c.put(0, 1, "small", {"ids": [1, 2, 3]})[2])


def test_inline_metadata_outlives_its_producer_but_a_forged_generation_does_not(ns):
    """Regression (found in this issue's work): metadata of a producer that closed, whose
    directory was recreated, was refused as a forged generation; it is gone, and its inline frame
    is still delivered."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_inline_producer, args=(ns, q))
    p.start()
    meta = q.get(timeout=30)
    p.join(30)
    with shm(ns, strict=True) as c:
        assert c.get(0, 1, "small", meta)[0] == {"ids": [1, 2, 3]}
        _, _, live = c.put(0, 1, "small", {"ids": [4]})
        with pytest.raises(stagelink.CorruptError, match="generation"):
            c.get(0, 1, "small", dict(live, gen=live["gen"] + 1))
        assert c.get(0, 1, "small", live)[0] == {"ids": [4]}




def test_lists_of_ids_across_run_boundaries_and_mixed_items(ns):
    # Runs of compact ints are written through a cursor of their own, 4096 at a time: a run that
    # crosses that bound, one broken by other items (big, negative, bool, float, nested), and
    # tuples must all come back exactly, types included.
    c = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns})
    try:
        ids = list(range(10_000))
        mixed = list(range(4090)) + [2 ** 40, -5, True, 1.5, [7, 8], None, 2 ** 63 + 1, -(2 ** 63)] + list(range(5000))
        for data in (ids, mixed, tuple(mixed), {"ids": ids, "t": (1, 2, 3), "x": [[1, 2], [3, [4, 2 ** 62]]]},
                     [], [0], [-1], [255, 256, 65535, 65536, 2 ** 32 - 1, 2 ** 32]):
            got, _ = roundtrip(c, data)
            assert got == data and type(got) is type(data)
            if isinstance(data, (list, tuple)):
                assert [type(x) for x in got] == [type(x) for x in data]
    finally:
        c.close()


# ---- vLLM-Omni's newer connector surface: _pending_keys, _metrics, arrival wake-ups ----


def test_a_zero_copy_torch_get_raises_on_an_in_place_write_instead_of_crashing(ns):
    """Issue 64: a zero_copy tensor from Connector.get viewed read-only shared memory as a plain
    tensor; an in-place write (a static or paged KV cache's) killed the process with SIGSEGV and
    left its arena in /dev/shm. Run in a child process: without the fix the child dies, not pytest."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    code = f"""
import torch, stagelink
c = stagelink.create_connector("SharedMemoryConnector", {{"namespace": "{ns}"}})
c.put("a", "b", "k", torch.arange(1024, dtype=torch.float32))
t, n = c.get("a", "b", "k", zero_copy=True)
assert float(t[3]) == 3.0 and float((t * 2)[3]) == 6.0   # reads and new tensors work
try:
    t.mul_(2)
    raise SystemExit("an in-place write went through")
except stagelink.ReadOnlyInputError as e:
    assert "clone()" in str(e)
u = t.clone(); u.mul_(2); assert float(u[3]) == 6.0      # a copy is the caller's
del t
c.close()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stdout, r.stderr)


def test_the_zero_copy_hook_runs_only_on_results_holding_torch_tensors(ns):
    """Issue 65: with torch imported, every zero_copy get's result went through the read-only
    wrapping hook, a Python walk of the whole tree: a list of 300 ids took 140-250 us instead of
    5 us. The decoder now calls the hook on each torch tensor it makes, and nothing else; the
    walk (stage outputs, relay inputs) returns lists and tuples of plain items as they are."""
    torch = pytest.importorskip("torch")
    from stagelink.pipeline import _readonly
    seen = []

    def hook(obj):
        seen.append(type(obj).__name__)
        return _readonly.protect_tensor(obj)

    c = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns})
    _core._set_zero_copy_hook(hook)
    try:
        for data in (list(range(300)), {"ids": list(range(300)), "a": np.ones(4, np.float32)}, b"x" * 5000, None):
            c.put(0, 1, "k", data)
            got, _ = c.get(0, 1, "k", zero_copy=True)
            assert type(got) is (memoryview if isinstance(data, bytes) else type(data))
        assert seen == []
        c.put(0, 1, "k", {"hidden": torch.ones(256), "ids": list(range(300))})
        got, _ = c.get(0, 1, "k", zero_copy=True)
        assert seen == ["Tensor"] and isinstance(got["hidden"], _readonly._cls()) and got["ids"] == list(range(300))
        del got
    finally:
        _core._set_zero_copy_hook(_readonly.protect_tensor)
        c.close()
    ids = list(range(300))
    assert _readonly.protect(ids) is ids and _readonly.protect((1, "a", None)) == (1, "a", None)
    nested = _readonly.protect([ids, torch.ones(2)])
    assert nested[0] is ids and isinstance(nested[1], _readonly._cls())


def test_a_copying_get_of_many_arrays_lands_them_in_one_pooled_buffer(ns):
    """Issue 65: a copying get of a KV cache's layers (each below 1 MiB, together more) copied each
    into memory of its own from malloc, fresh pages the kernel zeroed on every get: 1.8-2.4x a
    memcpy of the cache. Their bytes now go in one copy into one pooled buffer that the results
    view, writable; the slot is free at once, and the buffer returns to the pool with the last."""
    torch = pytest.importorskip("torch")
    c = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns})
    try:
        layers = [torch.full((65536,), float(i)) for i in range(16)]  # 16 x 256 KiB
        data = {"kv": layers, "mask": np.arange(65536, dtype=np.float32), "ids": [1, 2, 3], "b": b"x" * 10}
        before = _core.host_pool_stats()
        c.put(0, 1, "k", data)
        got, _ = c.get(0, 1, "k")
        assert c.health()["arena_used"] == 0  # a copy: the slot is released with the get
        assert [float(t[5]) for t in got["kv"]] == [float(i) for i in range(16)]
        assert np.array_equal(got["mask"], data["mask"]) and got["ids"] == [1, 2, 3] and got["b"] == b"x" * 10
        ptrs = sorted(t.data_ptr() for t in got["kv"]) + [got["mask"].ctypes.data]
        assert max(ptrs) - min(ptrs) < 17 * (256 << 10)  # one buffer, laid out as the frame was
        got["kv"][3].mul_(2)  # the caller's own memory
        got["mask"][0] = 7
        assert float(got["kv"][3][0]) == 6.0 and float(layers[3][0]) == 3.0
        after = _core.host_pool_stats()
        assert after["hits"] + after["misses"] == before["hits"] + before["misses"] + 1  # one buffer, not 17
        del got
        assert _core.host_pool_stats()["cached_buffers"] >= 1
        c.put(0, 1, "k", data)
        got, _ = c.get(0, 1, "k")
        assert _core.host_pool_stats()["hits"] == after["hits"] + 1  # the buffer dropped before, reused
        del got
        # One array alone, a list of bytes, tensors beside a 0-d one or an empty one: each comes
        # back whole, and none views the slot the get released (another put reuses it at once).
        big = [torch.ones(1 << 17), torch.ones(1 << 17)]
        for one in (np.ones(1 << 18, np.float32), [b"y" * (1 << 20), b"z" * (1 << 20)],
                    big + [torch.tensor(5.0)], big + [torch.ones(0)]):
            c.put(0, 1, "k", one)
            g, _ = c.get(0, 1, "k")
            assert c.health()["arena_used"] == 0
            c.put(0, 1, "other", np.full(1 << 20, 9, np.uint8))
            if isinstance(one, np.ndarray):
                assert np.array_equal(g, one)
            elif isinstance(one[0], bytes):
                assert g == one
            else:
                assert [float(x.sum()) for x in g[:2]] == [float(1 << 17)] * 2
                assert (float(g[2]) == 5.0) if one[2].dim() == 0 else g[2].numel() == 0
            c.get(0, 1, "other")
    finally:
        c.close()
