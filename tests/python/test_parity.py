"""vLLM-Omni parity: exact cleanup, foreign metadata, replacement, the rest of the base contract,
wake-ups, metrics, connector classes and the orchestrator glue (payload encoding: test_payloads.py)."""
import multiprocessing as mp
import threading
import time

import numpy as np
import pytest

import stagelink
from shm_util import shm


# ---- contract and data safety ----

def _tied_producer(ns, q):
    with shm(ns) as c:
        for k in ("X", "X_1_0_0", "X_suffix_0_0", "Xa"):
            assert c.put(0, 1, k, np.full(1000, 7, np.uint8))[0]
        for i in range(3):
            assert c.put(0, 1, f"chunk{i}", b"c" * 200000, request_id="X")[0]
        q.put("ready")
        q.get(timeout=30)  # keep the producer (owner of the arena) alive while the test reads


def test_cleanup_is_exact_across_processes(ns):
    """Regression: cleanup("X") freed X_1_0_0 and X_suffix_0_0, which may be other requests'."""
    ctx = mp.get_context("fork")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_tied_producer, args=(ns, q))
    p.start()
    try:
        assert q.get(timeout=30) == "ready"
        with shm(ns) as c:
            assert c.cleanup("X") == 4  # X and the three chunks tied to it
            for k in ("X", "chunk0", "chunk1", "chunk2"):
                assert c.get(0, 1, k) is None, k
            for k in ("X_1_0_0", "X_suffix_0_0", "Xa"):
                got = c.get(0, 1, k)
                assert got is not None and got[0][0] == 7, k
    finally:
        q.put("done")
        p.join(30)
    assert p.exitcode == 0


def test_foreign_empty_and_wrapped_metadata_fall_back_to_the_key(ns):
    te_meta = {"source_host": "10.0.0.2", "source_port": 15500, "data_size": 4096, "is_fast_path": True}
    with shm(ns) as c:
        for i, md in enumerate([te_meta, {}, "not a dict", 42, None]):
            arr = np.arange(100 + 30000 * (i % 2), dtype=np.int32)
            assert c.put(0, 1, "k", arr)[0]
            got = c.get(0, 1, "k", md)
            assert got is not None, (md, c.last_error)
            assert np.array_equal(got[0], arr)
        assert c.get(0, 1, "k", te_meta) is None  # absent: None, and last_error says why
        assert isinstance(c.last_error, stagelink.NotFoundError)
        for size in (100, 200000):
            ok, _, meta = c.put(0, 1, "w", np.ones(size, np.uint8))
            got = c.get(0, 1, "w", {"w": meta})  # wrapped as {get_key: metadata}
            assert got is not None and got[0].size == size


def test_our_inconsistent_metadata_is_corrupt_never_another_payload(ns):
    with shm(ns, strict=True) as c:
        _, _, meta = c.put(0, 1, "k", np.ones(100000, np.uint8))
        for bad in ({**meta, "gen": meta["gen"] + 1}, {**meta, "gen": meta["gen"] + 7},
                    {**meta, "entry": 10 ** 9}, {"entry": meta["entry"]}):
            with pytest.raises(stagelink.CorruptError):
                c.get(0, 1, "k", bad)
        c.put(0, 1, "other", np.zeros(100000, np.uint8))
        with pytest.raises(stagelink.CorruptError, match="another key"):
            c.get(0, 1, "other", meta)
        assert c.get(0, 1, "k", meta)[0][0] == 1


def test_put_replaces_an_unread_key_and_a_held_view_keeps_the_old_payload(ns):
    with shm(ns) as c, shm(ns) as r:
        assert c.put(0, 1, "k", np.full(100000, 1, np.uint8), readers=2)[0]
        view, _ = r.get(0, 1, "k", zero_copy=True)  # one of two readers holds a view
        assert c.put(0, 1, "k", np.full(100000, 2, np.uint8))[0]
        assert c.put(0, 1, "k", np.full(100000, 3, np.uint8))[0]
        got, _ = r.get(0, 1, "k")
        assert got[0] == 3 and r.get(0, 1, "k") is None
        assert view[0] == 1 and view[-1] == 1  # the old payload, intact
        assert c.health()["replaced"] == 2
        assert c.health()["outstanding"] == 1  # v1, held by the view
        del view
        assert c.reap_consumed() == 1
        assert c.health()["outstanding"] == 0
    with shm(ns, on_existing_key="error") as c:
        assert c.put(0, 1, "k", b"x")[0]
        ok, _, _ = c.put(0, 1, "k", b"y")
        assert not ok and isinstance(c.last_error, stagelink.KeyInUseError)
        assert c.get(0, 1, "k")[0] == b"x"


