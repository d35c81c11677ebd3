"""`stagelink bench mq`'s peer: vLLM's own ``shm_broadcast.MessageQueue`` (its code, unmodified)
against stagelink's ``MessageQueue``, from Python, in the same harness and run.

vLLM imports torch and much more, so the comparison runs in processes with vLLM on their path
(``STAGELINK_FRAMEWORKS_SITE``, else ``build/frameworks/site``, where ``./scripts/setup`` installs
vLLM 0.30.0). Both queues carry the same 64 B-class Python object (the writer's monotonic clock,
an int), paced: each message after every reader acknowledged the previous one through a counter in
shared memory outside both queues. Latency is the reader's clock at ``dequeue``'s return minus the
writer's before ``enqueue``. Then the wake-up: one message after each of ``idle_n`` gaps of
``idle_s`` seconds, the median and the worst. And each reader process's CPU time over an idle gap:
vLLM's reader keeps polling (``sched_yield``) for a second after each message, then waits on a
ZeroMQ socket; stagelink's spins ``spin_us`` (50 us), then sleeps on a futex.
"""
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time


def _queue(impl, n_readers):
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        return MessageQueue(n_readers, n_readers, max_chunk_bytes=4096, max_chunks=64)
    from stagelink.mq import MessageQueue
    return MessageQueue(n_readers, n_readers, max_chunk_bytes=4096, max_chunks=64, warn_interval_s=0)


def _reader(impl, handle, rank, n, n_idle, ack, out):
    import resource
    if impl == "vllm":
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        r = MessageQueue.create_from_handle(handle, rank)
        r.wait_until_ready()
    else:
        from stagelink.mq import MessageQueue
        r = MessageQueue.create_from_handle(handle, rank)
    lat, wake, cpu = [], [], []
    for i in range(n + n_idle):
        ts = r.dequeue(timeout=60)
        t = time.monotonic_ns()
        if ts < 0:  # the writer's marker: an idle gap begins now; CPU time until the next message
            c0 = resource.getrusage(resource.RUSAGE_SELF)
            ts = r.dequeue(timeout=60)
            t = time.monotonic_ns()
            c1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu.append((c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime))
            wake.append((t - ts) / 1e3)
        else:
            lat.append((t - ts) / 1e3)
        with ack.get_lock():
            ack.value += 1
    out.put({"lat": lat, "wake": wake, "cpu": cpu})


_CTX = None


def _context():
    """Reader processes forked from one server that imported vLLM's queue once: spawning each
    reader imported vLLM again (~5 s each, 34 s for a quick run; the readers then measure the
    same)."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["vllm.distributed.device_communicators.shm_broadcast", "stagelink.mq",
                                     __name__])
    return _CTX


def _run(impl, n_readers, n, n_idle, idle_s):
    ctx = _context()
    w = _queue(impl, n_readers)
    ack = ctx.Value("q", 0)
    out = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(impl, w.export_handle(), i, n, n_idle, ack, out)) for i in range(n_readers)]
    try:
        for p in procs:
            p.start()
        w.wait_until_ready()
        sent = 0

        def send(obj):
            nonlocal sent
            w.enqueue(obj)
            sent += 1
            deadline = time.monotonic() + 60
            while ack.value < sent * n_readers:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{impl}: a reader stalled")

        for _ in range(n):
            send(time.monotonic_ns())
        for _ in range(n_idle):
            w.enqueue(-1)  # not acknowledged: the readers start their CPU clocks
            time.sleep(idle_s)
            send(time.monotonic_ns())
        res = [out.get(timeout=60) for _ in procs]
    finally:  # a reader that failed or stalled is not left behind
        for p in procs:
            if p.pid is not None:
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
        if impl == "stagelink":
            w.close()
    lat = sorted(x for r in res for x in r["lat"][min(200, n // 5):])
    wake = sorted(x for r in res for x in r["wake"])
    cpu = [c for r in res for c in r["cpu"]]
    return {"median_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)],
            "wake_median_us": statistics.median(wake) if wake else None, "wake_worst_us": max(wake) if wake else None,
            "idle_cpu_pct": 100 * statistics.median(cpu) / idle_s if cpu else None}


def measure(n, n_idle, idle_s, rounds):
    """In the peer's process: {"1to1"|"1to4": {"vllm"|"stagelink": [per round]}}, interleaved."""
    import logging
    logging.disable(logging.WARNING)
    out = {}
    for readers in (1, 4):
        d = out.setdefault(f"1to{readers}", {"vllm": [], "stagelink": []})
        for _ in range(rounds):
            for impl in ("vllm", "stagelink"):
                d[impl].append(_run(impl, readers, n, n_idle if readers == 1 else 0, idle_s))
    return out


def run(quick=False, log=sys.stderr):
    """(result, None) from processes with vLLM on their path, or (None, why not)."""
    from .bench_omni import site
    path, why = site()
    if path is None:
        return None, why
    if not os.path.isdir(os.path.join(path, "vllm")):
        return None, f"vLLM not found in {path} (./scripts/setup installs it there; STAGELINK_FRAMEWORKS_SITE names another)"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    args = ("1000", "5", "0.2", "1") if quick else ("5000", "30", "1.0", "3")
    print(f"  ... vLLM's shm_broadcast.MessageQueue from {path} (imported twice: by the writer's process and by "
          "the server its readers fork from; ~20 s)", file=log, flush=True)
    r = subprocess.run([sys.executable, "-m", "stagelink.bench_vllm_mq", *args], env=env, capture_output=True,
                       text=True, timeout=3600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return None, f"its process failed (exit {r.returncode}): " + " | ".join(r.stderr.strip().splitlines()[-3:])
    return json.loads(lines[-1]), None


def print_result(res, out=sys.stdout):
    print("\nvs vLLM 0.30.0's shm_broadcast.MessageQueue (its own code), Python API, 64 B-class object, paced; "
          "medians of the rounds (us), ratios: range of the per-round ratios", file=out)
    rows = (("one-way median", "median_us"), ("one-way p99", "p99_us"), ("wake-up after idle, median", "wake_median_us"),
            ("wake-up after idle, worst", "wake_worst_us"), ("reader CPU while idle (%)", "idle_cpu_pct"))
    print(f"{'':34} | {'vLLM':>10} | {'stagelink':>10} | {'stagelink / vLLM':>16}", file=out)
    for case, d in res.items():
        for label, k in rows:
            v = [r[k] for r in d["vllm"]]
            s = [r[k] for r in d["stagelink"]]
            if None in v or None in s:
                continue
            rr = [b / a for a, b in zip(v, s) if a]
            span = f"{min(rr):.2f}-{max(rr):.2f}x" if rr else "-"
            print(f"{case + ' ' + label:34} | {statistics.median(v):10.2f} | {statistics.median(s):10.2f} | {span:>16}",
                  file=out)


if __name__ == "__main__":  # python -m stagelink.bench_vllm_mq N N_IDLE IDLE_S ROUNDS
    a = sys.argv[1:]
    print(json.dumps(measure(int(a[0]), int(a[1]), float(a[2]), int(a[3]))), flush=True)
