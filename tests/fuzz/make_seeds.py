"""Write the fuzz targets' seed corpora (tests/fuzz/corpus/<target>/) from what stagelink itself
produces: frames of native payloads, control messages, a message-queue handle, shared-memory put
metadata, store meta records and transfer configs. Run with the installed package:
    .venv/bin/python tests/fuzz/make_seeds.py"""
import hashlib
import os
import struct
import uuid

import numpy as np

import stagelink
from stagelink import _core

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, data: bytes):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, hashlib.sha1(data).hexdigest()[:16]), "wb") as f:
        f.write(data)


payloads = [b"", b"abc", np.arange(10, dtype=np.float32), {"hidden": np.zeros((2, 3), np.float16), "ids": [1, 2, 3]},
            [1, "two", 3.0, None, True, {"x": b"\x00\x01"}], {"nested": {"deeper": [np.arange(3), "s"]}}, 42]
for p in payloads:
    write("frame", stagelink.Connector.serialize_obj(p))
    write("control_body", stagelink.Connector.serialize_obj(p))
# what honest senders never send as a control body: a pickle frame, a CUDA device record
write("control_body", stagelink.Connector.serialize_obj({1, 2}))
write("control_body", _core._frame_from_parts({"tk": [1 | 256]}, [b"SLDR" + b"\0" * 200]))
write("control_body", _core.encode_object({"edges": {"a->b": {"messages": 3, "lat_ns": [1, 2, 3]}}}, 1 << 20))

msgs = [("submit", "r1", "", "a", None, None, False, "", b"frame"),
        ("data_ready", "r1", "a", "b", {"relay_key": "k", "entry": 3, "gen": 1, "size": 100}, None, False, "", None),
        ("stream", "r2", "b", "c", {"t_ns": 12345}, 7, True, "", None),
        ("complete", "r3", "c", "coordinator", None, None, False, "boom", None),
        ("shutdown", "", "", "", None, None, False, "", None), ("ready", "", "p", "", {"peers": {"a": "x"}}, None, False, "", None)]
for m in msgs:
    b = _core.control_encode(*m)
    write("control", b)
    write("msgpack", b)

ns = "seed" + uuid.uuid4().hex[:8]
with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
    for i, p in enumerate((np.arange(1000, dtype=np.uint8), b"x" * 10)):
        ok, _, md = c.put(0, 1, f"k{i}", p)
        md = {k: v for k, v in md.items() if k != "inline"}
        # The metadata as a data_ready carries it (under "md"): the target reads it from there.
        write("shm_metadata", _core.control_encode("data_ready", "r", "a", "b", md, None, False, "", None))
        c.get(0, 1, f"k{i}", md)

with stagelink.MessageQueue(2, 1, max_chunk_bytes=1 << 12, max_chunks=2, connect_ip="127.0.0.1") as w:
    write("mq_handle", w.export_handle().data)
with stagelink.MessageQueue(1, 1, max_chunk_bytes=1 << 12, max_chunks=2) as w:
    write("mq_handle", w.export_handle().data)

# Store meta: "SLS2" (magic), 16 hex digits of generation, then size, chunks, chunk_bytes, hash,
# readers (u64 each), then the request id (store_connector.cpp, encode_meta).
for size, chunk, readers, rid in ((100, 4096, 1, b""), (1 << 20, 1 << 18, 3, b"req-1")):
    chunks = (size + chunk - 1) // chunk
    write("store_meta", b"SLS2" + b"%016x" % 7 + struct.pack("<5Q", size, chunks, chunk, 0xdeadbeef, readers) + rid)

for y in ("runtime:\n  connectors:\n    shm: {name: SharedMemoryConnector, extra: {shm_threshold_bytes: 65536}}\n"
          "stage_args:\n  - stage_id: 0\n    output_connectors: {to_stage_1: shm}\n  - stage_id: 1\n"
          "    input_connectors: {from_stage_0: shm}\n",
          "connectors:\n  big: {name: SharedMemoryConnector, extra: {arena_bytes: '${ARENA:-1GB}'}}\n"
          "stages:\n  - {stage_id: 0, output_connectors: {to_stage_1: big}}\n  - {stage_id: 1}\n",
          "stage_args: []\n"):
    write("config", y.encode())


def mp(v) -> bytes:
    """A small msgpack encoder (maps of str, int, bytes) for the side channel's requests."""
    if isinstance(v, dict):
        return bytes([0x80 | len(v)]) + b"".join(mp(k) + mp(x) for k, x in v.items())
    if isinstance(v, str):
        b = v.encode()
        return (bytes([0xa0 | len(b)]) if len(b) < 32 else bytes([0xd9, len(b)])) + b
    if isinstance(v, bytes):
        return bytes([0xc4, len(v)]) + v
    if isinstance(v, int):
        return bytes([v]) if 0 <= v < 128 else b"\xcf" + struct.pack(">Q", v)
    raise TypeError(type(v))


for req in ({"op": "query", "key": "k0@0_1", "rq": 1},
            {"op": "pull", "key": "k1@0_1", "rq": 2, "len": 4096, "token": 7, "worker": b"\x01" * 40, "inline_max": 65536},
            {"op": "pull", "key": "k2@0_1", "rq": 3, "len": 10, "token": 9, "worker": b"\x02" * 8, "inline_max": 0},
            {"op": "hello", "key": "", "rq": 4, "worker": b"\x00" * 60},
            {"op": "nope", "key": "x", "rq": 5}):
    write("side_channel", mp(req))
