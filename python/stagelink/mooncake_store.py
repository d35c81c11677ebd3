"""MooncakeStoreConnector: payloads through a running Mooncake Store (the seed's connector), with
stagelink's framing (arrays, tensors and trees of them without pickle; pickle off by default) and
a get that waits by a bounded, backing-off wait (the store has no notification). It needs
Mooncake's Python client (``pip install mooncake-transfer-engine`` or
``mooncake-transfer-engine-non-cuda``) and a ``mooncake_master``; without them, creation fails
saying so. For a store with notification and TTLs, use ``StoreConnector`` (Redis)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from . import _core, _serde
from .connector import Connector, OmniConnectorBase

log = logging.getLogger("stagelink.mooncake_store")

_INSTALL = ("MooncakeStoreConnector needs Mooncake's Python client: pip install mooncake-transfer-engine "
            "(CUDA hosts) or mooncake-transfer-engine-non-cuda, and a running mooncake_master; or use "
            "StoreConnector (Redis: no extra service beyond redis-server)")


class MooncakeStoreConnector:
    """The vLLM-Omni connector contract (``put``/``get``/``cleanup``/``health``/``close``) on the
    Mooncake Store. ``extra``: ``host`` (this worker's address), ``metadata_server``, ``master``,
    ``segment`` (bytes this process gives the store), ``localbuf``, ``proto`` (tcp|rdma),
    ``device_name``; stagelink's ``timeout_s`` (a get's default wait, 5), ``allow_pickle`` (off)."""

    supports_raw_data: bool = False

    def __init__(self, extra: Optional[dict] = None, name: str = "MooncakeStoreConnector"):
        extra = dict(extra or {})
        self.name, self.extra = name, extra
        try:
            from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415 (optional dependency)
        except ImportError as e:
            raise _core.UnsupportedError(f"{_INSTALL} ({e})") from None
        for k in ("metadata_server", "master"):
            if not extra.get(k):
                raise _core.InvalidArgumentError(f"MooncakeStoreConnector extra needs '{k}'")
        #: vLLM-Omni's: the stage this connector serves (-1: not given) and the address other
        #: workers dial, with $VAR, ${VAR} and ${VAR:-default} taken from the environment (vLLM-Omni's $VAR too).
        self.stage_id = extra.get("stage_id", -1)
        self.host = _core.expand_env(str(extra.get("host", "127.0.0.1")), "host", "MooncakeStoreConnector extra",
                                     bare=True)
        self.timeout_s = float(extra.get("timeout_s", 5))
        self.allow_pickle = bool(extra.get("allow_pickle", False))
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(self.host, str(extra["metadata_server"]),
                               int(extra.get("segment", 512 << 20)), int(extra.get("localbuf", 64 << 20)),
                               str(extra.get("proto", "tcp")), str(extra.get("device_name", "")), str(extra["master"]))
        if rc != 0:
            raise _core.IOError(f"MooncakeStoreConnector: setup with master {extra['master']} failed (code {rc})")
        self._lock = threading.Lock()
        self._requests: dict[str, set[str]] = {}
        self._pending: list[str] = []  # read puts whose removal the store refused so far (lease)
        self._n = {"puts": 0, "gets": 0, "bytes_transferred": 0, "timeouts": 0, "errors": 0}

    @staticmethod
    def _key(key, from_stage, to_stage) -> str:
        return f"{key}@{from_stage}_{to_stage}"

    def put(self, from_stage, to_stage, put_key: str, data, request_id: Optional[str] = None, readers=None):
        """Store ``data`` framed by stagelink. Returns ``(ok, size, None)``: no metadata, the key is
        the rendezvous. Refuses (``ok`` False) an object that needs pickle unless allow_pickle."""
        frame = _core.encode_object(data)  # None: the object needs pickle
        if frame is None:
            if not self.allow_pickle:
                self._n["errors"] += 1
                log.warning("%s put of '%s' refused: it needs pickle and allow_pickle is off", self.name, put_key)
                return False, 0, None
            frame = Connector.serialize_obj(data)
        k = self._key(put_key, from_stage, to_stage)
        rc = self._store.put(k, bytes(frame))
        if rc != 0:
            self._n["errors"] += 1
            log.warning("%s put of '%s' failed (code %s)", self.name, k, rc)
            return False, 0, None
        with self._lock:
            self._requests.setdefault(str(request_id or put_key), set()).add(k)
            self._n["puts"] += 1
            self._n["bytes_transferred"] += len(frame)
        return True, len(frame), None

    def get(self, from_stage, to_stage, get_key: str, metadata=None, timeout: Optional[float] = None):
        """Wait for the key (backing off from 1 ms to 50 ms between looks, the store has no
        notification) up to ``timeout`` (default ``timeout_s``); then read it, delete it and return
        ``(object, size)``, or ``None`` when the time is up."""
        k = self._key(get_key, from_stage, to_stage)
        deadline = time.monotonic() + (self.timeout_s if timeout is None else float(timeout))
        pause = 0.001
        while True:
            data = self._store.get(k)
            if data:
                break
            if time.monotonic() + pause > deadline:
                self._n["timeouts"] += 1
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        self._remove(k)
        kind, obj = _core.decode_frame_parts(bytes(data))
        if kind != _serde.KIND_OBJECT and not self.allow_pickle:
            self._n["errors"] += 1
            _core.count_pickle_refused()
            raise _core.CorruptError(f"'{k}' holds a pickled object and allow_pickle is off: refused unread")
        obj = _serde.decode(kind, obj, False)
        with self._lock:
            self._n["gets"] += 1
            self._n["bytes_transferred"] += len(data)
        return obj, len(data)

    def _remove(self, k: str) -> None:
        """Remove a read put. Mooncake keeps an object leased for a while after a get (the master's
        kv lease) and refuses its removal meanwhile: such keys are retried on later calls."""
        with self._lock:
            pending, self._pending = self._pending + [k], []
        for key in pending:
            if self._store.remove(key) != 0 and self._store.is_exist(key) == 1:
                with self._lock:
                    self._pending.append(key)

    def get_with_deadline(self, from_stage, to_stage, get_key: str, metadata=None, deadline: Optional[float] = None):
        remaining = (deadline or 0) - time.monotonic()
        return None if remaining <= 0 else self.get(from_stage, to_stage, get_key, metadata, timeout=remaining)

    def cleanup(self, request_id: str) -> int:
        """Remove this connector's unread puts of the request. Returns how many."""
        with self._lock:
            keys = self._requests.pop(str(request_id), set())
        return sum(1 for k in keys if self._store.remove(k) == 0)

    def health(self) -> dict:
        return {"status": "healthy" if self._store else "closed", "connector": self.name, "backend": "mooncake",
                "master": self.extra.get("master"), "removals_pending": len(self._pending), **self._n}

    def close(self) -> None:
        if self._store is not None:
            self._remove_pending_until(time.monotonic() + float(self.extra.get("close_wait_s", 0)))
            self._store.close()
            self._store = None

    def _remove_pending_until(self, deadline: float) -> None:
        while True:
            with self._lock:
                keys, self._pending = self._pending, []
            for key in keys:
                if self._store.remove(key) != 0 and self._store.is_exist(key) == 1:
                    with self._lock:
                        self._pending.append(key)
            if not self._pending or time.monotonic() >= deadline:
                return
            time.sleep(0.1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


OmniConnectorBase.register(MooncakeStoreConnector)  # isinstance holds, as for every stagelink connector
