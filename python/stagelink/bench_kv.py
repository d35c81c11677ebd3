"""stagelink bench kv: a transformers DynamicCache (bf16, 32 layers of key and value) moved from a
prefill process to a decode process, ready to decode with, per cache size: stagelink's
shared-memory connector (copying get and zero-copy get) against torch.multiprocessing's
shared-memory tensor passing (a Queue: the sender's tensors are copied into shared memory, their
file descriptors passed) in the same run, with one memcpy of the cache beside them.

Each transfer is timed from just before the sender's put to the receiver holding the
DynamicCache (one CLOCK_MONOTONIC, two processes); every round sends a fresh cache, as a prefill
makes one per request. Medians over the rounds, with min-max."""
from __future__ import annotations

import statistics
import sys
import time

from .bench import _fmt_size, write_json

SIZES = [1 << 20, 16 << 20, 64 << 20]
LAYERS, HEADS, HEAD_DIM = 32, 8, 128


def _reps(size):
    return 7 if size >= 64 << 20 else 15 if size >= 16 << 20 else 40


def _cache(size, seed):
    import torch
    from .kv import dynamic_cache
    tokens = max(1, size // (LAYERS * 2 * HEADS * HEAD_DIM * 2))
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g).bfloat16(),
              torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g).bfloat16()) for _ in range(LAYERS)]
    return dynamic_cache(pairs)


def _receiver(method, ns, n, ready, times, data_q):
    """The decode process: n transfers, each ending when it holds a DynamicCache."""
    from .connector import create_connector
    from .kv import dynamic_cache
    c = create_connector("SharedMemoryConnector", {"namespace": ns}) if method != "torch.mp" else None
    try:
        for i in range(n):
            ready.put(i)
            if method == "torch.mp":
                cache = dynamic_cache(data_q.get(timeout=60))
            else:
                cache = c.get(0, 1, f"kv{i}", timeout=60, zero_copy=(method == "zero-copy"))[0]
            t1 = time.monotonic()
            if type(cache).__name__ != "DynamicCache":
                raise TypeError(f"got a {type(cache).__name__}")
            times.put(t1)
            del cache
    finally:
        if c is not None:
            c.close()


def _one(method, size, n):
    import torch.multiprocessing as tmp
    from .connector import create_connector
    ns = f"benchkv{int(time.time() * 1e3) % 100000}"
    ctx = tmp.get_context("spawn")
    ready, times, data_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receiver, args=(method, ns, n, ready, times, data_q))
    p.start()
    c = create_connector("SharedMemoryConnector", {"namespace": ns}) if method != "torch.mp" else None
    out = []
    try:
        for i in range(n):
            cache = _cache(size, i)
            pairs = [(layer.keys, layer.values) for layer in cache.layers]
            ready.get(timeout=120)
            time.sleep(0.002)  # the receiver is in its get
            t0 = time.monotonic()
            if method == "torch.mp":
                data_q.put(pairs)
            else:
                ok = c.put(0, 1, f"kv{i}", cache)[0]
                assert ok
            out.append((times.get(timeout=120) - t0) * 1e3)
            del cache, pairs
        p.join(60)
    finally:
        if p.is_alive():
            p.kill()
        if c is not None:
            c.close()
    return out[1:]  # the first transfer of a process maps its pages


def _memcpy_ms(size):
    import numpy as np
    a = np.ones(size, np.uint8)
    b = np.empty_like(a)
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        np.copyto(b, a)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _get_alone(size, n):
    """The get alone, in one process: each round a fresh cache put, then its get timed (copying,
    then zero-copy), the previous round's result still held as a decode loop's `cache = get()`
    holds it. Medians in ms. The caches are made before any is timed: torch's OpenMP threads spin
    for a while after the ops that make one, and on 2 cores they took the core a copy's second
    thread runs on (a 16 MiB get right after making its cache: 3.7-4.0 ms, 2.3 with
    OMP_NUM_THREADS=1). A stage process sizes those threads to its share of the CPUs."""
    import uuid
    from .connector import create_connector
    c = create_connector("SharedMemoryConnector", {"namespace": "benchkvg" + uuid.uuid4().hex[:8]})
    t = {"copying": [], "zero-copy": []}
    caches = [_cache(size, i) for i in range(n + 1)]
    try:
        for zc, k in ((False, "copying"), (True, "zero-copy")):
            held = None
            for i in range(n + 1):
                assert c.put(0, 1, f"g{i}", caches[i])[0]
                t0 = time.perf_counter()
                got = c.get(0, 1, f"g{i}", zero_copy=zc)[0]
                dt = (time.perf_counter() - t0) * 1e3
                if type(got).__name__ != "DynamicCache":
                    raise TypeError(f"got a {type(got).__name__}")
                held = got  # the previous result dropped only now, as in a loop
                if i:
                    t[k].append(dt)
            del held, got
    finally:
        c.close()
        del caches
    return {k: statistics.median(v) for k, v in t.items()}


def run_kv(sizes=None, json_path=None, out=sys.stdout):
    import importlib.util
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"stagelink bench kv needs {' and '.join(missing)} (pip install stagelink[torch] transformers)", file=out)
        return write_json({"kind": "kv", "skipped": f"{', '.join(missing)} not installed"}, json_path, out)
    sizes = sizes or SIZES
    methods = ["copying get", "zero-copy", "torch.mp"]
    rows = []
    print(f"DynamicCache (bf16, {LAYERS} layers) from a prefill process to a decode process, ms "
          "(median, min-max; each round a fresh cache):", file=out)
    print(f"{'size':>8} | {'memcpy':>7} | " + " | ".join(f"{m:>20}" for m in methods) + " | torch.mp / copying",
          file=out)
    for size in sizes:
        n = _reps(size)
        res = {}
        for m in methods:  # each method's rounds in a process pair of its own
            res[m] = _one(m, size, n + 1)
        med = {m: statistics.median(v) for m, v in res.items()}
        row = {"size": size, "memcpy_ms": _memcpy_ms(size),
               **{m: {"median_ms": med[m], "min_ms": min(res[m]), "max_ms": max(res[m])} for m in methods}}
        row["get_alone"] = _get_alone(size, n)
        rows.append(row)
        print(f"{_fmt_size(size):>8} | {row['memcpy_ms']:7.2f} | "
              + " | ".join(f"{med[m]:7.2f} ({min(res[m]):.2f}-{max(res[m]):.2f})".rjust(20) for m in methods)
              + f" | {med['torch.mp'] / med['copying get']:.2f}x", file=out)
    print("\nThe get alone (one process: a fresh cache put, then its get timed; the previous result still held), "
          "ms, and against one memcpy of the cache:", file=out)
    print(f"{'size':>8} | {'memcpy':>7} | {'copying get':>19} | {'zero-copy get':>19}", file=out)
    for row in rows:
        g, m = row["get_alone"], row["memcpy_ms"]
        print(f"{_fmt_size(row['size']):>8} | {m:7.2f} | {g['copying']:7.2f} ({g['copying'] / m:5.2f}x) | "
              f"{g['zero-copy']:7.2f} ({g['zero-copy'] / m:5.2f}x)", file=out)
    import os
    return write_json({"kind": "kv", "machine": os.uname().nodename, "cpus": os.cpu_count(), "rows": rows},
                      json_path, out)
