"""stagelink.Relay from Python: payload kinds, credits per edge with deadlines, completion,
cleanup, close, the local backend, and across processes."""
import multiprocessing as mp
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import stagelink
from proc_util import queues, spawned


def relay(ns, **kw):
    return stagelink.Relay(dict({"extra": {"namespace": ns}, "timeout_s": 0.3, "credits": 2}, **kw))


def test_payload_kinds_round_trip(ns):
    with relay(ns) as r:
        big = np.arange(1 << 20, dtype=np.float32)
        for obj in ({"hidden": big, "ids": list(range(300)), "t": (1, "a")}, b"x" * 100000, big,
                    {"nested": [np.int64(3), None, 2.5]}, object):
            op = r.put_async(obj, request_id="r", edge="e")
            got = r.get_async(op.metadata).result()
            if isinstance(obj, np.ndarray):
                np.testing.assert_array_equal(got, obj)
            elif isinstance(obj, dict) and "hidden" in obj:
                np.testing.assert_array_equal(got["hidden"], big)
                assert got["ids"] == obj["ids"] and got["t"] == (1, "a")
            else:
                assert got == obj
            op.wait(1)  # read: the credit is back
            assert op.done()


def test_credits_per_edge_time_out_with_a_clear_error(ns):
    with relay(ns) as r:
        x = np.ones(100_000, np.uint8)
        ops = [r.put_async(x, request_id="r", edge="a") for _ in range(2)]
        t0 = time.monotonic()
        with pytest.raises(stagelink.ExhaustedError, match="edge 'a'"):
            r.put_async(x, request_id="r", edge="a")
        assert 0.25 < time.monotonic() - t0 < 2
        r.put_async(x, request_id="r", edge="b")  # its own credits
        r.get_async(ops[0].metadata)
        r.put_async(x, request_id="r", edge="a")  # a read returned one
        assert r.health()["credit_timeouts"] == 1


def test_a_dropped_operation_loses_nothing(ns):
    with relay(ns, credits=1) as r:
        md = r.put_async(np.full(300_000, 7, np.uint8), request_id="r", edge="e").metadata  # op dropped
        assert (r.get_async(md).result() == 7).all()
        r.put_async(np.ones(10), request_id="r", edge="e")  # the credit came back


def test_cleanup_and_close_release_puts(ns):
    r = relay(ns, credits=1)
    op = r.put_async(np.ones(300_000, np.uint8), request_id="req-7", edge="e")
    assert r.cleanup("req-7") == 1
    with pytest.raises(stagelink.CancelledError):
        op.wait(1)
    with pytest.raises(stagelink.StagelinkError):
        r.get_async(op.metadata, timeout=0)
    held = r.put_async(np.ones(300_000, np.uint8), request_id="req-8", edge="e")
    r.close()
    with pytest.raises(stagelink.ClosedError):
        held.wait(1)
    with pytest.raises(stagelink.ClosedError):
        r.put_async(b"x")


def test_a_copying_get_copies_a_payload_once(ns):
    """A copying relay get asked its connector for a copy and then copied that copy into the
    Python object: two copies of every payload (a 1 MiB get took 94 us where one copy is ~35 us).
    Now it views the slot and copies once: one host buffer per get of 4 MiB."""
    with stagelink.Relay({"backend": "shm", "extra": {"namespace": ns}}) as r:
        data = np.arange(1 << 20, dtype=np.float32)
        for i in range(3):
            op = r.put_async(data, request_id=f"r{i}")
            before = stagelink._core.host_pool_stats()
            got = r.get_async(op.metadata).result()
            after = stagelink._core.host_pool_stats()
            assert np.array_equal(got, data) and got.flags.writeable
            assert (after["hits"] + after["misses"]) - (before["hits"] + before["misses"]) == 1
            op.wait(5)  # the slot was released by the get: the put is done
            del got


def test_get_into_a_destination_buffer(ns):
    with relay(ns) as r:
        x = np.arange(1000, dtype=np.int32)
        dest = np.zeros(1000, np.int32)
        op = r.put_async(x, edge="e")
        got = r.get_async(op.metadata, dest=dest)
        assert got.result() is dest and got.size == x.nbytes
        np.testing.assert_array_equal(dest, x)
        small = np.zeros(10, np.int32)
        op = r.put_async(x, edge="e")
        with pytest.raises(stagelink.InvalidArgumentError, match="do not fit"):
            r.get_async(op.metadata, dest=small)


