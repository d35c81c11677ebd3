"""stagelink.MessageQueue across real processes: local readers, a remote reader over TCP."""
import hashlib
import multiprocessing as mp
import os
import pickle
import random
import signal
import threading
import time

import numpy as np
import pytest

import stagelink

CHUNK = 4096
N_MSGS = 10_000


def _message(i: int):
    """Message i, reproducible in every process: random sizes 0 B .. 3x the chunk (overflow)."""
    rng = random.Random(i)
    n = 0 if i % 97 == 0 else rng.randrange(3 * CHUNK + 1)
    kind = i % 3
    data = rng.randbytes(n)
    if kind == 0:
        return data
    if kind == 1:
        return np.frombuffer(data, dtype=np.uint8).copy()
    return {"i": i, "payload": data, "tag": f"m{i}"}


def _digest(obj) -> str:
    if isinstance(obj, dict):
        return f"{obj['i']}:{obj['tag']}:" + hashlib.sha1(obj["payload"]).hexdigest()
    return hashlib.sha1(bytes(obj)).hexdigest()


def _reader(handle, rank, n, q):
    try:
        r = stagelink.MessageQueue.create_from_handle(handle, rank)
        r.wait_until_ready()
        rng = random.Random(rank)
        for i in range(n):
            got = r.dequeue(timeout=60)
            if _digest(got) != _digest(_message(i)):
                q.put((rank, f"message {i} differs"))
                return
            if rng.random() < 0.01:
                time.sleep(rng.random() * 0.002)
        r.close()
        q.put((rank, "ok"))
    except Exception as e:  # reported to the parent, which fails the test
        q.put((rank, repr(e)))


@pytest.mark.parametrize("n_local", [1, 4])
def test_every_reader_gets_every_message_once_in_order_intact(n_local, mq_clean):
    ctx = mp.get_context("spawn")
    w = stagelink.MessageQueue(n_local + 1, n_local, max_chunk_bytes=CHUNK, max_chunks=8, connect_ip="127.0.0.1",
                               overflow_bytes=64 << 10)
    handle = pickle.loads(pickle.dumps(w.export_handle()))
    q = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(handle, r, N_MSGS, q)) for r in range(n_local + 1)]
    for p in procs:
        p.start()
    w.wait_until_ready(timeout=60)
    rng = random.Random(1)
    for i in range(N_MSGS):
        w.enqueue(_message(i), timeout=60)
        if rng.random() < 0.01:
            time.sleep(rng.random() * 0.002)
    results = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == {r: "ok" for r in range(n_local + 1)}
    assert w.stats()["overflow_messages"] > 0
    w.close()


def test_torch_and_numpy_arrive_typed(mq_clean):
    torch = pytest.importorskip("torch")
    with stagelink.MessageQueue(1, 1, max_chunk_bytes=1024, max_chunks=2) as w:
        r = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
        t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
        w.enqueue({"t": t, "a": np.eye(3)})
        got = r.dequeue(timeout=5)
        assert torch.equal(got["t"], t) and np.array_equal(got["a"], np.eye(3))
        for a in (np.arange(10.0).reshape(2, 5), np.arange(300, dtype=np.int16), np.array(7)):
            w.enqueue(a)  # plain arrays travel as one typed tensor; the 0-d one is pickled
            got = r.dequeue(timeout=5)
            assert type(got) is np.ndarray and got.dtype == a.dtype and got.shape == a.shape
            assert np.array_equal(got, a)
        assert w.broadcast_object("x") == "x" and r.broadcast_object() == "x"
        r.close()


def test_timeouts_name_the_reader_behind(mq_clean):
    with stagelink.MessageQueue(2, 2, max_chunk_bytes=256, max_chunks=2) as w:
        r0 = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
        r1 = stagelink.MessageQueue.create_from_handle(w.export_handle(), 1)
        t0 = time.monotonic()
        with pytest.raises(stagelink.TimeoutError):
            r0.dequeue(timeout=0.1)
        assert time.monotonic() - t0 >= 0.09
        w.enqueue(1)
        w.enqueue(2)
        assert r0.dequeue(timeout=1) == 1
        with pytest.raises(stagelink.TimeoutError, match=r"rank 1 \(pid"):
            w.enqueue(3, timeout=0.1)
        assert r1.dequeue(timeout=1) == 1  # the slow reader catches up and the writer goes on
        w.enqueue(3, timeout=1)
        r0.close()
        r1.close()


