"""stagelink bench shm: C++ API, Python API, Python zero-copy, memcpy and the seed's design."""
from __future__ import annotations

import fcntl
import multiprocessing as mp
import json
import os
import pickle
import statistics
import sys
import time
from multiprocessing import shared_memory

import numpy as np

from . import __version__, _core
from .connector import create_connector

DEFAULT_SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 186 << 20]


def _stat(samples):
    s = sorted(samples)
    if not s:
        return {"median_us": float("nan"), "p99_us": float("nan")}
    return {"median_us": s[len(s) // 2], "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))]}


# virtio's balloon device and its feature bit "free page reporting" (VIRTIO_BALLOON_F_REPORTING).
_VIRTIO_BALLOON_ID = 0x0005
_VIRTIO_BALLOON_F_REPORTING = 5


def host_reclaims_free_pages(root="/sys/bus/virtio/devices"):
    """Whether this machine is a VM whose balloon reports freed memory to its host (virtio free
    page reporting). There, memory the kernel has had free for a second or two goes back to the
    host, and the next process to touch it waits for the host to fault it in again (measured on
    such a VM: a 186 MiB get into fresh memory up to 316 ms after an idle gap of 3-5 s, 19-45 ms
    back to back). A get into a new ``bytes`` object meets this; one into a pooled numpy or torch
    buffer, or a ``zero_copy`` view, does not. Reads sysfs only; False where it cannot tell."""
    try:
        names = os.listdir(root)
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(root, name, "device")) as f:
                device = int(f.read().strip(), 16)
            if device != _VIRTIO_BALLOON_ID:
                continue
            with open(os.path.join(root, name, "features")) as f:
                features = f.read().strip()  # one '0'/'1' per feature bit, bit 0 first
        except (OSError, ValueError):
            continue
        if len(features) > _VIRTIO_BALLOON_F_REPORTING and features[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return True
    return False


def _iters(size, iters):
    if size >= 64 << 20:
        return max(5, iters // 100)
    if size >= 8 << 20:
        return max(10, iters // 20)
    if size >= 1 << 20:
        return max(50, iters // 4)
    return iters


# ---- the seed's design: one SharedMemory segment per payload + pickle + a lock file ----
def _seed_lock(path: str):
    """The seed's lock file, opened as it is (one open and flock per put and get) but safely: the
    seed's open(path, "w") follows a link planted at that name in world-writable /dev/shm and
    truncates its target (where fs.protected_symlinks is 0). No link is followed (O_NOFOLLOW) and
    nothing is truncated, so a planted link fails the bench instead of harming its target."""
    return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "r+b")


def _seed_put(key, obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    lock = f"/dev/shm/shm_{key}_lockfile.lock"
    with _seed_lock(lock) as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        shm = shared_memory.SharedMemory(name=key, create=True, size=max(1, len(data)))
        shm.buf[: len(data)] = data
        name = shm.name
        shm.close()
        fcntl.flock(lf, fcntl.LOCK_UN)
    return {"shm": {"name": name, "size": len(data)}, "size": len(data)}


def _seed_get(meta):
    name, size = meta["shm"]["name"], meta["shm"]["size"]
    lock = f"/dev/shm/shm_{name}_lockfile.lock"
    with _seed_lock(lock) as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        shm = shared_memory.SharedMemory(name=name)
        obj = pickle.loads(bytes(shm.buf[:size]))
        shm.close()
        shm.unlink()
        fcntl.flock(lf, fcntl.LOCK_UN)
    try:
        os.unlink(lock)
    except FileNotFoundError:
        pass
    return obj


def _consumer(ns, plan, ready):
    c = create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 1 << 20})
    ready.set()
    for key, n in plan:
        for i in range(n):
            r = c.get(0, 1, f"{key}.{i}", timeout=30)
            if r is None:
                os._exit(4)
            c.put(1, 0, f"{key}.{i}", b"ack")
    c.close()


def bench_python(sizes, iters, ns, arena_bytes, progress=None):
    prod = create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": arena_bytes})
    cons = create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 1 << 20})
    rows = []
    for size in sizes:
        n = _iters(size, iters)
        arr = np.full(size, 7, dtype=np.uint8)
        out = np.zeros(size, dtype=np.uint8)  # get_into's destination, reused (pages faulted once)
        tput, tget, tinto, tview, tseed = [], [], [], [], []
        for i in range(-2, n):
            t0 = time.perf_counter()
            ok, _, meta = prod.put(0, 1, f"p{i}", arr)
            t1 = time.perf_counter()
            got = cons.get(0, 1, f"p{i}", meta)
            t2 = time.perf_counter()
            assert ok and got is not None and got[0].nbytes == size
            del got  # freeing the copy (munmap of a large array) must not land in the timed view below
            ok, _, meta = prod.put(0, 1, f"v{i}", arr)
            t3 = time.perf_counter()
            got = cons.get(0, 1, f"v{i}", meta, zero_copy=True)
            v = got[0]
            del got, v
            t4 = time.perf_counter()
            ok, _, meta = prod.put(0, 1, f"i{i}", arr)
            t5 = time.perf_counter()
            n_into = cons.get_into(0, 1, f"i{i}", out, meta)
            t6 = time.perf_counter()
            assert ok and n_into == size
            if i >= 0:
                tinto.append((t6 - t5) * 1e6)
                tput.append((t1 - t0) * 1e6)
                tget.append((t2 - t1) * 1e6)
                tview.append((t4 - t3) * 1e6)
        ns_seed = min(n, 20 if size >= 8 << 20 else n)
        for i in range(ns_seed):
            key = f"slseed_{os.getpid()}_{i}"
            t0 = time.perf_counter()
            m = _seed_put(key, arr)
            _seed_get(m)
            tseed.append((time.perf_counter() - t0) * 1e6)
        rows.append({"size": size, "iters": n, "put": _stat(tput), "get": _stat(tget),
                     "get_view": _stat(tview), "get_into": _stat(tinto),
                     "seed_put_get": _stat(tseed)})
        if progress:
            progress(f"python {size} B done")
    # cross-process round trip through the Python API
    plan = [(f"rt{si}", _iters(size, iters) + 2) for si, size in enumerate(sizes)]
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_consumer, args=(ns, plan, ready), daemon=True)
    p.start()
    ready.wait(60)
    for si, size in enumerate(sizes):
        arr = np.full(size, 3, dtype=np.uint8)
        trt = []
        for i in range(plan[si][1]):
            t0 = time.perf_counter()
            prod.put(0, 1, f"rt{si}.{i}", arr)
            if prod.get(1, 0, f"rt{si}.{i}", timeout=30) is None:
                break
            if i >= 2:
                trt.append((time.perf_counter() - t0) * 1e6)
        rows[si]["roundtrip"] = _stat(trt)
    p.join(60)
    if p.is_alive():
        p.kill()
    prod.close()
    cons.close()
    return rows


