"""A shared-memory connector for a test namespace (test_parity.py, test_payloads.py)."""
import stagelink


def shm(ns, **kw):
    extra = {"namespace": ns, "arena_bytes": 64 << 20}
    extra.update(kw)
    return stagelink.create_connector("SharedMemoryConnector", extra)
