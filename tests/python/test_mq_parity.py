"""MessageQueue parity with vLLM's shm_broadcast: names, arbitrary reader ranks, remote-only readers,
the host address, acquire_write/acquire_read, shutdown, process groups."""
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time

import numpy as np
import pytest

import stagelink
from stagelink import _core


def test_ranks_handle_fields_acquire_and_shutdown(mq_clean):
    # Local readers of group ranks 1 and 3 (not 0..n-1), one remote-only reader (rank -1).
    w = stagelink.MessageQueue(3, 2, [1, 3], max_chunk_bytes=1 << 16, max_chunks=4, connect_ip="127.0.0.1",
                               enable_shm_tensor_arena=False)
    h = w.export_handle()
    assert h.local_reader_ranks == [1, 3]
    assert h.buffer_handle[:3] == (2, 1 << 16, 4)
    assert h.local_subscribe_addr is None and h.remote_addr_ipv6 is False
    assert h.remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    h2 = pickle.loads(pickle.dumps(h))
    assert h2.local_reader_ranks == [1, 3]
    readers = [stagelink.MessageQueue.create_from_handle(h2, r) for r in (1, 3, -1)]
    # vLLM's fields: which side each is, and the queue's shape
    assert w._is_writer and not w._is_local_reader and not w._is_remote_reader
    assert [(r._is_writer, r._is_local_reader, r._is_remote_reader, r.local_reader_rank) for r in readers] == [
        (False, True, False, 0), (False, True, False, 1), (False, False, True, -1)]
    assert all((q.n_reader, q.n_local_reader, q.n_remote_reader) == (3, 2, 1) for q in [w, *readers])
    try:
        w.wait_until_ready(10)
        w.enqueue({"x": 1})
        with w.acquire_write(timeout=5) as buf:
            assert len(buf) == 1 << 16 and not buf.readonly
            buf[:5] = b"hello"
        for r in readers:
            assert r.dequeue(timeout=5) == {"x": 1}
            with r.acquire_read(timeout=5) as view:
                assert view.readonly and len(view) == 1 << 16 and bytes(view[:5]) == b"hello"
        # vLLM's `indefinite` only silences the reader's "no message" warning: the timeout holds.
        with pytest.raises(stagelink.TimeoutError):
            readers[0].dequeue(timeout=0.01, indefinite=True)
        t0 = time.monotonic()
        threading.Timer(0.3, lambda: w.enqueue("late")).start()
        assert readers[0].dequeue(indefinite=True) == "late"
        assert time.monotonic() - t0 >= 0.25
        with pytest.raises(stagelink.TimeoutError):
            readers[0].dequeue(timeout=0.05)
        assert not w.shutting_down and not readers[0].shutting_down
        w.shutdown()  # vLLM's: the writer's own; its readers still wait (and time out)
        assert w.shutting_down
        with pytest.raises(stagelink.CancelledError, match="cancelled"):
            w.enqueue("after", timeout=1)
        with pytest.raises(stagelink.TimeoutError):
            readers[0].dequeue(timeout=0.05)
        assert not readers[0].shutting_down
        w.close()  # the writer gone: the queue has ended for its readers, after what it sent
        for r in readers[1:]:
            assert r.dequeue(timeout=5) == "late"
        for r in readers:
            with pytest.raises(stagelink.CancelledError, match="cancelled"):
                r.dequeue(timeout=5)
            assert r.shutting_down
    finally:
        for r in readers:
            r.close()
        w.close()


def test_remote_readers_are_served_on_the_host_address(mq_clean, monkeypatch):
    import ipaddress
    # Found from the interfaces without sending anything; advertised in the handle (not connected
    # to here: tests stay on loopback).
    ipaddress.IPv4Address(_core.host_address())
    w = stagelink.MessageQueue(1, 0)  # no connect_ip: the host's address, as vLLM
    try:
        assert w.export_handle().remote_subscribe_addr.startswith(f"tcp://{_core.host_address()}:")
    finally:
        w.close()
    monkeypatch.setenv("STAGELINK_HOST_IP", "127.0.0.1")  # VLLM_HOST_IP is read too
    w = stagelink.MessageQueue(1, 0)
    try:
        assert w.export_handle().remote_subscribe_addr.startswith("tcp://127.0.0.1:")
        r = stagelink.MessageQueue.create_from_handle(w.export_handle(), -1)
        try:
            w.wait_until_ready(10)
            w.enqueue(np.arange(4))
            assert np.array_equal(r.dequeue(timeout=5), np.arange(4))
        finally:
            r.close()
    finally:
        w.close()


