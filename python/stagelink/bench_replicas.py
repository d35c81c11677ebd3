"""stagelink bench replicas: what stage replicas buy and what a dead one costs.

Scaling: `front -> work`, `work` spinning `cpu_ms` of CPU per request (stagelink.examples.busy),
with 1 and then 2 replicas of `work`, alternating, `rounds` rounds; requests/s at 8 in flight.
Failover: 2 replicas of `work` with `retry: true`; one SIGKILLed mid-run; every request must
complete, and the longest gap between two completions after the kill is the failover time."""
from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
import uuid


def _spec(replicas: int, retry: bool = False) -> dict:
    return {"name": "replicas", "relay": {"extra": {"namespace": "benchr" + uuid.uuid4().hex[:8]}},
            "settings": {"request_timeout_s": 60},
            "stages": [{"name": "front", "factory": "stagelink.examples.busy:front", "next": "work"},
                       {"name": "work", "factory": "stagelink.examples.busy:work", "terminal": True,
                        "replicas": replicas, "retry": retry}]}


def _drive(p, n: int, cpu_ms: float, in_flight: int = 8, on_submit=None):
    """Submit n requests with `in_flight` in flight; (seconds, completion times, results or errors)."""
    sem = threading.Semaphore(in_flight)
    done_at, futs = [], []
    tag = uuid.uuid4().hex[:6]  # request ids are unique per pipeline (a stage drops one it finished)
    t0 = time.monotonic()
    for i in range(n):
        sem.acquire()
        f = p.submit(f"{tag}-{i}", {"i": i, "cpu_ms": cpu_ms})
        f.add_done_callback(lambda _f: (done_at.append(time.monotonic()), sem.release()))
        futs.append(f)
        if on_submit is not None:
            on_submit(i)
    out = []
    for f in futs:
        try:
            out.append(f.result(120))
        except Exception as e:  # noqa: BLE001  counted as lost
            out.append(e)
    return time.monotonic() - t0, sorted(done_at), out


def scaling(replicas: int, n: int, cpu_ms: float) -> dict:
    from .pipeline import Pipeline
    with Pipeline.from_config(_spec(replicas)) as p:
        _drive(p, 16, cpu_ms)  # warm-up
        secs, _, out = _drive(p, n, cpu_ms)
        bad = [r for r in out if not isinstance(r, dict)]
        if bad:
            raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
        used = {r["pid"] for r in out}
    return {"replicas": replicas, "requests": n, "req_s": n / secs, "replicas_used": len(used)}


def failover(n: int, cpu_ms: float) -> dict:
    from .pipeline import Pipeline
    with Pipeline.from_config(_spec(2, retry=True)) as p:
        _drive(p, 16, cpu_ms)
        victim = p.process_ids()["work.1"]
        killed = []

        def kill(i):
            if i == n // 2:
                os.kill(victim, signal.SIGKILL)
                killed.append(time.monotonic())
        _, done_at, out = _drive(p, n, cpu_ms, on_submit=kill)
    lost = sum(1 for r in out if not isinstance(r, dict))
    before = [b - a for a, b in zip(done_at, done_at[1:]) if b < killed[0]]
    after = [t for t in done_at if t > killed[0]]
    gaps = [b - a for a, b in zip(killed + after, after)]
    return {"requests": n, "lost": lost, "failover_gap_ms": max(gaps) * 1000 if gaps else None,
            "median_gap_ms": statistics.median(before) * 1000 if before else None}


def run_replicas(rounds: int = 3, json_path=None, quick: bool = False, out=sys.stdout) -> dict:
    n, cpu_ms = (100, 10.0) if quick else (400, 10.0)
    cores = len(os.sched_getaffinity(0))
    print(f"stage replicas: front -> work ({cpu_ms:g} ms of CPU per request), {n} requests at 8 in flight, "
          f"{rounds} rounds, {cores} cores", file=out)
    runs = {1: [], 2: []}
    for r in range(rounds):
        for k in (1, 2):
            res = scaling(k, n, cpu_ms)
            runs[k].append(res["req_s"])
            print(f"  round {r + 1}: {k} replica(s) of work: {res['req_s']:.0f} req/s "
                  f"({res['replicas_used']} used)", file=out)
    ratios = [b / a for a, b in zip(runs[1], runs[2])]
    print(f"  2 replicas / 1: median {statistics.median(ratios):.2f}x (runs {', '.join(f'{x:.2f}' for x in ratios)})",
          file=out)
    fo = [failover(n, cpu_ms) for _ in range(rounds)]
    for f in fo:
        print(f"  failover: one of 2 replicas SIGKILLed mid-run: {f['lost']} of {f['requests']} lost, longest gap "
              f"after the kill {f['failover_gap_ms']:.0f} ms (median gap before {f['median_gap_ms']:.1f} ms)",
              file=out)
    from ._version import __version__
    result = {"kind": "replicas", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "stagelink": __version__, "cores": cores, "cpu_ms": cpu_ms, "requests": n,
              "req_s": {str(k): v for k, v in runs.items()}, "ratio_2_over_1": ratios, "failover": fo}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    run_replicas(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
