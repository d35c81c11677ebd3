"""stagelink bench replicas: what stage replicas buy and what a dead one costs.

Scaling: `front -> work`, `work` spinning `cpu_ms` of CPU per request (stagelink.examples.busy),
with 1 and then 2 replicas of `work`, alternating, `rounds` rounds; requests/s at 8 in flight.
Failover: 2 replicas of `work` with `retry: true` and `max_restarts`; a replica SIGKILLed 10 times
in one run (each time once the one before is back); every request must complete, and the
longest gap between two completions after a kill is the failover time."""
from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
import uuid


def _spec(replicas: int, retry: bool = False, max_restarts: int = 0) -> dict:
    return {"name": "replicas", "relay": {"extra": {"namespace": "benchr" + uuid.uuid4().hex[:8]}},
            "settings": {"request_timeout_s": 60},
            "stages": [{"name": "front", "factory": "stagelink.examples.busy:front", "next": "work"},
                       {"name": "work", "factory": "stagelink.examples.busy:work", "terminal": True,
                        "replicas": replicas, "retry": retry, "max_restarts": max_restarts}]}


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
    from .bench_pipeline import cpu_seconds
    with Pipeline.from_config(_spec(replicas)) as p:
        _drive(p, 16, cpu_ms)  # warm-up
        pids = p.process_ids()
        c0 = cpu_seconds(pids)
        secs, _, out = _drive(p, n, cpu_ms)
        c1 = cpu_seconds(pids)
        bad = [r for r in out if not isinstance(r, dict)]
        if bad:
            raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
        used = {r["pid"] for r in out}
    cpu = {k: (c1[k] - c0[k]) / n * 1e3 for k in c1 if k in c0}  # ms of CPU per request, per process
    return {"replicas": replicas, "requests": n, "req_s": n / secs, "replicas_used": len(used),
            "cpu_ms_per_request": cpu}


def failover(n: int, cpu_ms: float, kills: int = 10) -> dict:
    """2 replicas of `work` (retry: true, max_restarts: kills); `kills` times in the run one of
    them is SIGKILLed (in turn), each once the one killed before is back. Every request must
    complete; per kill, the longest gap between completions until the next kill."""
    from .pipeline import Pipeline
    with Pipeline.from_config(_spec(2, retry=True, max_restarts=kills)) as p:
        _drive(p, 16, cpu_ms)
        killed = []
        every = max(1, n // (kills + 1))

        def kill(i):
            if i % every or not i or len(killed) >= kills:
                return
            victim = f"work.{len(killed) % 2}"
            t = time.monotonic()

            def back():  # the replica killed before was noticed, started again, and is ready
                reps = p.replicas()
                return sum(v["restarts"] for v in reps.values()) == len(killed) and all(
                    v["alive"] for v in reps.values())
            while not back() and time.monotonic() - t < 30:
                time.sleep(0.005)
            os.kill(p.process_ids()[victim], signal.SIGKILL)
            killed.append(time.monotonic())
        _, done_at, out = _drive(p, n, cpu_ms, on_submit=kill)
        restarts = sum(v["restarts"] for v in p.replicas().values())
    lost = sum(1 for r in out if not isinstance(r, dict))
    gaps = []  # per kill: the longest wait for a completion until the next kill (or the run's end)
    for k, nxt in zip(killed, killed[1:] + [float("inf")]):
        after = [t for t in done_at if k < t < nxt]
        gaps.append(max(b - a for a, b in zip([k] + after, after)) if after else (done_at[-1] - k))
    before = [b - a for a, b in zip(done_at, done_at[1:]) if b < killed[0]] if killed else []
    return {"requests": n, "kills": len(killed), "restarts": restarts, "lost": lost,
            "failover_gap_ms": max(gaps) * 1000 if gaps else None,
            "failover_gap_ms_median": statistics.median(gaps) * 1000 if gaps else None,
            "median_gap_ms": statistics.median(before) * 1000 if before else None}


def run_replicas(rounds: int = 3, json_path=None, quick: bool = False, out=sys.stdout) -> dict:
    n, cpu_ms = (100, 10.0) if quick else (400, 10.0)
    cores = len(os.sched_getaffinity(0))
    print(f"stage replicas: front -> work ({cpu_ms:g} ms of CPU per request), {n} requests at 8 in flight, "
          f"{rounds} rounds, {cores} cores", file=out)
    runs = {1: [], 2: []}
    cpus = {1: [], 2: []}
    for r in range(rounds):
        for k in (1, 2):
            res = scaling(k, n, cpu_ms)
            runs[k].append(res["req_s"])
            cpu = res["cpu_ms_per_request"]
            work = sum(v for name, v in cpu.items() if name.startswith("work"))
            rest = sum(v for name, v in cpu.items() if not name.startswith("work"))
            cpus[k].append((work, rest))
            print(f"  round {r + 1}: {k} replica(s) of work: {res['req_s']:.0f} req/s ({res['replicas_used']} used); "
                  f"CPU per request: work {work:.1f} ms, front + coordinator {rest:.1f} ms", file=out)
    ratios = [b / a for a, b in zip(runs[1], runs[2])]
    work, rest = (statistics.median(x[i] for x in cpus[2]) for i in (0, 1))
    ceiling = min(2.0, cores * 1000 / (work + rest) / statistics.median(runs[1]))
    print(f"  2 replicas / 1: median {statistics.median(ratios):.2f}x (runs {', '.join(f'{x:.2f}' for x in ratios)}); "
          f"the cores' ceiling: {ceiling:.2f}x ({cores} cores over {work + rest:.1f} ms of CPU per request)", file=out)
    fo = [failover(n * 2, cpu_ms, kills=4 if quick else 10) for _ in range(rounds)]
    for f in fo:
        print(f"  failover: {f['kills']} SIGKILLs of a replica in one run (each restarted, {f['restarts']} in all): "
              f"{f['lost']} of {f['requests']} requests lost; gap in completions after a kill: median "
              f"{f['failover_gap_ms_median']:.0f} ms, longest {f['failover_gap_ms']:.0f} ms (median gap before "
              f"{f['median_gap_ms']:.1f} ms)", file=out)
    from ._version import __version__
    result = {"kind": "replicas", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "stagelink": __version__, "cores": cores, "cpu_ms": cpu_ms, "requests": n,
              "req_s": {str(k): v for k, v in runs.items()}, "ratio_2_over_1": ratios,
              "cpu_ms_per_request": {str(k): v for k, v in cpus.items()}, "ceiling_2_over_1": ceiling, "failover": fo}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    run_replicas(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
