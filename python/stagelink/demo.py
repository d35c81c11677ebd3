"""Demo: a producer process and a consumer process exchange payloads of many sizes through the
default SharedMemoryConnector; every payload is verified by checksum."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time

import numpy as np

from .bench import _fmt_size, parse_size
from .connector import create_connector


def _producer(sizes, ns, meta_q, ack_q):
    with create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 256 << 20}) as c:
        rng = np.random.default_rng(1)
        for i, size in enumerate(sizes):
            arr = rng.integers(0, 255, size, dtype=np.uint8)
            payload = {"request_id": f"req-{i}", "hidden": arr, "step": i}
            t0 = time.perf_counter()
            ok, n, meta = c.put("thinker", "talker", f"req-{i}", payload)
            dt = time.perf_counter() - t0
            meta_q.put((i, size, ok, n, meta, hashlib.sha256(arr.tobytes()).hexdigest(), dt))
            ack_q.get(timeout=60)
        meta_q.put(None)


def _consumer(ns, meta_q, res_q, ack_q):
    with create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        while True:
            item = meta_q.get(timeout=60)
            if item is None:
                break
            i, size, ok, n, meta, digest, put_s = item
            t0 = time.perf_counter()
            got = c.get("thinker", "talker", f"req-{i}", meta)
            dt = time.perf_counter() - t0
            good = got is not None and hashlib.sha256(got[0]["hidden"].tobytes()).hexdigest() == digest \
                and got[0]["step"] == i
            res_q.put((size, n, put_s, dt, good, "inline" in (meta or {})))
            ack_q.put(True)


def main(sizes_arg="0,1,1KiB,64KiB,1MiB,16MiB,64MiB"):
    sizes = [parse_size(s) for s in sizes_arg.split(",")]
    ns = f"demo{os.getpid()}"
    ctx = mp.get_context("spawn")
    meta_q, res_q, ack_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    prod = ctx.Process(target=_producer, args=(sizes, ns, meta_q, ack_q))
    cons = ctx.Process(target=_consumer, args=(ns, meta_q, res_q, ack_q))
    print(f"stagelink demo: producer 'thinker' -> consumer 'talker' over SharedMemoryConnector, {len(sizes)} payloads")
    prod.start()
    cons.start()
    rows, failed = [], 0
    for k in range(len(sizes)):
        size, n, put_s, get_s, good, inline = res_q.get(timeout=120)
        failed += not good
        rows.append((size, n, put_s, get_s, good, inline))
        print(f"  [{k + 1}/{len(sizes)}] {_fmt_size(size)} {'ok' if good else 'MISMATCH'}", flush=True)
    prod.join(60)
    cons.join(60)
    print(f"\n{'payload':>10} {'frame bytes':>12} {'path':>7} {'put us':>10} {'get us':>10} {'get GB/s':>9} {'verified':>9}")
    for size, n, put_s, get_s, good, inline in rows:
        gbs = n / get_s / 1e9 if get_s > 0 else 0
        print(f"{_fmt_size(size):>10} {n:>12} {'inline' if inline else 'arena':>7} {put_s * 1e6:>10.1f} "
              f"{get_s * 1e6:>10.1f} {gbs:>9.2f} {'yes' if good else 'NO':>9}")
    leftovers = [f for f in os.listdir("/dev/shm") if f".{ns}." in f]
    print(f"\n{len(rows) - failed}/{len(rows)} payloads verified; shared memory left behind: {leftovers or 'none'}")
    return 0 if failed == 0 and not leftovers and prod.exitcode == 0 and cons.exitcode == 0 else 1
