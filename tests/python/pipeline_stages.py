"""Model-free stages for the pipeline tests (imported by the stage processes)."""
import os
import time

import numpy as np


def double(payload, ctx):
    return {"x": payload["x"] * 2, "trail": payload.get("trail", []) + [ctx.stage]}


def add_one(payload, ctx):
    return {"x": payload["x"] + 1, "trail": payload.get("trail", []) + [ctx.stage]}


def streamer(payload, ctx):
    n = int(payload.get("chunks", 8))
    size = int(payload.get("chunk_bytes", 64))
    for i in range(n):
        if ctx.aborted:
            return None
        ctx.stream({"i": i, "data": np.full(size, i % 251, np.uint8)})
        if payload.get("chunk_sleep"):
            time.sleep(payload["chunk_sleep"])
    return {"n": n, "x": payload.get("x")}


def collector(payload, ctx):
    seen = []
    for c in ctx.chunks():
        assert int(c["data"][0]) == c["i"] % 251 and (c["data"] == c["data"][0]).all()
        seen.append(c["i"])
    return {"ids": seen, "payload": payload}


def relay_chunks(payload, ctx):
    n = 0
    for c in ctx.chunks():
        ctx.stream(c)
        n += 1
    return {"forwarded": n}


def fail(payload, ctx):
    if payload.get("fail"):
        raise ValueError(f"bad input {payload['fail']}")
    return payload


def slow(payload, ctx):
    for _ in range(int(payload.get("ticks", 100))):
        if ctx.aborted:
            return None
        time.sleep(0.02)
    return payload


def suicide(payload, ctx):
    if payload.get("die"):
        os.kill(os.getpid(), 9)
    return payload


def merge_sum(inputs):
    return {"x": sum(v["x"] for v in inputs.values()), "from": sorted(inputs)}


def pid(payload, ctx):
    return {"pid": os.getpid(), "x": payload["x"]}


class Scale:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, payload, ctx):
        return {"x": payload["x"] * self.factor}


class CallbackCollector:
    """A callback stage: chunks handled as they arrive, no thread of its own."""

    def on_chunk(self, chunk, ctx):
        assert int(chunk["data"][0]) == chunk["i"] % 251
        ctx.state.setdefault("ids", []).append(chunk["i"])
        if ctx.state.get("fail_at") is None and chunk["i"] == 3 and chunk.get("boom"):
            raise RuntimeError("boom at chunk 3")

    def finish(self, payload, ctx):
        return {"ids": ctx.state.get("ids", []), "payload": payload}


def boom_streamer(payload, ctx):
    for i in range(6):
        ctx.stream({"i": i, "data": np.full(8, i, np.uint8), "boom": True})
    return None


def inspect_input(payload, ctx):
    return {"writeable": bool(payload["x"].flags.writeable), "sum": int(payload["x"].sum())}


def cpp_chunks(payload, ctx):
    ids, total = [], 0.0
    for c in ctx.chunks():
        ids.append(int(c["i"]))
        total += float(c["x"].sum())
    return {"ids": ids, "sum": total}


def where_streamer(payload, ctx):
    """Streams 4 chunks of 200 kB saying where it ran (pid, network namespace); the last carries x + 1."""
    n = 4
    where = {"pid": os.getpid(), "net": os.readlink("/proc/self/ns/net"), "env": os.environ.get("SL_HOST_ENV"),
             "shm_dev": os.stat("/dev/shm").st_dev}
    for i in range(n):
        c = dict(where, i=i, data=np.full(200_000, i % 251, np.uint8))
        if i == n - 1:
            c["x"] = payload["x"] + 1
        ctx.stream(c)
    return None


def where_collector(payload, ctx):
    out = {"ids": []}
    for c in ctx.chunks():
        assert (c["data"] == c["i"] % 251).all()
        out["ids"].append(c["i"])
        out.update((k, c[k]) for k in ("pid", "net", "env", "shm_dev", "x") if k in c)
    return out


def env_seen(payload, ctx):
    """Adds what this stage's process sees of the variables `payload["keys"]` names."""
    seen = dict(payload.get("seen") or {})
    seen[ctx.stage] = {k: os.environ.get(k) for k in payload["keys"]}
    return {"keys": payload["keys"], "seen": seen}


