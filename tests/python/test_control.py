"""Control-plane messages from Python: round trips and malformed input."""
import random

import pytest

import stagelink
from stagelink.control import NO_REQUEST, TYPES, ControlMessage


def test_every_type_round_trips():
    for t in TYPES:
        m = ControlMessage(t, "" if t in NO_REQUEST else "req-1", from_stage="thinker", to_stage="talker",
                           metadata={"entry": 3, "gen": 1, "inline": b"\x00\x01"}, chunk_id=5 if t == "stream" else None,
                           is_done=t == "stream", error="boom" if t == "complete" else None,
                           body=b"frame" if t == "submit" else None)
        assert ControlMessage.from_bytes(m.to_bytes()) == m


def test_bad_input_is_a_clear_error():
    with pytest.raises(stagelink.InvalidArgumentError, match="unknown control message type"):
        ControlMessage("resubmit", "r").to_bytes()
    with pytest.raises(stagelink.InvalidArgumentError, match="request_id"):
        ControlMessage("data_ready").to_bytes()
    good = ControlMessage("stream", "r", chunk_id=2, metadata={"a": [1, 2]}).to_bytes()
    for n in range(len(good)):
        with pytest.raises(stagelink.CorruptError):
            ControlMessage.from_bytes(good[:n])
    rng = random.Random(3)
    for _ in range(3000):  # bit flips: a message or CorruptError, never anything else
        b = bytearray(good)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        try:
            ControlMessage.from_bytes(bytes(b))
        except stagelink.CorruptError:
            pass


def test_error_messages_quoting_bytes_that_are_not_utf8_stay_the_right_error():
    """Regression: a message quoting a wire string that is not UTF-8 raised UnicodeDecodeError (or
    nanobind's RuntimeError) instead of CorruptError."""
    good = ControlMessage("stream", "r", chunk_id=2).to_bytes()
    bad_type = good.replace(b"\xa6stream", b"\xa6s\xf4ream")
    with pytest.raises(stagelink.CorruptError, match="unknown control message type"):
        ControlMessage.from_bytes(bad_type)
    with pytest.raises(stagelink.CorruptError, match="UTF-8"):
        ControlMessage.from_bytes(good.replace(b"\xa3rid\xa1r", b"\xa3rid\xa1\xff"))
    md = ControlMessage("stream", "r", metadata={"k": "abc"}).to_bytes()
    with pytest.raises(stagelink.CorruptError, match="'md'"):
        ControlMessage.from_bytes(md.replace(b"\xa3abc", b"\xa3\xff\xfe\xfd"))


def test_a_payload_string_that_is_not_utf8_is_reported_not_raised(tmp_path):
    import uuid
    ns = "pyctl" + uuid.uuid4().hex[:8]
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        for tree in ({"s": "abc"}, {"abc": 1}):  # a value, then a dict key (was nanobind's RuntimeError)
            ok, _, meta = c.put(0, 1, "k", tree)
            forged = dict(meta, inline=meta["inline"].replace(b"\xa3abc", b"\xa3\xff\xfe\xfd"))
            assert c.get(0, 1, "k", forged) is None
            # Reported as the damage it is (was UnicodeDecodeError, before that nanobind's RuntimeError)
            assert isinstance(c.last_error, stagelink.CorruptError), c.last_error
            assert "UTF-8" in str(c.last_error)
            c.cleanup("k")


def _sender(endpoint, n):
    from stagelink.control import Outbox
    with Outbox(endpoint) as out:
        for i in range(n):
            out.send(ControlMessage("stream", "req", from_stage="a", to_stage="b", chunk_id=i, is_done=i == n - 1),
                     timeout=10)


