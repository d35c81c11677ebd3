"""`stagelink run` on the shipped examples, as a user runs it: a subprocess, a fresh process tree."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STAGELINK = os.path.join(os.path.dirname(sys.executable), "stagelink")


def shm_files():
    return set(os.listdir("/dev/shm"))


@pytest.mark.parametrize("example,requests", [("omni_pipeline.yaml", 12), ("fanin_pipeline.yaml", 8),
                                              ("toy_pipeline.yaml", 64), ("cpp_pipeline.yaml", 16)])
def test_run_example_verifies_every_result(tmp_path, example, requests):
    if example == "toy_pipeline.yaml":
        pytest.importorskip("torch")
    if example == "cpp_pipeline.yaml" and not os.path.exists(os.path.join(ROOT, "build", "cpp",
                                                                          "libstagelink_example_stages.so")):
        pytest.skip("the C++ example stages are built by ./scripts/test")
    before = shm_files()
    out = tmp_path / "r.json"
    p = subprocess.run([STAGELINK, "run", os.path.join(ROOT, "examples", example), "--requests", str(requests),
                        "--concurrency", "3", "--json", str(out)], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    assert r["completed"] == requests and r["failed"] == 0
    assert r["startup_ms"] < 5000
    assert all(e["messages"] > 0 for e in r["edges"])
    assert "verified end to end" in p.stdout or "all requests completed" in p.stdout
    if example == "toy_pipeline.yaml":  # how CUDA tensors cross its edges (all on one host), where a GPU is
        from stagelink import _core
        line = "CUDA tensors: prep->enc, enc->dec: stay on their GPU (device arena, CUDA IPC)"
        assert (line in p.stdout) == bool(_core.cuda_status().get("available")), p.stdout
    assert shm_files() <= before


def test_the_client_functions_import_from_beside_the_pipeline_file(tmp_path):
    """Regression (issue 55): `client.request`/`client.verify` from a module beside the pipeline file
    failed to import while the stages' factories from the same module imported fine."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "mine.py").write_text(
        "def make_request(i, **_):\n    return {'x': i}\n\n"
        "def double(payload, ctx):\n    return {'x': payload['x'] * 2}\n\n"
        "def verify(request, result, chunks, **_):\n    assert result == {'x': 2 * request['x']}, result\n")
    (tmp_path / "p" / "mine.yaml").write_text(
        "name: mine\nclient: {request: 'mine:make_request', verify: 'mine:verify'}\n"
        "stages:\n  - {name: d, factory: 'mine:double', terminal: true}\n")
    p = subprocess.run([STAGELINK, "run", str(tmp_path / "p" / "mine.yaml"), "--requests", "4"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "verified end to end" in p.stdout


def test_run_reports_a_broken_pipeline_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - {name: a, factory: 'x:y', next: nowhere}\n")
    p = subprocess.run([STAGELINK, "run", str(bad)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "nowhere" in p.stderr


def test_run_fails_when_a_result_is_wrong(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(open(os.path.join(ROOT, "examples", "omni_pipeline.yaml")).read()
                 .replace("args: {seconds: 2.0, chunks: 4, tokens_per_chunk: 256}",
                          "args: {seconds: 0.5, chunks: 3, tokens_per_chunk: 16}")
                 .replace('verify: "stagelink.examples.omni:verify"', 'verify: "stagelink.examples.omni:verify_fanin"'))
    p = subprocess.run([STAGELINK, "run", str(f), "--requests", "2"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    assert "wrong result" in p.stderr


def start_slow_run(tmp_path, name):
    """`stagelink run` of a slow pipeline in a session of its own, 2.5 s into its requests."""
    f = tmp_path / f"{name}.yaml"
    f.write_text(open(os.path.join(ROOT, "examples", "omni_pipeline.yaml")).read()
                 .replace("args: {seconds: 2.0, chunks: 4, tokens_per_chunk: 256}",
                          "args: {seconds: 1.0, chunks: 50, tokens_per_chunk: 64, compute_ms: 20}"))
    # SIGINT as a terminal leaves it: a suite started in the background (`cmd &` in a script) runs
    # with SIGINT ignored, which children inherit and Python then keeps (nohup's meaning).
    p = subprocess.Popen([STAGELINK, "run", str(f), "--requests", "100"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(2.5)
    return p


def test_ctrl_c_leaves_no_process_or_shared_memory(tmp_path):
    before = shm_files()
    p = start_slow_run(tmp_path, "slow")
    os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    assert_stopped_cleanly(p, "slow", 130, "interrupted", before)


def assert_stopped_cleanly(p, name, status, said, shm_before):
    out, err = p.communicate(timeout=60)
    assert p.returncode == status, out + err
    assert said in err
    time.sleep(0.3)
    leftover = subprocess.run(["pgrep", "-f", f"stagelink.pipeline._entry .*{name}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == ""
    assert shm_files() <= shm_before, shm_files() - shm_before


@pytest.mark.parametrize("to_group", [False, True], ids=["docker-stop", "systemd-cgroup"])
def test_sigterm_stops_cleanly_with_status_143(tmp_path, to_group):
    """SIGTERM as `docker stop` sends it (the main process only) and as systemd does (every process
    of the unit): the stages shut down, nothing is left in /dev/shm, and the status is 143."""
    before = shm_files()
    p = start_slow_run(tmp_path, "slowterm")
    assert p.poll() is None, p.communicate()
    if to_group:
        os.killpg(p.pid, signal.SIGTERM)
    else:
        os.kill(p.pid, signal.SIGTERM)
    assert_stopped_cleanly(p, "slowterm", 143, "terminated (SIGTERM)", before)


def test_a_bare_stagelink_prints_its_help():
    p = subprocess.run([STAGELINK], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: stagelink") and "run" in p.stdout and "bench" in p.stdout


def test_run_says_nothing_of_cuda_tensors_on_a_host_without_a_gpu():
    from stagelink import _core
    if _core.cuda_status().get("available"):
        pytest.skip("this host has a GPU")
    p = subprocess.run([STAGELINK, "run", os.path.join(ROOT, "examples", "toy_pipeline.yaml"), "--requests", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "CUDA tensors" not in p.stdout and "GPU" not in p.stdout


@pytest.mark.parametrize("factory,says", [
    ("no_such_module_here:f", "cannot import module 'no_such_module_here'"),
    ("pipeline_stages:no_such_stage", "no_such_stage"),
    ("pipeline_stages:make_scaler", "Add `args: {}`"),
])
def test_a_stage_the_file_names_wrong_is_one_line_and_status_2(tmp_path, factory, says):
    """Issue 64: a stage module that cannot be imported, a misspelt factory, a factory without
    args: one line saying what and where, exit 2, no traceback, no leak warnings."""
    here = os.path.join(ROOT, "tests", "python")
    f = tmp_path / "p.yaml"
    f.write_text(f"name: wrong\nstages:\n  - {{name: a, factory: 'pipeline_stages:double', next: b}}\n"
                 f"  - {{name: b, factory: '{factory}', terminal: true}}\n")
    p = subprocess.run([STAGELINK, "run", str(f), "--requests", "1"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert p.returncode == 2, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], p.stderr
    assert "stage 'b'" in lines[0] or "'b'" in lines[0] or "no_such_module_here" in lines[0], lines[0]
    assert "Traceback" not in p.stderr and "leak" not in p.stderr


def test_health_of_a_pipeline_file_makes_its_relays():
    """Issue 64: `stagelink health` on a pipeline file said `expected a stage id` (it read it as a
    vLLM-Omni transfer config); it makes each relay the pipeline's edges use and reports them."""
    p = subprocess.run([STAGELINK, "health", os.path.join(ROOT, "examples", "omni_two_hosts.yaml")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "relay shm: ok" in p.stdout and "relay ucx: ok" in p.stdout and "encoder -> thinker" in p.stdout
    assert "stage id" not in p.stdout + p.stderr and "without CURVE" not in p.stderr


def test_the_examples_travel_with_the_package_and_run_by_name(tmp_path):
    """Issue 64: `stagelink examples` lists the example pipelines installed with stagelink, prints
    one to start from, and `stagelink run NAME` runs one from an empty directory."""
    import yaml
    p = subprocess.run([STAGELINK, "examples"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env=dict(os.environ, COLUMNS="200"))
    assert p.returncode == 0, p.stderr
    for name in ("omni", "toy", "fanin", "replicas"):
        assert f"│ {name} " in p.stdout, p.stdout
    y = subprocess.run([STAGELINK, "examples", "toy"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert y.returncode == 0 and yaml.safe_load(y.stdout)["name"] == "toy"
    (tmp_path / "mine.yaml").write_text(y.stdout)  # a user's own copy runs as the example does
    for what in ("omni", "mine.yaml"):
        r = subprocess.run([STAGELINK, "run", what, "--requests", "4"], capture_output=True, text=True,
                           timeout=180, cwd=tmp_path)
        assert r.returncode == 0 and "verified end to end" in r.stdout, r.stdout + r.stderr
    assert os.listdir(tmp_path) == ["mine.yaml"]  # nothing written beside it
    bad = subprocess.run([STAGELINK, "examples", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "omni" in bad.stderr
