"""stagelink bench store: StoreConnector put+get through a redis-server this bench starts (on
loopback, and in a second network namespace joined by a veth pair when run as root), against
redis-benchmark (the C client, one connection: SET + GET of the same sizes), and Mooncake Store
(its master and Python client, where they are installed) in the same run. Also the wake-up of a
get blocked on a key, measured from the put's return to the get's, against Redis's PING round
trip. Every size's first get is checked end to end (BLAKE2)."""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

from .bench import _fmt_size, write_json
from .bench_te import TwoHosts, mooncake_python

SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 186 << 20]


def _iters(size):
    return 200 if size <= 64 << 10 else 40 if size <= 1 << 20 else 8 if size <= 16 << 20 else 3


_CLIENT = textwrap.dedent("""
    import hashlib, json, statistics, sys, time, numpy as np, stagelink
    extra, sizes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    c = stagelink.create_connector("StoreConnector", dict(extra, strict=True))
    rng = np.random.default_rng(3)
    out = []
    for size, n in sizes:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        put, get, ok = [], [], True
        for i in range(n + 1):
            t0 = time.perf_counter()
            c.put(0, 1, f"b{size}", data)
            t1 = time.perf_counter()
            got, _ = c.get(0, 1, f"b{size}", timeout=30, zero_copy=True)
            t2 = time.perf_counter()
            if i == 0:
                ok = hashlib.blake2b(memoryview(got).cast("B")).digest() == hashlib.blake2b(data).digest()
            del got
            if i:
                put.append(t1 - t0)
                get.append(t2 - t1)
        out.append({"size": size, "put_s": statistics.median(put), "get_s": statistics.median(get), "verified": ok})
    print(json.dumps(out), flush=True)
""")

# A get blocked on a key, and a put of it from another process: when did each return.
_WAITER = textwrap.dedent("""
    import json, sys, time, stagelink
    extra, n = json.loads(sys.argv[1]), int(sys.argv[2])
    c = stagelink.create_connector("StoreConnector", dict(extra, strict=True))
    print("ready", flush=True)
    woke = []
    for i in range(n):
        got = c.get(0, 1, f"w{i}", timeout=10)
        woke.append(time.monotonic())
        assert got is not None
    print(json.dumps(woke), flush=True)
""")
_PUTTER = textwrap.dedent("""
    import json, sys, time, numpy as np, stagelink
    extra, n = json.loads(sys.argv[1]), int(sys.argv[2])
    c = stagelink.create_connector("StoreConnector", dict(extra, strict=True))
    began, done, data = [], [], np.zeros(1024, np.uint8)
    for i in range(n):
        time.sleep(0.03)                      # the waiter is blocked by now
        began.append(time.monotonic())
        c.put(0, 1, f"w{i}", data)
        done.append(time.monotonic())
    print(json.dumps([began, done]), flush=True)
""")