def _pg_worker(rank, world, port, q):
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mq = stagelink.MessageQueue.create_from_process_group(dist.group.WORLD, 1 << 16, 4, writer_rank=0)
        if rank == 0:
            mq.enqueue({"step": 1})
            got = "sent"
        else:
            got = mq.dequeue(timeout=10)
        single, handles = stagelink.MessageQueue.create_from_process_group_single_reader(
            dist.group.WORLD, 1 << 16, 4, reader_rank=0)
        if rank == 0:
            got2 = sorted(r.dequeue(timeout=10) for r in single if r is not None)
        else:
            single.enqueue(rank * 10)
            got2 = "sent"
        # vLLM's external_writer_handle: the queue exists already (its writer outside the group
        # API); writer_rank hands its handle on and every rank reads it. blocking=False: no wait.
        ext = stagelink.MessageQueue(world, world, list(range(world)), 1 << 16, 4) if rank == 0 else None
        grp = stagelink.MessageQueue.create_from_process_group(
            dist.group.WORLD, 1 << 16, 4, writer_rank=0,
            external_writer_handle=ext.export_handle() if ext else None, blocking=False)
        assert not grp.is_writer
        if ext:
            ext.wait_until_ready(10)
            ext.enqueue("ext")
        got3 = grp.dequeue(timeout=10)
        dist.barrier()
        for x in (grp, ext):
            if x is not None:
                x.close()
        q.put((rank, got, got2, got3))
        dist.destroy_process_group()
    except Exception as e:  # reported, not lost in the child
        q.put((rank, "error", repr(e)))