def test_shutdown_wakes_blocked_reader_and_writer(mq_clean):
    w = stagelink.MessageQueue(2, 2, max_chunk_bytes=256, max_chunks=1)
    r0 = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
    r1 = stagelink.MessageQueue.create_from_handle(w.export_handle(), 1)
    w.enqueue("first")
    assert r0.dequeue(timeout=1) == "first"
    errors = {}

    def run(name, f):
        try:
            f()
        except Exception as e:
            errors[name] = e

    threads = [threading.Thread(target=run, args=("reader", lambda: r0.dequeue())),
               threading.Thread(target=run, args=("writer", lambda: w.enqueue("second")))]
    for t in threads:
        t.start()
    time.sleep(0.2)
    w.shutdown(everyone=True)
    for t in threads:
        t.join(2)
        assert not t.is_alive()
    assert isinstance(errors["reader"], stagelink.CancelledError)
    assert isinstance(errors["writer"], stagelink.CancelledError)
    assert r1.dequeue(timeout=1) == "first"  # what was enqueued is still delivered
    for q in (w, r0, r1):
        q.close()


def _attach_and_wait(handle, rank, ready):
    r = stagelink.MessageQueue.create_from_handle(handle, rank)
    ready.set()
    time.sleep(60)
    r.close()


def test_sigkilled_reader_is_reported_by_rank_then_dropped(mq_clean):
    ctx = mp.get_context("spawn")
    w = stagelink.MessageQueue(2, 2, max_chunk_bytes=256, max_chunks=2)
    ready = ctx.Event()
    victim = ctx.Process(target=_attach_and_wait, args=(w.export_handle(), 1, ready))
    victim.start()
    assert ready.wait(30)
    r0 = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
    w.wait_until_ready(timeout=5)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(5)
    w.enqueue(1)
    w.enqueue(2)
    assert r0.dequeue(timeout=1) == 1 and r0.dequeue(timeout=1) == 2
    with pytest.raises(stagelink.PeerDeadError, match="rank 1"):
        w.enqueue(3, timeout=5)
    w.drop_reader(1)
    w.enqueue(3, timeout=1)
    assert r0.dequeue(timeout=1) == 3
    r0.close()
    w.close()


def test_bad_arguments_are_clear_errors(mq_clean):
    with pytest.raises(stagelink.InvalidArgumentError):
        stagelink.MessageQueue(1, 2)
    with stagelink.MessageQueue(1, 1, max_chunk_bytes=256, max_chunks=2) as w:
        with pytest.raises(stagelink.InvalidArgumentError):
            stagelink.MessageQueue.create_from_handle(w.export_handle(), 3)
        with pytest.raises(stagelink.InvalidArgumentError):
            stagelink.MessageQueue.create_from_handle(stagelink.mq.Handle(b"\x81\xa1v\x07"), 0)
        with pytest.raises(stagelink.InvalidArgumentError):
            w.dequeue(timeout=0)
    with pytest.raises(stagelink.ClosedError):
        w.enqueue(1)


_INHERITED = {}


def _drop_inherited_writer():
    import gc
    _INHERITED.clear()  # the writer copied into this forked child: dropped, collected
    gc.collect()


def _read_three(handle, rank, q):
    r = stagelink.MessageQueue.create_from_handle(handle, rank)
    q.put([r.dequeue(timeout=20) for _ in range(3)])
    r.close()


def test_a_writer_dropped_in_a_forked_child_leaves_the_parents_queue_alone(mq_clean):
    """Regression: a forked child that dropped the writer it inherited (vLLM's executor makes the
    queue, then forks its workers) shut the parent's queue down and unlinked its segments; with a
    remote reader, the child hung for ever terminating the ZeroMQ context whose threads stayed in
    the parent. The child now leaves both alone and exits at once."""
    ctx = mp.get_context("fork")
    # Held only here (no local name): the child's clear() drops the last reference it has.
    _INHERITED["w"] = stagelink.MessageQueue(2, 1, max_chunk_bytes=1 << 16, max_chunks=4, connect_ip="127.0.0.1")
    try:
        t0 = time.monotonic()
        p = ctx.Process(target=_drop_inherited_writer)
        p.start()
        p.join(15)
        assert p.exitcode == 0, "the child hung or failed dropping the inherited writer"
        assert time.monotonic() - t0 < 10
        assert not _INHERITED["w"].shutting_down
        q = ctx.Queue()
        readers = [ctx.Process(target=_read_three, args=(_INHERITED["w"].export_handle(), rank, q)) for rank in (0, 1)]
        for r in readers:
            r.start()
        _INHERITED["w"].wait_until_ready(timeout=30)
        for i in range(3):
            _INHERITED["w"].enqueue({"i": i}, timeout=20)
        got = [q.get(timeout=30) for _ in readers]
        for r in readers:
            r.join(30)
        assert got == [[{"i": 0}, {"i": 1}, {"i": 2}]] * 2
    finally:
        w = _INHERITED.pop("w", None)
        if w is not None:
            w.close()
