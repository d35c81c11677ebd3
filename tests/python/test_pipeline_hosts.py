"""Stage processes on other hosts (`hosts:` and a stage's `host`): the checks of the file, and a
pipeline whose middle stage runs in another network namespace, launched there by its `launch`
prefix, with its data over the transfer engine and its control messages over TCP."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import stagelink
from stagelink.pipeline import PipelineConfigError, load_pipeline
from stagelink.pipeline.worker import endpoint, remote_args, remote_spec_line

S = "pipeline_stages"
HERE = os.path.dirname(os.path.abspath(__file__))


def remote_spec(**top):
    d = {"stages": [{"name": "a", "factory": f"{S}:double", "next": "b"},
                    {"name": "b", "factory": f"{S}:where_streamer", "stream_to": "c", "host": "far"},
                    {"name": "c", "factory": f"{S}:where_collector", "terminal": True}],
         "relay": {"backend": "ucx", "credits": 4, "timeout_s": 20, "extra": {"memory_pool_size": 64 << 20}},
         "control": {"transport": "tcp", "host": "10.9.0.1", "base_port": 47100},
         "hosts": {"far": {"address": "10.9.0.2", "launch": "ssh -o BatchMode=yes gpu2"}}}
    d.update(top)
    return d


def test_a_remote_stage_serves_on_its_hosts_address_and_its_relay_too():
    spec = load_pipeline(remote_spec())
    assert spec.hosts["far"]["launch"] == ["ssh", "-o", "BatchMode=yes", "gpu2"]
    assert endpoint(spec, "", "coordinator") == "tcp://10.9.0.1:47100"
    assert endpoint(spec, "", "a") == "tcp://10.9.0.1:47101"
    assert endpoint(spec, "", "b") == "tcp://10.9.0.2:47102"
    assert spec.relay_at("b", "a", "b")["extra"]["host"] == "10.9.0.2"
    assert spec.relay_at("a", "a", "b")["extra"]["host"] == "10.9.0.1"
    assert spec.relay_at("coordinator", "coordinator", "a")["extra"]["host"] == "10.9.0.1"
    # ssh's default, and what the stage process is given: its name only; the spec (secrets in its
    # env, args and connector extra) is the first line of its stdin
    d = remote_spec()
    d["hosts"]["far"].pop("launch")
    d["hosts"]["far"]["env"] = {"REDIS_PASSWORD": "hunter2-on-stdin"}
    spec = load_pipeline(d)
    assert spec.hosts["far"]["launch"] == ["ssh", "-o", "BatchMode=yes", "10.9.0.2"]
    assert remote_args("b") == ["--remote", "-", "b"]
    line = remote_spec_line(spec, ["/x"], ["/y"])
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line)["spec"]["hosts"]["far"]["env"]["REDIS_PASSWORD"] == "hunter2-on-stdin"
    # no command-line limit on its size any more
    d["stages"][0]["args"] = {"table": [os.urandom(8).hex() for _ in range(20000)]}
    assert len(remote_spec_line(load_pipeline(d), [], [])) > 200_000


def test_relay_auto_is_shared_memory_within_a_host_and_the_transfer_engine_between_hosts():
    spec = load_pipeline(remote_spec(relay={"backend": "auto", "extra": {"memory_pool_size": 64 << 20}}))
    backend = {(a, b): spec.relay_for(a, b)["backend"]
               for a, b in [("coordinator", "a"), ("a", "b"), ("b", "c"), ("c", "coordinator")]}
    assert backend == {("coordinator", "a"): "shm", ("a", "b"): "ucx", ("b", "c"): "ucx", ("c", "coordinator"): "shm"}
    assert spec.relay_at("b", "a", "b")["extra"]["host"] == "10.9.0.2"
    d = remote_spec(relay={"backend": "auto"})
    for st in d["stages"]:
        st.pop("host", None)
    assert {load_pipeline(d).relay_for("a", "b")["backend"]} == {"shm"}  # one host: shared memory throughout
    with pytest.raises(PipelineConfigError, match="backend must be one of"):
        load_pipeline(remote_spec(relay={"backend": "rdma"}))


def test_control_host_defaults_to_this_hosts_address_when_stages_run_elsewhere(monkeypatch):
    monkeypatch.setenv("STAGELINK_HOST_IP", "10.9.0.7")
    d = remote_spec(control={"transport": "tcp"})
    assert load_pipeline(d).control["host"] == "10.9.0.7"  # not 127.0.0.1, which the hosts cannot reach
    d = remote_spec(control={"transport": "tcp", "host": "auto"})
    assert load_pipeline(d).control["host"] == "10.9.0.7"
    d["stages"][1].pop("host")  # one host: loopback stays the default
    assert load_pipeline(remote_spec(control="tcp", stages=d["stages"])).control["host"] == "127.0.0.1"
    with pytest.raises(PipelineConfigError, match="loopback"):  # said explicitly: refused, not overridden
        load_pipeline(remote_spec(control={"transport": "tcp", "host": "127.0.0.1"}))


def test_hosts_declared_but_unused_change_nothing():
    d = remote_spec(control="shm")
    d["stages"][1].pop("host")
    spec = load_pipeline(d)
    # regression: a ucx relay looked up control.host, which shm control has not (KeyError)
    assert "host" not in spec.relay_at("b", "a", "b")["extra"]
    assert endpoint(spec, "/tmp/x", "b") == "shm://x-b"


@pytest.mark.parametrize("change, words", [
    (lambda d: d["stages"][1].update(host="nowhere"), ["host 'nowhere' is not under 'hosts:'"]),
    (lambda d: (d["stages"][0].update(process="p"), d["stages"][1].update(process="p")),
     ["share process 'p'", "different hosts"]),
    (lambda d: d.update(control="shm"), ["control must be", "tcp"]),
    (lambda d: d["control"].update(host="127.0.0.1"), ["control.host 127.0.0.1 is loopback"]),
    (lambda d: d["hosts"]["far"].update(address="127.0.0.2"), ["hosts.far.address", "loopback"]),
    (lambda d: d["hosts"]["far"].update(address="a b"), ["hosts.far.address"]),
    (lambda d: d["hosts"]["far"].update(python="/opt/my venv/python"), ["hosts.far.python"]),
    (lambda d: d["hosts"]["far"].update(launch=[]), ["hosts.far.launch"]),
    (lambda d: d["hosts"]["far"].update(port=1), ["hosts.far"]),
    (lambda d: d["hosts"]["far"].update(env={"A B": "1"}), ["hosts.far.env", "not an environment variable name"]),
    (lambda d: d.update(hosts=["far"]), ["hosts: a map"]),
    (lambda d: d.update(relay={"backend": "shm"}), ["edge a -> b", "relay backend 'shm'", "one host only"]),
])
def test_bad_host_layouts_are_refused_naming_what_is_wrong(change, words):
    d = remote_spec()
    change(d)
    with pytest.raises(PipelineConfigError) as e:
        load_pipeline(d)
    for w in words:
        assert w in str(e.value)


def test_an_edge_between_hosts_on_a_shared_memory_connector_is_refused():
    d = remote_spec(relay={"backend": "ucx"}, edges=[{"from": "a", "to": "b", "connector": "s"}],
                    connectors={"s": {"name": "SharedMemoryConnector"}})
    with pytest.raises(PipelineConfigError, match=r"edge a -> b joins two hosts .*SharedMemoryConnector"):
        load_pipeline(d)
    # the same edge within one host is fine
    d["stages"][0]["host"] = "far"
    load_pipeline(d)


# ---- across two network namespaces ----

DRIVER = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from stagelink.pipeline import Pipeline
    d = json.loads(sys.argv[1])
    d["hosts"]["far"]["env"]["SL_SECRET"] = os.environ["SL_SECRET"]  # never on a command line
    with Pipeline.from_config(d) as p:
        futs = [p.submit(f"r{i}", {"x": np.arange(300_000) + i})
                for i in range(4)]
        out = []
        for i, f in enumerate(futs):
            r = f.result(60)
            out.append({"ok": bool((r["x"] == (np.arange(300_000) + i) * 2 + 1).all()), "ids": r["ids"],
                        "net": r["net"], "pid": r["pid"], "env": r["env"], "shm_dev": r["shm_dev"]})
        print(json.dumps({"results": out, "net": os.readlink("/proc/self/ns/net"), "dir": p._dir,
                          "shm_dev": os.stat("/dev/shm").st_dev}), flush=True)
        if sys.argv[2] == "hold":
            sys.stdin.readline()  # killed here by the test
    st = p.stats()
    print(json.dumps({e: len(v["lat_ns"]) for s in st.values() for e, v in s["edges"].items()}), flush=True)
""")

