"""MooncakeStoreConnector: with Mooncake's client and master installed (./scripts/setup installs
mooncake-transfer-engine-non-cuda where it runs), a real store round trip; without them, a clear
error saying how to install it or to use StoreConnector."""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import stagelink

HAVE = importlib.util.find_spec("mooncake") is not None
MASTER = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(HAVE, reason="Mooncake is installed here: the error path cannot be shown")
def test_without_mooncake_creation_says_how_to_install_it():
    with pytest.raises(stagelink.UnsupportedError, match="pip install mooncake-transfer-engine"):
        stagelink.create_connector("MooncakeStoreConnector", {"master": "127.0.0.1:1", "metadata_server": "x"})


@pytest.mark.skipif(not HAVE or not os.path.exists(MASTER), reason="Mooncake's client or mooncake_master is not installed")
def test_round_trip_through_a_real_mooncake_store(monkeypatch):
    monkeypatch.setenv("SL_TEST_MC_HOST", "127.0.0.1")
    monkeypatch.delenv("SL_TEST_MC_UNSET", raising=False)
    rpc, http = _port(), _port()
    m = subprocess.Popen([MASTER, f"--rpc_port={rpc}", "--enable_http_metadata_server=true",
                          f"--http_metadata_server_port={http}", "--http_metadata_server_host=127.0.0.1",
                          "--rpc_address=127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        extra = {"host": "${SL_TEST_MC_HOST}", "metadata_server": f"http://127.0.0.1:{http}/metadata",
                 "master": f"127.0.0.1:{rpc}", "segment": 128 << 20, "localbuf": 64 << 20, "proto": "tcp"}
        # vLLM-Omni's: an unset variable in host is an error naming it, never a literal host name.
        with pytest.raises(stagelink.InvalidArgumentError, match="SL_TEST_MC_UNSET"):
            stagelink.create_connector("MooncakeStoreConnector", dict(extra, host="10.0.0.$SL_TEST_MC_UNSET"))
        with stagelink.create_connector("MooncakeStoreConnector", extra, stage_id=2) as c:
            assert c.host == "127.0.0.1" and c.stage_id == 2
            d = np.random.default_rng(2).integers(0, 256, 5 << 20, dtype=np.uint8)
            ok, size, md = c.put(0, 1, "req-1", {"h": d, "n": 3})
            assert ok and md is None and size > d.nbytes
            obj, got = c.get(0, 1, "req-1")
            assert np.array_equal(obj["h"], d) and obj["n"] == 3 and got == size
            t0 = time.monotonic()
            assert c.get(0, 1, "absent", timeout=0.3) is None
            assert 0.25 < time.monotonic() - t0 < 2
            assert c.put(0, 1, "obj", {1, 2})[0] is False            # needs pickle: refused
            c.put(0, 1, "a", b"x", request_id="r")
            assert c.cleanup("r") == 1
            assert c.health()["puts"] == 2
        # vLLM-Omni registers this connector as "MooncakeConnector" too (its CI stage configs
        # name it so): the same connector, reading what the other name put.
        spec = stagelink.ConnectorSpec(name="MooncakeConnector", extra=extra)
        with stagelink.OmniConnectorFactory.create_connector(spec) as a, \
                stagelink.create_connector("MooncakeStoreConnector", extra) as b:
            assert isinstance(a, stagelink.MooncakeStoreConnector) and not a.allow_pickle
            assert a.put(0, 1, "alias", [2.0, "x"])[0]
            assert b.get(0, 1, "alias")[0] == [2.0, "x"]
    finally:
        m.kill()
        m.wait()
