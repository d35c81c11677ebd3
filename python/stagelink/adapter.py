"""vLLM-Omni's orchestrator glue (its ``omni_connectors.adapter``), over any connector.

    ok = try_send_via_connector(connector, 0, 1, "req-1", engine_inputs, sampling_params,
                                prompt, stage1_queue.put, metrics)
    # in stage 1, for each task taken from its queue:
    engine_inputs, rx_metrics = try_recv_via_connector(task, connectors, stage_id=1)

The sender puts ``{"engine_inputs", "sampling_params", "metadata"}`` under the request id and
submits a small notification (``from_connector``, ``from_stage``, ``to_stage``,
``connector_metadata``) to the next stage's queue; the receiver resolves it through the connector
of the edge. Neither raises: a failure is logged and reported (``False``, ``(None, None)``), so
the caller can fall back to its queue, as vLLM-Omni's callers do.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

logger = logging.getLogger("stagelink")

# Processed multimodal features a rendered prompt may carry: large, and not needed by the
# receiver (it reads engine_inputs only), so they are left out of the payload's metadata.
_MM_FEATURE_KEYS = frozenset({"mm_kwargs", "mm_placeholders", "mm_hashes"})


def try_send_via_connector(connector: Any, stage_id: Any, next_stage_id: Any, req_id: Any, next_inputs: Any,
                           sampling_params: Any, original_prompt: Any,
                           next_stage_queue_submit_fn: Callable[[dict], None], metrics: Optional[Any] = None) -> bool:
    """Put the next stage's inputs through ``connector`` (key: the request id), then submit the
    notification to the next stage's queue and, where ``metrics`` is given, call its
    ``on_forward(stage_id, next_stage_id, req_id, size, tx_ms, True)``. Returns True when sent;
    False when the put failed or anything after it did (the put is then cleaned up, so nothing is
    left behind for a notification that never went)."""
    t0 = time.time()
    sent = False
    try:
        prompt = original_prompt
        if isinstance(prompt, dict) and not _MM_FEATURE_KEYS.isdisjoint(prompt):
            prompt = {k: v for k, v in prompt.items() if k not in _MM_FEATURE_KEYS}
        payload = {
            "engine_inputs": next_inputs,
            "sampling_params": sampling_params,
            "metadata": {"original_prompt": prompt, "stage_transition": f"{stage_id}->{next_stage_id}",
                         "timestamp": time.time()},
        }
        ok, size, metadata = connector.put(str(stage_id), str(next_stage_id), str(req_id), payload)
        if not ok:
            return False
        sent = True
        notification = {
            "type": "generate",
            "request_id": req_id,
            "sampling_params": sampling_params,
            "from_connector": True,
            "from_stage": str(stage_id),
            "to_stage": str(next_stage_id),
            "sent_ts": time.time(),
        }
        if metadata:
            notification["connector_metadata"] = metadata
        next_stage_queue_submit_fn(notification)
        if metrics is not None:
            metrics.on_forward(stage_id, next_stage_id, req_id, size, (time.time() - t0) * 1000.0, True)
        return True
    except Exception as e:  # noqa: BLE001 - the caller falls back to its queue
        logger.warning("connector send of request %s (stage %s -> %s) failed: %s; falling back to the queue",
                       req_id, stage_id, next_stage_id, e)
        if sent:
            try:
                connector.cleanup(str(req_id))
            except Exception:  # noqa: BLE001 - already reporting a failure
                pass
        return False


def try_recv_via_connector(task: dict, connectors: dict, stage_id: Any) -> tuple[Any, Optional[dict]]:
    """Resolve a task taken from a stage's queue. A notification (``from_connector``) is read
    through ``connectors[(from_stage, str(stage_id))]`` with its ``connector_metadata``; a task
    carrying ``engine_inputs`` itself (a seed request) gives them as they are. Returns
    ``(engine_inputs, {"rx_decode_time_ms", "rx_transfer_bytes"})``, or ``(None, None)`` when
    there is no connector for the edge, the payload is gone or not a dict, or the get failed."""
    rid = task.get("request_id")
    if not task.get("from_connector"):
        if "engine_inputs" in task:
            return task["engine_inputs"], {"rx_decode_time_ms": 0.0, "rx_transfer_bytes": 0}
        logger.error("[stage %s] task for request %s has neither engine_inputs nor a connector notification",
                     stage_id, rid)
        return None, None
    from_stage = task.get("from_stage")
    if from_stage is None or from_stage == "":
        logger.error("[stage %s] request %s: 'from_connector' is set but 'from_stage' is missing", stage_id, rid)
        return None, None
    from_stage, to_stage = str(from_stage), str(stage_id)
    connector = connectors.get((from_stage, to_stage))
    if connector is None:
        logger.error("[stage %s] request %s: no connector for edge %s -> %s", stage_id, rid, from_stage, to_stage)
        return None, None
    t0 = time.time()
    try:
        got = connector.get(from_stage, to_stage, str(rid), metadata=task.get("connector_metadata"))
    except Exception as e:  # noqa: BLE001 - reported as (None, None), as vLLM-Omni does
        logger.error("[stage %s] request %s: connector get failed: %s", stage_id, rid, e)
        return None, None
    ms = (time.time() - t0) * 1000.0
    data, size = got if isinstance(got, tuple) else (got, 0)
    if not isinstance(data, dict) or not data:
        logger.error("[stage %s] request %s: no payload from the connector (gone, or not a dict)", stage_id, rid)
        return None, None
    return data.get("engine_inputs"), {"rx_decode_time_ms": ms, "rx_transfer_bytes": size}