# A launcher that, like ssh, stays between the coordinator and the stage process: the stage
# process's parent is not the coordinator, so only its stdin tells it the coordinator is gone.
# Like ssh, it passes on none of the coordinator's environment (PYTHONPATH included): the stage
# modules are found through the import path the spec carries.
MIDDLE = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


# The other "host" also gets a /dev/shm of its own (a mount namespace with a fresh tmpfs): network
# namespaces share the machine's, and across real hosts nothing can go through it.
OWN_SHM = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=256m tmpfs /dev/shm && exec "$@"', "--"]


def _like_ssh(h):
    return ([sys.executable, "-c", MIDDLE, "env", "-i", "PATH=" + os.environ.get("PATH", "/usr/bin:/bin")] + h.b +
            OWN_SHM)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    from stagelink.bench_te import TwoHosts
    h = TwoHosts(True)
    try:
        yield h
    finally:
        h.close()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split(") ")[-1][0] != "Z"


SECRET = "sl-secret-" + os.urandom(8).hex()  # in the far host's env: must be on no command line


def _cmdlines_with(word: str) -> list:
    """Every process's command line (as any local user reads it) that holds `word`."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if word.encode() in cmd and str(os.getpid()) != pid:
                found.append(cmd.replace(b"\0", b" ")[:200])
    return found


def _driver(h, hold):
    # free ports (base_port 0) and this host's address found (no control.host) when holding;
    # both given otherwise
    ctl = {"transport": "tcp"} if hold else {"transport": "tcp", "host": h.addr_a, "base_port": 47100}
    # relay auto when not holding: shared memory for the coordinator's edges, UCX for a -> b -> c
    relay = {"backend": "ucx" if hold else "auto", "credits": 4, "timeout_s": 20, "extra": {"memory_pool_size": 64 << 20}}
    d = remote_spec(control=ctl, relay=relay,
                    hosts={"far": {"address": h.addr_b, "launch": _like_ssh(h),
                                   "python": sys.executable,
                                   "env": {"SL_HOST_ENV": "far"}}})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + [p for p in sys.path if p]), SL_SECRET=SECRET)
    return subprocess.Popen(h.a + [sys.executable, "-c", DRIVER, json.dumps(d), "hold" if hold else "run"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def test_a_stage_on_another_host_runs_there_and_its_data_crosses_both_ways(two_hosts):
    p = _driver(two_hosts, hold=False)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-4000:]
    res, lat = (json.loads(x) for x in out.strip().splitlines()[-2:])
    # hop latencies only where one clock serves both ends (CLOCK_MONOTONIC is per machine)
    assert lat["coordinator->a"] == 4 and lat["a->b"] == 0 and lat["b->c"] == 0, lat
    for r in res["results"]:
        assert r["ok"] and r["ids"] == list(range(4))
        assert r["net"] != res["net"]  # b ran in the other namespace
        assert r["shm_dev"] != res["shm_dev"]  # with a /dev/shm of its own
        assert r["env"] == "far"  # with its host's env (ssh forwards none of the coordinator's)
        assert not _alive(r["pid"])  # and the pipeline's close ended it there


def test_a_stage_on_another_host_exits_when_the_coordinator_is_killed(two_hosts):
    p = _driver(two_hosts, hold=True)
    pid, sock_dir = None, None
    try:
        line = p.stdout.readline()
        assert line, p.stderr.read()[-4000:]
        res = json.loads(line)
        pid, sock_dir = res["results"][0]["pid"], res["dir"]
        assert _alive(pid)
        # the far host's env (a password, say) is on no command line: not ssh's, not the stage's
        # (before: the whole spec rode in `--remote <base64>`, readable by any user of either host)
        assert _cmdlines_with("--remote"), "no remote stage process found"
        assert not any(b"--remote -" not in c and b"--remote" in c for c in _cmdlines_with("--remote"))
        assert not _cmdlines_with(SECRET)
        p.kill()  # SIGKILL: no close, no shutdown message; the launcher in between lives on
        p.wait(10)
        deadline = time.monotonic() + 5  # the stdin watch, then a recv timeout of 1 s, then shutdown
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the remote stage process outlived its coordinator"
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if sock_dir:
            shutil.rmtree(sock_dir, ignore_errors=True)  # what the killed coordinator could not remove


FAILING = textwrap.dedent("""
    import json, sys
    from stagelink.pipeline import Pipeline, PipelineStartError
    out = []
    for launch in json.loads(sys.argv[2]):
        d = json.loads(sys.argv[1])
        d["hosts"]["far"]["launch"] = launch
        try:
            Pipeline.from_config(d).close()
            out.append("started")
        except PipelineStartError as e:
            out.append(str(e))
    print(json.dumps(out))
