"""A call that waits (for a message, a key, a credit, a reader) runs Python's signal handlers while
it waits: Ctrl-C, or a SIGTERM handler that raises, ends it at once. Before, a wait without a
timeout ignored them until something arrived (for ever), and one with a timeout until it ran out."""
import os
import signal
import threading
import time

import pytest

import stagelink


class Interrupted(Exception):
    pass


def _ends_on_a_signal(call, limit=2.0):
    """Arm SIGALRM (a handler that raises) 0.3 s out, run `call`; the handler's exception must end
    it well before `limit` seconds. Returns the seconds it took."""
    def handler(signum, frame):
        raise Interrupted()
    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            call()
        took = time.monotonic() - t0
        assert took < limit, f"the wait ran {took:.2f} s past the signal"
        return took
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_message_queue_waits_end_on_a_signal(mq_clean):
    w = stagelink.MessageQueue(1, 1, max_chunk_bytes=1 << 10, max_chunks=2, overflow_bytes=0)
    r = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
    try:
        w.wait_until_ready(10)
        # vLLM's worker loop: no timeout. Should the signal be ignored, a message 5 s later ends the
        # wait (and the time check fails) rather than the test hanging.
        rescue = threading.Timer(5, lambda: w.enqueue("rescue"))
        rescue.start()
        try:
            _ends_on_a_signal(lambda: r.dequeue(indefinite=True))
        finally:
            rescue.cancel()
        _ends_on_a_signal(lambda: r.dequeue(timeout=30))
        _ends_on_a_signal(lambda: r.dequeue())
        w.enqueue(1)
        w.enqueue(2)  # the ring is full; the reader does not read
        _ends_on_a_signal(lambda: w.enqueue(3))
        _ends_on_a_signal(lambda: w.enqueue(3, timeout=30))
        assert r.dequeue(timeout=5) == 1 and r.dequeue(timeout=5) == 2  # nothing lost, nothing extra
        with pytest.raises(stagelink.TimeoutError):
            r.dequeue(timeout=0.05)
    finally:
        r.close()
        w.close()
    lonely = stagelink.MessageQueue(1, 1)
    try:
        _ends_on_a_signal(lambda: lonely.wait_until_ready(30))  # its reader never attaches
    finally:
        lonely.close()


def test_connector_and_control_waits_end_on_a_signal(ns):
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        _ends_on_a_signal(lambda: c.get(0, 1, "never", timeout=30))
        _ends_on_a_signal(lambda: c.wait_for_change(c.get_wakeup_generation() or 0, timeout=30))
        assert c.put(0, 1, "k", b"x")[0] and c.get(0, 1, "k", timeout=30)[0] == b"x"  # still works
    d = stagelink.control.private_socket_dir("sigtest")
    try:
        with stagelink.control.Inbox(f"ipc://{d}/in") as inbox:
            _ends_on_a_signal(lambda: inbox.recv())
    finally:
        stagelink.control.remove_socket_dir(d)
    with stagelink.Relay({"extra": {"namespace": ns}, "timeout_s": 60, "credits": 2}) as rel:
        op = rel.put_async(b"unread", request_id="r", edge="e")
        _ends_on_a_signal(lambda: op.wait())  # nobody reads it
        rel.put_async(b"unread too", request_id="r", edge="e")
        _ends_on_a_signal(lambda: rel.put_async(b"no credit", request_id="r2", edge="e"))  # both held
        assert rel.cleanup("r2") == 0 and rel.cleanup("r") == 2


def test_network_connector_gets_end_on_a_signal(redis):
    # Before, a get from the store or the transfer engine waited out its timeout (or for ever).
    # Only the wait for the key is cut short: a payload found is read whole, and the connectors
    # work on after the signal.
    with stagelink.create_connector("StoreConnector", {"host": "127.0.0.1", "port": redis}) as c:
        _ends_on_a_signal(lambda: c.get(0, 1, "never", timeout=30))
        _ends_on_a_signal(lambda: c.get(0, 1, "never", timeout=float("inf")))
        assert c.put(0, 1, "k", b"x" * 5000)[0] and c.get(0, 1, "k", timeout=30)[0] == b"x" * 5000
    s = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "zmq_port": 0, "role": "sender",
                                                               "memory_pool_size": 16 << 20,
                                                               "serve_by_key": True})  # gets by key
    r = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "role": "receiver",
                                                               "memory_pool_size": 16 << 20})
    try:
        r.update_sender_info("127.0.0.1", s.health()["zmq_port"])
        _ends_on_a_signal(lambda: r.get(0, 1, "never", timeout=30))  # asks the sender until the put
        assert s.put(0, 1, "k", b"y" * 5000)[0] and r.get(0, 1, "k", timeout=30)[0] == b"y" * 5000
    finally:
        r.close()
        s.close()


