import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import stagelink

THR = 65536


def shm(ns, **kw):
    extra = {"namespace": ns, "arena_bytes": 320 << 20}
    extra.update(kw)
    return stagelink.create_connector("SharedMemoryConnector", extra)


def _consumer(ns, n, q):
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        for i in range(n):
            got = c.get(0, 1, f"k{i}", timeout=30)
            if got is None:
                q.put(("missing", i))
                continue
            data, size = got
            q.put((i, hashlib.sha256(np.ascontiguousarray(data["x"]).tobytes()).hexdigest(), data["i"], size))


SIZES = [0, 1, THR - 1, THR, THR + 1, 1 << 20, 256 << 20]


def test_cross_process_round_trips_with_checksums(ns):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_consumer, args=(ns, len(SIZES), q))
    p.start()
    digests = {}
    with shm(ns) as c:
        for i, n in enumerate(SIZES):
            arr = np.random.default_rng(i).integers(0, 255, n, dtype=np.uint8)
            digests[i] = hashlib.sha256(arr.tobytes()).hexdigest()
            ok, size, meta = c.put(0, 1, f"k{i}", {"x": arr, "i": i})
            assert ok, c.last_error
            assert size >= n
        for _ in SIZES:
            item = q.get(timeout=120)
            assert item[0] != "missing", item
            i, digest, echoed, _size = item
            assert digest == digests[i] and echoed == i
        p.join(60)
    assert p.exitcode == 0


def test_inline_threshold_in_metadata(ns):
    with shm(ns) as c:
        ok, size, meta = c.put(0, 1, "small", b"x" * 1000)
        assert ok and "inline" in meta and meta["size"] == size
        assert c.get(0, 1, "small", meta) == (b"x" * 1000, size)
        ok, size, meta = c.put(0, 1, "big", b"x" * (THR + 10))
        assert ok and "inline" not in meta and meta["shm"]["name"].startswith(f"sl.{os.getuid()}.{ns}.")


@pytest.mark.parametrize("zero_copy", [False, True])
def test_inline_results_outlive_their_metadata(ns, zero_copy):
    # A get reads an inline frame from the metadata's bytes object in place: what it returns must
    # own its memory (or hold the bytes), whole after the metadata and its bytes are dropped and the
    # memory is reused.
    want = {"hidden": np.arange(200, dtype=np.float32), "ids": list(range(300)), "raw": b"r" * 64}
    with shm(ns) as c:
        for i in range(3):
            ok, size, meta = c.put(0, 1, f"k{i}", want)
            assert ok and "inline" in meta
            got, _ = c.get(0, 1, f"k{i}", {k: bytes(bytearray(v)) if k == "inline" else v for k, v in meta.items()},
                           zero_copy=zero_copy)
            del meta
            junk = [bytes([i]) * 4096 for _ in range(200)]  # reuse the freed memory
            assert np.array_equal(got["hidden"], want["hidden"]) and got["ids"] == want["ids"]
            assert bytes(got["raw"]) == want["raw"]
            del junk


def test_types_round_trip(ns):
    with shm(ns) as c:
        cases = {
            "bytes": b"abc" * 1000,
            "bytearray": bytearray(b"z" * 5000),
            "array": np.arange(12, dtype=np.float32).reshape(3, 4),
            "scalar_array": np.array(3.5),
            "tree": {"a": [1, 2.5, "s", None], "h": np.ones((2, 3), np.float16), "b": b"\x00\x01"},
            "noncontig": np.arange(100, dtype=np.int64)[::3],
        }
        for k, v in cases.items():
            ok, _, meta = c.put("enc", "llm", k, v)
            assert ok, (k, c.last_error)
            got, _ = c.get("enc", "llm", k, meta)
            if isinstance(v, np.ndarray):
                assert got.dtype == v.dtype and np.array_equal(got, v)
            elif isinstance(v, dict):
                assert got["a"] == v["a"] and np.array_equal(got["h"], v["h"]) and got["b"] == v["b"]
            else:
                assert bytes(got) == bytes(v)


