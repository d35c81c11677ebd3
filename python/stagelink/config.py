"""load_transfer_config: vLLM-Omni's transfer YAML, resolved by the C++ core."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from . import _core


@dataclass
class ConnectorSpec:
    name: str
    extra: dict = field(default_factory=dict)
    ref: str = ""


@dataclass
class Edge:
    from_stage: str
    to_stage: str
    connector: ConnectorSpec
    defaulted: bool = False


def _norm(stage) -> str:
    return str(stage)


class TransferConfig:
    def __init__(self, raw: dict):
        self._raw = raw
        self.source: str = raw["source"]
        self.edges = [Edge(e["from"], e["to"], ConnectorSpec(**e["connector"]), e["defaulted"]) for e in raw["edges"]]
        #: vLLM-Omni's view: the connector of every edge, ``{(from_stage, to_stage): ConnectorSpec}``
        #: (stage ids as strings), defaulted edges included.
        self.connectors = {(e.from_stage, e.to_stage): e.connector for e in self.edges}
        #: the connectors the file defines by name (``connectors:`` / ``runtime.connectors``)
        self.named_connectors = {k: ConnectorSpec(**v) for k, v in raw["connectors"].items()}
        self.stages = list(raw["stages"])
        #: the shm_threshold_bytes of the SharedMemoryConnector an undeclared edge gets
        self.default_shm_threshold = int(raw["default_shm_threshold_bytes"])
        #: what loading decided that you should know (a connector defined twice, which one won)
        self.notes = list(raw.get("notes", []))
        for n in self.notes:
            logging.getLogger("stagelink").info("%s", n)

    def connector_for_edge(self, from_stage, to_stage) -> ConnectorSpec:
        f, t = _norm(from_stage), _norm(to_stage)
        for e in self.edges:
            if e.from_stage == f and e.to_stage == t:
                return e.connector
        return ConnectorSpec("SharedMemoryConnector", {"shm_threshold_bytes": self.default_shm_threshold}, "")

    def stage_connectors(self, stage_id) -> list:
        """[{peer, direction ('input'|'output'), role, connector: ConnectorSpec}] for one stage,
        with ``role`` injected into each connector's extra."""
        out = []
        for d in self._raw["stage_connectors"].get(_norm(stage_id), []):
            out.append({"peer": d["peer"], "direction": d["direction"], "role": d["role"],
                        "connector": ConnectorSpec(**d["connector"])})
        return out

    def as_dict(self) -> dict:
        return self._raw

    def __repr__(self):
        return f"TransferConfig({self.source!r}, edges={[(e.from_stage, e.to_stage, e.connector.name) for e in self.edges]})"


class OmniTransferConfig(TransferConfig):
    """vLLM-Omni's config object built in code: ``OmniTransferConfig(connectors={(from_stage,
    to_stage): ConnectorSpec(name, extra)})``, resolved by the same loader as a file (stage ids
    may be ints or strings; an edge's ``extra`` is checked as a file's would be)."""

    def __init__(self, connectors: dict | None = None):
        edges = [{"from": str(f), "to": str(t), "connector": {"name": spec.name, "extra": dict(spec.extra or {})}}
                 for (f, t), spec in (connectors or {}).items()]
        super().__init__(_core.load_config_string(json.dumps({"edges": edges}, default=str), "<OmniTransferConfig>"))


def load_transfer_config(path_or_dict: Union[str, os.PathLike, dict],
                         default_shm_threshold: int = 65536) -> TransferConfig:
    """Read a vLLM-Omni config (``runtime.connectors`` + ``stage_args``, or top-level
    ``connectors`` + ``stages`` + ``edges``) and resolve every edge.

    As vLLM-Omni: ``base_config: other.yaml`` merges the file over ``other.yaml`` (relative to
    the file; cycles refused); ``${VAR}`` and ``${VAR:-default}`` are expanded from the
    environment; a ``role`` set in ``extra`` is kept; an edge declared by both of its stages
    must be declared equally (``role`` aside); an edge that declares no connector gets a
    SharedMemoryConnector with ``{"shm_threshold_bytes": default_shm_threshold}``. Raises
    InvalidArgumentError quoting the key and file for malformed input, NotFoundError for a
    missing file."""
    threshold = int(default_shm_threshold)
    if threshold < 0:
        raise _core.InvalidArgumentError(f"default_shm_threshold must not be negative (got {threshold})")
    if isinstance(path_or_dict, dict):
        return TransferConfig(_core.load_config_string(json.dumps(path_or_dict, default=str), "<dict>", threshold))
    return TransferConfig(_core.load_config_file(os.fspath(path_or_dict), threshold))


