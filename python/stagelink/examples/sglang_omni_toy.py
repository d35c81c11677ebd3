"""SGLang-Omni's model-free 3-stage toy pipeline on SGLang-Omni 0.1.9's own runtime, the peer of
`stagelink.examples.toy` in `stagelink bench pipeline` (which runs this module in a process whose
import path holds SGLang-Omni: it is not importable otherwise).

The same shape and the same checks as the stagelink twin: `prep` turns the request into a uint8
tensor of `payload_bytes`; `enc` streams `chunks` float32 tensors to `dec`, then sends the payload
on to `dec`; `dec` (`can_accept_stream_before_payload`, without which SGLang-Omni refuses a chunk
that comes before the payload) streams one message per chunk to the client and answers with a
summary. Each stage process is its own `process`, as the twin's are.

    python -m stagelink.examples.sglang_omni_toy PAYLOAD_BYTES CHUNK_BYTES SEQUENTIAL CONCURRENT IN_FLIGHT

prints one JSON line: start-up, e2e (one request at a time) and requests/s (IN_FLIGHT at once).
"""
from __future__ import annotations

import asyncio
import json
import queue
import statistics
import sys
import time

import torch
from sglang_omni.proto.request import OmniRequest
from sglang_omni.scheduling.message import OutgoingMessage
from sglang_omni.scheduling.simple_scheduler import SimpleScheduler

from .toy import _check_chunk, _check_data, _chunk, make_request, verify


def _prep(payload):
    req = payload.request.inputs
    for k in ("seed", "payload_bytes", "chunks", "chunk_bytes"):
        if not isinstance(req.get(k), int) or req[k] < 0:
            raise ValueError(f"prep: request field {k!r} is {req.get(k)!r}, not a count")
    payload.data = dict(req, data=torch.full((req["payload_bytes"],), req["seed"] % 251, dtype=torch.uint8))
    return payload


def create_prep():
    return SimpleScheduler(_prep)


class _Scheduler:
    """SGLang-Omni's scheduler contract (inbox/outbox queues, start/stop/abort), one thread."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue()
        self.running = False

    def warm_up_serving_thread(self):
        pass

    def stop(self):
        self.running = False

    def abort(self, request_id):
        pass

    def start(self):
        self.running = True
        while self.running:
            try:
                msg = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.handle(msg)
            except Exception as e:  # noqa: BLE001  fails that request only
                self.abort(msg.request_id)
                self.outbox.put(OutgoingMessage(request_id=msg.request_id, type="error", data=e))


class Enc(_Scheduler):
    def handle(self, msg):
        if msg.type != "new_request":
            return
        p = msg.data
        d = p.data
        _check_data(d, "enc")
        seed, nbytes = int(d["seed"]), int(d["chunk_bytes"])
        for i in range(int(d["chunks"])):
            c = _chunk(seed, i, nbytes)
            self.outbox.put(OutgoingMessage(request_id=msg.request_id, type="stream", data=c, target=None))
        self.outbox.put(OutgoingMessage(request_id=msg.request_id, type="result", data=p))


def create_enc():
    return Enc()


class Dec(_Scheduler):
    def __init__(self):
        super().__init__()
        self.reqs: dict = {}

    def abort(self, request_id):
        self.reqs.pop(request_id, None)

    def handle(self, msg):
        rid = msg.request_id
        if msg.type not in ("new_request", "stream_chunk", "stream_done"):
            return
        s = self.reqs.setdefault(rid, {"payload": None, "chunks": [], "done": False})
        if msg.type == "new_request":
            s["payload"] = msg.data
            s["chunks"] += [getattr(item, "data", item) for item in getattr(msg.data, "prefetched_chunks", ())]
            s["done"] = s["done"] or bool(getattr(msg.data, "prefetched_stream_done", False))
        elif msg.type == "stream_chunk":
            s["chunks"].append(getattr(msg.data, "data", msg.data))
        else:
            s["done"] = True
        if s["payload"] is not None and s["done"]:
            del self.reqs[rid]
            self.finish(rid, s)

    def finish(self, rid, s):
        p = s["payload"]
        d = p.data
        _check_data(d, "dec")
        seed = int(d["seed"])
        for i, c in enumerate(s["chunks"]):
            _check_chunk(c, seed, i, "dec")
            self.outbox.put(OutgoingMessage(request_id=rid, type="stream", data={"chunk": i, "seed": seed},
                                            target=None))
        if len(s["chunks"]) != int(d["chunks"]):
            raise ValueError(f"dec: {len(s['chunks'])} chunks arrived, expected {d['chunks']}")
        p.data = {"seed": seed, "chunks": len(s["chunks"]), "payload_bytes": int(d["data"].numel())}
        self.outbox.put(OutgoingMessage(request_id=rid, type="result", data=p))


def create_dec():
    return Dec()


def config():
    from sglang_omni.config.schema import PipelineConfig, StageConfig
    m = __name__
    return PipelineConfig(model_path="toy", entry_stage="prep", stages=[
        StageConfig(name="prep", factory_path=f"{m}.create_prep", next="enc", process="prep"),
        StageConfig(name="enc", factory_path=f"{m}.create_enc", next="dec", stream_to=["dec"], process="enc"),
        StageConfig(name="dec", factory_path=f"{m}.create_dec", terminal=True, process="dec",
                    can_accept_stream_before_payload=True),
    ])


async def _one(coord, rid, req):
    chunks, result = [], None
    async for m in coord.stream(rid, OmniRequest(inputs=req)):
        if type(m).__name__ == "StreamMessage":
            chunks.append(m.chunk)
        else:
            result = m.result
    verify(req, result, chunks)
    return result


async def _round(payload_bytes, chunk_bytes, sequential, concurrent, in_flight) -> dict:
    from sglang_omni.pipeline.mp_runner import MultiProcessPipelineRunner
    t0 = time.monotonic()
    runner = MultiProcessPipelineRunner(config())
    await runner.start(timeout=300)
    startup = time.monotonic() - t0
    try:
        coord = runner.coordinator
        reqs = [make_request(i, payload_bytes, 8, chunk_bytes) for i in range(16)]
        for i in range(10):  # warm-up
            await _one(coord, f"w{i}", reqs[i % 16])
        lat = []
        for i in range(sequential):
            t = time.perf_counter()
            await _one(coord, f"s{i}", reqs[i % 16])
            lat.append((time.perf_counter() - t) * 1e3)
        sem = asyncio.Semaphore(in_flight)

        async def limited(i):
            async with sem:
                await _one(coord, f"c{i}", reqs[i % 16])
        t = time.perf_counter()
        await asyncio.gather(*(limited(i) for i in range(concurrent)))
        rps = concurrent / (time.perf_counter() - t)
    finally:
        await runner.stop()
    lat.sort()
    return {"e2e_ms_p50": statistics.median(lat), "e2e_ms_p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            "requests_per_s": rps, "startup_s": startup, "total_s": time.monotonic() - t0}


def main(argv=None) -> int:
    a = [int(x) for x in (argv if argv is not None else sys.argv[1:])]
    print(json.dumps(asyncio.run(_round(*a))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