ARRAY_DTYPES = [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
                np.float16, np.float32, np.float64, np.bool_, np.complex64, np.complex128]


@pytest.mark.parametrize("zero_copy", [False, True])
def test_numpy_arrays_travel_typed_without_pickling(ns, zero_copy):
    """A plain array is put as one typed tensor (no pickle) and comes back as an equal array."""
    rng = np.random.default_rng(3)
    with shm(ns) as c:
        for i, dt in enumerate(ARRAY_DTYPES):
            # (40000,) is past the inline threshold; (1 << 18,) of 4+ byte items lands in a pooled buffer
            for shape in [(1,), (7,), (3, 5, 2), (40000,), (1 << 18,)]:
                a = (rng.integers(0, 100, shape) % 2 == 1) if dt is np.bool_ else rng.integers(0, 100, shape).astype(dt)
                key = f"a{i}.{len(shape)}.{shape[0]}"
                ok, size, meta = c.put(0, 1, key, a)
                assert ok
                # The 64-byte frame header and a tensor table under 64 bytes, then the array:
                # exactly one region, so no pickle stream (that would be a second region).
                assert size == 128 + a.nbytes
                got, _ = c.get(0, 1, key, meta, zero_copy=zero_copy)
                assert type(got) is np.ndarray and got.dtype == a.dtype and got.shape == a.shape
                assert np.array_equal(got, a)
                if zero_copy:
                    assert not got.flags.writeable
                else:  # the caller owns the copy
                    got[...] = got[::-1].copy()
                del got
        assert c.health()["outstanding"] == 0  # every slot released by its get (or dropped view)


class Sub(np.ndarray):
    pass


