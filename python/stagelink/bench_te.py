"""stagelink bench te: the transfer-engine connector between two processes (loopback, and two
network namespaces joined by a veth pair when run as root), against iperf3 (1 and 4 streams) and
UCX's own ucx_perftest ucp_am_bw over the same path, and Mooncake's transfer engine (PyPI
mooncake-transfer-engine-non-cuda, in this interpreter or STAGELINK_MOONCAKE_PYTHON's) where it is
installed, in the same run.

A get with metadata = pull request (over the side channel the first time, then as a UCX message)
+ the payload as a UCX active message into the receiver's pool + done; the receiver takes the
payload zero-copy (its pool region) or, by default, copies it out into a host buffer; the two
alternate get by get. Every size's first get of each kind is checked end to end (BLAKE2 of the
whole payload). Each path runs five sender/receiver pairs and
reports the median of their medians."""
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

from .bench import _fmt_size, plain_vs_curve, print_plain_vs_curve, write_json

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 512 << 20]
# Mooncake TE 0.3.13 over TCP across the namespaces (issue 11): GB/s at 1 MiB and at 16-186 MiB.
MOONCAKE = {"1MiB": 2.9, "16MiB+": 1.67}

_SENDER = textwrap.dedent("""
    import json, sys, numpy as np, stagelink
    host, plan = sys.argv[1], json.loads(sys.argv[2])
    total = 2 * sum(s for s, n in plan)
    c = stagelink.create_connector("TransferEngineConnector", {"host": host, "zmq_port": 0, "protocol": "tcp",
        "memory_pool_size": total + (64 << 20), "role": "sender", "timeout_s": 30, "strict": True})
    out = []
    rng = np.random.default_rng(1)
    for size, n in plan:
        data = rng.integers(0, 256, size, dtype=np.uint8)
        ok, _, md = c.put(0, 1, f"b{size}", data, readers=2 * n)
        ok, _, mdy = c.put(0, 1, f"y{size}", data.tobytes(), readers=n)  # the same payload as bytes
        import hashlib
        out.append({"size": size, "n": n, "md": md, "mdy": mdy, "sum": hashlib.blake2b(data.tobytes()).hexdigest()})
        del data
    print(json.dumps(out), flush=True)
    sys.stdin.readline()
    c.close()
""")

_RECEIVER = textwrap.dedent("""
    import hashlib, json, sys, time, numpy as np, stagelink
    todo = json.loads(sys.stdin.readline())
    big = max(t["size"] for t in todo)
    c = stagelink.create_connector("TransferEngineConnector", {"host": "auto", "protocol": "tcp",
        "memory_pool_size": 2 * big + (64 << 20), "role": "receiver", "timeout_s": 30, "strict": True})
    res = []
    for t in todo:
        lat, ok = {"view": [], "copy": [], "bytes": []}, True
        for i in range(t["n"]):
            for mode in ("view", "copy", "bytes"):  # alternating: the copying get is the default, the view
                t0 = time.perf_counter()          # zero_copy; bytes: the payload put as bytes, got as bytes
                if mode == "bytes":
                    data, size = c.get(0, 1, f"y{t['size']}", t["mdy"])
                else:
                    data, size = c.get(0, 1, f"b{t['size']}", t["md"], zero_copy=mode == "view")
                lat[mode].append((time.perf_counter() - t0) * 1e6)
                if i == 0:
                    ok = ok and (hashlib.blake2b(memoryview(data).cast("B")).hexdigest() == t["sum"]
                                 and size >= t["size"])
                del data  # as a consumer that is done with a payload: its buffer is reused
        res.append({"size": t["size"], "verified": ok,
                    **{f"lat_us_{m}": (v[2:] if len(v) > 4 else v) for m, v in lat.items()}})
    print(json.dumps(res), flush=True)
    c.close()
""")


# Mooncake TE's own engine (PyPI mooncake-transfer-engine-non-cuda), P2P handshake over TCP: the
# initiator writes `size` bytes into the target's registered buffer (transfer_sync_write, which
# returns when the write completed), as the issue measured it.
_MOONCAKE = textwrap.dedent("""
    import json, statistics, sys, time, numpy as np
    from mooncake.engine import TransferEngine
    role, host, big, sizes = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")]
    te = TransferEngine()
    assert te.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0, "mooncake initialize failed"
    buf = np.zeros(big, np.uint8)
    assert te.register_memory(buf.ctypes.data, big) == 0, "mooncake register_memory failed"
    if role == "target":
        print(json.dumps({"session": f"{host}:{te.get_rpc_port()}", "addr": buf.ctypes.data}), flush=True)
        sys.stdin.readline()
    else:
        peer, out = json.loads(sys.stdin.readline()), []
        buf[:] = 7
        for size in sizes:
            n = 200 if size <= 1 << 20 else 20 if size <= 16 << 20 else 4
            lat = []
            for i in range(n + 2):
                t = time.perf_counter()
                assert te.transfer_sync_write(peer["session"], buf.ctypes.data, peer["addr"], size) == 0
                lat.append((time.perf_counter() - t) * 1e6)
            out.append({"size": size, "median_us": statistics.median(lat[2:])})
        print(json.dumps(out), flush=True)
""")


