"""stagelink bench relay: one relay hop between processes (C++ harness) against memcpy and raw
ZeroMQ, and control messages over tcp plain and CURVE-authenticated, in the same run. Pipelines
(SGLang-Omni's toy beside SGLang-Omni's own runtime) are `stagelink bench pipeline`'s."""
from __future__ import annotations

import os
import statistics
import sys
import time
import uuid

from . import _core
from .bench import _fmt_size, plain_vs_curve, print_plain_vs_curve, write_json

# SGLang-Omni 0.1.9's shm relay hop of 64 B on this machine class (issue 10), printed beside.
REFERENCE = {"hop_64B_us": 171.0}




def control_curve_figures(rounds=5, iters=400, sizes=(64, 64 << 10)):
    """The cost of CURVE on the tcp control plane: round trips of a control message (a body of
    `size` bytes) to an echoing inbox over loopback TCP, plain and CURVE-authenticated, interleaved
    round by round. Returns {size: {plain_us, curve_us, ratio}} (bench.plain_vs_curve)."""
    import threading
    from .control import ControlMessage, Inbox, Outbox
    keys = {n: _core.curve_keypair() for n in ("a", "b")}

    def curve_server(me, peer):
        return {"public_key": keys[me][0], "secret_key": keys[me][1], "allowed_clients": [keys[peer][0]]}

    def curve_client(me, server):
        return {"public_key": keys[me][0], "secret_key": keys[me][1], "server_key": keys[server][0]}

    def rtts(curve, size):
        a = Inbox("tcp://127.0.0.1:0", curve_server("a", "b") if curve else None)
        b = Inbox("tcp://127.0.0.1:0", curve_server("b", "a") if curve else None)
        to_b = Outbox(b.endpoint, curve_client("a", "b") if curve else None)
        to_a = Outbox(a.endpoint, curve_client("b", "a") if curve else None)

        def echo():
            for _ in range(iters + 20):
                to_a.send(b.recv(timeout=10), timeout=10)
        t = threading.Thread(target=echo)
        t.start()
        msg, out = ControlMessage("stream", "r", body=b"x" * size), []
        for i in range(iters + 20):
            t0 = time.perf_counter()
            to_b.send(msg, timeout=10)
            a.recv(timeout=10)
            if i >= 20:
                out.append((time.perf_counter() - t0) * 1e6)
        t.join()
        for s in (to_b, to_a, a, b):
            s.close()
        return statistics.median(out)

    return plain_vs_curve(rtts, sizes, rounds)


def run_relay(sizes=None, iters=2000, json_path=None, out=sys.stdout):
    sizes = sizes or [64, 4096, 1 << 20, 16 << 20, 64 << 20, 186 << 20]
    ns = "benchr" + uuid.uuid4().hex[:8]
    print("stagelink bench relay: one hop = relay put + data_ready control message + get, process to process;\n"
          "peers in the same run: memcpy (a warm buffer) and raw ZeroMQ PUSH/PULL over ipc:// (bytes in the "
          "message).\n", file=out)
    rows = _core.bench_relay_cpp(sizes, iters, ns, lambda w: print(f"  ... {w}", file=sys.stderr))
    modes = ("rtt_copy", "rtt_view", "rtt_zmq", "rtt_view_zmqctl")
    base = {m: rows[0][m]["median_us"] / 2 for m in modes}  # hop of 64 B
    table = []
    print("control messages over shared memory (shm://, the default on one host); the 'view, ZeroMQ control' "
          "column sends them over ipc:// instead\n", file=out)
    print(f"{'size':>9} {'relay copy-out':>15} {'relay view':>11} {'view, ZeroMQ ctl':>16} {'raw ZeroMQ':>11} "
          f"{'memcpy':>9} {'relay GB/s':>10} {'memcpy GB/s':>11} {'relay/memcpy':>12} {'ZeroMQ/relay':>12}", file=out)
    for r in rows:
        s = r["size"]
        hop = {m: (r[m]["median_us"] / 2 if s == 64 else max(0.01, r[m]["median_us"] - base[m])) for m in modes}
        mc = max(0.001, r["memcpy"]["median_us"])
        row = {"size": s, "hop_us_copy": hop["rtt_copy"], "hop_us_view": hop["rtt_view"], "hop_us_zmq": hop["rtt_zmq"],
               "hop_us_view_zmq_control": hop["rtt_view_zmqctl"], "memcpy_us": mc, "raw": r}
        row["gbps_view"] = s / hop["rtt_view"] / 1e3
        row["gbps_memcpy"] = s / mc / 1e3
        row["view_vs_memcpy"] = hop["rtt_view"] / mc
        row["zmq_vs_view"] = hop["rtt_zmq"] / hop["rtt_view"]
        table.append(row)
        print(f"{_fmt_size(s):>9} {hop['rtt_copy']:>12.1f} us {hop['rtt_view']:>8.1f} us {hop['rtt_view_zmqctl']:>13.1f} us "
              f"{hop['rtt_zmq']:>8.1f} us "
              f"{mc:>6.1f} us {row['gbps_view']:>10.2f} {row['gbps_memcpy']:>11.2f} "
              f"{row['view_vs_memcpy']:>11.2f}x {row['zmq_vs_view']:>11.2f}x", file=out)
    print(f"\none hop of 64 B: {table[0]['hop_us_view']:.1f} us median (aim: under 20 us; raw ZeroMQ "
          f"{table[0]['hop_us_zmq']:.1f} us; the reference's shm relay {REFERENCE['hop_64B_us']:.0f} us)", file=out)
    result = {"kind": "relay", "machine": os.uname().nodename, "cpus": os.cpu_count(), "hops": table}
    print("\ncontrol messages over tcp (loopback, a round trip to an echoing inbox, Python on both ends), plain "
          "and CURVE-authenticated (the default of control: tcp), interleaved:", file=out)
    cc = control_curve_figures()
    result["control_tcp_curve"] = {str(k): v for k, v in cc.items()}
    print_plain_vs_curve("body", cc, out)
    print("\nthe pipeline runtime on SGLang-Omni's toy pipeline, beside SGLang-Omni's own runtime: "
          "stagelink bench pipeline", file=out)
    return write_json(result, json_path, out)
