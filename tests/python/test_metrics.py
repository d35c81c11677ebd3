"""Metrics (issue 63): one tree per process, counted in the C++ core; Prometheus' text format at
/metrics, parsed here with prometheus_client's own parser; a pipeline is one scrape target."""
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import stagelink
from stagelink.pipeline import Pipeline

S = "pipeline_stages"


def scrape(url):
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels):
    """The sum of `name`'s samples whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_a_connector_s_puts_gets_and_bytes_move_the_counters_exactly(ns):
    c = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns})
    was = stagelink.metrics.time_every()
    stagelink.metrics.set_time_every(1)  # every put and get timed: the histograms' counts exact too
    try:
        with stagelink.serve_metrics(0) as srv:
            assert srv.url.startswith("http://127.0.0.1:")
            before = scrape(srv.url)
            put_bytes, get_bytes = 0, 0
            for i in range(12):
                ok, n, _ = c.put("a", "b", f"k{i}", np.full(1000 + i, i, np.uint8))
                assert ok
                put_bytes += n
            for i in range(9):
                obj, n = c.get("a", "b", f"k{i}")
                assert obj[0] == i
                get_bytes += n
            assert c.get("a", "b", "absent") is None  # a miss, not an error
            assert c.put("a", "b", "", b"x")[0] is False  # a bad key: an error, by its code
            after = scrape(srv.url)
    finally:
        stagelink.metrics.set_time_every(was)
        c.close()
    lab = {"connector": "SharedMemoryConnector"}
    d = lambda n, **kw: value(after, n, **lab, **kw) - value(before, n, **lab, **kw)  # noqa: E731
    assert d("stagelink_connector_puts_total") == 12
    assert d("stagelink_connector_gets_total") == 9
    assert d("stagelink_connector_put_bytes_total") == put_bytes
    assert d("stagelink_connector_get_bytes_total") == get_bytes
    assert d("stagelink_connector_get_misses_total") == 1
    assert d("stagelink_connector_errors_total", op="put", code="invalid_argument") == 1
    assert d("stagelink_connector_put_seconds_count") == 12
    assert d("stagelink_connector_get_seconds_count") == 9
    assert 0 < d("stagelink_connector_put_seconds_sum") < 12 * 0.5
    # Buckets are cumulative and end at the count.
    inf = value(after, "stagelink_connector_put_seconds_bucket", le="+Inf", **lab)
    assert inf == value(after, "stagelink_connector_put_seconds_count", **lab)
    assert d("stagelink_shm_outstanding_entries") == 3  # k9..k11 unread


def test_what_a_stranger_can_hold_of_the_endpoint_is_bounded():
    from stagelink import metrics
    with stagelink.serve_metrics(0) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(metrics.MAX_CONNECTIONS + 4)]
        try:
            time.sleep(0.3)
            # Past the cap, connections are closed at once.
            closed = 0
            for s in idle[metrics.MAX_CONNECTIONS:]:
                s.settimeout(2)
                try:
                    closed += s.recv(1) == b""
                except (ConnectionResetError, socket.timeout):
                    pass
            assert closed == 4
            # The idle ones are closed after the idle timeout: a scrape gets through then.
            t0 = time.monotonic()
            while True:
                try:
                    scrape(srv.url)
                    break
                except (urllib.error.URLError, ConnectionError):
                    assert time.monotonic() - t0 < metrics.IDLE_TIMEOUT_S + 5, "idle connections held too long"
                    time.sleep(0.2)
            assert time.monotonic() - t0 > 1  # (the cap held them off meanwhile)
        finally:
            for s in idle:
                s.close()


def test_a_label_set_found_once_counts_into_the_same_sample():
    m = stagelink.metrics.counter("myapp_cells_total", "cells", ["kind"])
    cell = m.labels("a")
    for _ in range(5):
        cell.inc()
    m.inc("a", by=2)
    with pytest.raises(stagelink.StagelinkError):
        cell.inc(-1)
    with pytest.raises(stagelink.StagelinkError):
        m.labels("a", "b")
    with stagelink.serve_metrics(0) as srv:
        assert value(scrape(srv.url), "myapp_cells_total", kind="a") == 7


def test_the_endpoint_serves_metrics_only_on_loopback_by_default():
    with stagelink.serve_metrics(0) as srv:
        assert srv.host == "127.0.0.1"
        for path in ("/", "/metrics/../etc/passwd", "/debug"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(srv.url.replace("/metrics", path), timeout=5)
            assert e.value.code == 404
        req = urllib.request.Request(srv.url, data=b"x", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 405
        # A port in use: an error, not a silent second server.
        with pytest.raises(OSError):
            stagelink.serve_metrics(srv.port)
        # OpenMetrics when asked for.
        req = urllib.request.Request(srv.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        r = urllib.request.urlopen(req, timeout=5)
        assert "openmetrics" in r.headers["Content-Type"]
        assert r.read().decode().rstrip().endswith("# EOF")
    with pytest.raises(OSError):  # closed: nothing answers
        urllib.request.urlopen(srv.url, timeout=2)


def test_metrics_of_your_own_join_the_tree():
    m = stagelink.metrics.counter("myapp_widgets_total", "widgets made", ["kind"])
    m.inc("round")
    m.inc("round", by=2)
    assert stagelink.metrics.counter("myapp_widgets_total", "widgets made", ["kind"]).name == m.name
    with pytest.raises(stagelink.StagelinkError):
        m.inc("round", by=-1)
    with pytest.raises(stagelink.StagelinkError):
        stagelink.metrics.gauge("myapp_widgets_total", "as a gauge", ["kind"])
    with pytest.raises(stagelink.StagelinkError):
        stagelink.metrics.counter("stagelink_connector_puts_total", "stagelink's own")
    with stagelink.serve_metrics(0) as srv:
        assert value(scrape(srv.url), "myapp_widgets_total", kind="round") == 3


def _pipeline(ns, name, **kw):
    d = {"name": name, "relay": {"extra": {"namespace": ns}, "timeout_s": 10},
         "stages": [{"name": "thinker", "factory": f"{S}:streamer", "stream_to": "talker", "next": "talker"},
                    {"name": "talker", "factory": f"{S}:collector", "next": "vocoder"},
                    {"name": "vocoder", "factory": f"{S}:passthrough", "terminal": True}]}
    return Pipeline.from_config(d, metrics_port=0, **kw)


def test_a_pipeline_is_one_scrape_target_counting_every_stage_and_hop(ns):
    n, chunks = 20, 5
    with _pipeline(ns, "watched") as p:
        url = p.metrics_server.url
        for i in range(n):
            r = p.submit(f"r{i}", {"x": i, "chunks": chunks, "chunk_bytes": 200_000}).result(30)
            assert r["ids"] == list(range(chunks))
        m = scrape(url)
    # Every process answered, each labelled.
    for proc in ("thinker", "talker", "vocoder"):
        assert value(m, "stagelink_pipeline_process_up", process=proc) == 1
        assert value(m, "stagelink_stage_runs_total", stage=proc, process=proc) == n
        assert value(m, "stagelink_stage_failures_total", stage=proc) == 0
        assert value(m, "stagelink_stage_run_seconds_count", stage=proc) == n
    assert value(m, "stagelink_pipeline_requests_total", pipeline="watched", result="ok") == n
    assert value(m, "stagelink_pipeline_request_seconds_count", pipeline="watched") == n
    assert value(m, "stagelink_pipeline_time_to_first_chunk_seconds_count", pipeline="watched") == 0  # none to the caller
    assert value(m, "stagelink_stage_chunks_total", stage="thinker") == n * chunks
    # Hops between the stage processes (the coordinator's process is this test's, holding other
    # tests' relays and connectors): each relay put is read once; bytes out equal bytes in; the
    # connectors under those relays count the same puts and bytes.
    stages = ("thinker", "talker", "vocoder")
    at = lambda name: sum(value(m, name, process=s) for s in stages)  # noqa: E731
    puts, gets = at("stagelink_relay_puts_total"), at("stagelink_relay_gets_total")
    assert puts == gets >= n * chunks  # the chunks at least (small payloads travel in the control message)
    assert at("stagelink_relay_put_bytes_total") == at("stagelink_relay_get_bytes_total") >= n * chunks * 200_000
    assert at("stagelink_connector_puts_total") == puts
    assert at("stagelink_connector_put_bytes_total") == at("stagelink_relay_put_bytes_total")


def test_pipeline_stats_edges_are_the_metrics_tree_s_counts(ns):
    """Issue 63: an edge's messages and bytes are counted once, in the metrics tree; the figures of
    Pipeline.stats() (and stagelink run's table) read the same cells, and the hop latency is a
    histogram there too."""
    n, chunks = 6, 3
    with _pipeline(ns, "edges") as p:
        url = p.metrics_server.url
        for i in range(n):
            p.submit(f"r{i}", {"x": i, "chunks": chunks, "chunk_bytes": 100_000}).result(30)
        m = scrape(url)
        coord = p.coordinator_edges()
    stats = p.stats()
    edges = {k: v for proc in stats.values() for k, v in proc["edges"].items()}
    edges.update(coord)
    assert set(edges) >= {"thinker->talker", "talker->vocoder", "vocoder->coordinator"}
    for edge, fig in edges.items():
        assert value(m, "stagelink_edge_messages_total", pipeline="edges", edge=edge) == fig["messages"], edge
        assert value(m, "stagelink_edge_bytes_total", pipeline="edges", edge=edge) == fig["bytes"], edge
        assert value(m, "stagelink_edge_hop_seconds_count", pipeline="edges", edge=edge) == len(fig["lat_ns"]), edge
    assert edges["thinker->talker"]["messages"] == n * (chunks + 1)  # the chunks and the payload
    assert edges["thinker->talker"]["bytes"] >= n * chunks * 100_000


def test_a_stage_process_killed_mid_run_shows_in_the_failure_counters(ns):
    with _pipeline(ns, "killed") as p:
        url = p.metrics_server.url
        assert p.submit("warm", {"x": 0, "chunks": 1}).result(30)
        victim = p.process_ids()["talker"]
        futs = [p.submit(f"k{i}", {"x": i, "chunks": 50, "chunk_sleep": 0.02}) for i in range(3)]
        time.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        failed = 0
        for f in futs:
            try:
                f.result(30)
            except stagelink.StagelinkError:
                failed += 1
        deadline = time.monotonic() + 10
        while True:
            m = scrape(url)
            if value(m, "stagelink_pipeline_process_deaths_total", process="talker") or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        time.sleep(1.0)  # ten rounds of the coordinator's checks: a death is counted once, not per round
        m = scrape(url)
    assert failed == 3
    assert value(m, "stagelink_pipeline_process_deaths_total", pipeline="killed", process="talker") == 1
    assert value(m, "stagelink_pipeline_requests_total", pipeline="killed", result="failed") == 3
    assert value(m, "stagelink_pipeline_requests_total", pipeline="killed", result="ok") == 1
    assert value(m, "stagelink_pipeline_process_up", pipeline="killed", process="talker") == 0
    assert value(m, "stagelink_pipeline_process_up", pipeline="killed", process="thinker") == 1


def test_stagelink_run_serves_metrics_while_it_runs(tmp_path):
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "stagelink.cli", "run", os.path.join(root, "examples", "omni_pipeline.yaml"),
                             "--requests", "8", "--metrics-port", str(port), "--metrics-linger", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 90
        m = {}
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                m = scrape(url)
                if value(m, "stagelink_pipeline_requests_total", result="ok") == 8:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        assert value(m, "stagelink_pipeline_requests_total", pipeline="omni", result="ok") == 8
        for stage in ("encoder", "thinker", "talker", "vocoder"):
            assert value(m, "stagelink_stage_runs_total", stage=stage) == 8
        assert value(m, "stagelink_pipeline_time_to_first_chunk_seconds_count", pipeline="omni") == 8
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert f"metrics: http://127.0.0.1:{port}/metrics" in out, out
