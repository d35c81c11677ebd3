"""CUDA tensors left on their GPU (issue 54): a put copies each CUDA tensor into the producer's
device arena, the frame carries a record of it, and a get in another process maps the arena over
CUDA IPC and returns a tensor on that GPU (a copy, or a view of the slot with zero_copy). Every test
here needs a GPU and skips without one; the bookkeeping they rest on (records, slots, events) is
tested without one in tests/cpp/test_cuda_arena.cpp."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import stagelink

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not stagelink.cuda_status()["available"],
                                reason="no CUDA device here (runs on the GPU machine: scripts/test-gpu)")

HERE = os.path.dirname(os.path.abspath(__file__))


def in_flight():
    """Device slots of this process's puts not yet released (every connector's: the arenas are the
    process's; earlier tests' closed connectors may keep some, so tests compare with a baseline)."""
    return sum(d["slots_in_flight"] for d in stagelink._core.cuda_arenas())


def settle(c, base, timeout=30):
    """Until this process's slots in flight are back to `base`: readers release once their work on a
    slot finished, the producer reclaims on its next call (a put also runs the reaper each second)."""
    deadline = time.time() + timeout
    while in_flight() > base and time.time() < deadline:
        stagelink._core.shm_reap("/dev/shm")
        c.put(0, 1, "tick", b"x")
        c.health()
        time.sleep(0.1)
    return in_flight()


def checksum(t):
    """A checksum computed on the device: the sum of the bytes, and of every 4093rd byte weighted."""
    b = t.contiguous().view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    s = int(b.to(torch.int64).sum().item()) if b.numel() else 0
    w = b[::4093].to(torch.int64)
    s2 = int((w * torch.arange(1, w.numel() + 1, device=w.device)).sum().item()) if w.numel() else 0
    return [s, s2, b.numel()]


CHILD = textwrap.dedent("""
    import json, os, sys, time, torch, stagelink
    sys.path.insert(0, {here!r})
    from test_cuda_ipc import checksum
    ns, keys, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    out = {{}}
    with stagelink.create_connector("SharedMemoryConnector", {{"namespace": ns}}) as c:
        for k in keys:
            got = c.get(0, 1, k, None, timeout=60, zero_copy=(mode in ("view", "hold")),
                        device="cpu" if mode == "host" else None)
            if got is None:
                out[k] = {{"error": repr(c.last_error)}}
                continue
            t = got[0]
            out[k] = {{"device": str(t.device), "dtype": str(t.dtype), "shape": list(t.shape), "sum": checksum(t)}}
            print(json.dumps({{k: out[k]}}), flush=True)  # one line per key as it comes
            if mode == "hold":  # keep the view, say so, and wait to be killed
                print(json.dumps(out), flush=True)
                time.sleep(600)
            del t, got
        torch.cuda.synchronize()
        stagelink._core.cuda_drain(30)
    print(json.dumps(out), flush=True)
