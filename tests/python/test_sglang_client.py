"""SGLang-Omni 0.1.9's own stage I/O (sglang_omni.comm.stage_io, unpacked by ./scripts/setup into
build/clients) run on stagelink's relay: the real client, not a re-creation of it.

Its package imports SGLang itself on the way to this module; the loader below gives
``sglang_omni`` and ``sglang_omni.comm`` empty package shells so that only the modules stage_io
needs are imported (stage_io, data_ref, proto, relay.base), unchanged.
"""
import asyncio
import importlib
import os
import sys
import types

import pytest

import stagelink
from proc_util import queues, spawned

CLIENTS = os.path.join(os.path.dirname(__file__), "..", "..", "build", "clients")


def _stage_io():
    root = os.path.abspath(os.path.join(CLIENTS, "sglang_omni"))
    if not os.path.isdir(root):
        pytest.skip("sglang-omni 0.1.9 not fetched (./scripts/setup fetches it where PyPI is reachable)")
    pytest.importorskip("msgspec")
    pytest.importorskip("torch")
    return load_stage_io(root)


def load_stage_io(root):
    if os.path.dirname(root) not in sys.path:
        sys.path.insert(0, os.path.dirname(root))
    for name, path in (("sglang_omni", root), ("sglang_omni.comm", os.path.join(root, "comm"))):
        if name not in sys.modules:
            shell = types.ModuleType(name)
            shell.__path__ = [path]
            sys.modules[name] = shell
    return importlib.import_module("sglang_omni.comm.stage_io")


def _reading_stage(root, ns, q_in, q_out):
    """A receiving stage process: SGLang-Omni's read_payload (which ends with relay.cleanup(request_id))
    and read_stream_chunk, on a stagelink relay of its own."""
    sio = load_stage_io(root)
    from sglang_omni.comm.data_ref import DataRef
    relay = stagelink.ShmRelay("talker", 4, 2, extra={"namespace": ns})
    try:
        async def read():
            payload = await sio.read_payload(relay, "req-1", DataRef.from_dict(q_in.get(timeout=60)))
            chunk, meta = await sio.read_stream_chunk(relay, DataRef.from_dict(q_in.get(timeout=60)))
            return payload, chunk, meta

        payload, chunk, meta = asyncio.run(read())
        q_out.put({"video": payload.data["video"].float().tolist(), "grid": payload.data["grid"].tolist(),
                   "text": payload.data["text"], "inputs": payload.request.inputs,
                   "chunk": chunk.tolist(), "finished": bool(meta["finished"]), "step": meta["step"]})
    finally:
        relay.close()


def test_sglang_omnis_stage_io_across_processes_with_fan_out(ns):
    """The thinker writes one request's payload to two stages and a stream chunk with a metadata
    tensor; the talker, another process, reads both with SGLang-Omni's functions. Its
    read_payload's relay.cleanup("req-1") must leave the vocoder's payload alone, which the
    vocoder then reads. Before stagelink's relay carried transfer_info and kept cleanup to its
    own puts, write_payload failed (no transfer_info.size) and the vocoder's payload was lost."""
    sio = _stage_io()
    import torch
    from sglang_omni.comm.data_ref import DataRef, TransportKind
    from sglang_omni.proto import OmniRequest, StagePayload

    video = torch.randn(256, 256).bfloat16()  # 128 KiB: past the inline threshold, so in the arena
    grid = torch.tensor([[2, 4, 4]])
    payload = StagePayload(request_id="req-1", request=OmniRequest(inputs={"prompt": "hi"}),
                           data={"video": video, "grid": grid, "text": "caption"})
    q_in, q_out = queues()

    async def run(thinker, vocoder):
        kw = dict(transport=TransportKind.SHM, from_stage="thinker")
        to_talker, op_t = await sio.write_payload(thinker, "req-1", payload, to_stage="talker", **kw)
        to_vocoder, op_v = await sio.write_payload(thinker, "req-1", payload, to_stage="vocoder", **kw)
        chunk_ref, chunk_ops = await sio.write_stream_chunk(
            thinker, request_id="req-1", data=torch.arange(25, dtype=torch.int32), target_stage="talker",
            from_stage="thinker", chunk_id=0, metadata={"finished": torch.tensor(True), "step": 3},
            transport=TransportKind.SHM)
        assert len(chunk_ops) == 2  # the chunk and its metadata tensor: two puts on the edge
        q_in.put(to_talker.to_dict())  # the control plane's message, pickled
        q_in.put(chunk_ref.to_dict())
        got = await asyncio.get_running_loop().run_in_executor(None, q_out.get, True, 60)
        for op in [op_t, *chunk_ops]:
            await op.wait_for_completion(timeout=10)
        assert got["grid"] == [[2, 4, 4]] and got["text"] == "caption" and got["inputs"] == {"prompt": "hi"}
        assert got["video"] == video.float().tolist()
        assert got["chunk"] == list(range(25)) and got["finished"] is True and got["step"] == 3
        # The talker's cleanup("req-1") did not touch the vocoder's payload:
        read = await sio.read_payload(vocoder, "req-1", DataRef.from_dict(to_vocoder.to_dict()))
        assert torch.equal(read.data["video"], video) and torch.equal(read.data["grid"], grid)
        await op_v.wait_for_completion(timeout=10)

    # Three puts to the talker before it reads any (the payload, the chunk, its metadata tensor).
    with spawned(_reading_stage, os.path.abspath(os.path.join(CLIENTS, "sglang_omni")), ns, q_in, q_out), \
            stagelink.ShmRelay("thinker", 4, 3, extra={"namespace": ns}) as thinker, \
            stagelink.ShmRelay("vocoder", 4, 2, extra={"namespace": ns}) as vocoder:
        asyncio.run(run(thinker, vocoder))


def test_a_stream_chunk_needing_more_credits_than_the_edge_has_fails_in_time(ns):
    """SGLang-Omni 0.1.9 writes a stream chunk with k metadata tensors as k + 1 puts, each holding a
    credit until read, and the receiver reads none before the chunk's message arrives: with 2
    credits and 2 metadata tensors its own shm relay waits for ever (REFERENCE.md). stagelink's
    relay ends that wait after timeout_s with ExhaustedError naming the edge; with k + 1 credits
    the chunk goes."""
    sio = _stage_io()
    import torch
    from sglang_omni.comm.data_ref import TransportKind
    meta = {"a": torch.ones(3), "b": torch.zeros(2)}

    async def write(relay):
        return await sio.write_stream_chunk(relay, request_id="r", data=torch.arange(8), target_stage="vocoder",
                                            from_stage="talker", chunk_id=0, metadata=meta,
                                            transport=TransportKind.SHM)

    with stagelink.ShmRelay("talker", 1, 2, timeout_s=0.3, extra={"namespace": ns}) as two:
        with pytest.raises(stagelink.ExhaustedError, match="receiver:vocoder"):
            asyncio.run(write(two))
        assert two.health()["credits_in_use"] == {"receiver:vocoder": 2}  # the two puts it made: back at close
    with stagelink.ShmRelay("talker", 1, 3, timeout_s=0.3, extra={"namespace": ns}) as three:
        ref, ops = asyncio.run(write(three))
        assert len(ops) == 3 and len(ref.metadata_tensors) == 2
        assert three.health()["credits_in_use"] == {"receiver:vocoder": 3}