def release(proc, timeout=30):
    """Let a peer process that waits on its stdin finish (one line), then reap it; kill it if it hangs."""
    if proc.poll() is None:
        proc.stdin.write("x\n")
        proc.stdin.flush()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def mooncake_python():
    """An interpreter that can import Mooncake's transfer engine: STAGELINK_MOONCAKE_PYTHON, or this one."""
    for py in (os.environ.get("STAGELINK_MOONCAKE_PYTHON"), sys.executable):
        if py and subprocess.run([py, "-c", "import mooncake.engine"], capture_output=True).returncode == 0:
            return py
    return None


def _mooncake(h: TwoHosts, sizes):
    py = mooncake_python()
    if not py:
        return None
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", GLOG_minloglevel="3")
    big, arg = str(max(sizes)), ",".join(str(s) for s in sizes)
    tgt = subprocess.Popen(h.a + [py, "-c", _MOONCAKE, "target", h.addr_a, big, arg], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = tgt.stdout.readline()
        if not line:
            return None
        r = subprocess.run(h.b + [py, "-c", _MOONCAKE, "initiator", h.addr_b, big, arg], input=line, capture_output=True,
                           text=True, timeout=600, env=env)
        if r.returncode != 0:
            return None
        return {x["size"]: x["size"] / x["median_us"] / 1e3 for x in json.loads(r.stdout.strip().splitlines()[-1])}
    except (subprocess.TimeoutExpired, ValueError):
        return None
    finally:
        release(tgt)


def _iters(size):
    return 400 if size <= 64 << 10 else 100 if size <= 1 << 20 else 20 if size <= 16 << 20 else 8 if size <= 64 << 20 else 4




class TwoHosts:
    """Loopback, or two network namespaces joined by a veth pair (root; `close()` removes them):
    `a`/`b` prefix a command to run it on either side, `addr_a`/`addr_b` are the sides' addresses,
    `va` a's veth. The transfer-engine tests use it too."""

    def __init__(self, namespaces: bool):
        self.ns = namespaces
        if not namespaces:
            self.a = self.b = []
            self.addr_a = self.addr_b = "127.0.0.1"
            return
        tag = str(os.getpid() % 100000)
        self.na, self.nb, self.va, vb = f"sbta{tag}", f"sbtb{tag}", f"sbva{tag}", f"sbvb{tag}"
        va = self.va
        net = 150 + os.getpid() % 50
        for c in (["ip", "netns", "add", self.na], ["ip", "netns", "add", self.nb],
                  ["ip", "link", "add", va, "type", "veth", "peer", "name", vb],
                  ["ip", "link", "set", va, "netns", self.na], ["ip", "link", "set", vb, "netns", self.nb],
                  ["ip", "-n", self.na, "addr", "add", f"10.{net}.1.1/24", "dev", va],
                  ["ip", "-n", self.nb, "addr", "add", f"10.{net}.1.2/24", "dev", vb],
                  ["ip", "-n", self.na, "link", "set", va, "up"], ["ip", "-n", self.nb, "link", "set", vb, "up"],
                  ["ip", "-n", self.na, "link", "set", "lo", "up"], ["ip", "-n", self.nb, "link", "set", "lo", "up"]):
            subprocess.run(c, check=True, capture_output=True)
        self.a, self.b = ["ip", "netns", "exec", self.na], ["ip", "netns", "exec", self.nb]
        self.addr_a, self.addr_b = f"10.{net}.1.1", f"10.{net}.1.2"

    def close(self):
        if self.ns:
            subprocess.run(["ip", "netns", "del", self.na], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.nb], capture_output=True)


ROUNDS = 5  # process pairs per path: on a small VM a run's thread placement moves its figures 2-3x