def _view_holder(ns, q, back):
    """Another process: holds a zero-copy view of v1 while the producer replaces the key."""
    with shm(ns) as r:
        view, _ = r.get(0, 1, "k", timeout=10, zero_copy=True)
        q.put(int(view[0]))
        back.get(timeout=30)  # the producer replaced k meanwhile
        q.put((int(view[0]), int(view[-1]), int(view.sum() == view.size)))
        del view


def test_replacement_across_processes_keeps_the_readers_view(ns):
    ctx = mp.get_context("fork")
    q, back = ctx.Queue(), ctx.Queue()
    with shm(ns) as c:
        assert c.put(0, 1, "k", np.full(300000, 1, np.uint8), readers=2)[0]
        p = ctx.Process(target=_view_holder, args=(ns, q, back))
        p.start()
        try:
            assert q.get(timeout=30) == 1
            assert c.put(0, 1, "k", np.full(300000, 2, np.uint8))[0]  # replaces the unread half
            got = c.get(0, 1, "k")
            assert got is not None and got[0][0] == 2
            back.put("go")
            assert q.get(timeout=30) == (1, 1, 1)  # the other process's view still reads v1
        finally:
            p.join(30)
        assert p.exitcode == 0
        assert c.reap_consumed() >= 1 and c.health()["outstanding"] == 0  # v1 freed once the view went


def test_get_with_deadline_abandon_get_reap_consumed_and_class_attributes(ns):
    assert stagelink.Connector.supports_raw_data is False
    with shm(ns) as c:
        ok, size, _ = c.put(0, 1, "k", b"abc")
        assert ok
        assert c.get_with_deadline(0, 1, "k", None, time.monotonic() - 1) is None  # expired: not read
        assert c.get_with_deadline(0, 1, "k", deadline=time.monotonic() + 5) == (b"abc", size)
        t0 = time.monotonic()
        assert c.get_with_deadline(0, 1, "absent", deadline=time.monotonic() + 0.2) is None
        assert 0.18 <= time.monotonic() - t0 < 3
        with pytest.raises(TypeError):
            c.get_with_deadline(0, 1, "k")
        # abandon_get wakes a get blocked in another thread; it returns None at once.
        out = []
        th = threading.Thread(target=lambda: out.append(c.get(0, 1, "never", timeout=30)))
        t0 = time.monotonic()
        th.start()
        woken = 0
        while not woken and time.monotonic() - t0 < 10:
            time.sleep(0.01)
            woken = c.abandon_get("never")
        th.join(10)
        assert woken == 1 and out == [None] and time.monotonic() - t0 < 5
        assert c.abandon_get("nobody") == 0
        assert c.put(0, 1, "r", b"x" * 100000)[0]
        assert c.get(0, 1, "r") is not None
        assert c.reap_consumed() == 1 and c.reap_consumed() == 0


def test_unknown_connector_name_is_not_found_and_value_error():
    with pytest.raises(stagelink.NotFoundError) as e:
        stagelink.create_connector("NoSuchConnector")
    assert isinstance(e.value, ValueError) and isinstance(e.value, stagelink.StagelinkError)


def test_stage_id_is_an_attribute_as_in_vllm_omni():
    # vLLM-Omni's chunk adapter reads connector.stage_id; the orchestrator injects it (-1: none).
    with stagelink.create_connector("SharedMemoryConnector", {}, stage_id=3) as c:
        assert c.stage_id == 3
    with stagelink.create_connector("SharedMemoryConnector", {}) as c:
        assert c.stage_id == -1