def test_fan_out_reads_are_not_destructive(ns):
    with relay(ns) as r:
        op = r.put_async(np.arange(50_000), edge="e", readers=2)
        a = r.get_async(op.metadata).result()
        assert not op.done()
        b = r.get_async(op.metadata).result()
        np.testing.assert_array_equal(a, b)
        op.wait(1)


def test_local_backend_passes_python_objects_by_reference():
    with stagelink.Relay(backend="local", credits=1, timeout_s=0.2) as r:
        obj = {"state": [1, 2, 3], "fn": print}
        op = r.put_async(obj, request_id="r", edge="e")
        with pytest.raises(stagelink.ExhaustedError):
            r.put_async(obj, edge="e")
        assert r.get_async(op.metadata).result() is obj
        op.wait(0.1)
        with pytest.raises(stagelink.NotFoundError):
            r.get_async(op.metadata)
        op2 = r.put_async(obj, request_id="r2", edge="e")
        assert r.cleanup("r2") == 1
        with pytest.raises(stagelink.CancelledError):
            op2.wait(0.1)


def test_the_local_backend_is_the_native_one_and_lets_go_of_its_objects():
    """One same-process backend (C++, as every other): it holds a Python object by reference until
    its last reader took it, its put is withdrawn or the relay closes, and lets go of it outside its
    locks: an object whose __del__ uses a relay again (here: a put) does not deadlock it. Run in a
    child process: a deadlock there is a timeout here, not a hung suite."""
    code = textwrap.dedent("""
        import gc, threading, weakref, stagelink
        other = stagelink.Relay(backend="local", credits=64, timeout_s=5)
        class Obj:
            def __del__(self):
                other.put_async(b"from __del__", edge="d")  # takes the same-process table's lock
        with stagelink.Relay(backend="local", credits=4, timeout_s=5, engine_id="eng") as r:
            assert type(r._native).__name__ == "_Relay"
            o = Obj(); w = weakref.ref(o)
            op = r.put_async(o, request_id="a", edge="e", readers=2)
            md = op.metadata
            assert md["engine_id"] == "eng" and md["transfer_info"]["req_id"] == "a"
            del o
            assert r.get_async(md).result() is w()
            assert w() is not None                   # a second reader may still come
            assert r.get_async(md).result() is w()   # the last reader: the relay lets go
            gc.collect(); assert w() is None
            op.wait(1)
            o = Obj(); w = weakref.ref(o)
            op = r.put_async(o, request_id="b", edge="e"); del o
            assert r.cleanup("b") == 1               # withdrawn
            gc.collect(); assert w() is None
            o = Obj(); w = weakref.ref(o)
            r.put_async(o, edge="e"); del o
            t = threading.Thread(target=r.close)     # closed from another thread, the GIL let go
            t.start(); t.join(10)
            assert not t.is_alive()
            gc.collect(); assert w() is None
        print(other.health()["credits_in_use"])
        other.close()
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "'d': 3" in p.stdout  # every __del__ ran, each putting once


def test_bad_config_and_metadata_are_clear_errors(ns):
    with pytest.raises(stagelink.InvalidArgumentError, match="unknown key 'credit'; did you mean 'credits'"):
        stagelink.Relay(credit=3)
    with pytest.raises(stagelink.InvalidArgumentError, match=r"unknown key 'spin' \(known: backend, connector"):
        stagelink.Relay(spin=3)  # the relay's config is closed: every unknown key is refused
    with pytest.raises(stagelink.InvalidArgumentError, match="relay config: backend must be one of: shm ucx local "
                                                             "connector, got 'nccl'"):
        stagelink.Relay(backend="nccl")
    with pytest.raises(stagelink.InvalidArgumentError, match=r"relay config: credits must be an integer in \[1, "
                                                             r"65536\], got 2.5"):
        stagelink.Relay(credits=2.5)
    with relay(ns) as r:
        with pytest.raises(stagelink.CorruptError, match="relay_key"):
            r.get_async({"size": 3})
        with pytest.raises(stagelink.InvalidArgumentError, match="dst_rank"):
            r.put_async(b"x", dst_rank=-1)
    with stagelink.Relay({"extra": {"namespace": ns}, "world_size": 2}) as r:
        with pytest.raises(stagelink.InvalidArgumentError, match="dst_rank"):
            r.put_async(b"x", dst_rank=5)


def _sglang_stage_reader(ns, q_in, q_out):
    """A receiving stage as SGLang-Omni's relay_io reads a payload: a uint8 buffer sized by the
    metadata's transfer_info.size on relay.device, get_async(metadata=, dest_tensor=,
    request_id=), await wait_for_completion, then relay.cleanup(request_id)."""
    import asyncio
    import torch
    r = stagelink.create_relay("shm", engine_id="talker", extra={"namespace": ns})

    async def read(relay_info, rid):
        buf = torch.zeros(relay_info["transfer_info"]["size"], dtype=torch.uint8, device=getattr(r, "device", "cpu"))
        op = await r.get_async(metadata=relay_info, dest_tensor=buf, request_id=rid)
        await op.wait_for_completion()
        r.cleanup(rid)
        return buf

    try:
        md = q_in.get(timeout=60)
        buf = asyncio.run(read(md["relay_info"], md["rid"]))
        q_out.put(buf.view(torch.bfloat16).reshape(md["shape"]).float().tolist())
    finally:
        r.close()


def test_sglang_omni_stage_io_across_processes_and_a_receivers_cleanup(ns):
    """SGLang-Omni's relay_io as a client, across processes: the metadata carries engine_id and
    transfer_info {size, req_id}; a receiver cleans the request up after reading it, which must
    not cancel what the producer put for the request's other receiver (it did: cleanup took every
    unread put of the request on the host); an unrelated dst_rank is taken (no world_size)."""
    import asyncio
    torch = pytest.importorskip("torch")
    x = torch.randn(256, 256).to(torch.bfloat16)  # 128 KiB: past the inline threshold, in the arena
    flat = x.contiguous().view(torch.uint8).reshape(-1)
    q_in, q_out = queues()
    with spawned(_sglang_stage_reader, ns, q_in, q_out), \
            stagelink.ShmRelay("thinker", 1, 2, "cpu", extra={"namespace": ns}) as sender:
        async def send():
            to_talker = await sender.put_async(flat, request_id="req", dst_rank=1, receiver_id="talker")
            to_vocoder = await sender.put_async(flat, request_id="req", receiver_id="vocoder")
            md = to_talker.metadata
            assert md["engine_id"] == "thinker"
            assert md["transfer_info"]["size"] == flat.numel() and md["transfer_info"]["req_id"] == "req"
            q_in.put({"relay_info": md, "rid": "req", "shape": list(x.shape)})  # pickled, as a control message
            await to_talker.wait_for_completion(timeout=60)
            got = q_out.get(timeout=60)
            assert got == x.float().tolist()
            # The talker's cleanup("req") left the vocoder's put alone:
            dest = torch.zeros(to_vocoder.metadata["transfer_info"]["size"], dtype=torch.uint8)
            op = await sender.get_async(metadata=to_vocoder.metadata, dest_tensor=dest, request_id="req")
            await op.wait_for_completion()
            assert torch.equal(dest.view(torch.bfloat16).reshape(x.shape), x)
            await to_vocoder.wait_for_completion(timeout=5)

        asyncio.run(send())


def test_sglang_wait_for_completion_withdraws_an_unconsumed_put(ns):
    """SGLang-Omni's put contract: wait_for_completion(timeout) of a put nobody consumed raises
    TimeoutError ("was not consumed in time") and gives the put's slot and credit back; a later get
    of it fails (a payload above the inline threshold: a small one travels in its metadata). The
    synchronous wait() keeps the put (it can be waited on again)."""
    import asyncio
    torch = pytest.importorskip("torch")

    async def main(r):
        t = torch.arange(100_000, dtype=torch.int32).to(torch.uint8)
        op = await r.put_async(t, request_id="r0")
        with pytest.raises(TimeoutError, match="was not consumed in time"):
            await op.wait_for_completion(timeout=0.0)
        with pytest.raises(stagelink.StagelinkError):
            r.get_async(op.metadata, timeout=0)
        op2 = await asyncio.wait_for(r.put_async(t, request_id="r1"), timeout=1.0)  # the one credit is back
        with pytest.raises(stagelink.TimeoutError):
            op2.wait(0)  # sync: still there
        assert torch.equal(r.get_async(op2.metadata).result(), t)
        await op2.wait_for_completion()
        assert r.health()["credits_in_use"] == {"any": 0}  # the local backend named it "rankNone"
        if r.backend == "shm":  # a reader holding a view when the put is withdrawn keeps it whole
            held = await r.put_async(t, request_id="r2")
            view = r.get_async(held.metadata, zero_copy=True).result()
            with pytest.raises(TimeoutError, match="when the reader already reading it is done"):
                await held.wait_for_completion(timeout=0.0)
            assert r.health()["credits_in_use"] == {"any": 1}  # its slot is still in use
            await asyncio.sleep(0.01)
            assert torch.equal(view, t)
            del view
            assert r.health()["credits_in_use"] == {"any": 0}

    for kind in ("shm", "local"):
        with stagelink.create_relay(kind, engine_id="sender", device="cpu", credits=1, timeout_s=0.3,
                                    extra={"namespace": ns}) as r:
            asyncio.run(main(r))


def test_sglang_relay_classes_and_registry(ns):
    """ShmRelay(engine_id, slot_size_mb, credits, device) by position, its attributes, and the
    registry: register_relay adds a type, create_relay passes only the keyword arguments a
    class's constructor takes (all of them to one taking **kwargs)."""
    r = stagelink.ShmRelay("e0", extra={"namespace": ns})
    try:
        assert (r.engine_id, r.device) == ("e0", "cpu")
        assert r.health()["credits"] == 2  # SGLang-Omni's defaults: 2 credits of 64 MiB
        r.get_async(r.put_async(b"x" * 100_000).metadata)  # the arena is made at the first put
        assert r.health()["connector"]["arena_bytes"] == 128 << 20
    finally:
        r.close()
    from stagelink.relay import RELAY_REGISTRY, register_relay
    assert RELAY_REGISTRY["shm"] is stagelink.ShmRelay
    seen = {}

    @register_relay("test-narrow")
    class Narrow(stagelink.LocalRelay):
        def __init__(self, engine_id, credits=1):
            seen["narrow"] = (engine_id, credits)
            super().__init__(engine_id, credits=credits)

    @register_relay("test-wide")
    class Wide(stagelink.LocalRelay):
        def __init__(self, **kwargs):
            seen["wide"] = kwargs
            super().__init__(kwargs["engine_id"])

    try:
        with stagelink.create_relay("test-narrow", engine_id="n", credits=3, rank=0, world_size=2) as a:
            assert isinstance(a, Narrow) and seen["narrow"] == ("n", 3)
        with stagelink.create_relay("test-wide", engine_id="w", send_to_ranks=[1]) as b:
            assert isinstance(b, Wide) and seen["wide"] == {"engine_id": "w", "send_to_ranks": [1]}
    finally:
        del RELAY_REGISTRY["test-narrow"], RELAY_REGISTRY["test-wide"]


