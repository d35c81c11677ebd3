"""Metrics: what this process's metrics tree holds (counted in the C++ core, see
include/stagelink/metrics.hpp), metrics of your own in the same tree, and a Prometheus endpoint.

    import stagelink
    server = stagelink.serve_metrics(9464)          # GET http://127.0.0.1:9464/metrics
    stagelink.metrics.collect()                      # the same samples, as Python data

A pipeline is one scrape target: ``Pipeline(spec, metrics_port=9464)`` (or ``stagelink run
--metrics-port 9464``) serves its coordinator's samples and, gathered at each scrape over the
control plane, every stage process's on every host, each labelled with its ``process``.

The text exposition is rendered by ``prometheus_client`` (the Prometheus project's own Python
client: its escaping, its format negotiation, OpenMetrics when a scraper asks for it). The
endpoint binds the address given (loopback by default) and answers ``GET /metrics`` and nothing else.
"""
from __future__ import annotations

import http.server
import math
import threading
from typing import Callable, Dict, List, Optional, Sequence

from . import _core

__all__ = ["collect", "families", "time_every", "set_time_every", "counter", "gauge", "histogram", "Metric", "Cell", "render", "serve_metrics",
           "MetricsServer", "with_labels"]

#: A sample list as collect() returns it: [{name, kind, unit, help, labels, samples: [...]}].
Families = List[dict]


def collect() -> Families:
    """Every sample of this process's metrics tree now: a list of families (name, kind: counter,
    gauge or histogram, unit, help, label names, and samples: {labels: [values], value} or, for a
    histogram, {labels, buckets: cumulative counts per bound, sum}, with its ``bounds``)."""
    return _core.metrics_collect()


def time_every() -> int:
    """Connectors' latency histograms time one put and get in this many per thread (default 8,
    ``STAGELINK_METRICS_TIME_EVERY`` at load): a clock read costs 17-20 ns on a VM. Calls are
    counted exactly all the same (``stagelink_connector_puts_total``); a histogram's ``_count`` is
    the calls it timed."""
    return _core.metrics_time_every()


def set_time_every(n: int) -> None:
    """Time one put and get in `n` per thread (1: every one)."""
    _core.metrics_set_time_every(int(n))


def families() -> List[dict]:
    """Every metric family declared in this process (stagelink's own and yours), by name."""
    return _core.metric_families()


class Metric:
    """A metric of your own in this process's tree (and so at its ``/metrics``): made by
    `counter`, `gauge` or `histogram`. Label values are given positionally, one
    per label name declared."""

    def __init__(self, name: str, kind: str, help: str, labels: Sequence[str], unit: str = ""):
        self._m = _core._Metric.get(name, kind, unit, help, list(labels))
        self.name, self.kind, self.label_names = name, kind, tuple(labels)

    def inc(self, *labels: str, by: float = 1.0) -> None:
        """Add `by` (counter, gauge)."""
        self._m.add([str(v) for v in labels], float(by))

    def set(self, *labels: str, value: float) -> None:
        """Set a gauge."""
        self._m.set([str(v) for v in labels], float(value))

    def observe(self, *labels: str, seconds: float) -> None:
        """Count one duration into a histogram."""
        self._m.observe([str(v) for v in labels], float(seconds))

    def labels(self, *values: str) -> "Cell":
        """The sample of these label values, found once: its ``inc``, ``set`` and ``observe`` take
        no lock, lookup or allocation (for metrics counted per message)."""
        return Cell(self._m.cell([str(v) for v in values]))


class Cell:
    """One label set of a `Metric` (``Metric.labels(...)``)."""
    __slots__ = ("_c",)

    def __init__(self, c):
        self._c = c

    def inc(self, by: float = 1.0) -> None:
        self._c.add(by)

    def set(self, value: float) -> None:
        self._c.set(value)

    def observe(self, seconds: float) -> None:
        self._c.observe(seconds)

    @property
    def value(self) -> float:
        """A counter's or gauge's value now (a histogram's: the sum of what it observed)."""
        return self._c.value


def counter(name: str, help: str, labels: Sequence[str] = ()) -> Metric:
    """A counter (its name ends in ``_total``); the same object's metric again for the same name."""
    return Metric(name, "counter", help, labels)


def gauge(name: str, help: str, labels: Sequence[str] = (), unit: str = "") -> Metric:
    return Metric(name, "gauge", help, labels, unit)


def histogram(name: str, help: str, labels: Sequence[str] = ()) -> Metric:
    """A histogram of durations in seconds (its name ends in ``_seconds``)."""
    return Metric(name, "histogram", help, labels, "seconds")


