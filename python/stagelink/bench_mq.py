"""stagelink bench mq: the MessageQueue against ZeroMQ PUB/SUB over ipc:// (and iceoryx2 when
its PyPI package is installed), measured in the same run."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

from . import _core
from .bench import write_json


def _py_reader(handle, n, ack, out):
    from .mq import MessageQueue
    r = MessageQueue.create_from_handle(handle, 0)
    lat = []
    for _ in range(n):
        ts = r.dequeue(timeout=30)
        lat.append((time.monotonic_ns() - ts) / 1e3)
        with ack.get_lock():
            ack.value += 1
    out.put(lat)
    r.close()


def python_latency(n=5000):
    """One-way latency of a 64-byte-class Python object (an int timestamp) through the Python API, 1 -> 1."""
    from .mq import MessageQueue
    ctx = mp.get_context("spawn")
    w = MessageQueue(1, 1, max_chunk_bytes=4096, max_chunks=64, warn_interval_s=0)
    ack = ctx.Value("q", 0)
    out = ctx.Queue()
    p = ctx.Process(target=_py_reader, args=(w.export_handle(), n, ack, out))
    p.start()
    w.wait_until_ready(timeout=60)
    lat = _paced(n, lambda: w.enqueue(time.monotonic_ns()), ack, out, p, "stagelink")
    w.close()
    return lat


def _paced(n, send, ack, out, proc, who):
    """Send n messages, each after the reader acknowledged the previous one; the reader's
    latency samples (minus 200 of warm-up) as median and p99."""
    for i in range(n):
        send()
        deadline = time.monotonic() + 30
        while ack.value < i + 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{who} latency reader stalled")
    lat = sorted(out.get(timeout=60)[200:])
    proc.join(30)
    return {"median_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)]}


def _iox_payload():
    import ctypes

    class Msg(ctypes.Structure):  # 64 bytes: a timestamp and padding
        _fields_ = [("ts", ctypes.c_uint64), ("pad", ctypes.c_uint8 * 56)]
    return Msg


def _iox_reader(service_name, n, ack, ready, out):
    import iceoryx2 as iox2
    Msg = _iox_payload()
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    svc = node.service_builder(iox2.ServiceName.new(service_name)).publish_subscribe(Msg).open_or_create()
    sub = svc.subscriber_builder().create()
    ready.set()
    lat = []
    while len(lat) < n:  # iceoryx2's pub/sub has no blocking receive: poll, as its examples do
        sample = sub.receive()
        if sample is None:
            continue
        lat.append((time.monotonic_ns() - sample.payload().contents.ts) / 1e3)
        del sample
        with ack.get_lock():
            ack.value += 1
    out.put(lat)


def iceoryx2_latency(n=5000):
    """One-way latency of a 64-byte ctypes message through iceoryx2's Python API, 1 -> 1
    (the subscriber polls), paced exactly like python_latency."""
    import iceoryx2 as iox2
    Msg = _iox_payload()
    name = f"stagelink/bench/{os.getpid()}"
    node = iox2.NodeBuilder.new().create(iox2.ServiceType.Ipc)
    svc = node.service_builder(iox2.ServiceName.new(name)).publish_subscribe(Msg).open_or_create()
    pub = svc.publisher_builder().create()
    ctx = mp.get_context("spawn")
    ack, ready, out = ctx.Value("q", 0), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_iox_reader, args=(name, n, ack, ready, out))
    p.start()
    if not ready.wait(60):
        raise TimeoutError("iceoryx2 reader did not start")
    time.sleep(0.2)

    def send():
        pub.loan_uninit().write_payload(Msg(ts=time.monotonic_ns())).send()
    return _paced(n, send, ack, out, p, "iceoryx2")


def _iox_available():
    try:
        import iceoryx2  # noqa: F401
        return True
    except Exception:
        return False


def run_mq(quick=False, json_path=None, out=sys.stdout, peer=True):
    print("stagelink bench mq: MessageQueue vs ZeroMQ PUB/SUB (ipc://), same harness, same run", file=out)
    say = lambda m: print("  " + m, file=out, flush=True)  # noqa: E731
    args = (2000, 20000, 16, 2, 0.2) if quick else (20000, 200000, 64, 5, 1.0)
    res = _core.bench_mq_cpp(*args, say)
    say("stagelink Python API: one-way latency, 1 -> 1")
    res["stagelink"]["python_latency_1to1"] = python_latency(1000 if quick else 5000)
    if not _iox_available():
        res["iceoryx2"] = {"note": "the iceoryx2 package is not installed (pip install iceoryx2)"}
    else:
        say("iceoryx2 Python API: one-way latency, 1 -> 1 (polling subscriber)")
        try:
            res["iceoryx2"] = {"python_latency_1to1": iceoryx2_latency(1000 if quick else 5000)}
        except Exception as e:  # a peer that does not run here is reported, not fatal
            res["iceoryx2"] = {"note": f"iceoryx2 did not run here: {e!r}"}
    sl, zq = res["stagelink"], res["zeromq"]

    def cell(d, k, f="{:.2f}"):
        v = d.get(k)
        if v is None:
            return "-"
        if isinstance(v, dict):
            return f"{v['median_us']:.2f} / {v['p99_us']:.1f}"
        return f.format(v)

    rows = [
        ("64 B one-way, 1 -> 1 (median / p99 us)", "latency_64B_1to1", "{:.2f}"),
        ("64 B one-way, 1 -> 4 (median / p99 us)", "latency_64B_1to4", "{:.2f}"),
        ("64 B messages/s, 1 -> 1", "msgs_per_s_1to1", "{:,.0f}"),
        ("64 B messages/s, 1 -> 4", "msgs_per_s_1to4", "{:,.0f}"),
        ("bandwidth 1 MiB, 1 -> 1 (GB/s)", "gbps_1MiB", "{:.2f}"),
        ("bandwidth 16 MiB, 1 -> 1 (GB/s)", "gbps_16MiB", "{:.2f}"),
        ("wake-up after idle (median / p99 us)", "wakeup_after_idle", "{:.2f}"),
        ("idle reader CPU (%)", "idle_reader_cpu_pct", "{:.3f}"),
    ]
    w0 = max(len(r[0]) for r in rows)
    print(f"\n{'':{w0}} | {'stagelink':>18} | {'ZeroMQ PUB/SUB':>18} | ratio", file=out)
    print("-" * (w0 + 52), file=out)
    for label, key, f in rows:
        a, b = sl.get(key), zq.get(key)
        ratio = ""
        if isinstance(a, dict) and isinstance(b, dict) and a["median_us"] > 0:
            ratio = f"{b['median_us'] / a['median_us']:.1f}x faster"
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 and key.startswith(("msgs", "gbps")):
            ratio = f"{a / b:.1f}x"
        print(f"{label:{w0}} | {cell(sl, key, f):>18} | {cell(zq, key, f):>18} | {ratio}", file=out)
    pl = sl["python_latency_1to1"]
    print(f"{'Python API 64 B one-way, 1 -> 1':{w0}} | {pl['median_us']:.2f} / {pl['p99_us']:.1f}".rstrip(), file=out)
    iox = res.get("iceoryx2", {})
    if "python_latency_1to1" in iox:
        il = iox["python_latency_1to1"]
        print(f"{'iceoryx2 Python API 64 B one-way, 1 -> 1':{w0}} | {il['median_us']:.2f} / {il['p99_us']:.1f}"
              f" (its subscriber polls: one core at 100%)", file=out)
    if "note" in iox:
        print(f"iceoryx2: {iox['note']}", file=out)
    if peer:  # vLLM's own shm_broadcast.MessageQueue, where it is installed (bench_vllm_mq)
        from . import bench_vllm_mq
        say("vLLM's shm_broadcast.MessageQueue against stagelink's, Python API, interleaved")
        vres, why = bench_vllm_mq.run(quick=quick, log=out)
        if vres is None:
            res["vllm"] = {"note": why}
            print(f"\nvs vLLM: skipped: {why}", file=out)
        else:
            res["vllm"] = vres
            bench_vllm_mq.print_result(vres, out)
    write_json({"kind": "mq", "machine": os.uname().nodename, "cpus": os.cpu_count(), "results": res}, json_path, out)
    return res