""").format(here=HERE)


def consumer(ns, keys, mode="copy"):
    return subprocess.Popen([sys.executable, "-c", CHILD, ns, json.dumps(keys), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(p, timeout=120):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def producer(ns, **extra):
    return stagelink.create_connector("SharedMemoryConnector", dict({"namespace": ns}, **extra))


def sample(dt, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dt.is_floating_point:
        return torch.randn(n, generator=g, device="cuda").to(dt)
    return torch.randint(-1 << 40, 1 << 40, (n,), generator=g, device="cuda", dtype=dt)


@pytest.mark.parametrize("mode", ["copy", "view"])
def test_cuda_tensors_cross_processes_on_their_gpu(ns, mode):
    cases = [(torch.bfloat16, 0), (torch.float16, 1 << 9), (torch.int64, 1 << 17), (torch.bfloat16, 32 << 20),
             (torch.int64, 64 << 20)]  # 0 B to 512 MiB
    base = in_flight()
    with producer(ns) as c:
        want, keys = {}, []
        for i, (dt, n) in enumerate(cases):
            t = sample(dt, n, i)
            k = f"k{i}"
            ok, _, meta = c.put(0, 1, k, t)
            assert ok, c.last_error
            assert "inline" not in meta  # readers claim the entry: it holds the slot
            want[k] = {"device": "cuda:0", "dtype": str(dt), "shape": [n], "sum": checksum(t)}
            keys.append(k)
            del t
        got = finish(consumer(ns, keys, mode))
        assert got == want
        h = c.health()
        assert h["cuda_arenas"][0]["puts"] >= len(cases) and h["cuda_imports"]["releases_pending"] == 0
        assert settle(c, base) == base


def test_a_put_does_not_copy_through_the_host_and_its_frame_is_a_record(ns):
    with producer(ns) as c:
        t = torch.arange(1 << 20, device="cuda", dtype=torch.int32)
        ok, size, meta = c.put(0, 1, "k", t)
        assert ok and size < 4096  # the record, not 4 MiB
        got, _ = c.get(0, 1, "k", meta)  # same process: the slot itself, no IPC
        assert got.device == t.device and torch.equal(got, t)
        host, _ = c.get(0, 1, "k3", c.put(0, 1, "k3", t)[2], device="cpu")
        assert host.device.type == "cpu" and torch.equal(host, t.cpu())
        view, _ = c.get(0, 1, "k2", c.put(0, 1, "k2", t)[2], zero_copy=True)
        assert view.is_cuda and torch.equal(view, t)
        del view
        assert stagelink._core.cuda_drain(30)


def test_fan_out_to_three_consumers(ns):
    with producer(ns) as c:
        t = sample(torch.float16, 3 << 20, 7)
        ok, _, _ = c.put(0, 1, "fan", t, readers=3)
        assert ok, c.last_error
        ps = [consumer(ns, ["fan"], m) for m in ("copy", "view", "host")]  # host: get(..., device="cpu")
        got = [finish(p)["fan"] for p in ps]
        assert [g["sum"] for g in got] == [checksum(t)] * 3
        assert [g["device"] for g in got] == ["cuda:0", "cuda:0", "cpu"]


def test_a_reader_never_sees_bytes_before_the_producers_copy_finished(ns):
    """The put returns before its copy ran (the producer's stream is busy); the reader waits for it.
    Without the readiness wait the reader finds the slot's previous bytes (the 3s)."""
    with producer(ns, cuda_arena_bytes=8 << 20) as c:
        p = consumer(ns, ["a", "b"])  # it waits for "b" while the producer's GPU is still busy
        old = torch.full((1 << 20,), 3, dtype=torch.int32, device="cuda")
        ok, _, meta = c.put(0, 1, "a", old)
        assert json.loads(p.stdout.readline())["a"]["sum"] == checksum(old)
        time.sleep(0.3)
        c.health()  # "a" reclaimed: "b" is likely to take its slot (stale 3s), else fresh memory
        t = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU time before the fill and the put's copy
        t.fill_(7)
        ok, _, meta = c.put(0, 1, "b", t)
        assert ok
        assert finish(p)["b"]["sum"] == checksum(torch.full_like(t, 7))


def test_a_slot_a_reader_still_reads_is_not_reused(ns):
    """The reader holds a view and keeps its GPU busy before reading it; the producer meanwhile puts
    more than its arena holds. The view's bytes stay those of its put."""
    code = textwrap.dedent(f"""
        import sys, torch, stagelink
        sys.path.insert(0, {HERE!r})
        from test_cuda_ipc import checksum
        with stagelink.create_connector("SharedMemoryConnector", {{"namespace": {ns!r}}}) as c:
            v, _ = c.get(0, 1, "first", None, timeout=60, zero_copy=True)
            torch.cuda._sleep(int(2e9))     # ~1 s: the read below runs after the producer's later puts
            copy = v.clone()
            del v                           # released once the clone ran, not now
            print("dropped", flush=True)
            sys.stdin.readline()            # the producer has put more than its arena holds
            print(checksum(copy), flush=True)
    """)
    with producer(ns, cuda_arena_bytes=4 << 20) as c:
        first = torch.full((1 << 20,), 5, dtype=torch.int32, device="cuda")  # 4 MiB: the whole arena
        c.put(0, 1, "first", first)
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "dropped"
        for i in range(8):  # each freed at once: the next one takes its slot, or "first"'s if it were free
            ok, _, _ = c.put(0, 1, f"more{i}", torch.full((1 << 20,), 100 + i, dtype=torch.int32, device="cuda"))
            assert ok, c.last_error
            c.cleanup(f"more{i}")
        p.stdin.write("\n")
        p.stdin.flush()
        line = p.stdout.readline()
        p.wait(60)
        assert json.loads(line) == checksum(first)
        assert c.health()["cuda_arenas"][0]["arenas"] >= 1


def test_a_consumer_killed_holding_a_view_gives_the_read_back_then_its_slot_is_reclaimed(ns):
    """At least once, as for host memory: the read a killed reader never finished is given back by
    the reaper, a retry reads the same tensor from the same slot, and the slot is then reclaimed.
    The driver's file of the killed process (cuda.shm.<uid>.<pid in hex>.1) goes with the reap."""
    base = in_flight()
    with producer(ns) as c:
        t = sample(torch.float32, 1 << 20, 3)
        c.put(0, 1, "held", t)
        p = consumer(ns, ["held"], "hold")
        line = p.stdout.readline()
        assert json.loads(line)["held"]["sum"] == checksum(t)
        time.sleep(1.2)
        assert settle(c, base, timeout=1) == base + 1  # the reader holds it
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        driver_file = f"cuda.shm.{os.getuid()}.{p.pid:x}.1"
        stagelink._core.shm_reap("/dev/shm")  # gives the dead reader's read back
        assert settle(c, base, timeout=1) == base + 1  # not lost: still there for a retry
        assert finish(consumer(ns, ["held"]))["held"]["sum"] == checksum(t)
        assert settle(c, base) == base
        assert not os.path.exists(f"/dev/shm/{driver_file}")


def test_a_producer_killed_after_its_put_leaves_a_clear_miss_and_nothing_behind(ns):
    code = textwrap.dedent(f"""
        import torch, stagelink, sys
        c = stagelink.create_connector("SharedMemoryConnector", {{"namespace": {ns!r}}})
        ok, _, meta = c.put(0, 1, "orphan", torch.ones(1 << 20, device="cuda"))
        torch.cuda.synchronize()
        print("put", flush=True)
        sys.stdin.readline()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "put"
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    with producer(ns) as r:
        got = r.get(0, 1, "orphan", None, timeout=2)
        assert got is None  # its entry names a dead producer: never read
    stagelink._core.shm_reap("/dev/shm")
    assert not os.path.exists(f"/dev/shm/cuda.shm.{os.getuid()}.{p.pid:x}.1")  # the driver's file, reaped


def test_cuda_ipc_off_stages_through_host_memory(ns):
    with producer(ns, cuda_ipc=False) as c:
        t = torch.arange(1000, device="cuda")
        ok, size, meta = c.put(0, 1, "k", t)
        assert ok and size >= t.numel() * 8 and "inline" in meta
        got, _ = c.get(0, 1, "k", meta)
        assert got.device == t.device and torch.equal(got, t)
        assert c.health()["cuda_ipc"] is False


RELAY_CHILD = textwrap.dedent("""
    import json, sys, torch, stagelink
    sys.path.insert(0, {here!r})
    from test_cuda_ipc import checksum
    ns, md = sys.argv[1], json.loads(sys.argv[2])
    with stagelink.Relay(backend="shm", extra={{"namespace": ns}}) as r:
        t = r.get_async(md).result()
        print(json.dumps({{"device": str(t.device), "sum": checksum(t)}}), flush=True)
""").format(here=HERE)


def test_the_relay_moves_cuda_tensors_on_their_gpu(ns):
    """The relay over shared memory (SGLang-Omni's shapes): a CUDA tensor stays on its GPU, the
    metadata says so and sizes the data, not its record; a get into a CUDA or a CPU destination
    copies straight into it; the credit comes back once the reader's work on the slot finished."""
    with stagelink.Relay(backend="shm", credits=2, timeout_s=10, extra={"namespace": ns}) as r:
        t = sample(torch.bfloat16, 3 << 20, 11)
        op = r.put_async({"hidden": t, "ids": [1, 2, 3]}, request_id="q", edge="talker")
        md = op.metadata
        assert md["cuda_ipc"] is True and md["transfer_info"]["size"] >= t.numel() * 2
        p = subprocess.Popen([sys.executable, "-c", RELAY_CHILD, ns, json.dumps(md)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["device"] == "cuda:0" and got["sum"] == checksum(t)
        op.wait(30)  # the reader released it: the credit is back
        raw = sample(torch.int64, 1 << 18, 12)
        for dest in (torch.empty(1 << 21, dtype=torch.uint8, device="cuda"), torch.empty(1 << 21, dtype=torch.uint8)):
            op = r.put_async(raw, request_id="d", edge="talker")
            assert op.metadata["transfer_info"]["size"] == raw.numel() * 8
            r.get_async(op.metadata, dest_tensor=dest)
            assert torch.equal(dest.view(torch.int64).to("cuda"), raw)
            op.wait(30)


MQ_CHILD = textwrap.dedent("""
    import json, pickle, sys, torch, stagelink
    sys.path.insert(0, {here!r})
    from test_cuda_ipc import checksum
    handle = pickle.loads(bytes.fromhex(sys.argv[1]))
    r = stagelink.MessageQueue.create_from_handle(handle, 0)
    r.wait_until_ready(30)
    out = [checksum(r.dequeue(timeout=60)["t"]) for _ in range(int(sys.argv[2]))]
    print(json.dumps(out), flush=True)
    r.close()
""").format(here=HERE)


def test_the_queue_moves_cuda_tensors_on_their_gpu_to_local_readers(mq_clean):
    """vLLM's tensor arena: a queue whose readers are all local leaves CUDA tensors in the writer's
    device arena, readers copy them out on their GPU before they mark the message read, and the
    slots come back once every reader read them (more messages than the ring holds)."""
    import pickle
    base = in_flight()
    with stagelink.MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=2) as w:
        p = subprocess.Popen([sys.executable, "-c", MQ_CHILD, pickle.dumps(w.export_handle()).hex(), "6"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        w.wait_until_ready(60)
        ts = [sample(torch.float16, 1 << 20, 20 + i) for i in range(6)]
        for t in ts:
            w.enqueue({"t": t}, timeout=60)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == [checksum(t) for t in ts]
    assert in_flight() == base  # every message was read: the writer's close returned their slots


def test_the_metrics_count_device_slots_and_arena_bytes(ns):
    """Issue 63: CUDA arena slots and bytes in the metrics tree (read from the arenas' health)."""
    from stagelink import metrics

    def by_device(name):
        return {s["labels"][0]: s["value"] for f in metrics.collect() if f["name"] == name for s in f["samples"]}
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        puts0 = sum(by_device("stagelink_cuda_puts_total").values())
        t = torch.arange(1 << 18, dtype=torch.float32, device="cuda")
        ok, _, md = c.put(0, 1, "g", t)
        assert ok
        assert sum(by_device("stagelink_cuda_puts_total").values()) == puts0 + 1
        assert sum(by_device("stagelink_cuda_slots_in_flight").values()) == in_flight() >= 1
        assert all(v > 0 for v in by_device("stagelink_cuda_arena_bytes").values())
        got, _ = c.get(0, 1, "g", md)
        assert torch.equal(got, t)