def load_omni_transfer_config(config_path: Union[str, os.PathLike, None] = None, config_dict: Optional[dict] = None,
                              default_shm_threshold: int = 65536) -> Optional[TransferConfig]:
    """vLLM-Omni's loader, its arguments and results: a file (``config_path``) or a dict
    (``config_dict``); None when given neither; ``FileNotFoundError`` for a file that is not
    there. Otherwise as `load_transfer_config`."""
    if config_path is None and config_dict is None:
        return None
    if config_path is not None:
        if not os.path.exists(os.fspath(config_path)):
            raise FileNotFoundError(f"Config file not found: {os.fspath(config_path)}")
        return load_transfer_config(config_path, default_shm_threshold)
    return load_transfer_config(config_dict, default_shm_threshold)




# vLLM-Omni's role-bound connectors: a sender serves a side channel on ``zmq_port`` that its
# receivers reach at ``sender_host:sender_zmq_port``. stagelink's say so by their descriptor's
# `side_channel` trait; vLLM-Omni's MORI one, which stagelink does not build, by its name.
_FOREIGN_ROLE_BOUND = frozenset({"MoriTransferEngineConnector"})


def _role_bound(name: str) -> bool:
    from .connector import has_trait
    return name in _FOREIGN_ROLE_BOUND or has_trait(name, "side_channel")


def _detect_local_ip() -> str:
    """This host's address for peers (``STAGELINK_HOST_IP`` / ``VLLM_HOST_IP``, else the first
    interface that is up and not loopback, else 127.0.0.1)."""
    return _core.host_address()


def _inject_chunk_path_endpoints(extra: dict, connector_name: str, role: str, own_stage, upstream_stage) -> None:
    """vLLM-Omni's endpoint derivation for co-located stages, in place: for a role-bound connector
    a stage that sends (``sender``, ``dual``) listens on ``zmq_port`` + its stage id, and one that
    receives (``receiver``, ``dual``) is pointed at its upstream stage's listener
    (``sender_zmq_port`` = ``zmq_port`` + the upstream id; ``sender_host`` = ``host`` unless it is
    ``auto``, else this host's address). ``sender_host`` / ``sender_zmq_port`` the user set are
    kept. Any other connector, a stage id that is not an integer (``"prefill"``) or ``zmq_port: 0``
    (pick any port) is left as it is. The ports are the seed's request-forwarding ports
    (`stagelink.transfer_engine_port`, purpose offset 0, one replica)."""
    if not _role_bound(connector_name):
        return
    try:
        own = int(own_stage)
        upstream = None if upstream_stage is None else int(upstream_stage)
        base = int(extra.get("zmq_port", 50051))  # the transfer engines' default port
    except (TypeError, ValueError):
        return
    if base <= 0:
        return
    if role in ("sender", "dual"):
        extra["zmq_port"] = base + own
    if role in ("receiver", "dual") and upstream is not None:
        host = extra.get("host", "auto")
        if "sender_host" not in extra:
            extra["sender_host"] = _detect_local_ip() if host in (None, "", "auto") else host
        extra.setdefault("sender_zmq_port", base + upstream)


def get_connectors_config_for_stage(transfer_config, stage_id) -> dict:
    """vLLM-Omni's per-stage view: ``{"from_stage_X": {"spec": {"name", "extra"}}, "to_stage_Y":
    ...}`` for the stage's incoming and outgoing edges, with ``role`` injected into each ``extra``
    ("receiver" incoming, "sender" outgoing; one the user set is kept). A role-bound connector
    (the transfer engines) on both sides of a stage makes it ``dual`` on both entries, which then
    carry the same extra, and gets its endpoints derived (`_inject_chunk_path_endpoints`),
    so co-located stages do not collide on one port. ``None`` (no config loaded) gives ``{}``."""
    if transfer_config is None:
        return {}
    entries = transfer_config.stage_connectors(stage_id)
    upstream = next((c["peer"] for c in entries if c["direction"] == "input"), None)
    out = {}
    for c in entries:
        name, incoming = c["connector"].name, c["direction"] == "input"
        extra = dict(c["connector"].extra)
        if _role_bound(name):
            edge = (c["peer"], stage_id) if incoming else (stage_id, c["peer"])
            role = transfer_config.connector_for_edge(*edge).extra.get("role")
            if role is None:
                sides = {d["direction"] for d in entries if d["connector"].name == name}
                role = "dual" if sides == {"input", "output"} else ("receiver" if incoming else "sender")
            extra["role"] = role
            _inject_chunk_path_endpoints(extra, connector_name=name, role=role, own_stage=stage_id,
                                         upstream_stage=upstream)
        side = "from_stage_" if incoming else "to_stage_"
        out[side + str(c["peer"])] = {"spec": {"name": name, "extra": extra}}
    return out