def test_arrays_the_typed_path_cannot_carry_are_pickled_exactly(ns):
    """0-d, strided, byte-swapped, subclassed and structured arrays keep their exact type."""
    cases = {
        "zerod": np.array(3.5),
        "strided": np.arange(30, dtype=np.int32)[::3],
        "bigendian": np.arange(6, dtype=">i4").reshape(2, 3),
        "sub": np.arange(4).view(Sub),
        "struct": np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
        "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    }
    with shm(ns) as c:
        for k, v in cases.items():
            ok, _, meta = c.put(0, 1, k, v)
            assert ok, k
            got, _ = c.get(0, 1, k, meta)
            assert type(got) is type(v) and got.dtype == v.dtype and got.shape == v.shape, k
            assert np.array_equal(got, v), k


def test_torch_tensors_come_back_as_torch():
    torch = pytest.importorskip("torch")
    ns = "pytorch" + str(os.getpid())
    with shm(ns) as c:
        t = torch.randn(64, 32).to(torch.bfloat16)
        ok, _, meta = c.put(0, 1, "t", {"hidden": t, "codes": torch.arange(25, dtype=torch.int32)})
        assert ok, c.last_error
        got, _ = c.get(0, 1, "t", meta)
        assert isinstance(got["hidden"], torch.Tensor) and got["hidden"].dtype == torch.bfloat16
        assert torch.equal(got["hidden"], t) and torch.equal(got["codes"], torch.arange(25, dtype=torch.int32))
        ok, _, meta = c.put(0, 1, "v", t.float())
        view, _ = c.get(0, 1, "v", meta, zero_copy=True)
        assert torch.equal(view, t.float())
        del view


def test_zero_copy_view_holds_slot_until_dropped(ns):
    with shm(ns, arena_bytes=4 << 20, put_timeout_s=0.2) as c, shm(ns) as r:
        arr = np.full(3 << 20, 9, np.uint8)
        ok, _, meta = c.put(0, 1, "a", arr)
        view, _ = r.get(0, 1, "a", meta, zero_copy=True)
        assert not view.flags.writeable and view[123] == 9
        ok, _, _ = c.put(0, 1, "b", arr)  # arena still held by the view
        assert not ok and isinstance(c.last_error, stagelink.ExhaustedError)
        del view
        ok, _, _ = c.put(0, 1, "b", arr)
        assert ok, c.last_error
        assert r.get(0, 1, "b") is not None


def test_zero_copy_results_are_read_only_at_every_size(ns):
    """An inline payload asked for zero-copy comes back as a private copy, a large one as a view
    into shared memory: read-only alike, so code that works for one size works for the other."""
    with shm(ns) as c:
        for n in (16, 1 << 20):
            a = np.arange(n, dtype=np.uint8)
            for name, data in (("arr", a), ("obj", {"x": a})):
                key = f"{name}{n}"
                ok, _, meta = c.put(0, 1, key, data)
                assert ok and (("inline" in meta) == (n == 16)), key
                got, _ = c.get(0, 1, key, meta, zero_copy=True)
                arr = got if name == "arr" else got["x"]
                assert np.array_equal(arr, a) and not arr.flags.writeable, key
                with pytest.raises(ValueError):
                    arr[0] = 1
                del got, arr
        assert c.health()["outstanding"] == 0


def test_get_into_copies_into_the_callers_buffer_and_frees_the_slot(ns):
    with shm(ns, arena_bytes=4 << 20, put_timeout_s=0.2) as c, shm(ns) as r:
        out = np.zeros(3 << 20, np.uint8)
        for i in range(3):  # the arena holds one payload: each get_into must free its slot
            arr = np.arange(3 << 20, dtype=np.uint32).astype(np.uint8) + np.uint8(i)
            ok, _, meta = c.put(0, 1, f"a{i}", arr)
            assert ok, c.last_error
            assert r.get_into(0, 1, f"a{i}", out, meta) == arr.nbytes
            assert np.array_equal(out, arr)
        small = bytearray(100)
        c.put(0, 1, "raw", b"x" * 64)
        assert r.get_into(0, 1, "raw", small, timeout=1) == 64 and small[:64] == b"x" * 64
        assert r.get_into(0, 1, "absent", small) is None and r.last_error is None
    with shm(ns, strict=True) as c, shm(ns, strict=True) as r:
        c.put(0, 1, "big", np.ones(1000, np.uint8))
        with pytest.raises(stagelink.InvalidArgumentError, match="1000 bytes"):
            r.get_into(0, 1, "big", bytearray(10), timeout=1)
        c.put(0, 1, "obj", {"a": {1, 2}})  # a set: pickled
        with pytest.raises(stagelink.InvalidArgumentError, match="pickled"):
            r.get_into(0, 1, "obj", bytearray(10), timeout=1)
        c.put(0, 1, "ro", b"abc")
        with pytest.raises(BufferError):
            r.get_into(0, 1, "ro", b"read-only", timeout=1)


def test_loan_writes_in_place(ns):
    with shm(ns) as c:
        loan = c.loan((256, 1024), np.float32)
        loan.array[:] = 1.5
        ok, size, meta = c.put(0, 1, "loaned", loan)
        assert ok and loan.published
        got, _ = c.get(0, 1, "loaned", meta)
        assert got.shape == (256, 1024) and got.dtype == np.float32 and float(got.sum()) == 1.5 * 256 * 1024


def _reader(ns, meta, q):
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        got = c.get(0, 1, "fan", meta)
        q.put(None if got is None else int(got[0].sum()))


def test_loan_may_outlive_its_connector(ns):
    c = shm(ns, arena_bytes=1 << 20)
    small = c.loan((1024,), np.float32)
    big = c.loan((1 << 20,), np.float32)  # larger than the arena: a segment of its own
    view = big.array
    c.close()
    small.array[:] = 1.0  # still mapped: writing is safe
    view[:] = 2.0
    ok, _, _ = c.put(0, 1, "late", small)
    assert not ok and isinstance(c.last_error, stagelink.ClosedError)
    del small, big, view
    import gc
    gc.collect()
    assert not [f for f in os.listdir("/dev/shm") if f".{ns}." in f]


def test_fan_out_three_readers(ns):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with shm(ns) as c:
        arr = np.ones(1 << 20, np.uint8)
        ok, _, meta = c.put(0, 1, "fan", arr, readers=3)
        assert ok
        procs = [ctx.Process(target=_reader, args=(ns, meta, q)) for _ in range(3)]
        for p in procs:
            p.start()
        results = [q.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        assert results == [1 << 20] * 3
        assert c.get(0, 1, "fan", meta) is None  # a fourth read finds nothing
        assert c.health()["outstanding"] == 0


def test_keyless_get_waits_and_times_out(ns):
    with shm(ns) as c:
        t0 = time.monotonic()
        assert c.get(0, 1, "never", timeout=0.3) is None
        assert 0.28 <= time.monotonic() - t0 < 3
        assert c.get(0, 1, "never") is None  # no timeout: one attempt


def test_cleanup_close_and_context_manager(ns):
    c = shm(ns)
    for k in ("req-7", "req-7_1_0_0", "req-70"):
        assert c.put(0, 1, k, b"x" * 100000)[0]
    assert c.put(0, 1, "req-7_chunk1", b"y" * 100, request_id="req-7")[0]
    # Exact: the key equal to the id and the keys tied to it; regression: req-7_1_0_0 was freed too.
    assert c.cleanup("req-7") == 2
    assert c.get(0, 1, "req-7_chunk1") is None
    assert c.get(0, 1, "req-7_1_0_0") is not None
    assert c.get(0, 1, "req-70") is not None
    c.close()
    c.close()
    assert c.closed
    # Regression: these raised ClosedError without the GIL held and crashed the interpreter.
    assert c.put(0, 1, "x", b"1") == (False, 0, None)
    assert isinstance(c.last_error, stagelink.ClosedError)
    assert c.put(0, 1, "x", b"1" * (1 << 20)) == (False, 0, None)  # the GIL-free large-put path
    assert c.get(0, 1, "req-70") is None and isinstance(c.last_error, stagelink.ClosedError)


def test_bad_input_is_a_clear_error(ns):
    with shm(ns) as c:
        ok, _, _ = c.put(0, 1, "../etc/passwd", b"x")
        assert not ok and isinstance(c.last_error, stagelink.InvalidArgumentError) and ".." in str(c.last_error)
        assert c.put(0, 1, "k", b"x")[0]
        assert c.get(0, 1, "k", {"entry": 10**9, "gen": 1}) is None
        assert isinstance(c.last_error, stagelink.CorruptError)

        class Local:  # pickle cannot find a local class: AttributeError, reported, not raised
            pass
        ok, _, _ = c.put(0, 1, "local", Local())
        assert not ok and isinstance(c.last_error, AttributeError)
        ok, _, _ = c.put(0, 1, "lambda", lambda: 1)
        assert not ok and c.last_error is not None
    strict = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns, "strict": True})
    with strict, pytest.raises(stagelink.InvalidArgumentError):
        strict.put(0, 1, "a/b", b"x")
    with pytest.raises(stagelink.NotFoundError):
        stagelink.create_connector("NoSuchConnector")
    with pytest.raises(ValueError, match="NoSuchConnector"):  # what vLLM-Omni's callers catch
        stagelink.create_connector("NoSuchConnector")
    # Without Mooncake installed: how to install it; with it: the missing master is named.
    with pytest.raises((stagelink.UnsupportedError, stagelink.InvalidArgumentError),
                       match="pip install mooncake|needs 'metadata_server'"):
        stagelink.create_connector("MooncakeStoreConnector", {"host": "127.0.0.1"})
    with pytest.raises(stagelink.InvalidArgumentError):
        stagelink.create_connector("SharedMemoryConnector", {"namespace": "bad/ns"})