""")


def test_a_launch_that_fails_is_a_start_error_naming_the_process_and_host(two_hosts):
    h = two_hosts
    d = remote_spec(control={"transport": "tcp", "host": h.addr_a, "base_port": 47100},
                    hosts={"far": {"address": h.addr_b}})
    launches = [["sh", "-c", "echo 'ssh: connect to host gpu2: No route to host' >&2; exit 255", "--"],
                ["/nonexistent/ssh"],
                ["sh", "-c", 'exec "$@" </dev/null', "--"] + h.b]  # like ssh -n: no stdin
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + [p for p in sys.path if p]))
    r = subprocess.run(h.a + [sys.executable, "-c", FAILING, json.dumps(d), json.dumps(launches)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    ssh_fails, no_launcher, no_stdin = json.loads(r.stdout)
    assert "stage process 'b'" in ssh_fails and "exit code 255" in ssh_fails
    assert "No route to host" in r.stderr  # the launcher's own words reach the coordinator's stderr
    assert "cannot launch stage process 'b' on host 'far'" in no_launcher and "/nonexistent/ssh" in no_launcher
    assert "stage process 'b'" in no_stdin and "must forward stdin" in no_stdin


DYING = textwrap.dedent("""
    import json, sys
    import numpy as np
    from stagelink.pipeline import Pipeline, StageDiedError
    with Pipeline.from_config(json.loads(sys.argv[1])) as p:
        first = p.submit("ok", {"x": np.arange(100_000)}).result(60)
        try:
            p.submit("dies", {"x": np.arange(100_000), "die": True}).result(60)
            print(json.dumps({"error": None}))
        except StageDiedError as e:
            print(json.dumps({"first": int(first["x"][-1]), "error": str(e)}))