def _payload_cases():
    """(name, object, the numpy peer's name) for the payload-kind table."""
    cases = [("numpy float32[256] (1 KiB)", np.ones(256, np.float32)),
             ("bytes 1 KiB", b"x" * 1024),
             ("dict {hidden: numpy 1 KiB, ids: [300 ints]}", {"hidden": np.ones(256, np.float32), "ids": list(range(300))}),
             (_NONE_CASE, None)]
    try:
        import torch
    except ImportError:
        return cases + _list_cases()
    cases[1:1] = [("torch float32[256] (1 KiB)", torch.ones(256)),
                  ("torch bfloat16[512] (1 KiB)", torch.ones(512, dtype=torch.bfloat16))]
    # The tree without its ids beside it: what the tensor and the dict cost alone.
    cases[-1:-1] = [("dict {hidden: torch 1 KiB}", {"hidden": torch.ones(256)}),
                    ("dict {hidden: torch 1 KiB, ids: [300 ints]}", {"hidden": torch.ones(256), "ids": list(range(300))})]
    return cases + _list_cases()


_NONE_CASE = "None (a put+get's fixed cost)"


def _floor_peers():
    """What Python and torch themselves take for the parts of a received
    ``{hidden: torch, ids: [300 ints]}`` that no connector can skip: torch's cheapest creation of a
    tensor object (``t.detach()``, no argument parsing) and CPython's copy of a 300-int list
    (``ids[:]``). With a put+get of ``None`` (the connector's fixed cost) they bound from below
    what any implementation of that put+get can take in this process. {name: per-call seconds}."""
    try:
        import torch
    except ImportError:
        return {}
    t, ids = torch.ones(256), list(range(300))
    out = {}
    for name, fn in (("torch t.detach()", t.detach), ("list ids[:]", ids.copy)):
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            best.append((time.perf_counter() - t0) / 200)
        out[name] = sorted(best)[2]
    return out


