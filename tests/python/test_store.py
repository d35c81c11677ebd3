"""StoreConnector through redis-server instances this file starts: a producer process and a
consumer process with nothing but the key in common (the seed's contract), up to 256 MiB verified;
cleanup and consumption leave no key; a missing key is None after the timeout; pickle is off; a
server in another network namespace (root)."""
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import stagelink
from net_util import start_redis as _start

pytestmark = pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")


def _dbsize(port, prefix=(), host="127.0.0.1"):
    return int(subprocess.run(list(prefix) + ["redis-cli", "-h", host, "-p", str(port), "DBSIZE"], capture_output=True,
                              text=True).stdout.strip())


PRODUCER = textwrap.dedent("""
    import hashlib, json, sys, numpy as np, stagelink
    cfg = stagelink.load_transfer_config(sys.argv[1])
    spec = [d for d in cfg.stage_connectors(0) if d["direction"] == "output"][0]["connector"]
    c = stagelink.create_connector(spec.name, spec.extra)
    out, rng = [], np.random.default_rng(5)
    for i, n in enumerate(json.loads(sys.argv[2])):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        ok, size, md = c.put(0, 1, f"req-{i}", {"hidden": data, "step": i})
        assert ok and md is None, (ok, md)                  # the store is the rendezvous: no metadata
        out.append(hashlib.blake2b(data.tobytes()).hexdigest())
    print(json.dumps(out), flush=True)
""")

YAML = """
runtime:
  connectors:
    store:
      name: StoreConnector
      extra: {{backend: redis, host: "127.0.0.1", port: "${{SL_TEST_REDIS_PORT}}", ttl_seconds: 60, timeout_ms: 5000}}
stage_args:
  - {{stage_id: 0, output_connectors: {{to_stage_1: store}}}}
  - {{stage_id: 1, input_connectors: {{from_stage_0: store}}}}
"""


