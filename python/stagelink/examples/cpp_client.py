"""The client of examples/cpp_pipeline.yaml: requests for its C++ stages (scale -> chunker -> sum,
from examples/cpp_stage/example_stages.cpp) and the check of what comes back."""
from __future__ import annotations

import numpy as np


def make_request(i: int, n: int = 4096, factor: float = 2.0, **_):
    return {"x": np.full(n, float(i % 100), np.float32), "factor": factor}


def verify(request, result, chunks):
    """scale multiplies x by factor, chunker streams it 4 times, sum adds up each chunk and all."""
    one = float(request["x"].astype(np.float64).sum()) * float(request["factor"])
    if [c["i"] for c in chunks] != [0, 1, 2, 3] or any(c["sum"] != one for c in chunks):
        raise ValueError(f"streamed {chunks!r}, expected 4 chunks of sum {one}")
    if result != {"n": 4, "sum": 4 * one}:
        raise ValueError(f"result {result!r}, expected n 4 and sum {4 * one}")
