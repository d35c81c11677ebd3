"""The frameworks' own code, unmodified, finding stagelink through their own plugin mechanisms
(stagelink.integrations) and moving data through it across real processes:

- vLLM-Omni 0.30.0: its plugin loader finds the ``vllm_omni.general_plugins`` entry point, its
  YAML names ``StagelinkSharedMemoryConnector`` / ``StagelinkStoreConnector``, and its
  orchestrator glue (try_send_via_connector) and stage worker (build_stage_connectors,
  try_recv_via_connector) move a request's inputs;
- vLLM 0.30.0: with STAGELINK_VLLM_MQ=1 its ``vllm.general_plugins`` entry point makes
  ``MessageQueue.create_from_process_group`` (a gloo group of 3 processes) stagelink's;
- SGLang-Omni 0.1.9 (with SGLang 0.5.22, which its CommRouter imports): with STAGELINK_SGLANG_OMNI=1 its CommRouter's shm relay is stagelink's and
  its stage I/O moves a payload between two processes.

The framework processes import nothing of stagelink (their scripts assert it). The frameworks are
installed by ./scripts/setup into build/frameworks/site and build/frameworks/sglang-site (pip
--no-deps plus the packages their modules import), which only these processes have on their path.
"""
import os
import pickle
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
SITE = os.environ.get("STAGELINK_FRAMEWORKS_SITE", os.path.join(ROOT, "build", "frameworks", "site"))
SGLANG_SITE = os.environ.get("STAGELINK_SGLANG_SITE", os.path.join(ROOT, "build", "frameworks", "sglang-site"))
CLIENTS = os.path.join(ROOT, "build", "clients")
SCRIPTS = os.path.join(HERE, "frameworks")


def _need_site():
    if not os.path.isdir(os.path.join(SITE, "vllm_omni")):
        pytest.skip("vLLM-Omni/vLLM not installed in build/frameworks/site (./scripts/setup installs them)")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STAGELINK_VLLM", "STAGELINK_SGLANG", "VLLM_PLUGINS"))}
    env["PYTHONPATH"] = SITE
    env.update(extra)
    return env


class Proc:
    """A framework process; ``line()`` is its next ``@@`` line (frameworks log to stdout too)."""

    def __init__(self, args, env, cwd):
        self.p = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)

    def line(self, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.p.stdout.readline()
            if not out:
                break
            if out.startswith("@@ "):
                return out[3:].rstrip("\n")
        self.p.kill()
        raise AssertionError(f"no line from {self.p.args[1:]}: {self.p.stderr.read()[-3000:]}")

    def send(self, text):
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def finish(self, timeout=60):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            rc = self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        err = self.p.stderr.read()
        assert rc == 0, f"{self.p.args[1:]} exited {rc}: {err[-3000:]}"
        return err


def _vllm_omni_yaml(path, connectors):
    import yaml
    cfg = {"runtime": {"connectors": {name: {"name": cname, "extra": extra} for name, (cname, extra) in connectors.items()}},
           "stage_args": [{"stage_id": 0, "output_connectors": {"to_stage_1": "a"}},
                          {"stage_id": 1, "input_connectors": {"from_stage_0": "a"}}]}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)


def _vllm_omni_round_trip(tmp_path, connector_name, extra, env=None):
    cfg = tmp_path / "pipeline.yaml"
    _vllm_omni_yaml(cfg, {"a": (connector_name, extra)})
    env = env or _env()
    script = os.path.join(SCRIPTS, "vllm_omni_stage.py")
    sender = Proc([script, "send", str(cfg), "0", "1"], env, str(tmp_path))
    sender_class = sender.line()
    ok, notes = pickle.loads(bytes.fromhex(sender.line()))
    receiver = Proc([script, "recv", str(cfg), "1"], env, str(tmp_path))
    receiver.send(pickle.dumps(notes[0]).hex() if notes else "")
    receiver_classes = receiver.line()
    got, rx = pickle.loads(bytes.fromhex(receiver.line()))
    receiver.finish()
    sender.send("done")
    sender.finish()
    return sender_class, ok, notes, receiver_classes, got, rx


@pytest.mark.timeout(600)
def test_vllm_omni_selects_stagelinks_shm_connector_from_its_yaml(tmp_path, ns):
    _need_site()
    import numpy as np
    sender_class, ok, notes, receiver_classes, got, rx = _vllm_omni_round_trip(
        tmp_path, "StagelinkSharedMemoryConnector", {"namespace": ns, "shm_threshold_bytes": 4096})
    assert sender_class == "stagelink.connector.SharedMemoryConnector"
    assert receiver_classes == "0->1:stagelink.connector.SharedMemoryConnector"
    assert ok and notes[0]["from_connector"] is True and notes[0]["request_id"] == "req-1"
    assert got["prompt_token_ids"] == list(range(100)) and got["text"] == "the thinker's words"
    np.testing.assert_array_equal(got["hidden"], np.arange(4096 * 16, dtype=np.float32).reshape(16, 4096))
    assert rx["rx_transfer_bytes"] >= 4096 * 16 * 4


@pytest.mark.timeout(600)
def test_vllm_omni_selects_stagelinks_store_connector(tmp_path, redis):
    _need_site()
    sender_class, ok, _, receiver_classes, got, _ = _vllm_omni_round_trip(
        tmp_path, "StagelinkStoreConnector", {"host": "127.0.0.1", "port": redis})
    assert sender_class == "stagelink.connector.StoreConnector" and ok
    assert receiver_classes == "0->1:stagelink.connector.StoreConnector"
    assert got["prompt_token_ids"] == list(range(100)) and got["hidden"].shape == (16, 4096)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("allowed, loaded", [("someone_else", False), ("someone_else,stagelink", True)])