PRODUCER_SCRIPT = """
import sys, time, stagelink
c = stagelink.create_connector("SharedMemoryConnector", {"namespace": sys.argv[1], "arena_bytes": 8 << 20})
for i in range(3):
    assert c.put(0, 1, f"k{i}", b"x" * 200000)[0]
print("ready", flush=True)
time.sleep(60)
"""


def _start_and_kill_producer(ns):
    p = subprocess.Popen([sys.executable, "-c", PRODUCER_SCRIPT, ns], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    assert any(f".{ns}.a{p.pid}." in f for f in os.listdir("/dev/shm"))
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    return p.pid


def test_sigkilled_producer_is_reclaimed_at_attach(ns):
    _start_and_kill_producer(ns)
    with shm(ns) as c:  # attaching reaps what the dead producer held
        assert c.get(0, 1, "k0") is None
        assert c.health()["directory_live_entries"] == 0
        assert not any(f".{ns}.a" in f for f in os.listdir("/dev/shm"))


def test_sigkilled_producer_is_reclaimed_by_cli(ns):
    pid = _start_and_kill_producer(ns)
    cli = os.path.join(os.path.dirname(sys.executable), "stagelink")
    ls = subprocess.run([cli, "shm", "ls"], capture_output=True, text=True, check=True).stdout
    arena = [line for line in ls.splitlines() if f".{ns}.a{pid}." in line]
    assert arena and " False " in arena[0]  # listed with its owner dead
    out = subprocess.run([cli, "shm", "reap"], capture_output=True, text=True, check=True).stdout
    assert f"of dead process {pid}" in out
    assert not any(f".{ns}." in f for f in os.listdir("/dev/shm"))  # arena and directory gone


def _hammer(ns, who, n, q):
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 16 << 20}) as c:
        bad = 0
        for i in range(n):
            ok, _, _ = c.put(f"p{who}", "sink", f"m{i}", np.full(1000 + i, i % 251, np.uint8))
            bad += not ok
        got = 0
        for i in range(n):
            r = c.get(f"p{1 - who}", "sink", f"m{i}", timeout=30)
            got += r is not None and int(r[0][0]) == i % 251 and r[0].size == 1000 + i
        q.put((bad, got))
        c.get("done", f"p{who}", "x", timeout=5)  # linger so the peer can read everything
        time.sleep(0.5)