def test_inbox_and_outbox_across_processes():
    import multiprocessing as mp
    import os
    import threading
    import time

    from stagelink.control import Inbox, private_socket_dir, remove_socket_dir

    d = private_socket_dir("sltest")
    try:
        assert oct(os.stat(d).st_mode & 0o777) == "0o700"
        with Inbox(f"ipc://{d}/coordinator") as inbox:
            p = mp.get_context("spawn").Process(target=_sender, args=(inbox.endpoint, 500))
            p.start()
            got = [inbox.recv(timeout=30) for _ in range(500)]
            p.join(30)
            assert [m.chunk_id for m in got] == list(range(500)) and got[-1].is_done and p.exitcode == 0
            t0 = time.monotonic()
            with pytest.raises(stagelink.TimeoutError):
                inbox.recv(timeout=0.1)
            assert time.monotonic() - t0 >= 0.09
            out = []

            def waiter():
                try:
                    inbox.recv()  # no deadline: only close() ends it
                    out.append("returned")
                except stagelink.ClosedError:
                    out.append("closed")
                except Exception as e:  # noqa: BLE001 - reported below
                    out.append(repr(e))

            th = threading.Thread(target=waiter)
            th.start()
            time.sleep(0.05)
            inbox.close()  # wakes the blocked recv
            th.join(5)
            assert not th.is_alive() and out == ["closed"]
    finally:
        remove_socket_dir(d)
    assert not os.path.exists(d)


def _close_inherited(inbox):
    inbox.close()  # the parent's inbox, copied into this forked child


def test_an_inbox_closed_in_a_forked_child_does_not_wake_the_parents_for_ever():
    """Regression: closing an inherited inbox in a forked child wrote to the eventfd it shares
    with the parent, and the parent's recv, finding it readable and never draining it, spun at
    100% CPU until its deadline. The child leaves it alone."""
    import multiprocessing as mp
    import os
    import time
    from stagelink.control import Inbox, private_socket_dir, remove_socket_dir

    d = private_socket_dir("sltest")
    try:
        with Inbox(f"ipc://{d}/in") as inbox:
            p = mp.get_context("fork").Process(target=_close_inherited, args=(inbox,))
            p.start()
            p.join(30)
            assert p.exitcode == 0
            cpu0, t0 = time.process_time(), time.monotonic()
            with pytest.raises(stagelink.TimeoutError):
                inbox.recv(timeout=0.5)
            assert time.monotonic() - t0 >= 0.45
            assert time.process_time() - cpu0 < 0.2, "recv spun instead of sleeping"
    finally:
        remove_socket_dir(d)


def test_the_runtime_lifecycle_has_one_typed_message_per_meaning():
    """Issue 62: the pipeline runtime's lifecycle messages (a `ready` told apart by metadata keys
    before) are a wire type each, decoded field by field in one module (pipeline/protocol.py)."""
    from stagelink.pipeline import protocol as proto
    msgs = [proto.Progress("p1", "thinker", "torch"), proto.Ready("p1", "tcp://10.0.0.2:5000", [["a", "b", {"h": 1}]]),
            proto.StartFailed("p1", "Traceback: boom"), proto.Peers({"p1": "tcp://x:1", "p2": "tcp://y:2"}),
            proto.PeersKnown("p2"), proto.Connect([["a", "b", {"host": "h", "port": 5}]], 2.5),
            proto.Connected("p2", ["edge a -> b: refused"]), proto.Stats("p1", {"edges": {"a->b": {"bytes": 3}}}),
            proto.Shutdown(), proto.Launch("talker.1", b'{"spec": {}}\n{"control": "k"}\n')]
    types = set()
    for msg in msgs:
        wire = ControlMessage.from_bytes(msg.encode().to_bytes())
        assert proto.decode(wire) == msg
        types.add((wire.type, bool(wire.error)))
    assert len(types) == len(msgs), "one wire type (or a ready's error) per meaning"
    for t in ("submit", "data_ready", "stream", "complete", "abort", "abort_ack"):
        assert proto.decode(ControlMessage(t, "r")) is None  # a request's: handled as it is
    bad = [ControlMessage("progress", metadata={"building": 3}), ControlMessage("ready", metadata={"senders": [1]}),
           ControlMessage("peers", metadata={"peers": ["x"]}), ControlMessage("connect", metadata={"edges": "x"}),
           ControlMessage("connect", metadata=[1]), ControlMessage("stats", from_stage="p"),
           ControlMessage("stats", body=stagelink._core.encode_object([1, 2])),
           ControlMessage("launch", to_stage="p"), ControlMessage("launch", body=b"x")]
    for m in bad:
        with pytest.raises(stagelink.CorruptError, match=f"control message '{m.type}'"):
            proto.decode(ControlMessage.from_bytes(m.to_bytes()))
