"""A Ray driver for test_ray.py, run on the head node (inside its network namespace):

    python ray_driver.py SCENARIO ADDRESS ADDR_B OUT.json [retry]

Each scenario starts a pipeline placed by Ray (`placement: {engine: ray}`) on the two-node cluster
bench_ray.TwoNodeRay made, runs requests, and writes what the test checks to OUT.json. The
stages are pipeline_stages' (this directory: the stage processes import it through the
coordinator's import path, as any stage module)."""
import json
import os
import signal
import sys
import threading
import time

from stagelink.pipeline import Pipeline, StageDiedError

S = "pipeline_stages"


def pipeline(address, stages, **top):
    d = {"stages": stages, "relay": {"backend": "auto", "timeout_s": 10},
         "placement": {"engine": "ray", "address": address, "timeout_s": 60},
         "settings": {"request_timeout_s": 60, "startup_timeout_s": 60}}
    d.update(top)
    return Pipeline.from_config(d)


def run_requests(p, n, payload, on_submit=None, window=8):
    futs, done_at = [], []
    sem = threading.Semaphore(window)
    for i in range(n):
        sem.acquire()
        f = p.submit(f"q{i}", payload(i))
        f.add_done_callback(lambda _f: (done_at.append(time.monotonic()), sem.release()))
        futs.append(f)
        if on_submit:
            on_submit(i)
    out = []
    for f in futs:
        try:
            out.append(f.result(90))
        except StageDiedError as e:
            out.append({"error": str(e)})
        except Exception as e:  # noqa: BLE001  reported to the test
            out.append({"error": f"{type(e).__name__}: {e}"})
    return out, sorted(done_at)


def two_talkers(address, addr_b, out):
    """A thinker on node a, two talker replicas, one on each node; 64 streamed requests."""
    with pipeline(address, [
            {"name": "thinker", "factory": f"{S}:pid_streamer", "stream_to": "talker", "next": "talker",
             "labels": {"side": "a"}},
            # 5 of each node's 8 CPUs: the two replicas cannot share a node
            {"name": "talker", "factory": f"{S}:pid_collector", "terminal": True, "replicas": 2,
             "resources": {"CPU": 5}},
    ], placement={"engine": "ray", "address": address, "strategy": "SPREAD"}) as p:
        res, _ = run_requests(p, 64, lambda i: {"x": i, "chunks": 6, "sleep": 0.002})
        out.update(results=res, pids=p.process_ids(), placement=p.placement(), startup_s=p.startup_s,
                   stats={k: v.get("edges", {}) for k, v in p.stats().items()})


def kill_replica(address, addr_b, out, retry):
    """Two replicas of b (on node b, the transfer engine between); one SIGKILLed mid-run. With
    retry, b also has max_restarts: 1, and the killed replica's actor is made again and rejoins."""
    with pipeline(address, [
            {"name": "a", "factory": f"{S}:double", "next": "b", "labels": {"side": "a"}},
            {"name": "b", "factory": f"{S}:slow_pid", "terminal": True, "replicas": 2, "retry": retry,
             "concurrency": 4, "node": addr_b, "max_restarts": 1 if retry else 0},
    ]) as p:
        victim = p.process_ids()["b.1"]
        killed = []

        def at(i):
            if i == 20:
                os.kill(victim, signal.SIGKILL)
                killed.append(time.monotonic())
        res, done_at = run_requests(p, 40, lambda i: {"x": i, "sleep": 0.05}, at)
        after = p.submit("after", {"x": 1, "sleep": 0}).result(30)
        if retry:  # back: wait for it, then it takes requests again
            deadline = time.monotonic() + 60
            while not p.replicas()["b.1"]["alive"] and time.monotonic() < deadline:
                time.sleep(0.1)
            more, _ = run_requests(p, 16, lambda i: {"x": 100 + i, "sleep": 0.02})
            out.update(rejoined=p.process_ids().get("b.1"), after_restart=more)
        out.update(results=res, after=after, victim=victim, replicas=p.replicas(),
                   gap_s=max((b - a for a, b in zip([killed[0]] + [t for t in done_at if t > killed[0]],
                                                    [t for t in done_at if t > killed[0]])), default=None))


def scale(address, addr_b, out):
    """b grows 1 -> 3 -> 1 while requests run."""
    with pipeline(address, [
            {"name": "a", "factory": f"{S}:double", "next": "b"},
            {"name": "b", "factory": f"{S}:slow_pid", "terminal": True, "replicas": 1, "max_replicas": 3},
    ], placement={"engine": "ray", "address": address, "strategy": "SPREAD"}) as p:
        sizes = []

        def at(i):
            if i == 10:
                sizes.append(p.scale("b", 3, timeout=60))
            if i == 40:
                sizes.append(p.scale("b", 1, timeout=60))
        res, _ = run_requests(p, 60, lambda i: {"x": i, "sleep": 0.03}, at)
        out.update(results=res, sizes=sizes, placement=p.placement(), replicas=p.replicas())


def node_dies(address, addr_b, out, retry):
    """Replicas of b on both nodes; node b is killed mid-run by the test (a file says when)."""
    with pipeline(address, [
            {"name": "a", "factory": f"{S}:double", "next": "b", "labels": {"side": "a"}},
            # 5 of each node's 8 CPUs: the two replicas cannot share a node
            {"name": "b", "factory": f"{S}:slow_pid", "terminal": True, "replicas": 2, "retry": retry,
             "concurrency": 4, "resources": {"CPU": 5}},
    ]) as p:
        where = p.placement()
        marks = {}

        def at(i):
            if i == 20:
                marks["ready"] = time.monotonic()
                with open(out["_signal"], "w") as f:  # the test kills node b now
                    f.write("kill")
                while not os.path.exists(out["_signal"] + ".done"):
                    time.sleep(0.01)
                marks["killed"] = time.monotonic()
        res, done_at = run_requests(p, 40, lambda i: {"x": i, "sleep": 0.05}, at)
        after = p.submit("after", {"x": 1, "sleep": 0}).result(30)
        out.update(results=res, after=after, placement=where, replicas=p.replicas(), pids=p.process_ids(),
                   last_done_s=(done_at[-1] - marks["killed"]) if done_at else None)


def main():
    scenario, address, addr_b, path = sys.argv[1:5]
    retry = len(sys.argv) > 5 and sys.argv[5] == "retry"
    out = {"_signal": path + ".signal"}
    t0 = time.monotonic()
    try:
        f = globals()[scenario]
        if scenario in ("kill_replica", "node_dies"):
            f(address, addr_b, out, retry)
        else:
            f(address, addr_b, out)
    except BaseException as e:  # noqa: BLE001  the test shows it
        import traceback
        out["exception"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    out["wall_s"] = time.monotonic() - t0
    with open(path, "w") as f:
        json.dump(out, f, default=str)


if __name__ == "__main__":
    main()
