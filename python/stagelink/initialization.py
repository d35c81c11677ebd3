"""vLLM-Omni's connector set-up functions (its ``omni_connectors.utils.initialization``), over
stagelink's loader and factory, so an orchestrator and its stage workers switch without change.

    cfg, connectors = initialize_orchestrator_connectors("stages.yaml")   # {(from, to): connector}
    stage_cfg = get_stage_connector_config(cfg, stage_id)                 # shipped to the worker
    inbound = build_stage_connectors(stage_id, stage_cfg)                 # {(from, stage_id): connector}
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from .config import ConnectorSpec, TransferConfig, get_connectors_config_for_stage, load_omni_transfer_config
from .connector import OmniConnectorFactory

log = logging.getLogger("stagelink")

# vLLM-Omni's KV-transfer port constants, by its names, for its KV managers' port arithmetic
# (zmq_port = base + KV_TRANSFER_PORT_OFFSET + replica * KV_REPLICA_PORT_STRIDE
#  + tp_rank * KV_RANK_PORT_STRIDE + stage). stagelink's own derivation follows the seed
# (stagelink.transfer_engine_port; docs/te.md says how the two differ); a transfer-engine
# connector listens on whatever zmq_port it is given, so ports computed either way work.
KV_TRANSFER_PORT_OFFSET = 100
KV_RANK_PORT_STRIDE = 16
KV_REPLICA_PORT_STRIDE = 1024


def create_connectors_from_config(connectors_config: dict, purpose: Optional[str] = None,
                                  caller_stage_id: Any = None, is_sender: Optional[bool] = None) -> dict:
    """One connector per edge, ``{(from_stage, to_stage): ConnectorSpec}`` in, ``{edge:
    connector}`` out, made by `OmniConnectorFactory`. ``is_sender`` sets ``role`` where
    the spec has none (``sender`` / ``receiver``). A connector that cannot be made raises, after
    the ones already made are closed: a stage never starts with an edge missing."""
    made: dict = {}
    try:
        for edge, spec in connectors_config.items():
            extra = dict(spec.extra or {})
            if is_sender is not None:
                extra.setdefault("role", "sender" if is_sender else "receiver")
            made[edge] = OmniConnectorFactory.create_connector(ConnectorSpec(spec.name, extra))
            log.info("connector for edge %s -> %s: %s", edge[0], edge[1], type(made[edge]).__name__)
    except Exception:
        for c in made.values():
            c.close()
        raise
    return made


def initialize_connectors_from_config(config_path=None, default_shm_threshold: int = 65536,
                                      purpose: Optional[str] = None, caller_stage_id: Any = None,
                                      is_sender: Optional[bool] = None):
    """``(transfer_config, {edge: connector})`` for every edge of the file; ``(None, {})`` without
    one. A file that does not load raises (vLLM-Omni's older versions logged and went on)."""
    cfg = load_omni_transfer_config(config_path, default_shm_threshold=default_shm_threshold)
    if cfg is None:
        return None, {}
    return cfg, create_connectors_from_config(cfg.connectors, purpose, caller_stage_id, is_sender)


def initialize_orchestrator_connectors(config_path, worker_backend: Optional[str] = "multi_process",
                                       shm_threshold_bytes: int = 65536):
    """The orchestrator's connectors, one per edge, as senders. ``worker_backend="ray"`` puts
    everything through shared memory segments rather than inline (vLLM-Omni's rule)."""
    threshold = (1 << 62) if worker_backend == "ray" else max(0, int(shm_threshold_bytes))
    return initialize_connectors_from_config(config_path, default_shm_threshold=threshold,
                                             purpose="request_forwarding", caller_stage_id="orchestrator",
                                             is_sender=True)


def get_stage_connector_config(transfer_config: Optional[TransferConfig], stage_id) -> dict:
    """What a stage worker is given: `get_connectors_config_for_stage` (``{}`` without a
    config)."""
    return get_connectors_config_for_stage(transfer_config, stage_id)


def build_stage_connectors(stage_id, connectors_config: dict, purpose: str = "request_forwarding") -> dict:
    """A stage worker's inbound connectors from what `get_stage_connector_config` gave it:
    ``{(from_stage, stage_id): connector}`` for each ``from_stage_*`` entry (the orchestrator
    owns the outbound ones)."""
    specs = {}
    for key, entry in (connectors_config or {}).items():
        if not key.startswith("from_stage_") or not (entry or {}).get("spec"):
            continue
        spec = entry["spec"]
        specs[(key[len("from_stage_"):], str(stage_id))] = ConnectorSpec(spec.get("name", "SharedMemoryConnector"),
                                                                          dict(spec.get("extra") or {}))
    return create_connectors_from_config(specs, purpose, stage_id, is_sender=False)
