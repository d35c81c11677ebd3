import os
import subprocess
import sys

import numpy as np
import pytest

import stagelink
from net_util import free_port_run

BIN = os.path.join(os.path.dirname(sys.executable), "stagelink")

SEED_MOONCAKE = """
runtime:
  connectors:
    connector_of_mooncake:
      name: MooncakeStoreConnector
      extra:
        host: "127.0.0.1"
        metadata_server: "http://127.0.0.1:8080/metadata"
        master: "127.0.0.1:50051"
        segment: 512000000
        localbuf: 64000000
        proto: "tcp"
stage_args:
- stage_id: 0
  output_connectors:
    to_stage_1: connector_of_mooncake
- stage_id: 1
  input_connectors:
    from_stage_0: connector_of_mooncake
- stage_id: 2
  engine_input_source: [1]
"""


def test_seed_yaml_loads_and_fills_defaults(tmp_path):
    f = tmp_path / "stages.yaml"
    f.write_text(SEED_MOONCAKE)
    cfg = stagelink.load_transfer_config(f)
    assert [(e.from_stage, e.to_stage) for e in cfg.edges] == [("0", "1"), ("1", "2")]
    spec = cfg.connector_for_edge(0, 1)
    assert spec.name == "MooncakeStoreConnector" and spec.extra["segment"] == 512000000
    assert cfg.connector_for_edge(1, 2).name == "SharedMemoryConnector"
    roles = {d["direction"]: d["role"] for d in cfg.stage_connectors(1)}
    assert roles == {"input": "receiver", "output": "sender"}
    assert cfg.stage_connectors(0)[0]["connector"].extra["role"] == "sender"



def test_vllm_omni_names_for_config_and_factory(tmp_path):
    # load_omni_transfer_config, get_connectors_config_for_stage and OmniConnectorFactory, as
    # vLLM-Omni's callers use them.
    f = tmp_path / "stages.yaml"
    f.write_text(SEED_MOONCAKE)
    cfg = stagelink.load_omni_transfer_config(f)
    mid = stagelink.get_connectors_config_for_stage(cfg, 1)
    assert set(mid) == {"from_stage_0", "to_stage_2"}
    assert mid["from_stage_0"]["spec"]["name"] == "MooncakeStoreConnector"
    assert mid["from_stage_0"]["spec"]["extra"]["role"] == "receiver"
    assert mid["to_stage_2"]["spec"] == {"name": "SharedMemoryConnector",
                                         "extra": {"shm_threshold_bytes": 65536, "role": "sender"}}
    assert list(stagelink.get_connectors_config_for_stage(cfg, 0)) == ["to_stage_1"]
    assert stagelink.get_connectors_config_for_stage(None, 0) == {}
    # vLLM-Omni's TransferConfig.connectors: the connector of every edge, keyed by stage ids
    assert cfg.connectors[("0", "1")].name == "MooncakeStoreConnector"
    assert cfg.connectors[("1", "2")].name == "SharedMemoryConnector"
    assert all(isinstance(k, tuple) and len(k) == 2 for k in cfg.connectors)
    # ... and the object built in code, as vLLM-Omni's tests build it
    shared = {"shm_threshold_bytes": 65536}
    built = stagelink.OmniTransferConfig(connectors={
        (0, 1): stagelink.ConnectorSpec("SharedMemoryConnector", dict(shared)),
        ("1", "2"): stagelink.ConnectorSpec("SharedMemoryConnector", dict(shared))})
    assert set(built.connectors) == {("0", "1"), ("1", "2")}
    for sid, want in ((0, {"to_stage_1": "sender"}), (1, {"from_stage_0": "receiver", "to_stage_2": "sender"}),
                      (2, {"from_stage_1": "receiver"})):
        per = stagelink.get_connectors_config_for_stage(built, sid)
        assert {k: v["spec"]["extra"]["role"] for k, v in per.items()} == want
        assert all(v["spec"]["extra"]["shm_threshold_bytes"] == 65536 for v in per.values())
    c = stagelink.OmniConnectorFactory.create_connector(stagelink.ConnectorSpec(name="SharedMemoryConnector"))
    try:
        assert c.put(0, 1, "k", {"a": 1})[0] and c.get(0, 1, "k")[0] == {"a": 1}
    finally:
        c.close()
    with pytest.raises(ValueError):
        stagelink.OmniConnectorFactory.create_connector(stagelink.ConnectorSpec(name="UnknownConnector"))
    data = {"key": "value", "list": [1, 2, 3]}
    blob = stagelink.OmniSerializer.serialize(data)
    assert isinstance(blob, bytes) and stagelink.OmniSerializer.deserialize(blob) == data
    made = []
    stagelink.OmniConnectorFactory.register_connector("MyConnector", lambda extra: made.append(extra) or "mine",
                                                      supports_dual=True)  # vLLM-Omni's keyword
    try:
        assert stagelink.OmniConnectorFactory.create_connector(stagelink.ConnectorSpec("MyConnector", {"x": 1})) == "mine"
        assert made == [{"x": 1}]
        names = stagelink.OmniConnectorFactory.list_registered_connectors()
        assert {"MyConnector", "SharedMemoryConnector", "MooncakeConnector", "MooncakeStoreConnector",
                "MooncakeTransferEngineConnector"} <= set(names)
    finally:
        stagelink.OmniConnectorFactory._registry.pop("MyConnector")
    assert "MyConnector" not in stagelink.OmniConnectorFactory.list_registered_connectors()


