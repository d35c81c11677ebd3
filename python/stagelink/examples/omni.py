"""Synthetic stages shaped like Qwen3-Omni (no model): what `examples/omni_pipeline.yaml` runs.

encoder -> thinker ~~> talker ~~> vocoder ~~> client       (-> data, ~~> stream)

- encoder: audio (16 kHz float32) -> features [frames, 1280] float16 (one frame per 40 ms).
- thinker: streams hidden-state chunks [tokens_per_chunk, 3584] float16 (~1.8 MB at 256 tokens).
- talker: per hidden chunk, streams codec codes [25 frames, 16 codebooks] int32.
- vocoder: per codec chunk, streams audio [25 * 1920 samples] float32 at 24 kHz (~192 KB), and
  returns a summary.

Every array is filled from a value derived from the request (its `seed`), each stage checks what
it received before using it, and `verify` recomputes the summary from the request alone:
a payload damaged, lost, reordered or mixed up with another request's anywhere fails the run.
"""
from __future__ import annotations

import time

import numpy as np

HIDDEN = 3584
FEATURES = 1280
CODEBOOKS = 16
FRAMES_PER_CHUNK = 25
SAMPLES_PER_FRAME = 1920


def _tag(seed: int, step: int, salt: int) -> int:
    """A small deterministic value per (request, step, stage): exact in float16 (<= 2048)."""
    return (seed * 131 + step * 17 + salt * 7) % 2039 + 1


def make_request(i: int, seconds: float = 2.0, chunks: int = 4, tokens_per_chunk: int = 256,
                 compute_ms: float = 0.0) -> dict:
    """Request i of a run: `seconds` of audio and how much the thinker generates."""
    seed = i % 10007
    return {"seed": seed, "audio": np.full(int(16000 * seconds), seed, np.float32), "chunks": int(chunks),
            "tokens_per_chunk": int(tokens_per_chunk), "compute_ms": float(compute_ms), "prompt": f"request {i}"}


def _work(ms: float):
    if ms > 0:
        time.sleep(ms / 1000.0)  # stands in for a model step (releases the GIL, as a GPU kernel would)


def encoder(payload, ctx):
    audio = payload["audio"]
    seed = int(payload["seed"])
    if audio.dtype != np.float32 or audio.size == 0 or audio[0] != seed or audio[-1] != seed:
        raise ValueError(f"encoder: audio of request {ctx.request_id} is damaged")
    _work(payload["compute_ms"])
    frames = max(1, audio.size // 640)
    feats = np.full((frames, FEATURES), _tag(seed, 0, 1), np.float16)
    return {"seed": seed, "features": feats, "chunks": payload["chunks"],
            "tokens_per_chunk": payload["tokens_per_chunk"], "compute_ms": payload["compute_ms"],
            "prompt": payload["prompt"]}


def thinker(payload, ctx):
    seed = int(payload["seed"])
    f = payload["features"]
    if f.shape[1] != FEATURES or f[0, 0] != _tag(seed, 0, 1) or f[-1, -1] != _tag(seed, 0, 1):
        raise ValueError(f"thinker: features of request {ctx.request_id} are damaged")
    for step in range(int(payload["chunks"])):
        if ctx.aborted:
            return None
        _work(payload["compute_ms"])
        hidden = np.full((int(payload["tokens_per_chunk"]), HIDDEN), _tag(seed, step, 2), np.float16)
        ctx.stream({"seed": seed, "step": step, "hidden": hidden,
                    "text": f"tok{step}" if step else payload["prompt"]})
    return None


def talker(payload, ctx):
    for step, c in enumerate(ctx.chunks()):
        seed = int(c["seed"])
        h = c["hidden"]
        if c["step"] != step or h.shape[1] != HIDDEN or h[0, 0] != _tag(seed, step, 2) or h[-1, -1] != h[0, 0]:
            raise ValueError(f"talker: hidden chunk {step} of request {ctx.request_id} is damaged or out of order")
        codes = np.full((FRAMES_PER_CHUNK, CODEBOOKS), _tag(seed, step, 3), np.int32)
        ctx.stream({"seed": seed, "step": step, "codes": codes})
    return None


def vocoder(payload, ctx):
    samples = 0
    digest = 0
    for step, c in enumerate(ctx.chunks()):
        seed = int(c["seed"])
        codes = c["codes"]
        if c["step"] != step or codes.shape != (FRAMES_PER_CHUNK, CODEBOOKS) or codes[0, 0] != _tag(seed, step, 3):
            raise ValueError(f"vocoder: codec chunk {step} of request {ctx.request_id} is damaged or out of order")
        audio = np.full(FRAMES_PER_CHUNK * SAMPLES_PER_FRAME, float(_tag(seed, step, 4)), np.float32)
        ctx.stream({"step": step, "audio": audio})
        samples += audio.size
        digest = (digest * 31 + int(codes[-1, -1])) % (1 << 61)
    return {"samples": samples, "digest": digest, "chunks": step + 1 if samples else 0}


def verify(request: dict, result: dict, chunks: list) -> None:
    """Raise AssertionError unless `result` and the streamed `chunks` are what `request` must give."""
    seed, n = int(request["seed"]), int(request["chunks"])
    digest = 0
    for step in range(n):
        digest = (digest * 31 + _tag(seed, step, 3)) % (1 << 61)
    want = {"samples": n * FRAMES_PER_CHUNK * SAMPLES_PER_FRAME, "digest": digest, "chunks": n}
    assert result == want, f"result {result} != expected {want}"
    assert len(chunks) == n, f"{len(chunks)} audio chunks streamed, expected {n}"
    for step, c in enumerate(chunks):
        a = c["audio"]
        assert c["step"] == step and a.size == FRAMES_PER_CHUNK * SAMPLES_PER_FRAME, f"audio chunk {step} misplaced"
        assert a[0] == _tag(seed, step, 4) and a[-1] == a[0], f"audio chunk {step} damaged"


# -- the fan-in example: encoder -> (vision, audio_enc) -> thinker(merge)

def split(payload, ctx):
    seed = int(payload["seed"])
    return {"seed": seed, "audio": payload["audio"], "chunks": payload["chunks"]}


def vision_encoder(payload, ctx):
    seed = int(payload["seed"])
    return {"seed": seed, "tokens": np.full((256, FEATURES), _tag(seed, 0, 5), np.float16)}


def audio_encoder(payload, ctx):
    seed = int(payload["seed"])
    if payload["audio"][0] != seed:
        raise ValueError("audio_encoder: damaged audio")
    return {"seed": seed, "tokens": np.full((payload["audio"].size // 640, FEATURES), _tag(seed, 0, 6), np.float16)}


def merge_modalities(inputs: dict) -> dict:
    """Fan-in: {source stage: payload} -> one payload for the thinker."""
    seeds = {int(v["seed"]) for v in inputs.values()}
    if len(seeds) != 1:
        raise ValueError(f"merge: inputs of different requests {seeds}")
    return {"seed": seeds.pop(), "vision": inputs["vision"]["tokens"], "audio": inputs["audio_enc"]["tokens"]}


def fused_thinker(payload, ctx):
    seed = int(payload["seed"])
    assert payload["vision"][0, 0] == _tag(seed, 0, 5) and payload["audio"][0, 0] == _tag(seed, 0, 6)
    return {"seed": seed, "tokens": int(payload["vision"].shape[0] + payload["audio"].shape[0])}


def verify_fanin(request: dict, result: dict, chunks: list) -> None:
    want = {"seed": int(request["seed"]), "tokens": 256 + request["audio"].size // 640}
    assert result == want, f"result {result} != expected {want}"