def torch_inplace(payload, ctx):
    """Model code that writes to its input in place (mode: mul_, setitem, out=, add_ on a view) or
    clones it first (clone), then returns it scaled."""
    import torch
    x = payload["x"]
    mode = payload["mode"]
    if mode == "clone":
        x = x.clone()
        x.mul_(2)
    elif mode == "mul_":
        x.mul_(2)
    elif mode == "setitem":
        x[0] = 5
    elif mode == "out":
        torch.add(x, 1, out=x)
    elif mode == "view":
        x.view(-1)[:3].add_(1)
    elif mode == "read":  # no write: views, reductions and arithmetic make plain tensors
        y = x.reshape(-1)[: x.numel()] * 2
        assert type(y) is torch.Tensor
        x = y
    return {"x": x, "mode": mode}


def thread_name(payload, ctx):
    """Which thread ran it (after sleeping payload["sleep_s"] and burning payload["burn_s"] of
    its thread's CPU time, if any)."""
    import threading
    import time
    time.sleep(payload.get("sleep_s", 0))
    until = time.thread_time() + payload.get("burn_s", 0)
    while time.thread_time() < until:
        pass
    return {"thread": threading.current_thread().name}


class PayloadAndChunks:
    """A callback stage fed by a payload and a stream: on_payload refuses a payload asking it to."""

    def on_chunk(self, c, ctx):
        ctx.state.setdefault("ids", []).append(c["i"])

    def on_payload(self, payload, ctx):
        if payload.get("x") == "refuse":
            raise ValueError("on_payload refused its payload")
        ctx.state["seen_payload_after"] = len(ctx.state.get("ids", []))

    def finish(self, payload, ctx):
        return {"ids": ctx.state.get("ids", []), "x": payload["x"], "n": payload["n"]}


def collect_where(payload, ctx):
    """Reads its stream; says which thread ran it and the thread-pool sizes its process was given."""
    import threading
    ids = [c["i"] for c in ctx.chunks()]
    return {"ids": ids, "thread": threading.current_thread().name,
            "omp": os.environ.get("OMP_NUM_THREADS"), "mkl": os.environ.get("MKL_NUM_THREADS")}


def passthrough(payload, ctx):
    return payload


def float_streamer(payload, ctx):
    """Streams payload["chunks"] chunks {"i": i, "x": float32 x chunk_len, all i}; gives up with an
    error at chunk payload["fail_after"] when given; sleeps chunk_sleep s after each chunk."""
    n, size = int(payload.get("chunks", 4)), int(payload.get("chunk_len", 1000))
    for i in range(n):
        if i == payload.get("fail_after"):
            raise ValueError(f"float_streamer gives up at chunk {i}")
        ctx.stream({"i": i, "x": np.full(size, i, np.float32)})
        if payload.get("chunk_sleep"):
            time.sleep(payload["chunk_sleep"])
    return None


def pid_streamer(payload, ctx):
    """Streams payload["chunks"] chunks, each saying which process made it (replica tests)."""
    if payload.get("sleep"):
        time.sleep(payload["sleep"])
    for i in range(int(payload.get("chunks", 4))):
        ctx.stream({"i": i, "pid": os.getpid()})
    return {"x": payload["x"], "thinker": os.getpid()}


def pid_collector(payload, ctx):
    """Collects the chunks in order; says which process collected them and which made them."""
    ids, makers = [], set()
    for c in ctx.chunks():
        ids.append(int(c["i"]))
        makers.add(int(c["pid"]))
    return {"x": payload["x"], "ids": ids, "makers": sorted(makers), "thinker": payload["thinker"],
            "talker": os.getpid()}


def slow_pid(payload, ctx):
    """Sleeps payload["sleep"] s (in ticks that see an abort), then returns x + 1 and its pid."""
    end = time.monotonic() + float(payload.get("sleep", 0.05))
    while time.monotonic() < end and not ctx.aborted:
        time.sleep(0.005)
    return {"x": payload["x"] + 1, "pid": os.getpid()}


def make_scaler(factor=2):
    """A factory written as a function (its stage needs `args: {}` to be called)."""
    return Scale(factor)
