"""The transfer-engine connector on loopback (no namespaces needed): what the Python caller gets."""
import time

import numpy as np
import pytest

import stagelink


def _pair():
    s = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "zmq_port": 0, "role": "sender",
                                                               "memory_pool_size": 64 << 20})
    r = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "role": "receiver",
                                                               "memory_pool_size": 64 << 20})
    return s, r


def test_zero_copy_get_is_a_view_of_the_receivers_pool_held_until_dropped():
    # Regression: the pool region's keepalive held a null pointer, so every zero-copy get of a
    # large payload was silently copied (16 MiB: a whole memcpy per get on the caller's thread).
    s, r = _pair()
    try:
        for i in range(3):  # the first pull goes by the side channel, the others over UCX
            data = np.arange(1 << 20, dtype=np.float32)
            ok, _, md = s.put(0, 1, f"k{i}", data)
            assert ok
            x, size = r.get(0, 1, f"k{i}", md, zero_copy=True)
            assert np.array_equal(x, data)
            assert not x.flags.writeable and x.base is not None
            assert r.health()["ucx"]["pool_used"] >= data.nbytes  # the region is held by the view
            del x
            assert r.health()["ucx"]["pool_used"] == 0
        h = r.health()
        assert h["gets_over_side_channel"] == 1 and h["gets_over_ucx"] == 2
    finally:
        s.close()
        r.close()


def test_copying_get_owns_its_array_and_frees_the_region_at_once():
    s, r = _pair()
    try:
        data = np.arange(300000, dtype=np.int64)
        ok, _, md = s.put(0, 1, "c", data)
        x, _ = r.get(0, 1, "c", md)
        assert np.array_equal(x, data) and x.flags.writeable  # its own memory (a capsule holds it)
        assert r.health()["ucx"]["pool_used"] == 0
    finally:
        s.close()
        r.close()


def test_copying_get_lands_in_memory_it_owns_copied_once_at_most():
    """Issue 52: a copying get of 1 MiB and more lands the payload straight in a host buffer the
    result owns (no copy after the transfer: it took 1.2-1.6x the zero-copy get), never in the
    pool: held results take none of its room. Exactly one host buffer per get (the copy out of the
    pool made one, then the binding a second). A payload larger than the pool is refused either
    way: the pool bounds what a receiver accepts."""
    s = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "zmq_port": 0, "role": "sender",
                                                               "memory_pool_size": 128 << 20})
    r = stagelink.create_connector("TransferEngineConnector", {"host": "127.0.0.1", "role": "receiver",
                                                               "memory_pool_size": 40 << 20})
    try:
        data = np.arange(8 << 20, dtype=np.float32)  # 32 MiB
        held = []
        for i in range(3):  # three 32 MiB results alive at once in a 40 MiB pool
            ok, _, md = s.put(0, 1, f"big{i}", data)
            assert ok
            before = stagelink._core.host_pool_stats()
            x, size = r.get(0, 1, f"big{i}", md)
            after = stagelink._core.host_pool_stats()
            assert x is not None, r.last_error
            assert np.array_equal(x, data) and x.flags.writeable and size >= data.nbytes
            assert (after["hits"] + after["misses"]) - (before["hits"] + before["misses"]) == 1
            x[0] = -1.0  # ours: writes go nowhere else
            assert r.health()["ucx"]["pool_used"] == 0
            held.append(x)
        big = np.zeros(12 << 20, dtype=np.float32)  # 48 MiB: over the pool
        for zc in (False, True):
            ok, _, md = s.put(0, 1, f"over{zc}", big)
            assert r.get(0, 1, f"over{zc}", md, zero_copy=zc) is None
            assert "more than this receiver's memory pool" in str(r.last_error)
    finally:
        s.close()
        r.close()


def _use_inherited(s, r, q):
    ok, _, _ = s.put(0, 1, "from_child", np.arange(10))
    q.put((ok, type(s.last_error).__name__, str(s.last_error)[:200]))
    s.close()  # the parent's engine, thread and sockets: left alone, and no hang
    r.close()


def test_a_connector_inherited_through_fork_says_so_and_leaves_the_parents_alone():
    """UCX does not survive fork(): in a forked child the inherited connector's put fails with
    UnsupportedError saying to make a new one (instead of driving the parent's UCX worker), and its
    close there neither hangs (the side-channel thread and the ZeroMQ context stayed in the parent)
    nor breaks the parent's connector."""
    import multiprocessing as mp
    import time
    s, r = _pair()
    try:
        ok, _, md = s.put(0, 1, "before", np.arange(1000))
        assert ok and np.array_equal(r.get(0, 1, "before", md)[0], np.arange(1000))
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        t0 = time.monotonic()
        p = ctx.Process(target=_use_inherited, args=(s, r, q))
        p.start()
        ok, kind, msg = q.get(timeout=30)
        p.join(30)
        assert p.exitcode == 0 and time.monotonic() - t0 < 20
        assert not ok and kind == "UnsupportedError" and "fork" in msg, msg
        ok, _, md = s.put(0, 1, "after", np.arange(2000))
        assert ok and np.array_equal(r.get(0, 1, "after", md)[0], np.arange(2000))
    finally:
        s.close()
        r.close()


