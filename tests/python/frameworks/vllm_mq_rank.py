"""One rank of a gloo process group running vLLM's own MessageQueue.create_from_process_group,
with the real vLLM on its path and STAGELINK_VLLM_MQ=1: vLLM loads its general plugins, stagelink's
entry point swaps the class, and rank 0 broadcasts to the others through it. Imports nothing of
stagelink. argv: RANK WORLD PORT; prints the class used and what this rank received."""
import sys
from datetime import timedelta


def say(line, **_):
    """A line for the test (frameworks log to stdout too: the test reads only these)."""
    sys.stdout.write(f"@@ {line}\n")
    sys.stdout.flush()


def main():
    rank, world, port = (int(a) for a in sys.argv[1:4])
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, 1 << 20, 6)
    got = []
    if rank == 0:
        for i in range(50):
            mq.enqueue({"step": i, "tokens": list(range(i))})
        mq.enqueue(b"x" * (3 << 20))  # past max_chunk_bytes: vLLM's overflow path
    else:
        for _ in range(51):
            got.append(mq.dequeue(timeout=60))
    dist.barrier()
    say(f"{type(mq).__module__}.{type(mq).__name__}")
    ok = rank == 0 or (all(m == {"step": i, "tokens": list(range(i))} for i, m in enumerate(got[:50]))
                       and got[50] == b"x" * (3 << 20))
    say("received-all" if ok else f"wrong: {got[:3]}")
    mq.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
