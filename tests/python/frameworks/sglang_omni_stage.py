"""One SGLang-Omni stage process using SGLang-Omni 0.1.9's own CommRouter and stage I/O
(unchanged; its package shells as test_sglang_client.py makes them, so that SGLang itself is not
needed), with STAGELINK_SGLANG_OMNI=1 in its environment. Imports nothing of stagelink: the
relay CommRouter builds for the shm transport comes from stagelink's start-up hook.

    sglang_omni_stage.py write CLIENTS     prints the relay class and the DataRef (hex pickle), waits
                                           for a line, then for the put to complete
    sglang_omni_stage.py read CLIENTS      reads the DataRef from stdin, prints the payload (hex pickle)
    sglang_omni_stage.py which CLIENTS     prints the relay class only
"""
import asyncio
import importlib
import os
import pickle
import sys
import types


def load(root):
    sys.path.insert(0, os.path.dirname(root))
    for name, path in (("sglang_omni", root), ("sglang_omni.comm", os.path.join(root, "comm"))):
        shell = types.ModuleType(name)
        shell.__path__ = [path]
        sys.modules[name] = shell
    return importlib.import_module("sglang_omni.comm.stage_io")


def say(line, **_):
    """A line for the test (frameworks log to stdout too: the test reads only these)."""
    sys.stdout.write(f"@@ {line}\n")
    sys.stdout.flush()


def main():
    role, root = sys.argv[1], os.path.join(sys.argv[2], "sglang_omni")
    sio = load(root)
    import torch
    from sglang_omni.comm.data_ref import DataRef, TransportKind
    from sglang_omni.comm.router import CommRouter
    from sglang_omni.proto import OmniRequest, StagePayload

    router = CommRouter(stage_name="thinker" if role == "write" else "talker", gpu_id=None,
                        same_process_targets=set(), gpu_stage_names=set(),
                        comm_config={"slot_size_mb": 4, "credits": 2})
    relay = router.relay(TransportKind.SHM)
    say(f"{type(relay).__module__}.{type(relay).__name__}")
    try:
        if role == "which":
            return
        if role == "write":
            payload = StagePayload(request_id="req-1", request=OmniRequest(inputs={"prompt": "hi"}),
                                   data={"hidden": torch.arange(64 * 1024, dtype=torch.float32).reshape(64, 1024),
                                         "text": "caption"})

            async def write():
                ref, op = await sio.write_payload(relay, "req-1", payload, transport=TransportKind.SHM,
                                                  from_stage="thinker")
                say(pickle.dumps(ref.to_dict()).hex())
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
                await op.wait_for_completion(timeout=30)
            asyncio.run(write())
        else:
            ref = DataRef.from_dict(pickle.loads(bytes.fromhex(sys.stdin.readline().strip())))
            got = asyncio.run(sio.read_payload(relay, "req-1", ref))
            say(pickle.dumps({"hidden": got.data["hidden"].numpy(), "text": got.data["text"],
                                "inputs": got.request.inputs}).hex())
    finally:
        router.close()


if __name__ == "__main__":
    assert "stagelink" not in sys.modules
    main()