def test_base_class_helpers_serialize_obj_and_make_key():
    torch = pytest.importorskip("torch")
    C = stagelink.Connector
    assert C._make_key("req-1", 0, 1) == "req-1@0_1" and C._make_key("k", "a", "b", separator="#") == "k#a_b"
    for obj in ({"h": torch.ones(3, dtype=torch.bfloat16), "ids": (1, 2)}, b"raw", {1, 2}, np.arange(4)):
        data = C.serialize_obj(obj)
        assert isinstance(data, bytes) and data[:4] == b"SLFR"
        back = C.deserialize_obj(data)
        if isinstance(obj, dict):
            assert torch.equal(back["h"], obj["h"]) and back["ids"] == (1, 2)
        elif isinstance(obj, np.ndarray):
            assert np.array_equal(back, obj)
        else:
            assert back == obj
    with pytest.raises(stagelink.CorruptError):
        C.deserialize_obj(b"not a frame")


def test_pending_keys_and_metrics_as_vllm_omni_tests_read_them(ns):
    with shm(ns, shm_threshold_bytes=0) as c, shm(ns) as other:
        ok, size, meta = c.put("s0", "s1", "k1", {"hello": "world", "n": 42})
        assert ok and size > 0 and "shm" in meta  # threshold 0: every payload in a segment
        assert list(c._pending_keys) == ["k1"]
        assert c.get("s0", "s1", "k1")[0] == {"hello": "world", "n": 42}
        assert "k1" not in c._pending_keys
        assert c._metrics["gets"] == 1 and c._metrics["puts"] == 1
        for i in range(3):
            c.put("s0", "s1", f"close_test_{i}", {"i": i})
        assert other.get("s0", "s1", "close_test_1")[0] == {"i": 1}  # read by another connector
        assert list(c._pending_keys) == ["close_test_0", "close_test_2"]
        c.cleanup("close_test_0")  # exact key
        assert list(c._pending_keys) == ["close_test_2"]
        assert other._pending_keys == {}
        c.close()
        assert len(c._pending_keys) == 0


def _late_putter(ns, key, delay):
    time.sleep(delay)
    with shm(ns) as c:
        assert c.put("70", "71", key, {"value": 1})[0]
        time.sleep(0.5)  # keep the producer while the receiver reads


def test_wakeup_generation_sleeps_until_another_process_puts(ns):
    with shm(ns, stage_id=71) as rcv:
        gen = rcv.get_wakeup_generation()
        assert isinstance(gen, int)
        t0 = time.monotonic()
        assert rcv.wait_for_change(gen, timeout=0.05) is False
        assert time.monotonic() - t0 >= 0.04  # no arrival: the whole timeout, asleep
        p = mp.get_context("fork").Process(target=_late_putter, args=(ns, "wake", 0.2))
        p.start()
        try:
            t0 = time.process_time()
            assert rcv.wait_for_change(gen, timeout=10) is True
            assert time.process_time() - t0 < 0.05  # slept in the kernel, did not spin
            assert rcv.get("70", "71", "wake", timeout=5)[0] == {"value": 1}
            assert rcv.wait_for_change(rcv.get_wakeup_generation(), timeout=0.02) is False
        finally:
            p.join(30)
        assert p.exitcode == 0
    assert rcv.get_wakeup_generation() is None  # closed: the caller keeps its timed poll