""")


def test_a_stage_dying_on_another_host_fails_its_requests_naming_process_and_host(two_hosts):
    h = two_hosts
    d = remote_spec(control={"transport": "tcp", "host": h.addr_a, "base_port": 47100},
                    hosts={"far": {"address": h.addr_b, "launch": _like_ssh(h),
                                   "python": sys.executable}})
    d["stages"] = [{"name": "b", "factory": f"{S}:suicide", "next": "c", "host": "far"},
                   {"name": "c", "factory": f"{S}:add_one", "terminal": True}]
    # auto: the coordinator sends over UCX (to b, there) and receives over shared memory (from c, here)
    d["relay"] = {"backend": "auto", "timeout_s": 20, "extra": {"memory_pool_size": 64 << 20}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + [p for p in sys.path if p]))
    r = subprocess.run(h.a + [sys.executable, "-c", DYING, json.dumps(d)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["first"] == 100_000  # arange's last + 1, through the remote stage and back
    assert "stage process 'b'" in res["error"] and "on host 'far'" in res["error"] and "died" in res["error"]


def test_the_two_host_example_is_a_valid_pipeline_file():
    spec = load_pipeline(os.path.join(HERE, "..", "..", "examples", "omni_two_hosts.yaml"))
    assert {s.name: s.host for s in spec.stages.values()} == {"encoder": "", "thinker": "gpu2", "talker": "gpu2",
                                                             "vocoder": ""}
    assert endpoint(spec, "", "thinker") == "tcp://10.0.0.6:47102"
    assert spec.relay_at("thinker", "encoder", "thinker")["extra"]["host"] == "10.0.0.6"
