"""Stages that cost CPU on purpose, for measuring stage replicas (`stagelink bench replicas`):
`front` passes a request on, `work` spins `cpu_ms` of CPU in its own process (a stand-in for a
CPU-bound model stage) and answers with the request id and the pid that ran it."""
from __future__ import annotations

import os
import time


def front(payload, ctx):
    return payload


def work(payload, ctx):
    end = time.thread_time() + float(payload.get("cpu_ms", 10)) / 1000
    n = 0
    while time.thread_time() < end:
        n += 1
        if n % 4096 == 0 and ctx.aborted:
            return None
    return {"i": payload["i"], "pid": os.getpid()}


def make_request(i: int, cpu_ms: float = 10, **_):
    return {"i": i, "cpu_ms": cpu_ms}


def verify(request, result, chunks):
    if result["i"] != request["i"]:
        raise ValueError(f"request {request['i']} answered as {result['i']}")
