"""A reader or a writer SIGKILLed mid-operation, for every connector and relay backend (issue 62:
what failover relies on). Whatever dies, nothing is lost that the survivor was promised, nothing
is left behind for good, and the survivor is told why, at once or within its timeout:

| dies | shared memory | transfer engine | store (Redis) |
|---|---|---|---|
| writer | its puts are reclaimed: a get says the entry is gone, at once | a get fails with TimeoutError naming the sender, within timeout_s | its completed puts read back whole; a torn put's chunks expire (TTL) |
| reader, mid-get | its claim is reclaimed: the next reader gets the payload whole | the sender goes on: the next reader gets it whole | its lease lapses: the next reader gets it whole |
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import stagelink

HERE = os.path.dirname(os.path.abspath(__file__))


def _child(role, kind, name, extra):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "death_child.py"), role, kind, name, json.dumps(extra)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _line(p):
    line = p.stdout.readline()
    assert line, f"the child ended early ({p.wait()})"
    return json.loads(line)


def _kill(p, after=0.1):
    time.sleep(after)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    p.stdin.close()


def _extra(name, ns, port=None):
    return {"SharedMemoryConnector": {"namespace": ns},
            "TransferEngineConnector": {"host": "127.0.0.1", "zmq_port": 0, "timeout_s": 3,
                                        "memory_pool_size": "320MiB"},
            "StoreConnector": {"port": port, "timeout_ms": 500}}[name]


CONNECTORS = ["SharedMemoryConnector", "TransferEngineConnector", "StoreConnector"]


@pytest.mark.parametrize("name", CONNECTORS)
def test_a_writer_killed_mid_put(name, ns, request):
    port = request.getfixturevalue("redis") if name == "StoreConnector" else None
    extra = _extra(name, ns, port)
    w = _child("writer", "connector", name, extra)
    md = _line(w)
    assert _line(w) == "go"
    _kill(w, 0.15)  # in the middle of a 64 MiB put
    with stagelink.create_connector(name, dict(extra, strict=True, role="receiver")) as c:
        t = time.monotonic()
        if name == "SharedMemoryConnector":
            with pytest.raises(stagelink.NotFoundError, match="reclaimed"):
                c.get("w", "r", "done", md, timeout=5)
            assert time.monotonic() - t < 1
            assert c.health()["directory_live_entries"] == 0
        elif name == "TransferEngineConnector":
            with pytest.raises(stagelink.TimeoutError, match="no reply from the sender at tcp://127.0.0.1"):
                c.get("w", "r", "done", md, timeout=5)
            assert time.monotonic() - t < 5
        else:
            got = c.get("w", "r", "done", md, timeout=5)
            assert got[0].size == 1 << 20 and (got[0] == 7).all()
            out = subprocess.run(["redis-cli", "-p", str(port), "--scan"], capture_output=True, text=True).stdout.split()
            assert out, "the torn put left its chunks"
            for k in out:  # ... every one of them expiring
                ttl = subprocess.run(["redis-cli", "-p", str(port), "PTTL", k], capture_output=True, text=True)
                assert int(ttl.stdout) > 0, k


@pytest.mark.parametrize("name", CONNECTORS)
def test_a_reader_killed_mid_get(name, ns, request):
    port = request.getfixturevalue("redis") if name == "StoreConnector" else None
    extra = _extra(name, ns, port)
    size = 64 << 20
    with stagelink.create_connector(name, dict(extra, strict=True, role="sender")) as c:
        _, _, md = c.put("w", "r", "big", np.full(size, 9, np.uint8))
        r = _child("reader", "connector", name, dict(extra, role="receiver"))
        r.stdin.write(json.dumps(md) + "\n")
        r.stdin.flush()
        assert _line(r) == "go"
        if name == "SharedMemoryConnector":
            assert _line(r) == "got"  # it holds a zero-copy view of the payload
            _kill(r, 0)
        else:
            _kill(r, 0.02)  # in the middle of the transfer
        with stagelink.create_connector(name, dict(extra, strict=True, role="receiver")) as again:
            t = time.monotonic()
            x = again.get("w", "r", "big", md, timeout=20)  # the store: once the dead reader's lease lapsed
            assert x[0].size == size and x[0][0] == 9 and x[0][-1] == 9
            assert time.monotonic() - t < (6 if name == "StoreConnector" else 3)
            del x
        assert c.put("w", "r", "after", np.full(size, 3, np.uint8))[0]  # the writer goes on


@pytest.mark.parametrize("backend", ["shm", "ucx"])
def test_a_relay_writer_killed_mid_put_leaves_the_reader_a_clear_error(backend, ns):
    extra = {"namespace": ns} if backend == "shm" else {"host": "127.0.0.1", "memory_pool_size": "320MiB"}
    cfg = {"extra": extra, "timeout_s": 3, "credits": 64, "slot_size_mb": 1}
    w = _child("writer", "relay", backend, cfg)
    md = _line(w)
    assert _line(w) == "go"
    _kill(w, 0.15)
    with stagelink.Relay(dict(cfg, backend=backend)) as r:
        t = time.monotonic()
        if backend == "shm":  # its puts are reclaimed: said at once
            with pytest.raises(stagelink.NotFoundError, match="reclaimed"):
                r.get_async(md, timeout=3).result()
            assert time.monotonic() - t < 1
        else:  # nobody answers for the sender: said within the timeout, naming it
            with pytest.raises(stagelink.TimeoutError, match="sender at tcp://127.0.0.1"):
                r.get_async(md, timeout=3).result()
            assert time.monotonic() - t < 4.5


@pytest.mark.parametrize("backend", ["shm", "ucx"])
def test_a_relay_reader_killed_mid_get_loses_nothing_and_the_credit_comes_back(backend, ns):
    """credits: 1. The reader dies holding (shm) or pulling (ucx) the one put: the put is read
    whole by the next reader, and then the writer's next put gets the credit."""
    extra = {"namespace": ns} if backend == "shm" else {"host": "127.0.0.1", "memory_pool_size": "320MiB"}
    cfg = {"extra": extra, "timeout_s": 5, "credits": 1, "slot_size_mb": 64}
    size = 64 << 20
    with stagelink.Relay(dict(cfg, backend=backend)) as w:
        md = dict(w.put_async(np.full(size, 5, np.uint8), request_id="one", edge="r").metadata)
        r = _child("reader", "relay", backend, cfg)
        r.stdin.write(json.dumps(md) + "\n")
        r.stdin.flush()
        assert _line(r) == "go"
        if backend == "shm":
            assert _line(r) == "got"
            _kill(r, 0)
        else:
            _kill(r, 0.02)
        with stagelink.Relay(dict(cfg, backend=backend)) as again:
            x = again.get_async(md, timeout=5).result()
            assert x.size == size and x[0] == 5 and x[-1] == 5
            del x
        t = time.monotonic()
        w.put_async(np.full(size, 6, np.uint8), request_id="two", edge="r")  # waits for the credit
        assert time.monotonic() - t < 3
        w.cleanup("two")