def _list_cases():
    """Python lists as stages hand them on: 4096 token ids of a 151,646-token vocabulary (Qwen's),
    and 4096 audio samples as floats."""
    import random
    rng = random.Random(4096)
    return [("list of 4096 token ids (vocab 151,646)", [rng.randrange(151646) for _ in range(4096)]),
            ("list of 4096 floats (audio samples)", [rng.uniform(-1.0, 1.0) for _ in range(4096)])]


def print_plain_vs_curve(label, figures, out, digits=1):
    """One line per size of plain_vs_curve's figures."""
    for size, f in figures.items():
        print(f"  {label} {_fmt_size(size):>9}: plain {f['plain_us']:.{digits}f} us, CURVE {f['curve_us']:.{digits}f} us "
              f"({f['ratio']:.2f}x)", file=out)


def plain_vs_curve(measure, sizes, rounds):
    """`measure(curve: bool, size) -> us`, plain and CURVE interleaved round by round: per size
    {plain_us, curve_us (medians of the rounds), ratio (median of the per-round ratios)}."""
    res = {}
    for size in sizes:
        plain, curve = [], []
        for _ in range(rounds):
            plain.append(measure(False, size))
            curve.append(measure(True, size))
        res[size] = {"plain_us": statistics.median(plain), "curve_us": statistics.median(curve),
                     "ratio": statistics.median([c / p for c, p in zip(curve, plain)])}
    return res