def test_wakeups_can_be_turned_off_as_in_vllm_omni(ns, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_SHM_WAKEUP", "0")
    with shm(ns) as c:
        assert c.get_wakeup_generation() is None  # the caller keeps its timed poll
        assert c.put(0, 1, "k", {"v": 2})[0] and c.get(0, 1, "k")[0] == {"v": 2}


def test_connector_classes_by_name_as_vllm_omni_constructs_them(ns):
    """vLLM-Omni's tests and callers construct connectors directly from their config dict, and
    check what the factory made with isinstance."""
    c = stagelink.SharedMemoryConnector({"namespace": ns, "shm_threshold_bytes": 0, "stage_id": 3})
    try:
        assert c.name == "SharedMemoryConnector" and c.stage_id == 3
        assert c.put("s0", "s1", "k", {"x": 1})[0] and c.get("s0", "s1", "k")[0] == {"x": 1}
    finally:
        c.close()
    made = stagelink.OmniConnectorFactory.create_connector(stagelink.ConnectorSpec("SharedMemoryConnector", {"namespace": ns}))
    with made:
        assert isinstance(made, stagelink.SharedMemoryConnector) and isinstance(made, stagelink.Connector)
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c2:
        assert type(c2) is stagelink.SharedMemoryConnector
    assert issubclass(stagelink.MooncakeTransferEngineConnector, stagelink.TransferEngineConnector)
    assert stagelink.TransferEngineConnector.supports_raw_data is False
    assert stagelink.MooncakeStoreConnector.__name__ == "MooncakeStoreConnector"
    with pytest.raises(AttributeError):
        stagelink.NoSuchConnector


class _Metrics:
    def __init__(self):
        self.calls = []

    def on_forward(self, *args):
        self.calls.append(args)


def test_vllm_omni_adapter_send_and_receive(ns):
    """vLLM-Omni's orchestrator glue (omni_connectors.adapter) over a real connector: the payload
    under the request id, the notification through the stage queue, the receive through the
    edge's connector; failures are reported, not raised, and leave nothing behind."""
    from stagelink.adapter import try_recv_via_connector, try_send_via_connector
    queue, metrics = [], _Metrics()
    with shm(ns) as c:
        inputs = {"prompt_token_ids": list(range(40)), "hidden": np.ones((4, 8), np.float32)}
        prompt = {"prompt": "hi", "mm_kwargs": object(), "mm_hashes": ["h"]}  # features left out
        assert try_send_via_connector(c, 0, 1, "req-1", inputs, {"temperature": 0.7}, prompt, queue.append, metrics)
        (note,) = queue
        assert note["from_connector"] is True and (note["from_stage"], note["to_stage"]) == ("0", "1")
        assert note["request_id"] == "req-1" and note["sampling_params"] == {"temperature": 0.7}
        assert "connector_metadata" in note
        (call,) = metrics.calls
        assert call[:3] == (0, 1, "req-1") and call[3] > 0 and call[5] is True
        got, rx = try_recv_via_connector(note, {("0", "1"): c}, stage_id=1)
        assert got["prompt_token_ids"] == inputs["prompt_token_ids"]
        np.testing.assert_array_equal(got["hidden"], inputs["hidden"])
        assert rx["rx_transfer_bytes"] > 0 and rx["rx_decode_time_ms"] >= 0
        # Read once: gone, reported as (None, None); no connector for the edge, or no from_stage: the same.
        assert try_recv_via_connector(dict(note, connector_metadata={}), {("0", "1"): c}, 1) == (None, None)
        assert try_recv_via_connector(note, {}, 1) == (None, None)
        assert try_recv_via_connector({"request_id": "x", "from_connector": True}, {("0", "1"): c}, 1) == (None, None)
        # A seed request carries its inputs itself.
        assert try_recv_via_connector({"request_id": "s", "engine_inputs": [1, 2]}, {}, 0)[0] == [1, 2]

        # The queue refuses the notification: False, and the put it went with is cleaned up.
        def full(_):
            raise RuntimeError("queue full")
        assert not try_send_via_connector(c, 0, 1, "req-2", inputs, {}, "", full)
        assert c.get(0, 1, "req-2", timeout=0) is None
        # A payload the connector cannot take (pickle off): False, nothing submitted.
        with shm(ns, allow_pickle=False) as strict:
            assert not try_send_via_connector(strict, 0, 1, "req-3", object(), {}, "", queue.append)
            assert len(queue) == 1
            # The prompt's multimodal features are left out of the payload (the object() in them
            # would need pickle, which this connector refuses).
            assert try_send_via_connector(strict, 0, 1, "req-4", {"ids": [1]}, {}, prompt, queue.append)
            assert try_recv_via_connector(queue[-1], {("0", "1"): strict}, 1)[0] == {"ids": [1]}


def test_cleanup_prefix_takes_chunk_numbers_only(ns):
    """vLLM-Omni's cleanup_prefix: the puts whose key is the prefix and a chunk number, unread,
    of this connector; never a key that merely starts with the prefix."""
    with shm(ns) as sender, shm(ns) as other:
        for key in ("req_0_0", "req_0_1", "req_0_10other", "request_0_0"):
            assert sender.put(0, 1, key, np.arange(56))[0]
        assert other.put(0, 1, "req_0_2", np.arange(56))[0]  # another producer's chunk
        assert sender.cleanup_prefix("req_0_") == 2
        assert sender.get(0, 1, "req_0_0", timeout=0) is None
        for left in ("req_0_10other", "request_0_0", "req_0_2"):
            assert sender.get(0, 1, left, timeout=0) is not None
        assert sender.cleanup_prefix("req_0_") == 0