def test_a_connector_of_ones_own_on_vllm_omnis_base_class(ns):
    """vLLM-Omni's OmniConnectorBase: a subclass implements the five abstract calls and gets the
    rest; registered with the factory, it is made by name; stagelink's connectors are instances."""
    class DictConnector(stagelink.OmniConnectorBase):
        def __init__(self, extra):
            self.store, self.closed = {}, 0

        def put(self, from_stage, to_stage, put_key, data):
            blob = self.serialize_obj(data)
            self.store[self._make_key(put_key, from_stage, to_stage)] = blob
            return True, len(blob), None

        def get(self, from_stage, to_stage, get_key, metadata=None):
            blob = self.store.pop(self._make_key(get_key, from_stage, to_stage), None)
            return None if blob is None else (self.deserialize_obj(blob), len(blob))

        def cleanup(self, request_id):
            return None

        def health(self):
            return {"status": "healthy"}

        def close(self):
            self.closed += 1

    with pytest.raises(TypeError):
        stagelink.OmniConnectorBase()  # abstract
    stagelink.OmniConnectorFactory.register_connector("DictConnector", DictConnector)
    try:
        with stagelink.OmniConnectorFactory.create_connector(stagelink.ConnectorSpec("DictConnector")) as c:
            assert isinstance(c, stagelink.OmniConnectorBase) and c.supports_raw_data is False
            ok, size, _ = c.put("0", "1", "k", {"x": [1.0, None]})
            assert ok and c.get("0", "1", "k") == ({"x": [1.0, None]}, size)
            with pytest.raises(NotImplementedError):
                c.get_with_deadline("0", "1", "k", deadline=0)
            assert c.abandon_get("k") is None and c.reap_consumed() is None
        assert c.closed >= 1
    finally:
        stagelink.OmniConnectorFactory._registry.pop("DictConnector")
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as shm:
        assert isinstance(shm, stagelink.OmniConnectorBase)
    assert issubclass(stagelink.MooncakeStoreConnector, stagelink.OmniConnectorBase)


def test_vllm_omnis_set_up_functions_connect_an_orchestrator_and_a_stage(tmp_path, ns):
    f = tmp_path / "stages.yaml"
    f.write_text(f"""
stage_args:
  - stage_id: 0
    output_connectors: {{to_stage_1: shm}}
  - stage_id: 1
    engine_input_source: [0]
runtime:
  connectors:
    shm: {{name: SharedMemoryConnector, extra: {{namespace: {ns}}}}}
""")
    assert stagelink.initialize_orchestrator_connectors(None) == (None, {})
    cfg, out = stagelink.initialize_orchestrator_connectors(f)
    try:
        assert list(out) == [("0", "1")] and out[("0", "1")].extra["role"] == "sender"
        stage_cfg = stagelink.get_stage_connector_config(cfg, 1)
        assert stage_cfg["from_stage_0"]["spec"]["extra"]["role"] == "receiver"
        inbound = stagelink.build_stage_connectors(1, stage_cfg)
        try:
            assert list(inbound) == [("0", "1")]
            ok, size, md = out[("0", "1")].put("0", "1", "req-1", {"h": [1.0]})
            assert ok and inbound[("0", "1")].get("0", "1", "req-1", md) == ({"h": [1.0]}, size)
        finally:
            for c in inbound.values():
                c.close()
        assert stagelink.get_stage_connector_config(None, 1) == {}
        assert stagelink.build_stage_connectors(1, {}) == {}
        with pytest.raises(stagelink.NotFoundError):  # a stage never starts with an edge missing
            stagelink.build_stage_connectors(1, {"from_stage_0": {"spec": {"name": "NoSuchConnector"}}})
    finally:
        for c in out.values():
            c.close()


