"""stagelink bench pipeline: SGLang-Omni's model-free 3-stage toy pipeline (prep -> enc -> dec;
enc streams 8 chunks to dec, then sends the payload on to dec; dec streams one message per chunk
to the client) on stagelink (`stagelink.examples.toy`: torch tensors, every stage checking its
input), with default settings and with the speed options, beside SGLang-Omni's own runtime when
it can run here (`bench_sglang_omni`), alternating, rounds in one run; medians and same-run ratios."""
from __future__ import annotations

import statistics
import sys
import time
import uuid

CASES = {"1MiB+8x8KiB": (1 << 20, 8 << 10), "4KiB+8x1KiB": (4 << 10, 1 << 10)}


def toy_spec(speed: bool = False, ns: str = "") -> dict:
    """The toy on stagelink: defaults only, or with the speed options (prep and enc `inline` and
    `zero_copy`, dec a callback stage)."""
    ns = ns or "benchp" + uuid.uuid4().hex[:8]
    fast = {"inline": True, "zero_copy": True} if speed else {}
    return {"name": "toy", "relay": {"extra": {"namespace": ns}},
            "stages": [dict({"name": "prep", "factory": "stagelink.examples.toy:prep", "next": "enc"}, **fast),
                       dict({"name": "enc", "factory": "stagelink.examples.toy:enc", "next": "dec",
                             "stream_to": "dec"}, **fast),
                       {"name": "dec", "factory": "stagelink.examples.toy:" + ("Dec" if speed else "dec"),
                        "terminal": True}]}


def _measure(submit, reqs, verify, sequential: int, concurrent: int, in_flight: int) -> dict:
    """e2e p50/p99 one request at a time, then requests/s with `in_flight` in flight; `submit(i,
    req)` returns (future, chunks list); every result is verified."""
    for i in range(10):  # warm-up
        f, ch = submit(f"w{i}", reqs[i % len(reqs)])
        verify(reqs[i % len(reqs)], f.result(60), ch)
    lat = []
    for i in range(sequential):
        req = reqs[i % len(reqs)]
        t = time.perf_counter()
        f, ch = submit(f"s{i}", req)
        res = f.result(60)
        lat.append((time.perf_counter() - t) * 1e3)
        verify(req, res, ch)
    pending, t = [], time.perf_counter()
    for i in range(concurrent):
        if len(pending) >= in_flight:
            j, f, ch = pending.pop(0)
            verify(reqs[j % len(reqs)], f.result(60), ch)
        f, ch = submit(f"c{i}", reqs[i % len(reqs)])
        pending.append((i, f, ch))
    for j, f, ch in pending:
        verify(reqs[j % len(reqs)], f.result(60), ch)
    rps = concurrent / (time.perf_counter() - t)
    lat.sort()
    return {"e2e_ms_p50": statistics.median(lat), "e2e_ms_p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "requests_per_s": rps}


def stagelink_toy(case: str, speed: bool = False, sequential: int = 200, concurrent: int = 800,
                  in_flight: int = 8) -> dict:
    """One round of the toy on stagelink: start-up (processes importing torch included), e2e one
    at a time, requests/s with `in_flight` in flight."""
    from .examples import toy
    from .pipeline import Pipeline
    pb, cb = CASES[case]
    reqs = [toy.make_request(i, pb, 8, cb) for i in range(16)]
    t0 = time.monotonic()
    with Pipeline.from_config(toy_spec(speed)) as p:
        startup = p.startup_s

        def submit(rid, req):
            chunks: list = []
            return p.submit(rid, req, on_chunk=chunks.append), chunks
        f = _measure(submit, reqs, toy.verify, sequential, concurrent, in_flight)
    f.update(startup_s=startup, total_s=time.monotonic() - t0)
    return f


def main(argv=None) -> int:  # a quick look: python -m stagelink.bench_pipeline [rounds]
    rounds = int((argv or sys.argv[1:] or ["1"])[0])
    for r in range(rounds):
        for case in CASES:
            for speed in (False, True):
                f = stagelink_toy(case, speed)
                print(f"round {r} {case:>12} {'speed' if speed else 'defaults':>8}: e2e p50 {f['e2e_ms_p50']:.2f} ms "
                      f"p99 {f['e2e_ms_p99']:.2f} ms, {f['requests_per_s']:.0f} req/s, start-up {f['startup_s']:.2f} s",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