def test_sglang_put_many_async_writes_segments_in_one_payload(ns):
    """SGLang-Omni's segmented put (relay_io uses it when a relay has it): tensors of any dtype at
    their offsets in one uint8 payload, zeros between, read back by size; bad segments refused
    without taking a credit."""
    import asyncio
    torch = pytest.importorskip("torch")
    video = torch.arange(96, dtype=torch.float32).reshape(12, 8).bfloat16()
    grid = torch.tensor([[2, 4, 4]], dtype=torch.long)
    big = torch.randn(300_000)  # past the inline threshold: written into the arena
    segs = [(0, video.contiguous().view(torch.uint8).reshape(-1)), (256, grid.view(torch.uint8).reshape(-1)),
            (512, big)]
    total = 512 + big.numel() * 4

    async def main(r):
        op = await r.put_many_async(segs, total_size=total, request_id="req")
        assert op.metadata["transfer_info"] == {"size": total, "req_id": "req"}
        buf = torch.full((op.metadata["transfer_info"]["size"],), 7, dtype=torch.uint8)
        got = await r.get_async(metadata=op.metadata, dest_tensor=buf, request_id="req")
        await got.wait_for_completion()
        assert torch.equal(buf[:192].view(torch.bfloat16).reshape(12, 8), video)
        assert torch.equal(buf[256:280].view(torch.long).reshape(1, 3), grid)
        assert torch.equal(buf[512:].view(torch.float32), big)
        assert int(buf[192:256].sum()) == 0 and int(buf[280:512].sum()) == 0  # zeros between
        await op.wait_for_completion(timeout=5)
        with pytest.raises(stagelink.InvalidArgumentError, match="overlap"):
            await r.put_many_async([(0, big), (8, grid)], total_size=total)
        with pytest.raises(stagelink.InvalidArgumentError, match="past total_size"):
            await r.put_many_async([(total - 4, grid)], total_size=total)
        with pytest.raises(stagelink.InvalidArgumentError, match="negative"):
            await r.put_many_async([(0, grid)], total_size=-1)
        assert r.health()["credits_in_use"].get("any", 0) == 0

    for kind in ("shm", "local"):
        with stagelink.create_relay(kind, engine_id="e", slot_size_mb=4, credits=1, timeout_s=0.3,
                                    extra={"namespace": ns}) as r:
            asyncio.run(main(r))