def with_labels(fams: Families, extra: Dict[str, str]) -> Families:
    """`fams` with label names and values `extra` added to every sample (a process's samples as
    its pipeline's coordinator serves them); a family that has such a label already keeps its own
    (the coordinator's stagelink_pipeline_process_up{process} is about the process it names)."""
    out = []
    for f in fams:
        if any(k in f["labels"] for k in extra):
            out.append(f)
            continue
        names, values = list(extra), [str(v) for v in extra.values()]
        g = dict(f)
        g["labels"] = list(f["labels"]) + names
        g["samples"] = [dict(s, labels=list(s["labels"]) + values) for s in f["samples"]]
        out.append(g)
    return out


def merge(*lists: Families) -> Families:
    """Families of several processes as one list: samples of the same family side by side (their
    label sets must tell them apart, see with_labels)."""
    by_name: Dict[str, dict] = {}
    for fams in lists:
        for f in fams:
            g = by_name.get(f["name"])
            if g is None:
                by_name[f["name"]] = dict(f, samples=list(f["samples"]))
            elif list(g["labels"]) == list(f["labels"]):
                g["samples"].extend(f["samples"])
    return [by_name[k] for k in sorted(by_name)]


class _Collector:
    """prometheus_client's collector over a source of families."""

    def __init__(self, source: Callable[[], Families]):
        self._source = source

    def collect(self):
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)
        for f in self._source():
            name, labels = f["name"], list(f["labels"])
            if f["kind"] == "counter":
                base = name[:-len("_total")] if name.endswith("_total") else name
                m = CounterMetricFamily(base, f["help"], labels=labels)
                for s in f["samples"]:
                    m.add_metric(list(s["labels"]), float(s["value"]))
            elif f["kind"] == "gauge":
                m = GaugeMetricFamily(name, f["help"], labels=labels)
                for s in f["samples"]:
                    m.add_metric(list(s["labels"]), float(s["value"]))
            else:
                m = HistogramMetricFamily(name, f["help"], labels=labels)
                bounds = f.get("bounds") or []
                for s in f["samples"]:
                    buckets = [("+Inf" if math.isinf(b) else _le(b), int(c)) for b, c in zip(bounds, s["buckets"])]
                    m.add_metric(list(s["labels"]), buckets, float(s["sum"]))
            yield m  # the unit is the name's suffix already (Prometheus' convention)


def _le(b: float) -> str:
    return repr(float(b))


def render(source: Optional[Callable[[], Families]] = None, accept: str = "") -> (bytes, str):
    """The text exposition of `source`'s families (default: this process's), as (body, content
    type); OpenMetrics when `accept` asks for it."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.exposition import choose_encoder
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(source or collect))
    encoder, content_type = choose_encoder(accept)
    return encoder(reg), content_type


#: Connections the endpoint serves at once (more are closed at once), and how long one may sit
#: idle before it is closed: what a stranger who can reach the port can hold.
MAX_CONNECTIONS = 16
IDLE_TIMEOUT_S = 10.0


class MetricsServer:
    """The endpoint serve_metrics() started: ``port`` (the one bound, when 0 was asked),
    ``url``, ``close()`` (also on ``with``)."""

    def __init__(self, source: Callable[[], Families], port: int, host: str):
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            server_version = "stagelink-metrics"
            sys_version = ""
            timeout = IDLE_TIMEOUT_S  # a connection that sends nothing is closed

            def do_GET(self):  # noqa: N802  http.server's name
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                try:
                    body, ctype = render(outer._source, self.headers.get("Accept", ""))
                except Exception as e:  # noqa: BLE001  a scrape that fails says why, the server stays
                    self.send_error(500, f"collecting metrics failed: {type(e).__name__}: {e}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_HEAD(self):  # noqa: N802
                self.send_error(405)

            do_POST = do_PUT = do_DELETE = do_HEAD  # noqa: N815

            def log_message(self, *a):  # quiet: a scrape every few seconds is not news
                pass

        slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True

            def process_request(self, request, client_address):
                if not slots.acquire(blocking=False):  # full: this one is closed, the others go on
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def process_request_thread(self, request, client_address):
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        import socket
        if ":" in host:
            Server.address_family = socket.AF_INET6
        self._source = source
        self._httpd = Server((host, int(port)), Handler)
        self.host, self.port = host, self._httpd.server_address[1]
        bracket = f"[{host}]" if ":" in host else host
        self.url = f"http://{bracket}:{self.port}/metrics"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="stagelink-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(5)
            self._httpd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_metrics(port: int = 0, host: str = "127.0.0.1",
                  source: Optional[Callable[[], Families]] = None) -> MetricsServer:
    """Serve this process's metrics (or `source`'s) at ``http://HOST:PORT/metrics`` from a
    background thread, until ``close()``. `host` defaults to loopback: a Prometheus on another
    host needs an address it can reach (``0.0.0.0``), and nothing but metrics is served there.
    ``port=0`` takes a free port (``.port`` says which). Raises OSError when the port is taken."""
    return MetricsServer(source or collect, port, host)