def test_tp_rank_aware_get_with_partial_metadata_reaches_that_ranks_sender():
    """vLLM-Omni's KV manager with TP > 1: each sender rank listens on base + KV_TRANSFER_PORT_OFFSET
    + rank * KV_RANK_PORT_STRIDE, puts under the same key, and the receiver passes only
    {source_host, source_port} to get(). The get must ask that rank's sender, not the configured
    one, and find the key there (no data_size: it queries first)."""
    from net_util import free_port_run
    from stagelink.initialization import KV_RANK_PORT_STRIDE, KV_TRANSFER_PORT_OFFSET

    def ports(base):
        return [base + KV_TRANSFER_PORT_OFFSET + rank * KV_RANK_PORT_STRIDE for rank in (0, 1)]

    base = free_port_run(KV_TRANSFER_PORT_OFFSET + KV_RANK_PORT_STRIDE + 1)
    assert base is not None
    # Gets that name no put's metadata (its capability) are served only where the sender says so
    # (serve_by_key; or extra.curve, which the KV manager's senders should rather have).
    senders = [stagelink.create_connector("TransferEngineConnector", {
        "host": "127.0.0.1", "zmq_port": p, "role": "sender", "memory_pool_size": 8 << 20,
        "serve_by_key": True}) for p in ports(base)]
    r = stagelink.create_connector("TransferEngineConnector", {
        "host": "127.0.0.1", "role": "receiver", "memory_pool_size": 8 << 20,
        "sender_host": "127.0.0.1", "sender_zmq_port": ports(base)[0]})  # rank 0's, as configured
    try:
        for rank, s in enumerate(senders):
            assert s.put("prefill", "decode", "req-1_kv", np.full(1000, rank, np.int32))[0]
        for rank, p in enumerate(ports(base)):
            got, _ = r.get("prefill", "decode", "req-1_kv", {"source_host": "127.0.0.1", "source_port": p}, timeout=5)
            assert (got == rank).all()
    finally:
        r.close()
        for s in senders:
            s.close()


def test_connect_ahead_makes_the_first_get_take_the_ucx_path_and_relays_expose_it(ns):
    # Connector: connect() to sender_info() (or a put's metadata) before any put; the first get
    # then goes over UCX like later ones (without it: by the side channel).
    s, r = _pair()
    try:
        assert r.sender_info() is None  # a receiver serves nothing
        info = s.sender_info()
        assert info["source_host"] == "127.0.0.1" and info["source_port"] > 0
        r.connect(info, timeout=5)
        data = np.arange(1 << 18, dtype=np.float32)
        ok, _, md = s.put(0, 1, "k", data)
        assert ok and np.array_equal(r.get(0, 1, "k", md)[0], data)
        h = r.health()
        assert h["connects"] == 1 and h["gets_over_side_channel"] == 0 and h["gets_over_ucx"] == 1
        s.close()
        t0 = time.monotonic()  # nobody serves that port any more: a timeout at the deadline
        with pytest.raises(stagelink.TimeoutError):
            r.connect(info, timeout=0.3)
        assert time.monotonic() - t0 < 2
        with pytest.raises(stagelink.NotFoundError):  # no sender known
            r.connect()
        # Regression: a NaN timeout raised a Python error without the GIL (a segfault).
        for who in (r, stagelink.Relay({"backend": "ucx", "extra": {"host": "127.0.0.1"}})):
            with pytest.raises(stagelink.InvalidArgumentError, match="NaN"):
                who.connect(info, timeout=float("nan"))
            if isinstance(who, stagelink.Relay):
                who.close()
    finally:
        s.close()
        r.close()
    # Relays: the same through sender_info()/connect(); nothing to do for shared memory.
    cfg = {"backend": "ucx", "timeout_s": 5, "extra": {"host": "127.0.0.1", "memory_pool_size": 64 << 20}}
    with stagelink.Relay(cfg) as a, stagelink.Relay(cfg) as b:
        b.connect(a.sender_info())
        op = a.put_async({"x": data}, edge="b")
        assert np.array_equal(b.get_async(op.metadata).result()["x"], data)
        h = b.health()["connector"]
        assert h["connects"] == 1 and h["gets_over_side_channel"] == 0
    with stagelink.Relay({"extra": {"namespace": ns}}) as m:
        assert m.sender_info() is None
        m.connect(None)


def test_the_transfer_engine_counts_bytes_per_peer_and_names_its_transports():
    """Issue 63: per sender, the bytes a receiver's gets pulled; the transports UCX runs; the pool."""
    from stagelink import metrics

    def samples(name):
        return {tuple(s["labels"]): s["value"] for f in metrics.collect() if f["name"] == name for s in f["samples"]}
    s, r = _pair()
    try:
        sizes = 0
        for i in range(3):
            data = np.arange(100000 * (i + 1), dtype=np.float32)
            ok, n, md = s.put(0, 1, f"p{i}", data)
            assert ok
            x, got = r.get(0, 1, f"p{i}", md)
            assert np.array_equal(x, data)
            sizes += got
        peers = samples("stagelink_te_get_bytes_by_peer_total")
        mine = {k: v for k, v in peers.items() if k[0] == "TransferEngineConnector" and v == sizes}
        assert len(mine) == 1, peers  # one sender, every byte pulled from it
        (peer,) = mine
        assert peer[1].startswith("tcp://127.0.0.1:")
        tls = [k for k in samples("stagelink_te_transports_info") if k[0] == "TransferEngineConnector"]
        assert tls and all(k[1] == "tcp" and "tcp" in k[2] for k in tls), tls
        assert any(v >= 64 << 20 for k, v in samples("stagelink_te_pool_bytes").items())
        assert sum(v for k, v in samples("stagelink_te_write_bytes_total").items()) >= sizes
    finally:
        s.close()
        r.close()