def test_load_omni_transfer_config_takes_vllm_omnis_arguments(tmp_path):
    # vLLM-Omni's signature: load_omni_transfer_config(config_path=None, config_dict=None,
    # default_shm_threshold=65536); None for neither, FileNotFoundError for a missing file, and
    # an edge without a connector gets SharedMemoryConnector with that threshold.
    f = tmp_path / "stages.yaml"
    f.write_text(SEED_MOONCAKE)
    assert stagelink.load_omni_transfer_config() is None
    assert stagelink.load_omni_transfer_config(config_path=None, config_dict=None) is None
    with pytest.raises(FileNotFoundError):
        stagelink.load_omni_transfer_config(config_path=tmp_path / "absent.yaml")
    cfg = stagelink.load_omni_transfer_config(config_path=str(f), default_shm_threshold=4096)
    assert cfg.connectors[("1", "2")].extra == {"shm_threshold_bytes": 4096}
    assert cfg.connectors[("0", "1")].name == "MooncakeStoreConnector"
    d = {"stage_args": [{"stage_id": 0}, {"stage_id": 1, "engine_input_source": [0]}]}
    cfg = stagelink.load_omni_transfer_config(config_dict=d)
    assert cfg.connectors == {("0", "1"): stagelink.ConnectorSpec("SharedMemoryConnector", {"shm_threshold_bytes": 65536})}
    assert cfg.connector_for_edge(5, 6).extra == {"shm_threshold_bytes": 65536}
    with pytest.raises(stagelink.InvalidArgumentError):
        stagelink.load_omni_transfer_config(config_dict=d, default_shm_threshold=-1)


def test_dict_input_and_errors(tmp_path):
    cfg = stagelink.load_transfer_config({"stages": [{"stage_id": "a", "output_connectors": {"to_stage_b": {"name": "SharedMemoryConnector"}}}]})
    assert cfg.connector_for_edge("a", "b").name == "SharedMemoryConnector"
    bad = tmp_path / "bad.yaml"
    bad.write_text("stage_args:\n  - stage_id: 0\n    output_connectors: {to_stage_1: missing_ref}\n")
    with pytest.raises(stagelink.InvalidArgumentError, match=r"bad.yaml:3.*to_stage_1.*missing_ref"):
        stagelink.load_transfer_config(bad)
    with pytest.raises(stagelink.NotFoundError):
        stagelink.load_transfer_config(tmp_path / "absent.yaml")
    assert stagelink.transfer_engine_port(50051, "kv_transfer", 0, dp_index=1, tp_size=2, tp_rank=1) == 50154


def test_vllm_omni_parity_role_merge_env_and_overlays(tmp_path, monkeypatch, caplog):
    import logging
    monkeypatch.setenv("SL_PY_PORT", "50999")
    (tmp_path / "base.yaml").write_text(
        "runtime:\n  connectors:\n    te:\n      name: MooncakeTransferEngineConnector\n"
        "      extra:\n        zmq_port: ${SL_PY_PORT}\n        role: receiver\n"
        "stage_args:\n  - stage_id: 0\n    output_connectors: {to_stage_1: te}\n")
    (tmp_path / "deploy.yaml").write_text(
        "base_config: base.yaml\nconnectors:\n  te: {name: SharedMemoryConnector}\n"
        "runtime:\n  connectors:\n    te: {extra: {protocol: tcp}}\n")
    with caplog.at_level(logging.INFO, logger="stagelink"):
        cfg = stagelink.load_transfer_config(tmp_path / "deploy.yaml")
    spec = cfg.connector_for_edge(0, 1)
    assert spec.name == "MooncakeTransferEngineConnector"  # runtime.connectors wins over connectors
    assert spec.extra["zmq_port"] == 50999 and spec.extra["protocol"] == "tcp"
    assert cfg.stage_connectors(0)[0]["connector"].extra["role"] == "receiver"  # the user's role, kept
    assert any("'te'" in n for n in cfg.notes) and any("runtime.connectors.te" in r.message for r in caplog.records)
    two = {"stages": [{"stage_id": 0, "output_connectors": {"to_stage_1": {"name": "SharedMemoryConnector", "extra": {"a": 1}}}},
                      {"stage_id": 1, "input_connectors": {"from_stage_0": {"name": "SharedMemoryConnector", "extra": {"a": 2}}}}]}
    with pytest.raises(stagelink.InvalidArgumentError, match=r"edge 0 -> 1.*stage 0.*stage 1.*extra\.a"):
        stagelink.load_transfer_config(two)
    monkeypatch.delenv("SL_PY_PORT")
    with pytest.raises(stagelink.InvalidArgumentError, match="SL_PY_PORT"):
        stagelink.load_transfer_config(tmp_path / "deploy.yaml")


