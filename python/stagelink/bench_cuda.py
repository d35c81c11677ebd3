"""stagelink bench cuda: CUDA tensors between stages, against the paths of issue 13's table measured
in the same run: the seed's design (host bounce, pickle, a shared-memory segment per put), pinned
and pageable copies each way, one device-to-device copy, CUDA IPC handoff of a fresh allocation
(torch.multiprocessing), and stagelink's connector as it is today (a CUDA tensor staged through
host memory: `put` copies it to the host, `get` back to its device).

Without a GPU it says why and measures nothing; ``device="cpu"`` runs the same harness on CPU
tensors (what the tests do, to keep it working where no GPU is)."""
from __future__ import annotations

import os
import statistics
import sys
import time

from . import _core
from .bench import _fmt_size, _seed_get, _seed_put, write_json
from .connector import create_connector

SIZES = [1 << 20, 16 << 20, 186 << 20]


def _reps(size):
    return 5 if size >= 64 << 20 else 20 if size >= 8 << 20 else 100


def _timed(fn, n, sync):
    out = []
    for i in range(n + 2):
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= 2:  # two warm-ups
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def _ipc_child(q, back):
    import torch
    while True:
        item = q.get()
        if item is None:
            return
        t = item  # rebuilt from its IPC handle
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        back.put(time.perf_counter())
        del t, item


def _ipc_handoff(torch, size, dev, n):
    """A fresh allocation handed to another process through torch.multiprocessing (CUDA IPC on a
    GPU, a shared-memory fd on the CPU): put on the queue to usable in the child, ms."""
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_ipc_child, args=(q, back), daemon=True)
    p.start()
    try:
        out, keep = [], []
        for i in range(n + 2):
            t = torch.empty(size, dtype=torch.uint8, device=dev)
            keep.append(t)  # the producer keeps it alive while the consumer may use it
            t0 = time.perf_counter()
            q.put(t)
            t1 = back.get(timeout=60)
            if i >= 2:
                out.append((t1 - t0) * 1e3)
        return statistics.median(out)
    finally:
        q.put(None)
        p.join(30)
        if p.is_alive():
            p.kill()


def _reader(conn, ns):
    """The other process of the two-process rows: gets what the producer announces, times each."""
    import torch
    torch.cuda.init()
    c = create_connector("SharedMemoryConnector", {"namespace": ns})
    arena = ev = None
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            what = msg[0]
            if what == "torch_arena":  # the peer: an arena and an interprocess event, shared once
                arena, ev = msg[1], msg[2]
                conn.send(0.0)
                continue
            t0 = time.perf_counter()
            if what == "torch":
                _, n, view = msg
                ev.wait(torch.cuda.current_stream())
                if view:
                    t = arena[:n]
                else:
                    t = torch.empty(n, dtype=torch.uint8, device=arena.device)
                    t.copy_(arena[:n])
                    torch.cuda.current_stream().synchronize()
            else:  # stagelink: (what, key, meta, view)
                _, key, meta, view = msg
                got = c.get(0, 1, key, meta, zero_copy=view)
                t = got[0]
                if not view:
                    torch.cuda.current_stream().synchronize()
            dt = (time.perf_counter() - t0) * 1e3
            ok = t.is_cuda and t.numel() == (msg[1] if what == "torch" else t.numel())
            del t
            conn.send(dt if ok else -1.0)
    finally:
        c.close()


def _two_process(torch, size, dev, n, ns):
    """Same GPU, two processes: stagelink's device arena (put; get as a copy and as a view) and the
    same done with torch's own primitives (an arena and an interprocess event shared once over
    CUDA IPC; the producer copies in and records, the reader waits and copies out or slices).
    ms, medians; a get that copies includes the reader's synchronize."""
    import multiprocessing as mp
    import torch.multiprocessing  # noqa: F401  (CUDA tensors and events through the pipe)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_reader, args=(there, ns), daemon=True)
    p.start()
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
    c = create_connector("SharedMemoryConnector", {"namespace": ns, "cuda_arena_bytes": max(256 << 20, 2 * size)})
    row = {}
    seq = iter(range(1 << 62))
    try:
        arena = torch.empty(max(256 << 20, size), dtype=torch.uint8, device=dev)
        ev = torch.cuda.Event(interprocess=True)
        here.send(("torch_arena", arena, ev))
        here.recv()

        def one(kind, view):
            if kind == "torch":
                t0 = time.perf_counter()
                arena[:size].copy_(src)
                ev.record()
                put = (time.perf_counter() - t0) * 1e3
                here.send(("torch", size, view))
            else:
                k = f"c{next(seq)}"
                t0 = time.perf_counter()
                ok, _, meta = c.put(0, 1, k, src)
                put = (time.perf_counter() - t0) * 1e3
                assert ok, c.last_error
                here.send(("sl", k, meta, view))
            get = here.recv()
            assert get >= 0, "the reader got a wrong tensor"
            torch.cuda.synchronize(dev)  # the next put starts from an idle GPU, as a fresh request would
            return put, get

        for kind, view, name in (("torch", False, "torch_arena"), ("torch", True, "torch_arena_view"),
                                 ("sl", False, "stagelink_ipc"), ("sl", True, "stagelink_ipc_view")):
            puts, gets = [], []
            for i in range(n + 3):
                a, b = one(kind, view)
                if i >= 3:
                    puts.append(a)
                    gets.append(b)
            row[name + "_put"] = statistics.median(puts)
            row[name + "_get"] = statistics.median(gets)
            row[name] = row[name + "_put"] + row[name + "_get"]
        row["stagelink_ipc_health"] = c.health().get("cuda_arenas")
    finally:
        here.send(None)
        p.join(60)
        if p.is_alive():
            p.kill()
        c.close()
    return row