def bench_payloads(ns, iters=3000, big=186 << 20, progress=None, rounds=15):
    """Python put+get per payload kind, native frames against the pickle path (what stagelink did
    before, and what vLLM-Omni's connector does) in the same run; then a get of ``big`` bytes.

    The kinds are measured interleaved, ``rounds`` blocks each, so that a machine whose speed
    drifts (a VM's neighbours, frequency) weighs on every kind alike; "vs numpy" is the median of
    the per-round ratios to the numpy array of the same round."""
    from . import _serde

    c = create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": max(64 << 20, 2 * big + (8 << 20))})
    r = create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 1 << 20})
    seq = iter(range(1 << 62))

    def timed(put, n, zero_copy=False, tp=None, tg=None):
        """put, get and drop times of n put+gets (put and get appended to tp and tg where given);
        drop is releasing the result: a tensor's release runs torch's and stagelink's deleters,
        which a caller pays too."""
        tp = [] if tp is None else tp
        tg = [] if tg is None else tg
        td = []
        for i in range(-min(20, n), n):
            k = f"pk{next(seq)}"
            t0 = time.perf_counter()
            ok, _, meta = put(k)
            t1 = time.perf_counter()
            got = r.get(0, 1, k, meta, zero_copy=zero_copy)
            t2 = time.perf_counter()
            assert ok and got is not None
            del got
            t3 = time.perf_counter()
            if i >= 0:
                tp.append((t1 - t0) * 1e6)
                tg.append((t2 - t1) * 1e6)
                td.append((t3 - t2) * 1e6)
        return tp, tg, td

    def pickled(key, obj):
        kind, regions = _serde.encode(obj)
        size, meta = c._put_parts(0, 1, key, kind, regions, 0)
        return True, size, meta

    def med(v):
        return sorted(v)[len(v) // 2]

    cases = _payload_cases()
    samples = {name: {"np": [], "ng": [], "nd": [], "pp": [], "pg": [], "ratio": [], "ratio_drop": []}
               for name, _ in cases}
    floors = {}
    floor_ratio = []
    block = max(20, iters // rounds)
    for rnd in range(rounds):
        ref = ref_drop = None
        for name, obj in cases:
            d = samples[name]
            tp, tg, td = timed(lambda k: c.put(0, 1, k, obj), block)
            d["np"] += tp
            d["ng"] += tg
            d["nd"] += td
            pg = med([a + b for a, b in zip(tp, tg)])
            pgd = med([a + b + x for a, b, x in zip(tp, tg, td)])
            ref = pg if ref is None else ref
            ref_drop = pgd if ref_drop is None else ref_drop
            d["ratio"].append(pg / ref)
            d["ratio_drop"].append(pgd / ref_drop)
            timed(lambda k: pickled(k, obj), block, tp=d["pp"], tg=d["pg"])
        peers_now = _floor_peers()
        for fname, sec in peers_now.items():
            floors.setdefault(fname, []).append(sec * 1e6)
        if peers_now and _NONE_CASE in samples:
            # This round's floor over this round's numpy put+get (``ref``), as every other ratio: a
            # machine whose speed drifts between rounds would skew pooled medians apart.
            floor_ratio.append(samples[_NONE_CASE]["ratio"][-1] + sum(peers_now.values()) * 1e6 / ref)
        if progress:
            progress(f"payload kinds: round {rnd + 1} of {rounds} done")
    rows = [{"payload": name, "native_put": _stat(samples[name]["np"]), "native_get": _stat(samples[name]["ng"]),
             "native_drop": _stat(samples[name]["nd"]),
             "pickle_put": _stat(samples[name]["pp"]), "pickle_get": _stat(samples[name]["pg"]),
             "vs_numpy": med(samples[name]["ratio"]),
             "vs_numpy_with_drop": med(samples[name]["ratio_drop"])} for name, _ in cases]
    arr = np.full(big, 7, np.uint8)
    data = arr.tobytes()
    n = 7
    rows_big = {}
    for label, obj, zc in (("numpy", arr, False), ("bytes", data, False), ("bytes zero_copy", data, True)):
        rows_big[label] = _stat(timed(lambda k: c.put(0, 1, k, obj), n, zero_copy=zc)[1])
    del data
    rows.append(_mib_gets(lambda obj, n: timed(lambda k: c.put(0, 1, k, obj), n)[1]))
    rows.append({"payload": f"get of {big >> 20} MiB", "big_get": rows_big,
                 "host_reclaims_free_pages": host_reclaims_free_pages()})
    if floor_ratio:
        # The dict's floor: a put+get of None plus torch's and CPython's own object creation, each a
        # median over the rounds; its ratio is the median of the per-round ratios to the numpy
        # array's put+get, as "vs numpy" is for every payload.
        peers = {k: med(v) for k, v in floors.items()}
        none = med([a + b for a, b in zip(samples[_NONE_CASE]["np"], samples[_NONE_CASE]["ng"])])
        floor = none + sum(peers.values())
        rows.append({"payload": "floor of dict {hidden: torch 1 KiB, ids: [300 ints]}", "floor_us": floor,
                     "floor_vs_numpy": med(floor_ratio), "parts_us": {_NONE_CASE: none, **peers}})
    c.close()
    r.close()
    return rows


def _mib_gets(get_times, rounds=7, n=100):
    """The copying get of 1 MiB as torch tensors and dicts against a numpy array of the same bytes:
    each kind's get (``get_times(obj, n)``: n put+gets, the gets' times; put and drop not timed),
    kinds interleaved round by round; per kind the median get and the range of the per-round
    ratios to numpy's."""
    a = np.random.default_rng(1).random(1 << 17)  # 1 MiB of float64
    cases = {"numpy": a, "dict {hidden: numpy}": {"hidden": a}}
    try:
        import torch
        cases["torch"] = torch.from_numpy(a.copy())
        cases["dict {hidden: torch}"] = {"hidden": torch.from_numpy(a.copy())}
    except ImportError:
        pass
    got = {k: [] for k in cases}
    for _ in range(rounds):
        for name, obj in cases.items():
            got[name].append(statistics.median(get_times(obj, n)))
    return {"payload": "get of 1 MiB by kind", "mib_gets": {
        name: {"median_us": statistics.median(v), "vs_numpy": [min(x / y for x, y in zip(v, got["numpy"])),
                                                               max(x / y for x, y in zip(v, got["numpy"]))]}
        for name, v in got.items()}}


def print_payloads(rows, out=sys.stdout):
    m = lambda d: d["median_us"]  # noqa: E731
    ref = None
    print("\npayload kinds, Python put+get in one process (medians, us); pickle = the same object through "
          "pickle-5 (stagelink's old path, vLLM-Omni's design); kinds interleaved, 'vs numpy' = median "
          "of per-round ratios; drop = releasing the result (not in p+g), '+drop' = the ratio with it", file=out)
    hdr = (f"{'payload':<46} | {'put':>7} {'get':>7} {'p+g':>7} {'vs numpy':>8} | {'drop':>6} {'+drop':>6} | "
           f"{'pickle p+g':>10} {'speed-up':>8}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for row in rows:
        if "floor_us" in row:
            parts = " + ".join(f"{k} {v:.2f}" for k, v in row["parts_us"].items())
            print(f"{row['payload']}: {row['floor_us']:.2f} us = {row['floor_vs_numpy']:.2f}x numpy "
                  f"({parts} us): what no put+get of it can go below in this process", file=out)
            continue
        if "mib_gets" in row:
            g = row["mib_gets"]
            print("\ncopying get of 1 MiB (put and drop not timed), kinds interleaved: " + "; ".join(
                f"{k} {v['median_us']:.1f} us ({v['vs_numpy'][0]:.2f}-{v['vs_numpy'][1]:.2f}x numpy)"
                for k, v in g.items()), file=out)
            continue
        if "big_get" in row:
            b = row["big_get"]
            print(f"\n{row['payload']}: numpy {m(b['numpy']) / 1e3:.1f} ms, bytes {m(b['bytes']) / 1e3:.1f} ms "
                  f"({m(b['bytes']) / m(b['numpy']):.2f}x), bytes zero_copy (memoryview) "
                  f"{m(b['bytes zero_copy']) / 1e3:.3f} ms ({m(b['bytes zero_copy']) / m(b['numpy']):.3f}x)", file=out)
            if row.get("host_reclaims_free_pages"):
                print("  this VM's balloon hands freed memory back to its host (virtio free page reporting): "
                      "a bytes get lands in fresh memory, which the host may have to fault in again (up to "
                      "~15x slower after an idle gap); numpy's pooled buffer and zero_copy are not affected, "
                      "so the bytes ratio swings from run to run", file=out)
            continue
        pg = m(row["native_put"]) + m(row["native_get"])
        if ref is None:
            ref = pg
        pk = m(row["pickle_put"]) + m(row["pickle_get"])
        ratio = row.get("vs_numpy", pg / ref)
        print(f"{row['payload']:<46} | {m(row['native_put']):7.2f} {m(row['native_get']):7.2f} {pg:7.2f} "
              f"{ratio:7.2f}x | {m(row['native_drop']):6.2f} {row['vs_numpy_with_drop']:5.2f}x | "
              f"{pk:10.2f} {pk / pg:7.1f}x", file=out)


def run_shm(sizes=None, iters=2000, json_path=None, out=sys.stdout, peer=True):
    sizes = sizes or DEFAULT_SIZES
    ns = f"bench{os.getpid()}"
    arena = max(256 << 20, 2 * max(sizes) + (16 << 20))
    print(f"stagelink bench shm: sizes {sizes}, up to {iters} iterations per size (fewer for large sizes)", file=out)
    print("measuring C++ API ...", file=out, flush=True)
    cpp = _core.bench_shm_cpp(sizes, iters, ns, arena)
    print("measuring Python API, zero-copy path and the seed design ...", file=out, flush=True)
    py = bench_python(sizes, iters, ns, arena, progress=lambda m: print("  " + m, file=out, flush=True))
    print("measuring payload kinds (numpy, torch, bytes, trees) ...", file=out, flush=True)
    kinds = bench_payloads(ns + "k", iters=max(200, min(iters, 3000)), big=max(sizes))
    _core.shm_reap("/dev/shm")
    hdr = (f"{'size':>9} | {'memcpy':>9} | {'C++ put':>9} {'C++ get':>9} {'C++ into':>9} {'C++ view':>9} {'C++ rt':>9} | "
           f"{'Py put':>9} {'Py get':>9} {'Py into':>9} {'Py view':>9} {'Py rt':>9} | {'seed p+g':>10} | "
           f"{'C++ p+g/memcpy':>14}")
    print("\nmedians in microseconds (p99 in the JSON); into = get_into a reused buffer; "
          "rt = cross-process round trip (put, wake, get, ack)", file=out)
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    rows = []
    for c, p in zip(cpp, py):
        size = c["size"]
        m = lambda d: d["median_us"]  # noqa: E731
        ratio = (m(c["put"]) + m(c["get"])) / max(m(c["memcpy"]), 1e-9)
        print(f"{_fmt_size(size):>9} | {m(c['memcpy']):9.2f} | {m(c['put']):9.2f} {m(c['get']):9.2f} "
              f"{m(c['get_into']):9.2f} {m(c['get_view']):9.2f} {m(c['roundtrip']):9.2f} | {m(p['put']):9.2f} "
              f"{m(p['get']):9.2f} {m(p['get_into']):9.2f} {m(p['get_view']):9.2f} {m(p['roundtrip']):9.2f} | "
              f"{m(p['seed_put_get']):10.1f} | {ratio:14.2f}",
              file=out)
        rows.append({"size": size, "cpp": c, "python": p})
    print_payloads(kinds, out)
    omni = None
    if peer:  # vLLM-Omni's own connector, where it is installed (bench_omni), up to 16 MiB
        from . import bench_omni
        res, why = bench_omni.run([s for s in sizes if s <= 16 << 20] or sizes[:1], log=out)
        if res is None:
            print(f"\nvs vLLM-Omni: skipped: {why}", file=out)
        else:
            omni = bench_omni.summarize(res)
            bench_omni.print_rows(omni, out, _fmt_size)
    # What the metrics seam costs a put + get (the counting Connector::put/get do), against this
    # run's smallest C++ put + get: the direct cost, which an A/B of two builds on a noisy VM blurs.
    seam = _core.bench_seam_ns()
    small = cpp[0]["put"]["median_us"] + cpp[0]["get"]["median_us"]
    print(f"\nthe metrics seam: {seam:.1f} ns per put + get = {seam / 10 / max(small, 1e-9):.2f}% of the "
          f"{_fmt_size(cpp[0]['size'])} C++ put + get of this run ({small:.3f} us)", file=out)
    write_json({"kind": "shm", "machine": os.uname().nodename, "cpus": os.cpu_count(), "rows": rows,
                "payload_kinds": kinds, "seam_ns_per_put_get": seam, "vllm_omni": omni}, json_path, out)
    return rows


def write_json(result, json_path, out=sys.stdout):
    """Every bench's last step: its result as indented JSON at `json_path` (if given), said on `out`,
    stamped with when it ran (UTC) and the stagelink version that ran it."""
    result.setdefault("date", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    result.setdefault("stagelink", __version__)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {json_path}", file=out)
    return result


def _fmt_size(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def parse_size(s: str) -> int:
    s = s.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)