def _run_group(worker, world, *extra):
    """`worker(rank, world, port, q, *extra)` in `world` spawned processes; their reports, by rank."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, port, q, *extra)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted(q.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_create_from_process_group(mq_clean):
    pytest.importorskip("torch")
    results = _run_group(_pg_worker, 3)
    assert results == [(0, "sent", [10, 20], "ext"), (1, {"step": 1}, "sent", "ext"),
                       (2, {"step": 1}, "sent", "ext")], results


def test_process_group_without_torch_distributed_is_a_clear_error():
    with pytest.raises(stagelink.StagelinkError, match="torch.distributed|initialized"):
        stagelink.MessageQueue.create_from_process_group(object(), 1 << 16, 4)


class _StoreGroup:
    """vLLM's StatelessProcessGroup interface (rank, world_size, broadcast_obj, all_gather_obj,
    barrier) over a real torch TCPStore, as vLLM builds it: no torch.distributed global state."""

    def __init__(self, port, rank, world):
        from torch.distributed import TCPStore
        self.rank, self.world_size = rank, world
        self.store = TCPStore("127.0.0.1", port, world, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
        self.sent, self.got = 0, [0] * world

    def broadcast_obj(self, obj, src):
        if self.rank == src:
            self.store.set(f"b/{src}/{self.sent}", pickle.dumps(obj))
            self.sent += 1
            return obj
        key = f"b/{src}/{self.got[src]}"
        self.got[src] += 1
        return pickle.loads(self.store.get(key))

    def all_gather_obj(self, obj):
        return [self.broadcast_obj(obj if i == self.rank else None, i) for i in range(self.world_size)]

    def barrier(self):
        for i in range(self.world_size):
            self.broadcast_obj(None, i)

    def close(self):
        """Leave; rank 0 hosts the store's server, so it leaves last (its exit closed the store
        under a rank still reading the last barrier: DistNetworkError there)."""
        self.store.add("left", 1)
        deadline = time.monotonic() + 60
        while self.rank == 0 and self.store.add("left", 0) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.01)


def _group_worker(rank, world, port, q, body):
    """One rank of a 4-rank StatelessProcessGroup with vLLM's queue of its tests (writer rank 2,
    so the local readers are ranks 0, 1 and 3: not 0..n-1; 40 KiB chunks, 2 of them): runs
    ``globals()[body](rank, pg, mq, writer)``, then reports (rank, "ok") or what it raised."""
    try:
        pg = _StoreGroup(port, rank, world)
        writer = 2
        mq = stagelink.MessageQueue.create_from_process_group(pg, 40 * 1024, 2, writer)
        globals()[body](rank, pg, mq, writer)
        pg.barrier()
        mq.close()
        pg.close()
        q.put((rank, "ok"))
    except BaseException as e:  # reported, not lost in the child
        q.put((rank, repr(e)))


def _stateless_body(rank, pg, mq, writer):
    rng = np.random.default_rng(7)
    arrays = [rng.integers(1, 100, n) for n in (10, 9000, 3, 7000)]  # some over a chunk
    if rank == writer:
        for a in arrays:
            mq.broadcast_object(a)
    else:
        for a in arrays:
            assert np.array_equal(mq.broadcast_object(None), a)
    pg.barrier()
    # vLLM's shutdown test: a reader put into idle mode, shut down from another thread.
    if rank != writer:
        mq._spin_condition.last_read = 0
        ev = threading.Event()
        t = threading.Thread(target=lambda: (ev.wait(30), mq.shutdown()), daemon=True)
        t.start()
        with pytest.raises(TimeoutError):
            mq.dequeue(timeout=0.001)
        ev.set()
        t.join(10)
        with pytest.raises(RuntimeError, match="cancelled"):
            mq.dequeue(timeout=1)
        assert mq.shutting_down
    else:
        mq.shutdown()


def test_stateless_process_group_and_vllm_shutdown_flow(mq_clean):
    # vLLM's own queue test builds the queue from a StatelessProcessGroup (no torch.distributed
    # state) and reaches for the reader's _spin_condition; both must work here.
    pytest.importorskip("torch")
    results = _run_group(_group_worker, 4, "_stateless_body")
    assert results == [(r, "ok") for r in range(4)], results


def _spin_body(rank, pg, mq, writer):
    """vLLM's idle-to-busy and busy-to-idle tests: the reader's loop calls its SpinCondition's
    `wait` once per wait while idle, and many times (each within 1 ms) while busy."""
    from unittest import mock
    with mock.patch.object(mq._spin_condition, "wait", wraps=mq._spin_condition.wait) as wait:
        if rank != writer:
            # idle -> busy
            mq._spin_condition.last_read = 0
            with pytest.raises(TimeoutError):
                mq.dequeue(timeout=0.01)
            assert wait.call_count == 1, wait.call_count  # one wait while idle
            pg.barrier()
            assert mq.dequeue(timeout=5) == "hello world"
            assert wait.call_count == 2, wait.call_count  # woken by the message, not by a slice
            pg.barrier()
            assert np.array_equal(mq.dequeue(timeout=1), np.arange(100))
            assert wait.call_count > 3, wait.call_count  # busy after a read: short waits
            # busy -> idle
            mq._spin_condition.busy_loop_s = 9999
            pg.barrier()
            assert mq.dequeue(timeout=1) == 12345
            assert wait.call_count > 5, wait.call_count
            mq._spin_condition.busy_loop_s = 0
            with pytest.raises(TimeoutError):
                mq.dequeue(timeout=0.01)
            n = wait.call_count
            pg.barrier()
            assert mq.dequeue(timeout=1) == [0, 1, 2]
            assert wait.call_count == n + 1, (wait.call_count, n)
        else:
            for msg in ("hello world", np.arange(100), 12345, [0, 1, 2]):
                pg.barrier()
                time.sleep(0.1)  # the readers are waiting by then
                mq.enqueue(msg)
    pg.barrier()
    mq.shutdown()
    assert mq.shutting_down


def test_vllm_spin_condition_idle_and_busy_waits(mq_clean):
    pytest.importorskip("torch")
    results = _run_group(_group_worker, 4, "_spin_body")
    assert results == [(r, "ok") for r in range(4)], results


def test_reader_logs_a_long_wait_unless_indefinite(monkeypatch, caplog):
    # vLLM's warning test: a reader that waits past VLLM_RINGBUFFER_WARNING_INTERVAL logs it
    # (naming the writer), and does not with indefinite=True.
    monkeypatch.setattr(stagelink.mq, "VLLM_RINGBUFFER_WARNING_INTERVAL", 0.001)
    w = stagelink.MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=4)
    r = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
    try:
        w.wait_until_ready(10)
        with caplog.at_level(logging.INFO, logger="stagelink"):
            with pytest.raises(stagelink.TimeoutError):
                r.dequeue(timeout=0.05)
            assert any("No available shared memory broadcast block found in 0 seconds" in m
                       and "rank 0" in m for m in caplog.messages), caplog.messages
            caplog.clear()
            with pytest.raises(stagelink.TimeoutError):
                r.dequeue(timeout=0.05, indefinite=True)
            assert not any("No available shared memory" in m for m in caplog.messages), caplog.messages
    finally:
        r.close()
        w.close()


@pytest.mark.parametrize("should_warn", [False, True])
def test_read_timeout_caps_waits_as_vllms(monkeypatch, should_warn):
    # vLLM's test of its reader's timer: with no timeout a wait is capped at the recheck interval.
    monkeypatch.setattr(stagelink.mq, "SHM_READER_RECHECK_INTERVAL_MS", 7)
    monkeypatch.setattr(stagelink.mq, "VLLM_RINGBUFFER_WARNING_INTERVAL", 60)
    t = stagelink.MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=should_warn)
    assert t.timeout_ms() == 7 and not t.should_warn()
    t = stagelink.MessageQueue.ReadTimeoutWithWarnings(timeout=0.02, should_warn=should_warn)
    assert 0 < t.timeout_ms() <= 7
    time.sleep(0.03)
    with pytest.raises(TimeoutError):
        t.timeout_ms()
    monkeypatch.setattr(stagelink.mq, "VLLM_RINGBUFFER_WARNING_INTERVAL", 0.001)
    t = stagelink.MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=should_warn)
    time.sleep(0.002)
    assert t.timeout_ms() == (1 if should_warn else 7) and t.should_warn() == should_warn