def measure(size, dev, torch=None, n=None):
    """One row: ms per transfer of `size` bytes for every path."""
    import torch as _torch
    torch = torch or _torch
    n = n or _reps(size)
    cuda = str(dev).startswith("cuda")
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev)
    row = {"size": size, "device": str(dev)}
    dst = torch.empty_like(src)
    row["d2d_copy"] = _timed(lambda: dst.copy_(src), n, sync)
    host = torch.empty(size, dtype=torch.uint8)
    row["pageable_d2h"] = _timed(lambda: host.copy_(src), n, sync)
    row["pageable_h2d"] = _timed(lambda: dst.copy_(host), n, sync)
    if cuda:
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        row["pinned_d2h"] = _timed(lambda: pinned.copy_(src, non_blocking=True), n, sync)
        row["pinned_h2d"] = _timed(lambda: dst.copy_(pinned, non_blocking=True), n, sync)
    seq = iter(range(1 << 62))

    def seed():
        key = f"slcuda_{os.getpid()}_{next(seq)}"
        back = _seed_get(_seed_put(key, src.cpu()))
        back.to(dev)
    row["seed_design"] = _timed(seed, min(n, 10), sync)
    row["ipc_handoff"] = _ipc_handoff(torch, size, dev, min(n, 10))
    ns = f"bcuda{os.getpid()}"
    # The staged path (through host memory), as before the device arena: cuda_ipc off.
    c = create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 2 * size + (64 << 20),
                                                   "cuda_ipc": False})
    r = create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 1 << 20})
    try:
        def via_stagelink():
            k = f"t{next(seq)}"
            ok, _, meta = c.put(0, 1, k, src)
            got, _ = r.get(0, 1, k, meta)
            assert ok and got.device == src.device
        row["stagelink_staged"] = _timed(via_stagelink, min(n, 20), sync)
        k = "check"
        ok, _, meta = c.put(0, 1, k, src)
        got, _ = r.get(0, 1, k, meta)
        row["verified"] = bool(ok and torch.equal(got, src))
        if cuda:
            row.update(_two_process(torch, size, dev, min(n, 30), ns + "x"))
    finally:
        c.close()
        r.close()
        _core.shm_reap("/dev/shm")
    return row


def run_cuda(sizes=None, json_path=None, out=sys.stdout, device=None):
    sizes = sizes or SIZES
    status = _core.cuda_status()
    result = {"kind": "cuda", "machine": os.uname().nodename, "cuda": status, "rows": []}
    try:
        import torch
    except ImportError:
        print("bench cuda: torch is not installed; nothing measured", file=out)
        return None
    dev = device or ("cuda:0" if torch.cuda.is_available() else None)
    if dev is None:
        why = status.get("reason") or "torch sees no CUDA device"
        print(f"bench cuda: no GPU here ({why}); nothing measured. It runs on a GPU machine "
              "(DEVELOPERS.md).", file=out)
        result["skipped"] = why
    else:
        print(f"stagelink bench cuda on {dev}"
              f"{' (' + torch.cuda.get_device_name(dev) + ')' if str(dev).startswith('cuda') else ''}: "
              "ms per transfer, medians, same run", file=out, flush=True)
        cols = ["seed_design", "stagelink_staged", "stagelink_ipc", "stagelink_ipc_view_get", "torch_arena",
                "torch_arena_view_get", "pinned_d2h", "pinned_h2d", "pageable_d2h", "pageable_h2d", "ipc_handoff",
                "d2d_copy"]
        print(f"{'size':>9} | " + " ".join(f"{c:>16}" for c in cols) + " | verified", file=out)
        for size in sizes:
            row = measure(size, dev)
            result["rows"].append(row)
            cells = " ".join(f"{row[c]:>16.3f}" if c in row else f"{'-':>16}" for c in cols)
            print(f"{_fmt_size(size):>9} | {cells} | {row['verified']}", file=out, flush=True)
        for row in result["rows"]:
            print(f"{_fmt_size(row['size'])}: staged {row['seed_design'] / row['stagelink_staged']:.1f}x the seed's "
                  f"design; device arena (put+get, two processes) {row['seed_design'] / row['stagelink_ipc']:.0f}x "
                  f"the seed's design, {row['stagelink_ipc'] / row['d2d_copy']:.1f}x one device copy, "
                  f"{row['stagelink_ipc'] / row['torch_arena']:.2f}x torch's primitives; view get "
                  f"{row['stagelink_ipc_view_get'] * 1e3:.0f} us", file=out)
    return write_json(result, json_path, out)
