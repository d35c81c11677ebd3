"""Ray placement (issue 62): a real two-node Ray cluster made here (bench_ray.TwoNodeRay: a head
and a worker in two network namespaces joined by a veth pair, Ray's token authentication on), the
coordinator a driver on the head node. The example omni pipeline placed across both nodes, two talker replicas sharing 64
requests, a replica SIGKILLed with and without retry, scaling 1 -> 3 -> 1, and the worker node
killed mid-run. Root (namespaces) and the ray package; otherwise skipped, with the reason."""
import copy
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

from stagelink.pipeline import Pipeline, PipelineConfigError, PipelineStartError, load_pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

try:
    import ray  # noqa: F401
    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

needs_cluster = pytest.mark.skipif(os.geteuid() != 0 or not HAVE_RAY,
                                   reason="a two-node Ray cluster needs root (network namespaces) and ray "
                                          "(pip install 'stagelink[ray]')")


@pytest.fixture(scope="module")
def cluster():
    from stagelink.bench_ray import TwoNodeRay
    c = TwoNodeRay()
    try:
        yield c
    finally:
        c.close()
    assert not c.pids(c.h.na) and not c.pids(c.h.nb)


def drive(cluster, scenario, tmp_path, *extra, timeout=240, on_signal=None):
    out = str(tmp_path / f"{scenario}.json")
    p = subprocess.Popen(cluster.a + [sys.executable, os.path.join(HERE, "ray_driver.py"), scenario, cluster.address,
                                      cluster.addr_b, out, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=cluster.env)
    deadline = time.monotonic() + timeout
    if on_signal is not None:
        sig = out + ".signal"
        while not os.path.exists(sig) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.path.exists(sig):
            on_signal()
            open(sig + ".done", "w").close()
    try:
        log, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        log, _ = p.communicate()
        pytest.fail(f"{scenario}: the driver did not finish within {timeout} s:\n{log[-4000:]}")
    assert os.path.exists(out), f"{scenario}: no result (exit {p.returncode}):\n{log[-4000:]}"
    with open(out) as f:
        r = json.load(f)
    assert "exception" not in r, r["exception"] + "\n" + log[-3000:]
    r["log"] = log
    return r


@needs_cluster
def test_omni_pipeline_placed_across_two_nodes(cluster, tmp_path):
    """`stagelink run` of examples/omni_ray.yaml (thinker and two talkers on node b by label, the
    rest on node a): every result verified, the edges between nodes on the transfer engine, those
    within one on shared memory, and where each process went in the report."""
    d = yaml.safe_load(open(os.path.join(ROOT, "examples", "omni_ray.yaml")))
    d["placement"]["address"] = cluster.address
    path, out = tmp_path / "omni_ray.yaml", tmp_path / "out.json"
    path.write_text(yaml.safe_dump(d))
    # Where Ray would place them, asked before the run (a placement group made and removed)
    r = subprocess.run(cluster.a + [os.path.join(os.path.dirname(sys.executable), "stagelink"), "config", "check",
                                    str(path), "--place"], capture_output=True, text=True, timeout=120, env=cluster.env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    plan = " ".join(r.stdout.split())
    assert f"talker.1: talker on Ray node {cluster.addr_b} (CPU 1, labels side=b)" in plan, plan
    assert f"encoder: encoder on Ray node {cluster.addr_a} (the coordinator's) (CPU 1, labels side=a)" in plan, plan
    r = subprocess.run(cluster.a + [os.path.join(os.path.dirname(sys.executable), "stagelink"), "run", str(path),
                                    "--requests", "16", "--json", str(out)],
                       capture_output=True, text=True, timeout=240, env=cluster.env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all results verified end to end" in r.stdout
    assert f"thinker on Ray node {cluster.addr_b}" in " ".join(r.stdout.split())
    rep = json.loads(out.read_text())
    assert rep["completed"] == 16 and rep["failed"] == 0
    on_b = f"Ray node {cluster.addr_b}"
    assert rep["placement"]["thinker"] == rep["placement"]["talker.0"] == rep["placement"]["talker.1"] == on_b
    assert rep["placement"]["encoder"] == rep["placement"]["vocoder"] == f"Ray node {cluster.addr_a} (the coordinator's)"
    via, moved = {}, {}
    for e in rep["edges"]:
        edge = e["edge"].split(" ")[0]  # "thinker->talker (talker.1)": per receiving replica
        via.setdefault(edge, set()).add(e["via"])
        moved[edge] = moved.get(edge, 0) + e["bytes"]
    assert via["encoder->thinker"] == via["talker->vocoder"] == {"ucx"}, via  # between nodes
    assert via["thinker->talker"] == {"shm"}, via  # within node b
    assert via["coordinator->encoder"] == via["vocoder->coordinator"] == {"shm"}, via
    assert moved["encoder->thinker"] > 0 and moved["talker->vocoder"] > 0
    per_talker = [e["messages"] for e in rep["edges"] if e["edge"].startswith("thinker->talker")]
    assert len(per_talker) == 2 and min(per_talker) > 0, f"both talkers used: {per_talker}"
    # The aim (under 10 s with Ray running) is measured by scripts/bench-pipeline-hosts --ray on an
    # idle machine (4.3 s); here, a bound that a loaded CI machine keeps.
    assert rep["startup_ms"] < 60_000, f"start-up with Ray running: {rep['startup_ms']:.0f} ms"


@needs_cluster
def test_two_talker_replicas_on_two_nodes_share_the_requests(cluster, tmp_path):
    r = drive(cluster, "two_talkers", tmp_path)
    res = r["results"]
    assert len(res) == 64 and not [x for x in res if "error" in x]
    for i, x in enumerate(res):
        assert x["x"] == i and x["ids"] == list(range(6)), "every chunk of a request, in order, at one replica"
    talkers = {v for k, v in r["pids"].items() if k.startswith("talker.")}
    used = {x["talker"] for x in res}
    assert used == talkers, f"both replicas used: {used} of {talkers}"
    nodes = {r["placement"]["talker.0"].split()[2], r["placement"]["talker.1"].split()[2]}
    assert nodes == {cluster.addr_a, cluster.addr_b}, r["placement"]  # SPREAD: one on each node


@needs_cluster
@pytest.mark.parametrize("retry", [True, False])
def test_a_replica_killed_on_a_ray_node(cluster, tmp_path, retry):
    r = drive(cluster, "kill_replica", tmp_path, "retry" if retry else "no")
    res = r["results"]
    failed = [x["error"] for x in res if "error" in x]
    if retry:
        assert not failed, failed
        assert [x["x"] for x in res] == [2 * i + 1 for i in range(len(res))]
        # max_restarts: 1: a fresh actor in its bundle, a fresh process, taking requests again
        assert r["replicas"]["b.1"]["alive"] and r["replicas"]["b.1"]["restarts"] == 1, r["replicas"]["b.1"]
        assert r["rejoined"] not in (None, r["victim"])
        assert [x["x"] for x in r["after_restart"]] == [2 * (100 + i) + 1 for i in range(16)]
        assert r["rejoined"] in {x["pid"] for x in r["after_restart"]}, "the restarted replica takes requests"
    else:
        assert 0 < len(failed) <= 8, failed  # only what the dead replica held (its concurrency and queue)
        for e in failed:
            assert "replica 1 of stages b" in e and "b.1" in e and f"Ray node {cluster.addr_b}" in e, e
            assert "retry: false" in e
        assert not r["replicas"]["b.1"]["alive"]
    assert r["after"]["pid"] != r["victim"]
    assert r["replicas"]["b.0"]["alive"]
    assert r["gap_s"] is not None and r["gap_s"] < 1.0, f"completions resumed after {r['gap_s']:.2f} s"


@needs_cluster
def test_scaling_on_ray_one_to_three_to_one(cluster, tmp_path):
    r = drive(cluster, "scale", tmp_path)
    res = r["results"]
    assert not [x for x in res if "error" in x]
    assert [x["x"] for x in res] == [2 * i + 1 for i in range(60)]
    assert r["sizes"] == [["b.0", "b.1", "b.2"], ["b.0"]]
    assert {x["pid"] for x in res[15:40]} >= {x["pid"] for x in res[-5:]}
    assert len({x["pid"] for x in res}) == 3, "the grown replicas took requests"
    for p in ("b.1", "b.2"):  # retired, and they left cleanly (no SIGABRT at exit)
        assert r["replicas"][p]["state"] == "stopped" and r["replicas"][p]["died"] is None, r["replicas"][p]


@needs_cluster
@pytest.mark.parametrize("retry", [True, False])
def test_the_worker_node_dies_mid_run(cluster, tmp_path, retry):
    """Every process of node b SIGKILLed (raylet, workers, stage processes) while requests run:
    the requests its replica held fail naming stage, replica and node (or run again on node a),
    no other is lost, and the pipeline goes on; then node b is started again for what follows."""
    try:
        r = drive(cluster, "node_dies", tmp_path, "retry" if retry else "no", on_signal=cluster.kill_node_b)
    finally:
        cluster.start_b()
    res = r["results"]
    on_b = [p for p, w in r["placement"].items() if cluster.addr_b in w]
    assert len(on_b) == 1 and on_b[0].startswith("b."), r["placement"]
    failed = [x["error"] for x in res if "error" in x]
    if retry:
        assert not failed, failed
        assert [x["x"] for x in res] == [2 * i + 1 for i in range(len(res))]
    else:
        assert 0 < len(failed) <= 8, failed
        for e in failed:
            assert on_b[0] in e and f"Ray node {cluster.addr_b}" in e, e
    assert r["replicas"][on_b[0]]["state"] == "dead"
    assert r["after"]["x"] == 3
    assert r["last_done_s"] < 30, f"the last request finished {r['last_done_s']:.1f} s after the node died"


def _ray_doc(**placement):
    return {"stages": [{"name": "a", "factory": "pipeline_stages:double", "terminal": True}],
            "placement": dict({"engine": "ray"}, **placement)}


def test_placement_settings_are_checked_when_read():
    ok = load_pipeline(_ray_doc(address="10.0.0.1:6379", strategy="spread"))
    assert ok.placement["strategy"] == "SPREAD" and ok.control["transport"] == "tcp"
    assert ok.control["host"] == "auto" and ok.control["base_port"] == 0
    bad = [(dict(engine="slurm"), "placement.engine"), (dict(strategy="CLOSE"), "placement.strategy"),
           (dict(timeout_s=0), "timeout_s"), (dict(adress="x"), "unknown keys")]
    for kw, msg in bad:
        with pytest.raises(PipelineConfigError, match=msg):
            load_pipeline(_ray_doc(**kw))
    d = _ray_doc()
    d["stages"][0]["resources"] = {"GPU": "one"}
    with pytest.raises(PipelineConfigError, match="resources.GPU"):
        load_pipeline(d)
    d["stages"][0]["resources"] = {"memory": "8GiB", "CPU": 2}
    spec = load_pipeline(d)
    from stagelink.pipeline import placement
    assert placement.bundle(spec, "a") == {"memory": 8.0 * (1 << 30), "CPU": 2.0}
    d["stages"][0]["node"] = "10.0.0.6"
    assert placement.bundle(load_pipeline(d), "a")["node:10.0.0.6"] > 0
    no_engine = {"stages": [{"name": "a", "factory": "pipeline_stages:double", "terminal": True,
                             "resources": {"CPU": 1}}]}
    with pytest.raises(PipelineConfigError, match="placement: {engine: ray}"):
        load_pipeline(no_engine)
    with_hosts = _ray_doc()
    with_hosts["hosts"] = {"b": {"address": "10.0.0.2"}}
    with pytest.raises(PipelineConfigError, match="drop hosts"):
        load_pipeline(with_hosts)
    with pytest.raises(PipelineConfigError, match="control is tcp"):
        load_pipeline(dict(_ray_doc(), control="shm"))


def test_ray_missing_is_named_with_its_install_line(tmp_path):
    """Without the ray package a pipeline placed by Ray fails to start naming the extra to install."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "from stagelink.pipeline import Pipeline, PipelineStartError\n"
            "try:\n"
            "    Pipeline.from_config({'stages': [{'name': 'a', 'factory': 'pipeline_stages:double', 'terminal': True}],"
            " 'placement': {'engine': 'ray'}})\n"
            "except PipelineStartError as e:\n"
            "    print('ERR', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, timeout=60)
    assert "ERR" in r.stdout and "pip install 'stagelink[ray]'" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not HAVE_RAY, reason="needs ray (pip install 'stagelink[ray]')")
def test_no_cluster_at_the_address_is_a_start_error():
    with pytest.raises(PipelineStartError, match="no Ray cluster answers at .127.0.0.1:1"):
        Pipeline.from_config(dict(_ray_doc(address="127.0.0.1:1"), settings={"startup_timeout_s": 20}))


def test_config_check_prints_what_each_process_asks_of_ray(tmp_path):
    d = copy.deepcopy(_ray_doc(strategy="SPREAD"))
    d["stages"][0]["resources"] = {"CPU": 2, "GPU": 1}
    d["stages"][0]["labels"] = {"side": "b"}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(d))
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "stagelink"), "config", "check", str(path)],
                       capture_output=True, text=True, cwd=HERE, timeout=60)
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "placed by Ray" in out and "SPREAD" in out, out
    assert "a: a on a Ray node with CPU 2, GPU 1, labels side=b" in out, out


def test_the_ray_example_checks_without_a_cluster():
    """examples/omni_ray.yaml loads, and `config check` says what each process asks of Ray and
    that `auto` edges are decided by the placement."""
    spec = load_pipeline(os.path.join(ROOT, "examples", "omni_ray.yaml"))
    assert spec.placement["engine"] == "ray" and list(spec.initial_processes()) == [
        "encoder", "thinker", "talker.0", "talker.1", "vocoder"]
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "stagelink"), "config", "check",
                        os.path.join(ROOT, "examples", "omni_ray.yaml")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "talker.1: talker on a Ray node with CPU 1, labels side=b (replica 1, retry, up to 2 restarts)" in out, out
    assert "thinker -> talker (stream): relay auto (shm within a node, ucx between nodes: as Ray places them)" in out

