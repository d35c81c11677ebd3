"""The reference's model-free 3-stage pipeline (issue 10): A passes the payload on, B streams 8
chunks to C, C answers. Used by `stagelink bench relay`."""
import numpy as np


def forward(payload, ctx):
    return payload


def stream8(payload, ctx):
    size = int(payload["chunk_bytes"])
    for i in range(8):
        ctx.stream(np.full(size, i, np.uint8))
    return None


def collect(payload, ctx):
    n = 0
    for i, c in enumerate(ctx.chunks()):
        if c[0] != i or c[-1] != i:
            raise ValueError(f"chunk {i} damaged or out of order")
        n += 1
    return n


class Collect:
    """collect() as a callback stage: each chunk handled as it arrives, no thread of its own."""

    def on_chunk(self, c, ctx):
        i = ctx.state.get("n", 0)
        if c[0] != i or c[-1] != i:
            raise ValueError(f"chunk {i} damaged or out of order")
        ctx.state["n"] = i + 1

    def finish(self, payload, ctx):
        return ctx.state.get("n", 0)