def _reader(ns, md, q):
    r = stagelink.Relay({"extra": {"namespace": ns}})
    x = r.get_async(md).result()
    q.put((int(x["x"].sum()), x["tag"]))
    r.close()


def test_across_processes(ns):
    with relay(ns, timeout_s=10) as r:
        x = np.arange(2_000_000, dtype=np.int64)
        op = r.put_async({"x": x, "tag": "hello"}, request_id="r", edge="p")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_reader, args=(ns, op.metadata, q))
        p.start()
        op.wait(30)  # completes when the other process has read it
        assert q.get(timeout=30) == (int(x.sum()), "hello")
        p.join(30)
        assert p.exitcode == 0


def test_sglang_style_async_use(ns):
    import asyncio

    async def main():
        with relay(ns, timeout_s=5) as r:
            x = np.arange(100_000, dtype=np.float32)
            op = await r.put_async(x, request_id="r")          # awaitable, as the seed's API
            waiter = asyncio.ensure_future(op.wait_for_completion(timeout=5))
            await asyncio.sleep(0.01)
            assert not waiter.done()                            # the loop is not blocked by the wait
            got = await r.get_async(op.metadata, request_id="r")
            await waiter                                        # completes once read
            np.testing.assert_array_equal(got.result(), x)

    asyncio.run(main())


