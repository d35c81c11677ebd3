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
    c = create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 2 * size + (64 << 20)})
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
        cols = ["seed_design", "stagelink_staged", "pinned_d2h", "pinned_h2d", "pageable_d2h", "pageable_h2d",
                "ipc_handoff", "d2d_copy"]
        print(f"{'size':>9} | " + " ".join(f"{c:>16}" for c in cols) + " | verified", file=out)
        for size in sizes:
            row = measure(size, dev)
            result["rows"].append(row)
            cells = " ".join(f"{row[c]:>16.3f}" if c in row else f"{'-':>16}" for c in cols)
            print(f"{_fmt_size(size):>9} | {cells} | {row['verified']}", file=out, flush=True)
        for row in result["rows"]:
            print(f"{_fmt_size(row['size'])}: stagelink {row['seed_design'] / row['stagelink_staged']:.1f}x the seed's "
                  f"design; {row['stagelink_staged'] / row['d2d_copy']:.0f}x one device copy", file=out)
    return write_json(result, json_path, out)
