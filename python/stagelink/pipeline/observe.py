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