def test_get_into_a_torch_tensor(ns):
    torch = pytest.importorskip("torch")
    with relay(ns) as r:
        x = np.arange(1000, dtype=np.float32)
        dest = torch.zeros(1000, dtype=torch.float32)
        r.get_async(r.put_async(x, edge="e").metadata, dest)  # the seed's positional dest_tensor
        assert torch.equal(dest, torch.arange(1000, dtype=torch.float32))


def test_sglang_omnis_newer_relay_api(ns):
    """SGLang-Omni's current Relay: create_relay(type, **kwargs), put_async(..., receiver_id=),
    get_async(metadata, dest_tensor=) of any dtype, and the receiver's acknowledgement on the
    put (mark_receiver_done / mark_receiver_failed)."""
    import asyncio
    torch = pytest.importorskip("torch")

    async def main(r):
        x = torch.randn(64, 32).to(torch.bfloat16)
        op = await r.put_async(x, request_id="a", receiver_id="talker")
        dest = torch.empty(64, 32, dtype=torch.bfloat16)  # numpy has no bfloat16: filled as bytes
        got = await r.get_async(op.metadata, dest_tensor=dest, request_id="a")
        await got.wait_for_completion()
        assert torch.equal(dest, x)
        op.mark_receiver_done()  # the control plane relays the receiver's ack: accepted
        await op.wait_for_completion(timeout=5)
        # The receiver failed: the put is withdrawn, its one credit is back, its wait raises that.
        failed = await r.put_async(x, request_id="b", receiver_id="talker")
        failed.mark_receiver_failed(RuntimeError("talker could not decode"))
        with pytest.raises(RuntimeError, match="could not decode"):
            await failed.wait_for_completion(timeout=5)
        again = await r.put_async(x, request_id="c", receiver_id="talker")  # would wait 0.3 s, then fail
        r.get_async(again.metadata)
        await again.wait_for_completion(timeout=5)

    for kind in ("shm", "local"):
        r = stagelink.create_relay(kind, engine_id="e0", credits=1, timeout_s=0.3, extra={"namespace": ns})
        try:
            assert r.health()["credits"] == 1
            asyncio.run(main(r))
        finally:
            r.close()
    assert stagelink.create_relay("shm", engine_id="e1", extra={"namespace": ns}).health()["credits"] == 2
    with pytest.raises(ValueError, match="Unknown relay type"):
        stagelink.create_relay("bogus")
    with pytest.raises(stagelink.UnsupportedError, match="ucx"):
        stagelink.create_relay("nccl")
    with relay(ns) as r:  # a non-contiguous destination would be filled in a copy: refused
        op = r.put_async(np.arange(16, dtype=np.float32), edge="e")
        with pytest.raises(stagelink.InvalidArgumentError, match="contiguous"):
            r.get_async(op.metadata, torch.zeros(4, 4).t())
        r.cleanup(None)