def _stagelink(h: TwoHosts, sizes, rounds=ROUNDS):
    """Per size and get (`copy`, the default; `view`, zero_copy): the median of `rounds` runs'
    medians (each run a fresh sender/receiver pair), the pairs' spread and the median pair's p99."""
    runs = [_stagelink_once(h, sizes) for _ in range(rounds)]
    out = []
    for i, r in enumerate(runs[0]):
        row = {"size": r["size"], "verified": all(run[i]["verified"] for run in runs)}
        for m in ("copy", "view", "bytes"):
            per = sorted((run[i][m] for run in runs), key=lambda x: x["median_us"])
            mid = per[len(per) // 2]
            gb = sorted(x["gbps"] for x in per)
            row[m] = dict(mid, pairs_gbps=[round(x["gbps"], 3) for x in (run[i][m] for run in runs)],
                          pairs_min_gbps=gb[0], pairs_max_gbps=gb[-1])
        row["copy_vs_view"] = row["copy"]["median_us"] / row["view"]["median_us"]
        out.append(row)
    return out


def _stagelink_once(h: TwoHosts, sizes):
    # numpy's OpenBLAS workers spin for a while after any call, taking a core from the transfer
    # (perf: ~10% of the machine in blas_thread_server); the bench processes need none.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1")
    plan = [[s, _iters(s) + 2] for s in sizes]
    snd = subprocess.Popen(h.a + [sys.executable, "-c", _SENDER, h.addr_a, json.dumps(plan)], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = snd.stdout.readline()
        if not line:
            raise RuntimeError("bench te sender failed: " + snd.stderr.read()[-2000:])
        rcv = subprocess.run(h.b + [sys.executable, "-c", _RECEIVER], input=line, capture_output=True, text=True,
                             timeout=600, env=env)
        if rcv.returncode != 0:
            raise RuntimeError("bench te receiver failed: " + rcv.stderr[-2000:])
        rows = json.loads(rcv.stdout.strip().splitlines()[-1])
    finally:
        release(snd)
    out = []
    for r in rows:
        row = {"size": r["size"], "verified": r["verified"]}
        for m in ("copy", "view", "bytes"):
            lat = sorted(r[f"lat_us_{m}"])
            med = statistics.median(lat)
            row[m] = {"median_us": med, "p99_us": lat[int(len(lat) * 0.99)] if len(lat) > 1 else med,
                      "gbps": r["size"] / med / 1e3}
        out.append(row)
    return out


def _iperf(h: TwoHosts, streams: int):
    if not shutil.which("iperf3"):
        return None
    port = str(5201 + os.getpid() % 1000)
    srv = subprocess.Popen(h.a + ["iperf3", "-s", "-1", "-p", port], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            time.sleep(0.05)
            r = subprocess.run(h.b + ["iperf3", "-c", h.addr_a, "-p", port, "-t", "3", "-P", str(streams), "-J"],
                               capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                return json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
        return None
    finally:
        srv.kill()
        srv.wait()


def _sockperf(h: TwoHosts, size: int, seconds: int = 5):
    """A bare TCP round trip of `size` bytes each way over the same path, from C (sockperf
    ping-pong, full round trip): its p50 and p99 in us, the floor of a small get's tail here.
    None without sockperf (Debian's `sockperf`)."""
    if not shutil.which("sockperf"):
        return None
    port = str(11111 + os.getpid() % 1000)
    srv = subprocess.Popen(h.a + ["sockperf", "server", "--tcp", "-i", h.addr_a, "-p", port],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            time.sleep(0.05)
            r = subprocess.run(h.b + ["sockperf", "ping-pong", "--tcp", "-i", h.addr_a, "-p", port, "-m", str(size),
                                      "-t", str(seconds), "--full-rtt"], capture_output=True, text=True, timeout=60)
            pct = dict(re.findall(r"percentile (\d+\.\d+) =\s+([\d.]+)", r.stdout + r.stderr))
            if r.returncode == 0 and "50.000" in pct and "99.000" in pct:
                return {"p50_us": float(pct["50.000"]), "p99_us": float(pct["99.000"]),
                        "p99_9_us": float(pct.get("99.900", "nan"))}
        return None
    finally:
        srv.kill()
        srv.wait()


def _perftest(h: TwoHosts, size: int):
    if not shutil.which("ucx_perftest"):
        return None
    port = str(13000 + os.getpid() % 1000)
    env = dict(os.environ, UCX_TLS="tcp,self")
    srv = subprocess.Popen(h.a + ["ucx_perftest", "-p", port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=env)
    try:
        n = str(max(10, min(2000, (256 << 20) // size)))
        for _ in range(50):
            time.sleep(0.05)
            r = subprocess.run(h.b + ["ucx_perftest", h.addr_a, "-p", port, "-t", "ucp_am_bw", "-s", str(size), "-n", n,
                                      "-w", "3"], capture_output=True, text=True, timeout=120, env=env)
            m = re.search(r"Final:\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)", r.stdout)
            if m:
                return float(m.group(1)) * 1048576 / 1e9  # MB/s (UCX's MB = 2^20 B) -> GB/s
        return None
    finally:
        srv.kill()
        srv.wait()


def side_channel_curve_figures(rounds=5, iters=300, sizes=(4 << 10, 64 << 10)):
    """The cost of CURVE on the side channel: gets whose every pull goes through it
    (pull_channel: zmq; 4 KiB comes back inside the reply, 64 KiB as a UCX message after it),
    loopback TCP in one process, plain and with extra.curve, interleaved round by round. Returns
    {size: {plain_us, curve_us, ratio}} (medians of per-round medians; ratio: of per-round ratios)."""
    import numpy as np
    import stagelink
    _, secret = stagelink.curve_keypair()
    base = {"host": "127.0.0.1", "memory_pool_size": 32 << 20, "pull_channel": "zmq"}

    def once(curve, size):
        extra = dict(base, curve={"secret_key": secret}) if curve else base
        with stagelink.create_connector("TransferEngineConnector", dict(extra, role="sender")) as s, \
                stagelink.create_connector("TransferEngineConnector", dict(extra, role="receiver")) as r:
            data = np.ones(size, np.uint8)
            lat = []
            for i in range(iters + 20):
                ok, _, md = s.put(0, 1, f"k{i}", data)
                t0 = time.perf_counter()
                got = r.get(0, 1, f"k{i}", md)
                if i >= 20:
                    lat.append((time.perf_counter() - t0) * 1e6)
                assert ok and got is not None and got[0].nbytes == size
            return statistics.median(lat)

    return plain_vs_curve(once, sizes, rounds)


def run_te(sizes=None, json_path=None, out=sys.stdout, namespaces=None):
    sizes = sizes or SIZES
    if namespaces is None:
        namespaces = os.geteuid() == 0 and shutil.which("ip") is not None
    result = {"kind": "te", "machine": os.uname().nodename, "cpus": os.cpu_count(), "paths": {}}
    print("stagelink bench te: TransferEngineConnector get with metadata (pull + UCX active message + done), "
          "the default (copying) get and the zero_copy get alternating;\npeers in the same run: iperf3 (1 and 4 TCP streams) and "
          f"ucx_perftest ucp_am_bw (UCX_TLS=tcp) over the same path. Medians of {ROUNDS} runs.", file=out)
    for where in (["loopback"] + (["namespaces"] if namespaces else [])):
        h = TwoHosts(where == "namespaces")
        try:
            print(f"\n{where}{' (two network namespaces, veth, TCP)' if where == 'namespaces' else ' (TCP on lo)'}:",
                  file=out)
            rows = _stagelink(h, sizes)
            ip1 = _iperf(h, 1)
            ip4s = [x for x in (_iperf(h, 4) for _ in range(3)) if x]
            ip4 = statistics.median(ip4s) if ip4s else None
            mc = _mooncake(h, sizes)
            for r in rows:
                r["ucx_perftest_gbps"] = _perftest(h, r["size"]) if r["size"] >= (64 << 10) else None
                r["mooncake_gbps"] = mc.get(r["size"]) if mc else None
            print(f"{'size':>9} {'get p50':>10} {'get p99':>10} {'GB/s':>7} {'pairs GB/s min-max':>19} "
                  f"{'view p50':>10} {'view GB/s':>9} {'get/view':>8} {'bytes GB/s':>10} {'ucx_perftest':>12} {'mooncake':>9} "
                  f"{'verified':>8}", file=out)
            for r in rows:
                pt = f"{r['ucx_perftest_gbps']:.2f}" if r["ucx_perftest_gbps"] else "-"
                mk = f"{r['mooncake_gbps']:.2f}" if r["mooncake_gbps"] else "-"
                c, v = r["copy"], r["view"]
                spread = f"{c['pairs_min_gbps']:.2f}-{c['pairs_max_gbps']:.2f}"
                print(f"{_fmt_size(r['size']):>9} {c['median_us']:>7.0f} us {c['p99_us']:>7.0f} us {c['gbps']:>7.2f} "
                      f"{spread:>19} {v['median_us']:>7.0f} us {v['gbps']:>9.2f} {r['copy_vs_view']:>7.2f}x "
                      f"{r['bytes']['gbps']:>10.2f} "
                      f"{pt:>12} {mk:>9} {str(r['verified']):>8}", file=out)
            print("get: the default (a copy into a host buffer, reused once dropped); view: zero_copy=True (the "
                  "pool region); bytes: the payload put and got as bytes (a new bytes object: fresh memory each "
                  "get); pairs: the spread of the 5 sender/receiver pairs' medians (copying get)", file=out)
            print(f"iperf3: {ip1:.2f} GB/s (1 stream), {ip4:.2f} GB/s (4 streams; {len(ip4s)} runs "
                  f"{min(ip4s):.2f}-{max(ip4s):.2f}: the link's own spread between runs)" if ip1 and ip4 else
                  "iperf3: not available", file=out)
            missing = {t: pkg for t, pkg in (("iperf3", "iperf3"), ("ucx_perftest", "ucx-utils")) if not shutil.which(t)}
            if missing:  # Debian's packages of the peers
                print(f"peers not installed: {', '.join(missing)} (apt-get install {' '.join(missing.values())})",
                      file=out)
            big = [r for r in rows if r["size"] >= 16 << 20]
            # Mooncake of this run where it ran; else the figures the issue measured.
            ref = (lambda r: r["mooncake_gbps"]) if mc else (lambda r: MOONCAKE["16MiB+" if r["size"] >= 16 << 20 else "1MiB"])
            src = "Mooncake TE of this run" if mc else "Mooncake TE's figures from the issue (not installed here)"
            for m, what in (("copy", "the default get"), ("view", "the zero_copy get")):
                if big and ip4:
                    x4 = [r[m]["gbps"] / ip4 for r in big]
                    xm = [r[m]["gbps"] / ref(r) for r in big]
                    print(f"{what}, 16 MiB and above: {min(r[m]['gbps'] for r in big):.2f}-"
                          f"{max(r[m]['gbps'] for r in big):.2f} GB/s = {min(x4):.2f}-{max(x4):.2f}x iperf3 with 4 "
                          f"streams (aim 0.7x), {min(xm):.2f}-{max(xm):.2f}x {src} (aim 1.5x)", file=out)
                by = {r["size"]: r for r in rows}
                if 1 << 20 in by:
                    print(f"{what}, 1 MiB: {by[1 << 20][m]['gbps']:.2f} GB/s = "
                          f"{by[1 << 20][m]['gbps'] / ref(by[1 << 20]):.2f}x {src} (aim 1x)", file=out)
            sp = None
            if 4 << 10 in by:
                mk4 = f"; Mooncake's 4 KiB write {4096 / mc[4 << 10] / 1e3:.0f} us" if mc and mc.get(4 << 10) else ""
                print(f"4 KiB get: {by[4 << 10]['copy']['median_us']:.0f} us median, {by[4 << 10]['copy']['p99_us']:.0f}"
                      f" us p99 (aims: under 100 us and 1 ms{mk4})", file=out)
                # The tail's floor on this path: a bare C round trip of 4 KiB each way, no library.
                sp = _sockperf(h, 4 << 10)
                print(f"  sockperf ping-pong, 4 KiB each way over the same path (TCP, full round trip): "
                      f"{sp['p50_us']:.0f} us p50, {sp['p99_us']:.0f} us p99, {sp['p99_9_us']:.0f} us p99.9"
                      if sp else "  sockperf: not installed (apt-get install sockperf): no tail floor measured", file=out)
            big16 = [r for r in rows if r["size"] >= 16 << 20]
            if big16:
                print(f"copying get against the zero_copy get, 16 MiB and above: "
                      f"{min(r['copy_vs_view'] for r in big16):.2f}-{max(r['copy_vs_view'] for r in big16):.2f}x "
                      "(aim at most 1.25x)", file=out)
            result["paths"][where] = {"rows": rows, "iperf3_1_stream_gbps": ip1, "iperf3_4_streams_gbps": ip4,
                                      "iperf3_4_streams_runs_gbps": ip4s,
                                      "mooncake_ran": bool(mc), "sockperf_4KiB": sp}
        finally:
            h.close()
    print("\nthe side channel with CURVE (extra.curve) against without, every pull through it (pull_channel: zmq), "
          "loopback, interleaved:", file=out)
    sc = side_channel_curve_figures()
    result["side_channel_curve"] = {str(k): v for k, v in sc.items()}
    print_plain_vs_curve("get of", sc, out, digits=0)
    return write_json(result, json_path, out)