def test_cli_config_check_and_help(tmp_path):
    f = tmp_path / "te.yaml"
    f.write_text("""
runtime:
  connectors:
    rdma: {name: MooncakeTransferEngineConnector, extra: {zmq_port: 50051, protocol: tcp}}
stage_args:
  - {stage_id: 0, output_connectors: {to_stage_1: rdma}}
  - {stage_id: 1, input_connectors: {from_stage_0: rdma}}
""")
    out = subprocess.run([BIN, "config", "check", str(f)], capture_output=True, text=True, check=True).stdout
    assert "0 -> 1: MooncakeTransferEngineConnector rdma" in out
    assert "role=sender" in out and "role=receiver" in out and "kv_transfer=50151" in out
    h = subprocess.run([BIN, "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("bench", "config", "shm", "health", "run", "--version"):
        assert cmd in h
    v = subprocess.run([BIN, "--version"], capture_output=True, text=True, check=True).stdout
    assert v.strip() == f"stagelink {stagelink.__version__}"
    # One exit status for one kind of error in every command (2: the file cannot be read or does not
    # resolve), saying why; the statuses listed in --help.
    for cmd in (["config", "check"], ["health"], ["run"]):
        bad = subprocess.run([BIN, *cmd, str(tmp_path / "nope.yaml")], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "No such file or directory" in bad.stderr, (cmd, bad.stderr)
    assert "'cannot read" not in bad.stderr  # not a KeyError's quoted str()
    for cmd in (["run"], ["config", "check"]):
        assert "exit status: 0 done; 1" in subprocess.run([BIN, *cmd, "--help"], capture_output=True, text=True).stdout
    for cmd, words in ((["demo"], "verify each by checksum"), (["shm", "reap"], "Reclaim what processes that died"),
                       (["shm", "ls"], "List stagelink's shared memory")):
        assert words in " ".join(subprocess.run([BIN, *cmd, "--help"], capture_output=True, text=True).stdout.split())


def test_cli_config_check_of_a_pipeline_file(tmp_path):
    """A `stagelink run` file used to fail as a transfer config ('stages[0].stage_id' expected)."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
    r = subprocess.run([BIN, "config", "check", os.path.join(root, "omni_two_hosts.yaml")], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    assert "4 stages in 4 processes, entry encoder, terminal vocoder" in r.stdout
    assert "the coordinator on 10.0.0.5:47100" in r.stdout
    assert ("thinker: thinker on host gpu2 (10.0.0.6, launched by ssh -o BatchMode=yes 10.0.0.6), control on "
            "10.0.0.6:47102, env CUDA_VISIBLE_DEVICES=0") in r.stdout
    # ... and how CUDA tensors cross each edge (docs/cuda.md)
    assert ("encoder -> thinker (data): relay ucx (between hosts), no pickle; CUDA tensors staged through pinned "
            "host memory (transfer engine)\n") in r.stdout
    assert ("thinker -> talker (stream): relay shm, pickle allowed (same host, same user); CUDA tensors stay on "
            "their GPU (device arena, CUDA IPC)\n") in r.stdout  # auto
    assert "vocoder -> coordinator (result): relay shm" in r.stdout
    f = tmp_path / "bad.yaml"
    f.write_text(open(os.path.join(root, "omni_two_hosts.yaml")).read().replace("host: gpu2", "host: gpu3", 1))
    r = subprocess.run([BIN, "config", "check", str(f)], capture_output=True, text=True)
    assert r.returncode == 2 and "host 'gpu3' is not under 'hosts:'" in r.stderr


@pytest.mark.parametrize("relay, words", [
    ({"backend": "connector", "connector": "SharedMemoryConector"},
     ["relay: connector class 'SharedMemoryConector' is not available", "did you mean 'SharedMemoryConnector'"]),
    ({"extra": {"arena_byte": 1 << 20}}, ["relay: SharedMemoryConnector: unknown key 'extra.arena_byte'",
                                          "did you mean 'arena_bytes'"]),
    ({"extra": {"shm_threshold_bytes": "lots"}}, ["relay: SharedMemoryConnector: extra.shm_threshold_bytes must be "
                                                  "a size in bytes", "got 'lots'"]),
    ({"backend": "ucx", "extra": {"protocol": "carrier-pigeon"}}, ["relay: TransferEngineConnector: extra.protocol"]),
])
def test_config_check_refuses_a_connector_and_extra_its_connector_would(tmp_path, relay, words):
    """Issue 62 (configuration checked when it is read): `config check` passed a misspelt connector
    name, a misspelt key and a value of the wrong kind, exited 0, and the run then failed inside a
    stage process with a traceback (exit 1). Now each is refused when the file is read: exit 2,
    naming the file, where in it, the key, and the key or name meant."""
    import yaml
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"relay": relay, "stages": [{"name": "a", "factory": "m:f", "terminal": True}]}))
    r = subprocess.run([BIN, "config", "check", str(f)], capture_output=True, text=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(f) in r.stderr and all(w in r.stderr for w in words), r.stderr
    with pytest.raises(stagelink.pipeline.PipelineConfigError):
        stagelink.pipeline.load_pipeline(str(f))
    # the same connector named by a per-edge entry (edges:, vLLM-Omni's syntax)
    if relay.get("backend", "shm") in ("shm", "connector"):
        name = relay.get("connector", "SharedMemoryConnector")
        f.write_text(yaml.safe_dump({"connectors": {"c1": {"name": name, "extra": relay.get("extra", {})}},
                                     "edges": [{"from": "a", "to": "b", "connector": "c1"}],
                                     "stages": [{"name": "a", "factory": "m:f", "next": "b"},
                                                {"name": "b", "factory": "m:g", "terminal": True}]}))
        r = subprocess.run([BIN, "config", "check", str(f)], capture_output=True, text=True)
        assert r.returncode == 2, r.stdout + r.stderr
        assert "edges[0]" in r.stderr and all(w.replace("relay: ", "") in r.stderr for w in words), r.stderr


@pytest.mark.parametrize("extra, words", [
    ({"spare_bytes": "lots"}, ["runtime.connectors.shm: SharedMemoryConnector: extra.spare_bytes must be a size"]),
    ({"arena_byte": 1 << 20}, ["unknown key 'extra.arena_byte'", "did you mean 'arena_bytes'"]),
])
def test_config_check_of_a_vllm_omni_file_reads_each_connectors_extra(tmp_path, extra, words):
    """A vLLM-Omni transfer config's connectors were printed, not checked: a misspelt key or a value
    of the wrong kind passed `config check` (exit 0) and failed only when a stage made the
    connector. Now each connector's extra is read as the connector reads it: exit 2, naming the file
    and the connector; a good file still passes."""
    import yaml
    f = tmp_path / "stages.yaml"
    stages = [{"stage_id": 0, "output_connectors": {"to_stage_1": "shm"}},
              {"stage_id": 1, "input_connectors": {"from_stage_0": "shm"}}]
    f.write_text(yaml.safe_dump({"runtime": {"connectors": {"shm": {"name": "SharedMemoryConnector", "extra": extra}}},
                                 "stage_args": stages}))
    r = subprocess.run([BIN, "config", "check", str(f)], capture_output=True, text=True)
    assert r.returncode == 2 and str(f) in r.stderr and all(w in r.stderr for w in words), r.stdout + r.stderr
    f.write_text(yaml.safe_dump({"runtime": {"connectors": {"shm": {"name": "SharedMemoryConnector",
                                                                    "extra": {"spare_bytes": "2 GiB"}}}},
                                 "stage_args": stages}))
    r = subprocess.run([BIN, "config", "check", str(f)], capture_output=True, text=True)
    assert r.returncode == 0 and "0 -> 1: SharedMemoryConnector shm" in r.stdout, r.stderr


def test_config_check_finds_a_stage_module_that_cannot_be_imported(tmp_path):
    """Issue 62: a stage whose module cannot be found was met only at run time, inside its stage
    process. `config check` now looks for each of this host's stage modules (the pipeline's own
    directory first, as the stage process looks) without running any stage code, and for a C++
    stage's library."""
    import yaml
    (tmp_path / "my_stages.py").write_text("def f(x, ctx):\n    return x\n")
    f = tmp_path / "p.yaml"
    good = {"stages": [{"name": "a", "factory": "my_stages:f", "terminal": True}]}
    f.write_text(yaml.safe_dump(good))
    r = subprocess.run([BIN, "config", "check", str(f)], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr  # found beside the pipeline file, from any working directory
    for factory, words in (("my_stagez:f", "module 'my_stagez' of factory 'my_stagez:f' cannot be found"),
                           ("cpp:libnothere.so:stage", "the library of factory 'cpp:libnothere.so:stage' does not exist")):
        f.write_text(yaml.safe_dump({"stages": [{"name": "a", "factory": factory, "terminal": True}]}))
        r = subprocess.run([BIN, "config", "check", str(f)], capture_output=True, text=True, cwd="/")
        assert r.returncode == 2 and f"stage 'a': {words}" in r.stderr, r.stderr


def test_cli_shm_ls_and_reap(ns):
    c = stagelink.create_connector("SharedMemoryConnector", {"namespace": ns, "arena_bytes": 64 << 20})
    assert c.put(0, 1, "k", b"x" * 100000)[0]
    out = subprocess.run([BIN, "shm", "ls"], capture_output=True, text=True, check=True).stdout
    assert f"{ns}.dir" in out and "arena" in out
    # An arena spans its size and holds what puts reached: the first 2 MiB step here.
    arena = [r for r in stagelink._core.shm_list("/dev/shm") if r["kind"] == "arena" and f".{ns}.a" in r["name"]]
    assert len(arena) == 1 and arena[0]["size"] == 64 << 20 and arena[0]["held"] == 2 << 20, arena
    assert str(2 << 20) in next(line for line in out.splitlines() if arena[0]["name"] in line)
    c.close()
    out = subprocess.run([BIN, "shm", "reap"], capture_output=True, text=True, check=True).stdout
    assert "resources reclaimed" in out


def test_stage_view_derives_transfer_engine_endpoints_as_vllm_omni(monkeypatch):
    """vLLM-Omni's per-stage view for role-bound connectors: a middle stage is dual on both sides
    (one extra), each sending stage listens on zmq_port + its id, each receiving one is pointed at
    its upstream's listener; the shared-memory connector only gets its role. Then the derived
    endpoints carry a real three-stage transfer-engine pipeline on one host, no port taken twice."""
    monkeypatch.setattr(stagelink.config, "_detect_local_ip", lambda: "10.20.30.40")

    def linear(name, extra):
        return stagelink.OmniTransferConfig(connectors={e: stagelink.ConnectorSpec(name, dict(extra))
                                                        for e in (("0", "1"), ("1", "2"))})

    cfg = linear("MooncakeTransferEngineConnector", {"zmq_port": 50051, "host": "auto"})
    view = stagelink.get_connectors_config_for_stage
    first, mid, last = view(cfg, 0), view(cfg, 1), view(cfg, 2)
    assert list(first) == ["to_stage_1"]
    assert first["to_stage_1"]["spec"]["extra"] == {"zmq_port": 50051, "host": "auto", "role": "sender"}
    assert list(last) == ["from_stage_1"]
    assert last["from_stage_1"]["spec"]["extra"] == {"zmq_port": 50051, "host": "auto", "role": "receiver",
                                                     "sender_host": "10.20.30.40", "sender_zmq_port": 50052}
    assert set(mid) == {"from_stage_0", "to_stage_2"}
    assert mid["from_stage_0"] == mid["to_stage_2"]
    assert mid["from_stage_0"]["spec"]["extra"] == {"zmq_port": 50052, "host": "auto", "role": "dual",
                                                    "sender_host": "10.20.30.40", "sender_zmq_port": 50051}
    given = view(linear("MoriTransferEngineConnector", {"zmq_port": 50051, "sender_host": "192.168.1.10",
                                                        "sender_zmq_port": 60000}), 1)["from_stage_0"]["spec"]["extra"]
    assert (given["sender_host"], given["sender_zmq_port"], given["zmq_port"]) == ("192.168.1.10", 60000, 50052)
    named = view(linear("MooncakeTransferEngineConnector", {"zmq_port": 50051, "host": "172.16.0.5"}), 1)
    assert named["from_stage_0"]["spec"]["extra"]["sender_host"] == "172.16.0.5"
    assert view(linear("MooncakeTransferEngineConnector", {"zmq_port": 50051, "role": "receiver"}), 1)[
        "to_stage_2"]["spec"]["extra"]["role"] == "receiver"  # the user's role is kept
    for sid in (0, 1, 2):
        for entry in view(linear("SharedMemoryConnector", {"shm_threshold_bytes": 65536}), sid).values():
            assert set(entry["spec"]["extra"]) == {"shm_threshold_bytes", "role"}
    for stage, name in (("prefill", "MooncakeTransferEngineConnector"), ("1", "SomeFutureConnector")):
        extra = {"zmq_port": 50051, "host": "auto"}
        stagelink.config._inject_chunk_path_endpoints(extra, connector_name=name, role="dual", own_stage=stage,
                                                      upstream_stage="0")
        assert extra == {"zmq_port": 50051, "host": "auto"}

    # The derived endpoints, used: stage 0 puts, stage 1 (dual) gets without metadata and puts on,
    # stage 2 gets without metadata. Each sender binds its own port. Gets without metadata are
    # served where the config says so (serve_by_key; or curve): a put's capability is otherwise in
    # its metadata only.
    base = free_port_run(3)
    assert base is not None, "no free run of 3 ports on loopback"
    cfg = linear("TransferEngineConnector", {"zmq_port": base, "host": "127.0.0.1", "protocol": "tcp",
                                             "memory_pool_size": 16 << 20, "serve_by_key": True})
    made = []
    try:
        s0 = stagelink.create_connector("TransferEngineConnector", view(cfg, 0)["to_stage_1"]["spec"]["extra"])
        made.append(s0)
        s1 = stagelink.create_connector("TransferEngineConnector", view(cfg, 1)["from_stage_0"]["spec"]["extra"])
        made.append(s1)
        s2 = stagelink.create_connector("TransferEngineConnector", view(cfg, 2)["from_stage_1"]["spec"]["extra"])
        made.append(s2)
        assert (s0.health()["zmq_port"], s1.health()["zmq_port"]) == (base, base + 1)
        assert s0.put(0, 1, "req", np.arange(1000))[0]
        got, _ = s1.get(0, 1, "req", timeout=10)
        assert s1.put(1, 2, "req", got * 2)[0]
        assert np.array_equal(s2.get(1, 2, "req", timeout=10)[0], np.arange(1000) * 2)
    finally:
        for c in made:
            c.close()


def test_connector_options_share_one_reader_and_its_schemas_are_listed():
    """Issue 53: every connector's extra and the relay's config are read through one schema-driven
    reader: one error style naming the key, typos refused with the key meant, keys another caller
    adds (vLLM-Omni's stage_id) accepted and named in health(); the schemas are listed for the docs."""
    owners = {s["owner"]: s for s in stagelink._core.option_schemas()}
    assert {"SharedMemoryConnector", "TransferEngineConnector", "StoreConnector", "relay config"} <= set(owners)
    shm = {k["name"]: k for k in owners["SharedMemoryConnector"]["keys"]}
    assert shm["readers"] == {"name": "readers", "type": "integer", "default": "1", "min": 1.0, "max": 8.0,
                              "doc": shm["readers"]["doc"]}
    assert owners["relay config"]["closed"] and not owners["StoreConnector"]["closed"]
    with pytest.raises(stagelink.InvalidArgumentError, match="did you mean 'shm_threshold_bytes'"):
        stagelink.create_connector("SharedMemoryConnector", {"shm_treshold_bytes": 1024, "strict": True})
    with pytest.raises(stagelink.InvalidArgumentError,
                       match=r"TransferEngineConnector: extra.protocol must be one of: tcp rdma, got 'udp'"):
        stagelink.create_connector("TransferEngineConnector", {"protocol": "udp", "strict": True})
    c = stagelink.create_connector("SharedMemoryConnector", {"stage_id": 1, "namespace": f"opt{os.getpid()}",
                                                             "vendor_knob": "x"})
    try:
        assert c.health()["ignored_extra_keys"] == ["vendor_knob"]
    finally:
        c.close()


def test_connector_descriptors_are_the_one_source_of_what_a_connector_is():
    """Issue 62: each connector's names, traits and schema come from one descriptor in the core;
    what the Python layer decides from them (pickle default, role binding, relay placement) follows
    the descriptor, an alias included, not a list of class names."""
    ds = stagelink._core.connectors()
    assert ds["MooncakeTransferEngineConnector"]["name"] == "TransferEngineConnector"
    assert set(ds["SharedMemoryConnector"]["traits"]) >= {"host_local", "pickle_default", "lookup_gets"}
    assert "side_channel" in ds["TransferEngineConnector"]["traits"]
    assert ds["MooncakeConnector"]["python"] == "stagelink.mooncake_store:MooncakeStoreConnector"
    from stagelink.connector import has_trait
    from stagelink.config import _role_bound
    from stagelink.relay import default_allow_pickle
    assert has_trait("SharedMemoryConnector", "pickle_default") and not has_trait("StoreConnector", "pickle_default")
    assert not has_trait("NoSuchConnector", "host_local")  # unknown: taken to cross hosts
    assert _role_bound("MooncakeTransferEngineConnector") and _role_bound("MoriTransferEngineConnector")
    assert not _role_bound("SharedMemoryConnector")
    assert default_allow_pickle({"backend": "connector", "connector": "SharedMemoryConnector"})
    assert not default_allow_pickle({"backend": "connector", "connector": "TransferEngineConnector"})
    # Pickle defaults follow the traits: shared memory on, the transfer engine off.
    shm = stagelink.create_connector("SharedMemoryConnector", {"namespace": f"desc{os.getpid()}"})
    te = stagelink.create_connector("MooncakeTransferEngineConnector", {"host": "127.0.0.1", "zmq_port": 0})
    try:
        assert shm.allow_pickle and not te.allow_pickle
        assert te.name == "MooncakeTransferEngineConnector"  # made under the name asked for
    finally:
        shm.close()
        te.close()
    # Relay backends: where each one's data goes, and the connector it makes.
    from stagelink.pipeline.spec import relay_connector, relay_host_local
    assert relay_connector({"backend": "ucx"}) == "TransferEngineConnector"
    assert relay_connector({"backend": "local"}) is None
    assert relay_host_local({"backend": "shm"}) and not relay_host_local({"backend": "ucx"})
    assert relay_host_local({"backend": "connector", "connector": "SharedMemoryConnector"})
    assert not relay_host_local({"backend": "connector", "connector": "StoreConnector"})
    # The configuration reference lists them from the same descriptors.
    from stagelink.cli import config_reference
    ref = config_reference()
    assert "| `TransferEngineConnector` | `MooncakeTransferEngineConnector` | side_channel |" in ref


def test_pipeline_edges_are_read_as_values_not_reparsed_text(tmp_path, monkeypatch):
    """Issue 62: the pipeline file's `edges:` and `connectors:` went to the C++ loader as JSON text
    and its errors had the text's line (always 1) cut out with a regex. The loader now takes the
    values: strings stay strings, ${VAR} still expands, and an error names the file and the key."""
    import yaml
    monkeypatch.setenv("SL_EDGE_NS", "fromenv")
    f = tmp_path / "p.yaml"
    stages = [{"name": "a", "factory": "m:f", "next": "b"}, {"name": "b", "factory": "m:g", "terminal": True}]
    f.write_text(yaml.safe_dump({"connectors": {"c1": {"name": "SharedMemoryConnector",
                                                       "extra": {"namespace": "123", "ttl_s": 60}},
                                                "c2": {"name": "SharedMemoryConnector",
                                                       "extra": {"namespace": "${SL_EDGE_NS}"}}},
                                 "edges": [{"from": "a", "to": "b", "connector": "c1"}], "stages": stages}))
    spec = stagelink.pipeline.load_pipeline(str(f))
    extra = spec.edge_relays["a->b"]["extra"]
    assert extra["namespace"] == "123" and extra["ttl_s"] == 60  # a string stays one; a number stays one
    raw = yaml.safe_load(f.read_text())
    raw["edges"][0]["connector"] = "c2"
    assert stagelink.pipeline.load_pipeline(raw).edge_relays["a->b"]["extra"]["namespace"] == "fromenv"
    raw["edges"][0]["connector"] = "c3"
    with pytest.raises(stagelink.pipeline.PipelineConfigError) as e:
        stagelink.pipeline.load_pipeline(dict(raw))
    assert str(e.value).startswith("<dict>: ") and "c3" in str(e.value) and "<dict>:1:" not in str(e.value)