def test_a_timed_out_get_counts_one_timeout(ns, redis):
    # Regression: the binding waited in 0.2 s slices, each a get of its own, so one get that timed
    # out after 1.5 s counted 8 timeouts in health().
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c, \
            stagelink.create_connector("StoreConnector", {"host": "127.0.0.1", "port": redis}) as st:
        for conn in (c, st):
            before = conn.health()
            t0 = time.monotonic()
            assert conn.get(0, 1, "never", timeout=1.5) is None
            assert time.monotonic() - t0 >= 1.4
            after = conn.health()
            assert after["timeouts"] == before["timeouts"] + 1
            if "waits" in after:  # the store's: gets that waited, each once
                assert after["waits"] == before["waits"] + 1


def test_a_signal_whose_handler_returns_does_not_break_a_wait(ns):
    # Regression: a signal arriving while a ZeroMQ socket waited (any Python handler makes the
    # kernel call return EINTR) raised "RuntimeError: Interrupted system call" out of recv.
    seen = []
    old = signal.signal(signal.SIGALRM, lambda *a: seen.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.1, 0.1)  # every 0.1 s
    d = stagelink.control.private_socket_dir("sigtest")
    try:
        with stagelink.control.Inbox(f"ipc://{d}/in") as inbox:
            t0 = time.monotonic()
            with pytest.raises(stagelink.TimeoutError):
                inbox.recv(timeout=1.5)
            assert time.monotonic() - t0 >= 1.4
        w = stagelink.MessageQueue(1, 0, connect_ip="127.0.0.1")  # a remote reader waits in zmq_poll
        r = stagelink.MessageQueue.create_from_handle(w.export_handle(), -1)
        try:
            w.wait_until_ready(10)
            with pytest.raises(stagelink.TimeoutError):
                r.dequeue(timeout=1.5)
            w.enqueue("after")
            assert r.dequeue(timeout=5) == "after"
        finally:
            r.close()
            w.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        stagelink.control.remove_socket_dir(d)
    assert len(seen) >= 10


def test_infinite_and_absurd_timeouts_wait_for_ever_and_nan_is_refused(ns, mq_clean):
    # Regression: timeout=float("inf") raised OverflowError from dequeue, and 1e300 s overflowed
    # the deadline's nanoseconds (undefined behaviour in C++); NaN meant "no wait".
    w = stagelink.MessageQueue(1, 1)
    r = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
    try:
        w.wait_until_ready(10)
        for t in (float("inf"), 1e300):
            timer = threading.Timer(0.3, lambda: w.enqueue("late"))
            timer.start()
            t0 = time.monotonic()
            assert r.dequeue(timeout=t) == "late" and time.monotonic() - t0 >= 0.25
            timer.join()
        with pytest.raises(stagelink.InvalidArgumentError, match="NaN"):
            r.dequeue(timeout=float("nan"))
        with pytest.raises(stagelink.InvalidArgumentError, match="NaN"):
            w.enqueue("x", timeout=float("nan"))
    finally:
        r.close()
        w.close()
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        for i, t in enumerate((float("inf"), 1e300)):
            timer = threading.Timer(0.3, lambda i=i: c.put(0, 1, f"k{i}", b"v"))
            timer.start()
            assert c.get(0, 1, f"k{i}", timeout=t)[0] == b"v"
            timer.join()
        assert c.get(0, 1, "k", timeout=float("nan")) is None
        assert isinstance(c.last_error, stagelink.InvalidArgumentError)


def test_the_local_relay_takes_infinite_timeouts():
    # Regression: the same-process relay waited with Condition.wait(inf), which raises OverflowError.
    with stagelink.Relay(backend="local", credits=1, timeout_s=5) as r:
        op = r.put_async({"x": 1}, request_id="r", edge="e")
        threading.Timer(0.3, lambda: r.get_async(op.metadata)).start()
        op.wait(float("inf"))  # returns once read
        assert op.done()
        op2 = r.put_async({"x": 2}, request_id="r2", edge="e")
        with pytest.raises(stagelink.InvalidArgumentError, match="NaN"):
            op2.wait(float("nan"))
        r.cleanup("r2")
