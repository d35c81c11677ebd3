"""SGLang-Omni's model-free 3-stage toy pipeline, written on stagelink's public API: `prep` turns
the request into its payload (a tensor of `payload_bytes`, as a preprocessor turns a prompt into
features; a client's request to SGLang-Omni's entry stage is a control message, and cannot carry
tensors), `enc` streams `chunks` chunks to `dec` and then sends the payload on to `dec`, `dec`
answers the client with one streamed message per chunk and a summary. Torch
tensors throughout (as the toy has them); every stage checks what it receives (sampled: a few
elements, so that a check costs microseconds whatever the size). `examples/toy_pipeline.yaml`
runs it with default settings; `stagelink bench pipeline` runs it beside SGLang-Omni's own.

The shape is the one that deadlocked with default credits (issue 51): `dec` needs both the
payload and the stream, and the chunks are sent first."""
from __future__ import annotations

import torch

_PROBES = 5


def make_request(i: int, payload_bytes: int = 1 << 20, chunks: int = 8, chunk_bytes: int = 8192, **_):
    return {"seed": i, "payload_bytes": payload_bytes, "chunks": chunks, "chunk_bytes": chunk_bytes}


def _check_data(req, stage):
    d, seed = req["data"], int(req["seed"])
    if not isinstance(d, torch.Tensor) or d.dtype != torch.uint8:
        raise TypeError(f"{stage}: the payload is {type(d).__name__} {getattr(d, 'dtype', '')}, not a uint8 tensor")
    n = d.numel()
    for k in range(_PROBES):
        j = (k * (n - 1)) // (_PROBES - 1) if n > 1 else 0
        if n and int(d[j]) != seed % 251:
            raise ValueError(f"{stage}: payload byte {j} is {int(d[j])}, expected {seed % 251}")


def _chunk_value(seed: int, i: int) -> float:
    """What chunk i of request seed holds: exact in float32 (under 2**24) for any seed."""
    return float((seed % 4096) * 1000 + i)


def _chunk(seed: int, i: int, nbytes: int):
    return torch.full((max(1, nbytes // 4),), _chunk_value(seed, i), dtype=torch.float32)


def _check_chunk(c, seed: int, i: int, stage: str):
    if not isinstance(c, torch.Tensor) or c.dtype != torch.float32:
        raise TypeError(f"{stage}: chunk {i} is {type(c).__name__}, not a float32 tensor")
    want = _chunk_value(seed, i)
    if float(c[0]) != want or float(c[-1]) != want:
        raise ValueError(f"{stage}: chunk {i} holds {float(c[0])}..{float(c[-1])}, expected {want}")


def prep(req, ctx):
    for k in ("seed", "payload_bytes", "chunks", "chunk_bytes"):
        if not isinstance(req.get(k), int) or req[k] < 0:
            raise ValueError(f"prep: request field {k!r} is {req.get(k)!r}, not a count")
    data = torch.full((req["payload_bytes"],), req["seed"] % 251, dtype=torch.uint8)
    if "damage" in req:  # a test's request: a byte the later stages' checks must catch
        data[int(req["damage"])] ^= 0xFF
    return dict(req, data=data)


def enc(req, ctx):
    _check_data(req, "enc")
    seed, nbytes = int(req["seed"]), int(req["chunk_bytes"])
    for i in range(int(req["chunks"])):
        ctx.stream(_chunk(seed, i, nbytes))
    return req  # the payload goes on to dec after its chunks


def dec(req, ctx):
    """A plain stage fed by a payload and a stream: runs once the payload is there; the chunks
    that came first wait for it (copied out of the relay, so they hold no credit)."""
    _check_data(req, "dec")
    seed, n = int(req["seed"]), 0
    for i, c in enumerate(ctx.chunks()):
        _check_chunk(c, seed, i, "dec")
        ctx.stream({"chunk": i, "seed": seed})
        n += 1
    if n != int(req["chunks"]):
        raise ValueError(f"dec: {n} chunks arrived, expected {req['chunks']}")
    return {"seed": seed, "chunks": n, "payload_bytes": int(req["data"].numel())}


class Dec:
    """dec() as a callback stage: each chunk handled as it arrives (before the payload, too), the
    payload by on_payload, the summary by finish once both are in; no thread of its own."""

    def on_chunk(self, c, ctx):
        i = ctx.state.get("n", 0)
        seed = ctx.state.get("seed")
        if seed is None:  # the payload (which carries the seed) has not come yet: check later
            ctx.state.setdefault("pending", []).append(c)
        else:
            _check_chunk(c, seed, i, "dec")
        ctx.stream({"chunk": i, "seed": seed})
        ctx.state["n"] = i + 1

    def on_payload(self, req, ctx):
        _check_data(req, "dec")
        seed = ctx.state["seed"] = int(req["seed"])
        for i, c in enumerate(ctx.state.pop("pending", [])):
            _check_chunk(c, seed, i, "dec")

    def finish(self, req, ctx):
        n = ctx.state.get("n", 0)
        if n != int(req["chunks"]):
            raise ValueError(f"dec: {n} chunks arrived, expected {req['chunks']}")
        return {"seed": int(req["seed"]), "chunks": n, "payload_bytes": int(req["data"].numel())}


def verify(request, result, chunks):
    seed = int(request["seed"])
    if result != {"seed": seed, "chunks": request["chunks"], "payload_bytes": request["payload_bytes"]}:
        raise ValueError(f"result {result} is not request {seed}'s")
    if [c["chunk"] for c in chunks] != list(range(request["chunks"])):
        raise ValueError(f"request {seed}: streamed {len(chunks)} messages out of order or missing")