def test_round_trips_across_processes_up_to_256_mib_and_nothing_left(redis, tmp_path):
    cfg = tmp_path / "pipeline.yaml"
    cfg.write_text(YAML.format())
    sizes = [0, 1, 4096, (1 << 20) + 3, 16 << 20, 256 << 20]
    env = dict(os.environ, SL_TEST_REDIS_PORT=str(redis), PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    prod = subprocess.Popen([sys.executable, "-c", PRODUCER, str(cfg), json.dumps(sizes)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    c = stagelink.create_connector("StoreConnector", {"port": redis, "strict": True})
    got = []
    for i in range(len(sizes)):                               # each get waits for its put: no metadata needed
        obj, size = c.get(0, 1, f"req-{i}", timeout=60)
        assert obj["step"] == i
        got.append(hashlib.blake2b(np.asarray(obj["hidden"]).tobytes()).hexdigest())
        del obj
    out, err = prod.communicate(timeout=120)
    assert prod.returncode == 0, err[-2000:]
    assert got == json.loads(out)
    assert _dbsize(redis) == 0                                # read once: every key gone
    c.close()


def test_missing_key_is_none_after_the_timeout_and_cleanup_leaves_no_key(redis):
    c = stagelink.create_connector("StoreConnector", {"port": redis})
    t0 = time.monotonic()
    assert c.get(0, 1, "never", timeout=0.3) is None
    assert 0.25 < time.monotonic() - t0 < 2
    for i in range(3):
        c.put(0, 1, f"r7_chunk_{i}", np.arange(100000 * (i + 1)), request_id="r7")
    c.put(0, 1, "r8", b"other request")
    assert c.cleanup("r7") == 3
    assert c.get(0, 1, "r8")[0] == b"other request"
    assert _dbsize(redis) == 0
    h = c.health()
    assert h["status"] == "healthy" and h["store"]["role"] == "master" and h["puts"] == 4
    c.close()


def test_a_put_whose_chunk_another_client_deleted_says_why_at_once(redis):
    """Another Redis client deletes one chunk of a put. Before: the get waited out its deadline
    and said there was no such key; now it fails at once naming the missing chunk, and leaves
    nothing of that put behind."""
    c = stagelink.create_connector("StoreConnector", {"port": redis, "chunk_bytes": 1 << 20})
    assert c.put(0, 1, "k", np.arange(3 << 20, dtype=np.uint8))[0]
    keys = subprocess.run(["redis-cli", "-p", str(redis), "KEYS", "sl:{k@0_1}:c:*"], capture_output=True,
                          text=True).stdout.split()
    assert len(keys) >= 3
    subprocess.run(["redis-cli", "-p", str(redis), "DEL", sorted(keys)[1]], check=True, capture_output=True)
    t0 = time.monotonic()
    assert c.get(0, 1, "k", timeout=5) is None
    assert time.monotonic() - t0 < 2
    assert isinstance(c.last_error, stagelink.CorruptError)
    assert "a chunk of its put is gone from the store" in str(c.last_error)
    assert _dbsize(redis) == 0
    assert c.put(0, 1, "k", b"again")[0] and c.get(0, 1, "k")[0] == b"again"
    c.close()


def test_pickle_is_off_by_default_for_the_store(redis):
    c = stagelink.create_connector("StoreConnector", {"port": redis})
    ok, _, _ = c.put(0, 1, "obj", {"x": {1, 2, 3}})          # a set needs pickle: refused
    assert not ok
    assert _dbsize(redis) == 0
    c.close()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="network namespaces need root and iproute2")
def test_server_in_another_network_namespace():
    from stagelink.bench_te import TwoHosts
    h = TwoHosts(True)
    try:
        p, port = _start(h.a, h.addr_a)
        try:
            code = textwrap.dedent(f"""
                import numpy as np, stagelink
                c = stagelink.create_connector("StoreConnector", {{"url": "redis://{h.addr_a}:{port}", "strict": True}})
                d = np.random.default_rng(1).integers(0, 256, 20 << 20, dtype=np.uint8)
                c.put(0, 1, "x", d)
                got, _ = c.get(0, 1, "x", timeout=10)
                assert np.array_equal(got, d)
                print("ok")
            """)
            r = subprocess.run(h.b + [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, PYTHONPATH=os.pathsep.join(q for q in sys.path if q)))
            assert r.stdout.strip() == "ok", r.stderr[-2000:]
            assert _dbsize(port, h.a, h.addr_a) == 0
        finally:
            p.kill()
            p.wait()
    finally:
        h.close()


class _SlowReplies:
    """A TCP proxy to a redis-server that delays every byte the server sends by `delay` seconds
    (order kept): a link with a long way back, to count a client's round trips by its latency."""

    def __init__(self, port, delay):
        import asyncio
        import threading
        self.delay, self.target = delay, port
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def pump(reader, writer, delay):
            q = asyncio.Queue()

            async def sender():
                while True:
                    due, data = await q.get()
                    if data is None:
                        break
                    await asyncio.sleep(max(0.0, due - self.loop.time()))
                    writer.write(data)
                    await writer.drain()
                writer.close()

            task = asyncio.ensure_future(sender())
            try:
                while data := await reader.read(1 << 16):
                    q.put_nowait((self.loop.time() + delay, data))
            finally:
                q.put_nowait((0, None))
                await task

        async def handle(cr, cw):
            sr, sw = await asyncio.open_connection("127.0.0.1", self.target)
            await asyncio.gather(pump(cr, sw, 0.0), pump(sr, cw, self.delay), return_exceptions=True)

        async def main():
            self.stop = asyncio.Event()
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            await self.stop.wait()
            server.close()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            await server.wait_closed()

        def run():
            self.loop.run_until_complete(main())
            self.loop.close()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(10)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(5)


def test_a_woken_get_has_its_payload_without_another_round_trip(redis):
    """The claim rides behind the BLPOP in one pipeline: the server runs it the moment the put's
    signal wakes the wait, so a blocked get returns with the putter's own reply, not one round trip
    later. Measured over a link whose replies take 60 ms: without that, the get came 60 ms after
    the put returned."""
    import threading
    delay = 0.06
    proxy = _SlowReplies(redis, delay)
    try:
        extra = {"host": "127.0.0.1", "port": proxy.port, "strict": True, "timeout_ms": 5000}
        with stagelink.create_connector("StoreConnector", extra) as waiter, \
                stagelink.create_connector("StoreConnector", extra) as putter:
            lags = []
            for i in range(3):
                woke = {}

                def wait(i=i, woke=woke):
                    got = waiter.get(0, 1, f"w{i}", timeout=10)
                    woke["t"] = time.monotonic()
                    woke["got"] = got

                t = threading.Thread(target=wait)
                t.start()
                time.sleep(0.4)  # blocked by now
                putter.put(0, 1, f"w{i}", np.arange(100, dtype=np.int32))
                put_done = time.monotonic()
                t.join(10)
                assert woke["got"] is not None and np.array_equal(woke["got"][0], np.arange(100, dtype=np.int32))
                lags.append(woke["t"] - put_done)
            assert sorted(lags)[1] < delay / 2, lags
    finally:
        proxy.close()
    assert _dbsize(redis) == 0


def test_a_blocked_get_burns_no_cpu(redis):
    """Reads spin briefly for a reply (STAGELINK_REDIS_SPIN_US) before sleeping; a get blocked
    for a second spins once and then sleeps: well under a tenth of a core."""
    import resource
    with stagelink.create_connector("StoreConnector", {"host": "127.0.0.1", "port": redis}) as c:
        c.get(0, 1, "warm", timeout=0.05)
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        assert c.get(0, 1, "never", timeout=1.0) is None
        wall = time.monotonic() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert wall >= 0.9 and cpu < 0.1 * wall, (cpu, wall)


def _store_traffic(c, tag, n, q):
    """Puts and gets through `c` (inherited through fork() in the child); reports what came back wrong."""
    bad = []
    try:
        for i in range(n):
            data = np.full(1000 + i, i % 251, np.uint8)
            ok, _, _ = c.put(0, 1, f"{tag}{i}", {"d": data, "i": i})
            got = c.get(0, 1, f"{tag}{i}", timeout=5) if ok else None
            if got is None or got[0]["i"] != i or not np.array_equal(got[0]["d"], data):
                bad.append((i, ok, repr(c.last_error)[:120]))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        bad.append(("raised", repr(e)[:200]))
    q.put(bad)


def test_a_store_connector_inherited_through_fork_dials_its_own_connections(redis):
    """Regression: a forked child using the connector it inherited took the parent's pooled Redis
    connections, so the two processes wrote on the same sockets and read each other's replies.
    The child now drops its copy of the pool and dials its own."""
    c = stagelink.create_connector("StoreConnector", {"port": redis, "connections": 1})
    try:
        assert c.put(0, 1, "warm", b"x")[0] and c.get(0, 1, "warm")[0] == b"x"  # a pooled connection now
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_store_traffic, args=(c, "child", 300, q))
        p.start()
        _store_traffic(c, "parent", 300, q)
        results = [q.get(timeout=60), q.get(timeout=60)]
        p.join(30)
        assert p.exitcode == 0
        assert results == [[], []], results
        assert _dbsize(redis) == 0
    finally:
        c.close()


def _store_counter(name):
    from stagelink import metrics
    return sum(s["value"] for f in metrics.collect() if f["name"] == name
               for s in f["samples"] if s["labels"] == ["StoreConnector"])


def test_the_store_counts_its_round_trips_and_leased_reads(redis):
    """Issue 63: the store connector's round trips to its servers, and the reads it held under a
    lease (a large payload's last read), in the metrics tree."""
    c = stagelink.create_connector("StoreConnector", {"port": redis})
    try:
        rt0 = _store_counter("stagelink_store_round_trips_total")
        lease0 = _store_counter("stagelink_store_leased_reads_total")
        ok, _, meta = c.put(0, 1, "small", b"x" * 100)
        assert ok and c.get(0, 1, "small", meta)[0] == b"x" * 100
        small = _store_counter("stagelink_store_round_trips_total") - rt0
        assert 2 <= small <= 6, small  # a put and a get: a few pipelined batches, not one per command
        assert _store_counter("stagelink_store_leased_reads_total") == lease0  # read whole: no lease
        big = np.arange(4 << 20, dtype=np.uint8)
        ok, _, meta = c.put(0, 1, "big", big)
        got, _ = c.get(0, 1, "big", meta)
        assert np.array_equal(got, big)
        assert _store_counter("stagelink_store_leased_reads_total") == lease0 + 1
        assert _store_counter("stagelink_store_round_trips_total") - rt0 > small
    finally:
        c.close()
