"""CUDA (issue 13): the driver is loaded at run time, so everything here runs without a GPU too;
what needs one skips with the reason. The bench's harness runs on CPU tensors to stay working."""
import os
import subprocess
import sys

import pytest

import stagelink


def test_cuda_status_says_why_or_lists_the_devices():
    st = stagelink.cuda_status()
    assert isinstance(st["available"], bool)
    if not st["available"]:
        assert isinstance(st["reason"], str) and st["reason"]
        return
    assert st["driver_version"] > 0 and st["devices"]
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        assert len(st["devices"]) == torch.cuda.device_count()
        for d in st["devices"]:
            assert d["uuid"].startswith("GPU-") and len(d["uuid"]) == 40 and d["total_bytes"] > 0
            props = torch.cuda.get_device_properties(d["ordinal"])
            if hasattr(props, "uuid"):  # torch prints it without the GPU- prefix
                assert str(props.uuid) in d["uuid"]


def test_cuda_can_be_turned_off():
    code = "import stagelink, json; print(json.dumps(stagelink.cuda_status()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, STAGELINK_CUDA="0"))
    assert r.returncode == 0, r.stderr
    import json
    st = json.loads(r.stdout)
    assert st["available"] is False and "STAGELINK_CUDA=0" in st["reason"]


def test_bench_cuda_harness_on_cpu_tensors_and_a_clear_skip_without_a_gpu(tmp_path):
    pytest.importorskip("torch")
    from stagelink import bench_cuda
    row = bench_cuda.measure(64 << 10, "cpu", n=3)
    assert row["verified"] is True
    for k in ("d2d_copy", "pageable_d2h", "pageable_h2d", "seed_design", "ipc_handoff", "stagelink_staged"):
        assert row[k] > 0, k
    import io
    import torch
    out = io.StringIO()
    res = bench_cuda.run_cuda([64 << 10], json_path=str(tmp_path / "c.json"), out=out)
    if not torch.cuda.is_available():
        assert "no GPU here" in out.getvalue() and res["skipped"]
        assert not res["rows"]
    else:
        assert res["rows"][0]["verified"] is True
    assert (tmp_path / "c.json").exists()


def test_a_cuda_tensor_round_trips_through_the_connector(ns):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here (runs on the GPU machine)")
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        for dt in (torch.bfloat16, torch.float16, torch.int64):
            t = (torch.arange(1 << 20, device="cuda") % 977).to(dt)
            ok, _, meta = c.put(0, 1, f"k{dt}", t)
            assert ok, c.last_error
            got, _ = c.get(0, 1, f"k{dt}", meta)
            assert got.device == t.device and got.dtype == dt
            assert torch.equal(got, t)  # compared on the device


def test_a_frame_names_the_gpu_by_uuid(ns):
    """Ordinals differ between processes (CUDA_VISIBLE_DEVICES); a staged frame (cuda_ipc off) carries
    the GPU's UUID ("tg") beside its name, and a reader that has that GPU puts the tensor back on it."""
    torch = pytest.importorskip("torch")
    st = stagelink.cuda_status()
    if not torch.cuda.is_available() or not st["available"]:
        pytest.skip("no CUDA device here (runs on the GPU machine)")
    from stagelink import _core
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns, "cuda_ipc": False}) as c:
        t = torch.arange(100, device="cuda:0")
        ok, _, meta = c.put(0, 1, "small", t)
        assert ok, c.last_error
        ext = _core._frame_as_cpp_sees_it(meta["inline"])["ext"]
        assert ext["td"] == ["cuda:0"] and ext["tg"] == [st["devices"][0]["uuid"]]
        got, _ = c.get(0, 1, "small", meta)
        assert got.device == t.device and torch.equal(got, t)


def test_get_puts_torch_tensors_where_the_caller_asks(ns):
    """get(..., device=): "cpu" leaves torch tensors on the host (a CUDA tensor's frame would be
    copied to the host, not back to its GPU); None: where they came from. Here on CPU tensors; the
    GPU cases are in test_cuda_ipc.py."""
    torch = pytest.importorskip("torch")
    with stagelink.create_connector("SharedMemoryConnector", {"namespace": ns}) as c:
        t = torch.arange(10)
        ok, _, meta = c.put(0, 1, "k", {"t": t, "ids": [1, 2]})
        got, _ = c.get(0, 1, "k", meta, device="cpu")
        assert got["ids"] == [1, 2] and got["t"].device.type == "cpu" and torch.equal(got["t"], t)
        if not torch.cuda.is_available():
            ok, _, meta = c.put(0, 1, "k2", t)
            with pytest.raises((AssertionError, RuntimeError)):  # torch: "not compiled with CUDA"
                c.get(0, 1, "k2", meta, device="cuda:0")
