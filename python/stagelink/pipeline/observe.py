"""The pipeline runtime's metrics, declared once (in this process's metrics tree, beside the
connectors' and relays' that the C++ core counts): per stage in the stage processes, per pipeline
in the coordinator. The coordinator serves them all as one scrape target (metrics.py)."""
from __future__ import annotations

from .. import metrics as _m

# -- stage processes (labels: stage)
STAGE_RUNS = _m.counter("stagelink_stage_runs_total", "stage runs that ended (succeeded or failed)", ["stage"])
STAGE_FAILURES = _m.counter("stagelink_stage_failures_total",
                            "stage runs that raised (their requests failed; aborts not counted)", ["stage"])
STAGE_RUN_SECONDS = _m.histogram("stagelink_stage_run_seconds", "wall time of a stage run", ["stage"])
STAGE_QUEUE_SECONDS = _m.histogram("stagelink_stage_queue_seconds",
                                   "from a request's inputs all arriving to its stage run starting", ["stage"])
STAGE_CHUNKS = _m.counter("stagelink_stage_chunks_total", "stream chunks a stage emitted", ["stage"])
STAGE_IN_FLIGHT = _m.gauge("stagelink_stage_requests_in_flight",
                           "requests a stage holds: waiting for inputs, queued or running", ["stage"])

# -- edges (labels: pipeline, edge "SRC->DST"), counted by their receiver: a stage process, or the
# coordinator for the terminal stage's edge to it. Pipeline.stats() and `stagelink run` read these.
EDGE_MESSAGES = _m.counter("stagelink_edge_messages_total",
                           "payloads and stream chunks that arrived over an edge (read by its receiver)",
                           ["pipeline", "edge"])
EDGE_BYTES = _m.counter("stagelink_edge_bytes_total", "frame bytes that arrived over an edge", ["pipeline", "edge"])
EDGE_HOP_SECONDS = _m.histogram("stagelink_edge_hop_seconds",
                                "from a payload's put to its receiver having read it (both ends on one host: "
                                "one clock)", ["pipeline", "edge"])

# -- the coordinator (labels: pipeline)
REQUESTS = _m.counter("stagelink_pipeline_requests_total",
                      "requests that ended, by result (ok, failed, aborted)", ["pipeline", "result"])
REQUESTS_IN_FLIGHT = _m.gauge("stagelink_pipeline_requests_in_flight", "requests submitted, not yet ended",
                              ["pipeline"])
REQUEST_SECONDS = _m.histogram("stagelink_pipeline_request_seconds",
                               "end-to-end time of a request that succeeded (submit to result)", ["pipeline"])
FIRST_CHUNK_SECONDS = _m.histogram("stagelink_pipeline_time_to_first_chunk_seconds",
                                   "submit to the first streamed chunk at the caller", ["pipeline"])
RETRIES = _m.counter("stagelink_pipeline_retries_total",
                     "requests run again on another replica after the one running them died", ["pipeline"])
DEATHS = _m.counter("stagelink_pipeline_process_deaths_total",
                    "stage processes that died (exited without being told to)", ["pipeline", "process"])
RESTARTS = _m.counter("stagelink_pipeline_process_restarts_total", "stage processes started again (max_restarts)",
                      ["pipeline", "process"])
PROCESS_UP = _m.gauge("stagelink_pipeline_process_up",
                      "1 when a stage process answered this scrape, 0 when it did not (dead, stuck, starting)",
                      ["pipeline", "process"])


class EdgeCounts:
    """What one edge's receiver counts: messages and bytes (metrics cells: the tree is the one
    count, Pipeline.stats() and `stagelink run` read it), the hop latency (a histogram for
    Prometheus, and a window of the last `window` hops for the run's exact percentiles). `base`:
    the cells' values when this pipeline began (a process running the same pipeline again counts on
    from the last run's)."""
    __slots__ = ("messages", "bytes", "hop", "lat_ns", "base")

    def __init__(self, pipeline: str, edge: str, window: int):
        import collections
        self.messages = EDGE_MESSAGES.labels(pipeline, edge)
        self.bytes = EDGE_BYTES.labels(pipeline, edge)
        self.hop = EDGE_HOP_SECONDS.labels(pipeline, edge)
        self.lat_ns = collections.deque(maxlen=window)
        self.base = (self.messages.value, self.bytes.value)

    def count(self, nbytes: int, lat_ns=None) -> None:
        self.messages.inc()
        self.bytes.inc(nbytes)
        if lat_ns is not None:
            self.lat_ns.append(lat_ns)
            self.hop.observe(lat_ns / 1e9)

    def figures(self) -> dict:
        """{bytes, messages, lat_ns} as Pipeline.stats() gives an edge's."""
        return {"bytes": int(self.bytes.value - self.base[1]), "messages": int(self.messages.value - self.base[0]),
                "lat_ns": list(self.lat_ns)}
