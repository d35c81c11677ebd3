"""atheris (libFuzzer for Python): the decoder of control-message bodies, which the coordinator
and every stage process run on what other processes (or, without CURVE, anyone) send: a small
payload inline, and the `ready` message's figures (stagelink.pipeline._wire.from_frame). It may
only raise a StagelinkError (CorruptError: not a frame, a pickle frame, a CUDA device record,
...); any other exception, or code of the input's running (a pickle), is a bug the fuzzer reports.
    .venv/bin/python tests/fuzz/fuzz_control_body.py CORPUS_DIR SEED_DIR -max_total_time=60
(./scripts/fuzz runs it with the other targets when atheris is installed.)"""
import pickle
import sys

import atheris

with atheris.instrument_imports():
    import stagelink
    from stagelink.pipeline._wire import from_frame


def _never(*_a, **_k):
    raise AssertionError("a control body was unpickled")


pickle.loads = _never  # from_frame must never get there, whatever the bytes


def one(data: bytes):
    try:
        from_frame(data)
    except stagelink.StagelinkError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one)
    atheris.Fuzz()