def test_concurrent_producers_and_consumers(ns):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    n = 200
    ps = [ctx.Process(target=_hammer, args=(ns, w, n, q)) for w in (0, 1)]
    for p in ps:
        p.start()
    res = [q.get(timeout=120) for _ in ps]
    for p in ps:
        p.join(60)
    assert res == [(0, n), (0, n)]


def _put_from_inherited(c, q):
    ok, _, _ = c.put(0, 1, "from_child", np.full(1 << 18, 0xC1, np.uint8))
    q.put(ok)  # then ends as multiprocessing's children do: os._exit, nothing closed


def test_a_connector_inherited_through_fork_works_in_the_child_and_leaves_nothing(ns):
    """Regression: a connector made before a fork() and used in the child wrote the child's puts
    into the parent's arena through a copy of the parent's allocator; the parent's next put took
    the same range and the child's payload came back as another one (or as CorruptError). The
    child is now a participant of its own, and what it leaves on exit is reclaimed."""
    with shm(ns, arena_bytes=4 << 20) as c, shm(ns, arena_bytes=1 << 20) as r:
        assert c.put(0, 1, "before", np.full(1 << 18, 0xB0, np.uint8))[0]
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_put_from_inherited, args=(c, q))
        p.start()
        assert q.get(timeout=30) is True
        p.join(30)
        assert p.exitcode == 0
        ok, _, meta = c.put(0, 1, "after", np.full(1 << 18, 0xA1, np.uint8))
        assert ok
        got = r.get(0, 1, "from_child", None, timeout=5)
        assert got is not None, r.last_error
        assert got[0].shape == (1 << 18,) and (got[0] == 0xC1).all()
        del got
        for key, byte in (("before", 0xB0), ("after", 0xA1)):
            got = r.get(0, 1, key, None, timeout=5)
            assert got is not None and (got[0] == byte).all(), key
    assert not [f for f in os.listdir("/dev/shm") if ns in f]