_MOONCAKE_STORE = textwrap.dedent("""
    import json, statistics, sys, time, numpy as np
    from mooncake.store import MooncakeDistributedStore
    host, meta, master, sizes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    big = max(s for s, n in sizes)
    s = MooncakeDistributedStore()
    rc = s.setup(host, meta, 2 * big + (256 << 20), big + (64 << 20), "tcp", "", master)
    assert rc == 0, f"mooncake store setup: {rc}"
    out = {}
    for size, n in sizes:
        data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
        put, get = [], []
        for i in range(n + 1):
            k = f"b{size}_{i}"
            t0 = time.perf_counter(); rc = s.put(k, data); t1 = time.perf_counter()
            got = s.get(k); t2 = time.perf_counter()
            if rc != 0 or len(got) != size:              # this size does not run: say so, go on
                print(f"mooncake store {size} B: put {rc}, got {len(got)} bytes", file=sys.stderr)
                break
            s.remove(k)
            if i:
                put.append(t1 - t0); get.append(t2 - t1)
        if put:
            out[size] = {"put_s": statistics.median(put), "get_s": statistics.median(get)}
    print(json.dumps(out), flush=True)
    s.close()
""")


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis(h: TwoHosts, port: int):
    bind = h.addr_a
    p = subprocess.Popen(h.a + ["redis-server", "--port", str(port), "--bind", bind, "--save", "", "--appendonly", "no",
                                "--protected-mode", "no", "--loglevel", "warning"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        if subprocess.run(h.b + ["redis-cli", "-h", bind, "-p", str(port), "PING"], capture_output=True,
                          text=True).stdout.strip() == "PONG":
            return p
        time.sleep(0.02)
    p.kill()
    raise RuntimeError("redis-server did not start")


def _redis_benchmark(h: TwoHosts, host, port, size, n):
    r = subprocess.run(h.b + ["redis-benchmark", "-h", host, "-p", str(port), "-c", "1", "-n", str(n), "-d", str(size),
                              "-t", "set,get", "--csv"], capture_output=True, text=True, timeout=900)
    rps = {m.group(1): float(m.group(2)) for m in re.finditer(r'"(SET|GET)","([\d.]+)"', r.stdout)}
    if "SET" not in rps or "GET" not in rps:
        return None
    return {"set_s": 1 / rps["SET"], "get_s": 1 / rps["GET"]}


def _ping_rtt(h: TwoHosts, host, port):
    r = subprocess.run(h.b + ["redis-benchmark", "-h", host, "-p", str(port), "-c", "1", "-n", "5000", "-t", "ping",
                              "--csv"], capture_output=True, text=True, timeout=120)
    m = re.search(r'"PING_MBULK","([\d.]+)"', r.stdout)
    return 1e6 / float(m.group(1)) if m else None


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OPENBLAS_NUM_THREADS="1")


def _wake(h: TwoHosts, extra, n=40):
    w = subprocess.Popen(h.b + [sys.executable, "-c", _WAITER, json.dumps(extra), str(n)], stdout=subprocess.PIPE,
                         text=True, env=_env())
    try:
        if w.stdout.readline().strip() != "ready":
            return None
        p = subprocess.run(h.b + [sys.executable, "-c", _PUTTER, json.dumps(extra), str(n)], capture_output=True,
                           text=True, timeout=120, env=_env())
        woke = json.loads(w.stdout.readline())
        began, done = json.loads(p.stdout.strip().splitlines()[-1])
        # (after the put returned, after it began): the first is negative when the waiter has
        # the payload before the putter has its own reply (the server serves both in one pass).
        return (statistics.median((a - b) * 1e6 for a, b in zip(woke, done)),
                statistics.median((a - b) * 1e6 for a, b in zip(woke, began)))
    finally:
        if w.poll() is None:
            w.kill()
        w.wait()


# A Mooncake Store client that only lends its memory as a segment (a storage node), until stdin closes.
_MOONCAKE_HOLDER = textwrap.dedent("""
    import sys
    from mooncake.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    rc = s.setup(sys.argv[1], sys.argv[2], int(sys.argv[4]), 64 << 20, "tcp", "", sys.argv[3])
    print("ready" if rc == 0 else f"setup {rc}", flush=True)
    sys.stdin.read()
    s.close()
""")


def _mooncake_store(h: TwoHosts, sizes, server_segment=False):
    """Mooncake Store's put + get per size. Its data lives in segments that clients lend: by
    default the measuring client lends the only one, so its data never leaves it (a local copy
    plus metadata calls to the master); with `server_segment` a second client beside the master
    lends it and the measuring client none, so every byte crosses the link as it does to Redis."""
    py = mooncake_python()
    master_bin = shutil.which("mooncake_master") or (os.path.join(os.path.dirname(py), "mooncake_master") if py else None)
    if not py or not master_bin or not os.path.exists(master_bin):
        return None
    host_a, host_b = h.addr_a, h.addr_b
    rpc, http = _free_port(), _free_port()
    m = subprocess.Popen(h.a + [master_bin, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                                f"--http_metadata_server_port={http}", "--http_metadata_server_host=0.0.0.0",
                                f"--rpc_address={host_a}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    holder = None
    meta = f"http://{host_a}:{http}/metadata"
    env = dict(_env(), GLOG_minloglevel="3")
    try:
        time.sleep(1.0)
        plan = [[s, _iters(s)] for s in sizes]
        script = _MOONCAKE_STORE
        if server_segment:
            seg = 2 * max(sizes) + (256 << 20)
            holder = subprocess.Popen(h.a + [py, "-c", _MOONCAKE_HOLDER, host_a, meta, f"{host_a}:{rpc}", str(seg)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      text=True, env=env)
            if holder.stdout.readline().strip() != "ready":
                return None
            script = script.replace("s.setup(host, meta, 2 * big + (256 << 20),", "s.setup(host, meta, 0,")
        r = subprocess.run(h.b + [py, "-c", script, host_b, meta, f"{host_a}:{rpc}", json.dumps(plan)],
                           capture_output=True, text=True, timeout=900, env=env)
        if r.returncode != 0:
            return None
        return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}
    except (subprocess.TimeoutExpired, ValueError):
        return None
    finally:
        if holder:
            holder.kill()
            holder.wait()
        m.kill()
        m.wait()


def run_store(sizes=None, json_path=None, out=sys.stdout, namespaces=None, rounds=3):
    sizes = sizes or SIZES
    if not shutil.which("redis-server"):
        print("bench store: redis-server is not installed (./scripts/setup installs it)", file=out)
        return None
    if namespaces is None:
        namespaces = os.geteuid() == 0 and shutil.which("ip") is not None
    result = {"kind": "store", "machine": os.uname().nodename, "cpus": os.cpu_count(), "paths": {}}
    print(f"stagelink bench store: StoreConnector put + get (Redis 7, one connector, medians of {rounds} rounds) against "
          "redis-benchmark -c 1 SET + GET of the same sizes\nand Mooncake Store where installed, in the same run; "
          "wake = a blocked get's return after the put's return (and after its start).", file=out)
    for where in (["loopback"] + (["namespaces"] if namespaces else [])):
        h = TwoHosts(where == "namespaces")
        port = _free_port()
        srv = _redis(h, port)
        host = h.addr_a
        extra = {"host": host, "port": port, "timeout_ms": 10000}
        try:
            print(f"\n{where}{' (redis in one namespace, clients in the other, veth)' if h.ns else ' (TCP on lo)'}:",
                  file=out)
            plan = [[s, _iters(s)] for s in sizes]
            # Rounds of every peer in turn: this VM's speed drifts 2x between minutes, and a peer
            # measured only in a slow minute would look twice as slow. Each figure is the median
            # of its rounds' medians.
            per = {k: [] for k in ("stagelink", "redis", "mc", "mcr")}
            for _ in range(rounds):
                r = subprocess.run(h.b + [sys.executable, "-c", _CLIENT, json.dumps(extra), json.dumps(plan)],
                                   capture_output=True, text=True, timeout=1800, env=_env())
                if r.returncode != 0:
                    raise RuntimeError("bench store client failed: " + r.stderr[-2000:])
                per["stagelink"].append(json.loads(r.stdout.strip().splitlines()[-1]))
                # small sizes: enough requests that redis-benchmark's start does not weigh
                per["redis"].append({s: _redis_benchmark(h, host, port, s, max(3, _iters(s) * (20 if s <= 64 << 10 else 1)))
                                     for s in sizes})
                per["mc"].append(_mooncake_store(h, sizes) or {})
                per["mcr"].append((_mooncake_store(h, sizes, server_segment=True) if h.ns else None) or {})

            def med(runs, size, a, b):  # {a, b}: medians over the rounds that ran this size
                got = [x for x in (run.get(size) for run in runs) if x]
                if not got:
                    return None
                return {a: statistics.median(x[a] for x in got), b: statistics.median(x[b] for x in got)}
            rows = []
            for i, size in enumerate(sizes):
                runs = [run[i] for run in per["stagelink"]]
                rows.append({"size": size, "put_s": statistics.median(x["put_s"] for x in runs),
                             "get_s": statistics.median(x["get_s"] for x in runs),
                             "verified": all(x["verified"] for x in runs), "rounds": rounds})
            mc = any(per["mc"])
            for row in rows:
                row["redis_benchmark"] = med(per["redis"], row["size"], "set_s", "get_s")
                row["mooncake"] = med(per["mc"], row["size"], "put_s", "get_s")
                row["mooncake_server_segment"] = med(per["mcr"], row["size"], "put_s", "get_s")
            ping = _ping_rtt(h, host, port)
            wake, wake_from_begin = _wake(h, extra) or (None, None)
            print(f"{'size':>9} {'put':>10} {'get':>10} {'GB/s':>9} {'redis GB/s':>11} {'ratio':>6} "
                  f"{'mooncake':>9} {'mc remote':>9} {'verified':>8}", file=out)
            for row in rows:
                both = row["put_s"] + row["get_s"]
                row["gbps"] = row["size"] / both / 1e9
                rb = row["redis_benchmark"]
                row["redis_benchmark_gbps"] = row["size"] / (rb["set_s"] + rb["get_s"]) / 1e9 if rb else None
                mk = row["mooncake"]
                row["mooncake_gbps"] = row["size"] / (mk["put_s"] + mk["get_s"]) / 1e9 if mk else None
                mr = row["mooncake_server_segment"]
                row["mooncake_server_segment_gbps"] = row["size"] / (mr["put_s"] + mr["get_s"]) / 1e9 if mr else None
                mrg = f"{row['mooncake_server_segment_gbps']:.2f}" if mr else "-"
                ratio = row["gbps"] / row["redis_benchmark_gbps"] if row["redis_benchmark_gbps"] else None
                rbg = f"{row['redis_benchmark_gbps']:.2f}" if rb else "-"
                mkg = f"{row['mooncake_gbps']:.2f}" if mk else "-"
                rat = f"{ratio:.2f}x" if ratio else "-"
                print(f"{_fmt_size(row['size']):>9} {row['put_s'] * 1e3:>7.2f} ms {row['get_s'] * 1e3:>7.2f} ms "
                      f"{row['gbps']:>9.2f} {rbg:>11} {rat:>6} {mkg:>9} {mrg:>9} {str(row['verified']):>8}", file=out)
            if ping and wake is not None:
                print(f"PING round trip {ping:.0f} us; a blocked get returns {wake:.0f} us after the put returns "
                      f"({wake / ping:.2f}x PING, aim 2x; below 0: before it), {wake_from_begin:.0f} us after "
                      f"it began ({wake_from_begin / ping:.2f}x PING)", file=out)
            else:
                print("wake: not measured", file=out)
            big = [r["gbps"] / r["redis_benchmark_gbps"] for r in rows if r["size"] >= 1 << 20 and r["redis_benchmark_gbps"]]
            if big:
                print(f"1 MiB and above: {min(big):.2f}-{max(big):.2f}x redis-benchmark (aim 0.8x)", file=out)
            mcx = [r["gbps"] / r["mooncake_gbps"] for r in rows if r["size"] >= 16 << 20 and r["mooncake_gbps"]]
            print(f"16 MiB and above: {min(mcx):.2f}-{max(mcx):.2f}x Mooncake Store (aim above 1x)" if mcx else
                  "Mooncake Store: not installed or did not run here", file=out)
            mrx = [r["gbps"] / r["mooncake_server_segment_gbps"] for r in rows
                   if r["size"] >= 16 << 20 and r.get("mooncake_server_segment_gbps")]
            if mrx:
                print(f"16 MiB and above: {min(mrx):.2f}-{max(mrx):.2f}x Mooncake Store with its segment on the server "
                      "side (mc remote: its data crosses the link too)", file=out)
            result["paths"][where] = {"rows": rows, "ping_rtt_us": ping, "wake_us": wake,
                                      "wake_from_put_begin_us": wake_from_begin, "mooncake_ran": bool(mc)}
        finally:
            srv.kill()
            srv.wait()
            h.close()
    return write_json(result, json_path, out)