def test_vllm_omni_respects_vllm_plugins(allowed, loaded):
    """VLLM_PLUGINS lists the plugins vLLM-Omni loads: without stagelink in it, stagelink's
    connector names are not registered (a YAML naming one gets vLLM-Omni's 'Unknown connector')."""
    _need_site()
    code = ("from vllm_omni.plugins import load_omni_general_plugins as load; load(); "
            "from vllm_omni.distributed.omni_connectors import OmniConnectorFactory as F; import sys; "
            "print('@@', 'StagelinkSharedMemoryConnector' in F.list_registered_connectors(), 'stagelink' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], env=_env(VLLM_PLUGINS=allowed), capture_output=True, text=True,
                       timeout=240)
    assert f"@@ {loaded} {loaded}" in p.stdout, p.stderr[-2000:]


def test_register_twice_is_harmless():
    """The entry point's function run again (vLLM-Omni warns plugins may load several times) adds
    nothing and raises nothing; without vLLM-Omni importable it registers nothing."""
    from stagelink.integrations import vllm_omni
    if "vllm_omni" not in sys.modules and not os.path.isdir(os.path.join(SITE, "vllm_omni")):
        assert vllm_omni.register() == []
        return
    code = ("import sys; from stagelink.integrations import vllm_omni as v; a = v.register(); b = v.register(); "
            "print('@@', sorted(a), b)")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=240)
    line = [x for x in p.stdout.splitlines() if x.startswith("@@ ")]
    assert p.returncode == 0 and line, p.stderr[-2000:]
    assert line[0] == "@@ ['StagelinkSharedMemoryConnector', 'StagelinkStoreConnector', 'StagelinkTransferEngineConnector'] []"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mq_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"sl.{os.getuid()}.mq.")}


@pytest.mark.timeout(600)
def test_vllm_process_group_broadcast_is_stagelinks_when_asked(tmp_path):
    _need_site()
    before = _mq_files()
    port = _free_port()
    script = os.path.join(SCRIPTS, "vllm_mq_rank.py")
    ranks = [Proc([script, str(r), "3", str(port)], _env(STAGELINK_VLLM_MQ="1"), str(tmp_path)) for r in range(3)]
    try:
        lines = [(r.line(), r.line()) for r in ranks]
        errs = [r.finish() for r in ranks]
    finally:
        for r in ranks:
            if r.p.poll() is None:
                r.p.kill()
                r.p.wait()
    assert all(cls == "stagelink.mq.MessageQueue" and res == "received-all" for cls, res in lines), lines
    assert all("is now stagelink.MessageQueue" in e for e in errs), errs[0][-2000:]
    assert _mq_files() == before


@pytest.mark.timeout(300)
def test_vllm_keeps_its_queue_by_default(tmp_path):
    _need_site()
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as M; "
            "import sys; print('@@', M.__module__, 'stagelink' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=240)
    assert "@@ vllm.distributed.device_communicators.shm_broadcast" in p.stdout, p.stderr[-2000:]


def _sglang_round_trip(tmp_path, env):
    script = os.path.join(SCRIPTS, "sglang_omni_stage.py")
    writer = Proc([script, "write", CLIENTS], env, str(tmp_path))
    writer_class = writer.line()
    ref = writer.line()
    reader = Proc([script, "read", CLIENTS], env, str(tmp_path))
    reader_class = reader.line()
    reader.send(ref)
    got = pickle.loads(bytes.fromhex(reader.line()))
    reader_err = reader.finish()
    writer.send("done")
    writer_err = writer.finish()
    return writer_class, reader_class, got, writer_err + reader_err


def _need_clients():
    if not os.path.isdir(os.path.join(CLIENTS, "sglang_omni")) or not os.path.isdir(os.path.join(SGLANG_SITE, "sglang")):
        pytest.skip("sglang-omni 0.1.9 or sglang 0.5.22 not installed (./scripts/setup installs them)")
    pytest.importorskip("msgspec")
    pytest.importorskip("torch")


def _shm_files():
    return set(os.listdir("/dev/shm"))


@pytest.mark.timeout(300)
def test_sglang_omnis_comm_router_relays_through_stagelink(tmp_path):
    _need_clients()
    import numpy as np
    before = _shm_files()
    env = dict(_env(STAGELINK_SGLANG_OMNI="1"), PYTHONPATH=SGLANG_SITE)
    writer_class, reader_class, got, err = _sglang_round_trip(tmp_path, env)
    assert writer_class == reader_class == "stagelink.integrations.sglang_omni.StagelinkRelay"
    np.testing.assert_array_equal(got["hidden"], np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024))
    assert got["text"] == "caption" and got["inputs"] == {"prompt": "hi"}
    assert "relay type 'shm' (its built-in one) is now stagelink's StagelinkRelay" in err
    assert _shm_files() <= before


@pytest.mark.timeout(300)
def test_sglang_omni_keeps_its_relay_by_default(tmp_path):
    _need_clients()
    which = Proc([os.path.join(SCRIPTS, "sglang_omni_stage.py"), "which", CLIENTS], dict(_env(), PYTHONPATH=SGLANG_SITE),
                 str(tmp_path))
    assert which.line() == "sglang_omni.relay.shm.ShmRelay"
    assert "stagelink" not in which.finish()


def test_sglang_hook_values():
    from stagelink.integrations.sglang_omni import replaced_types
    assert replaced_types("1") == ("shm",) and replaced_types("") == () and replaced_types("0") == ()
    assert replaced_types("stagelink") == () and replaced_types("shm, mooncake") == ("shm", "mooncake")