SYSCALL_LOOP = """
import sys, numpy as np, stagelink
ns = sys.argv[2]
c = stagelink.SharedMemoryConnector({"namespace": ns, "arena_bytes": 64 << 20})
r = stagelink.SharedMemoryConnector({"namespace": ns})
small, big = np.ones(256, np.float32), np.ones(1 << 16, np.uint8)  # inline; in the arena
for i in range(int(sys.argv[1])):
    for v in (small, big):
        ok, _, md = c.put("a", "b", "k", v); r.get("a", "b", "k", md)  # with the put's metadata
        c.put("a", "b", "k", v); r.get("a", "b", "k")                  # by key
c.close(); r.close()
"""


MQ_LOOP = """
import sys, numpy as np, stagelink
w = stagelink.MessageQueue(1, 1)
r = stagelink.MessageQueue.create_from_handle(w.export_handle(), 0)
w.wait_until_ready(5); r.wait_until_ready(5)
msg = {"x": np.ones(16, np.float32), "ids": [1, 2, 3]}
for i in range(int(sys.argv[1])):
    w.enqueue(msg); r.dequeue(timeout=5)
    w.enqueue(b"x" * 100); r.dequeue(timeout=5)
w.shutdown(); r.shutdown()
"""

RELAY_CONTROL_LOOP = """
import os, sys, numpy as np
from stagelink.relay import Relay
from stagelink.control import ControlMessage, Inbox, Outbox
r = Relay({"backend": "shm", "extra": {"namespace": sys.argv[2]}})
ib = Inbox("shm://" + sys.argv[2]); ob = Outbox(ib.endpoint)
x = np.ones(1 << 16, np.uint8)
for i in range(int(sys.argv[1])):
    r.get_async(r.put_async(x, request_id="q").metadata).result()
    ob.send(ControlMessage("submit", "q", body=b"abc"), timeout=5); ib.recv(timeout=5)
r.close(); ob.close(); ib.close()
"""


def _syscalls(script, n, tmp_path, *args):
    out = tmp_path / f"strace{n}.txt"
    # numpy's BLAS thread pool off: numpy 1.x's OpenBLAS threads spin in sched_yield after import
    # (thousands of calls, varying from run to run), which are not stagelink's.
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    subprocess.run(["strace", "-f", "-c", "-o", str(out), sys.executable, "-c", script, str(n), *args],
                   check=True, timeout=300, env=env)
    return int(out.read_text().strip().splitlines()[-1].split()[3])  # the "total" row's call count


needs_strace = pytest.mark.skipif(not __import__("shutil").which("strace") or "libasan" in os.environ.get("LD_PRELOAD", ""),
                                  reason="needs strace, and the process's own allocator (ASan's maps and unmaps)")


@needs_strace
def test_put_and_get_make_no_system_call(ns, tmp_path):
    """The hot path's rule (ARCHITECTURE.md): no system call on the path of a small message. 40,000
    more round trips (inline and arena payloads, by metadata and by key, across two connectors)
    add no system call. Regression: every get of an arena payload called getuid() (30,000 more)."""
    few, many = _syscalls(SYSCALL_LOOP, 100, tmp_path, ns), _syscalls(SYSCALL_LOOP, 10100, tmp_path, ns)
    assert many - few < 200, f"{many - few} system calls more for 40,000 more round trips"


@needs_strace
def test_queue_messages_make_no_system_call_when_nobody_sleeps(tmp_path):
    """The queue's half of the rule: a reader that is not asleep costs the writer no futex wake,
    and neither side makes any other system call (20,000 more messages: none more)."""
    few, many = _syscalls(MQ_LOOP, 100, tmp_path), _syscalls(MQ_LOOP, 10100, tmp_path)
    assert many - few < 200, f"{many - few} system calls more for 20,000 more messages"


@needs_strace
def test_relay_puts_and_control_messages_make_no_system_call(ns, tmp_path):
    """The same for the shared-memory relay (put_async + get_async of 64 KiB) and a control message
    over the shared-memory rings: 10,000 more of each, no system call more."""
    few, many = (_syscalls(RELAY_CONTROL_LOOP, 100, tmp_path, ns),
                 _syscalls(RELAY_CONTROL_LOOP, 10100, tmp_path, ns))
    assert many - few < 200, f"{many - few} system calls more for 10,000 more relay puts and messages"
