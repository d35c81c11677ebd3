"""Stage replicas (issue 62): `replicas: N` runs N copies of a stage's process; each request goes
to the least loaded, every chunk of one request to the same replica; a replica that dies has its
requests run again (`retry: true`) or failed, naming it, while the others carry on."""
import os
import signal
import threading
import time

import pytest

from stagelink.pipeline import Pipeline, PipelineConfigError, StageDiedError, load_pipeline

S = "pipeline_stages"


def spec(ns, stages, **top):
    d = {"stages": stages, "relay": {"extra": {"namespace": ns}, "timeout_s": 10}}
    d.update(top)
    return d


def test_replicas_share_the_requests_and_keep_each_requests_chunks_together(ns):
    d = spec(ns, [{"name": "thinker", "factory": f"{S}:pid_streamer", "stream_to": "talker", "next": "talker"},
                  {"name": "talker", "factory": f"{S}:pid_collector", "terminal": True, "replicas": 2}])
    with Pipeline.from_config(d) as p:
        assert sorted(p.process_ids()) == ["talker.0", "talker.1", "thinker"]
        futs = {}
        sem = threading.Semaphore(8)
        for i in range(64):
            sem.acquire()
            f = p.submit(f"r{i}", {"x": i, "chunks": 6, "sleep": 0.002})
            f.add_done_callback(lambda _f: sem.release())
            futs[i] = f
        results = {i: f.result(60) for i, f in futs.items()}
        talkers = {pid for name, pid in p.process_ids().items() if name.startswith("talker.")}
        assert all(v["alive"] for v in p.replicas().values())
    for i, r in results.items():
        assert r["x"] == i
        assert r["ids"] == list(range(6)), "a request's chunks, in order, all at one replica"
        assert r["makers"] == [r["thinker"]]
    used = {r["talker"] for r in results.values()}
    assert used == talkers, f"both replicas used: {used} of {talkers}"
    counts = [sum(1 for r in results.values() if r["talker"] == t) for t in talkers]
    assert min(counts) >= 16, f"least loaded first: {counts}"


def _kill_one_replica_mid_run(ns, retry, n=40):
    d = spec(ns, [{"name": "a", "factory": f"{S}:double", "next": "b"},
                  {"name": "b", "factory": f"{S}:slow_pid", "terminal": True, "replicas": 2, "retry": retry,
                   "concurrency": 4}], settings={"request_timeout_s": 60})
    with Pipeline.from_config(d) as p:
        victim = p.process_ids()["b.1"]
        futs, done_at = [], []
        sem = threading.Semaphore(8)
        for i in range(n):
            sem.acquire()
            f = p.submit(f"q{i}", {"x": i, "sleep": 0.05})
            f.add_done_callback(lambda _f: (done_at.append(time.monotonic()), sem.release()))
            futs.append(f)
            if i == n // 2:
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
        out = []
        for f in futs:
            try:
                out.append(f.result(60))
            except StageDiedError as e:
                out.append(e)
        after = p.submit("after", {"x": 1, "sleep": 0}).result(30)
        state = p.replicas()
    return out, after, state, victim, killed, sorted(done_at)


def test_a_replica_killed_mid_run_with_retry_loses_no_request(ns):
    out, after, state, victim, killed, done_at = _kill_one_replica_mid_run(ns, retry=True)
    assert all(isinstance(r, dict) for r in out), [r for r in out if not isinstance(r, dict)]
    assert [r["x"] for r in out] == [2 * i + 1 for i in range(len(out))]
    assert after["x"] == 3 and after["pid"] != victim
    assert not state["b.1"]["alive"] and state["b.0"]["alive"]
    later = [t for t in done_at if t > killed]
    gaps = [b - a for a, b in zip([killed] + later, later)]
    assert gaps and max(gaps) < 1.0, f"completions resumed within 1 s of the kill: gaps {gaps}"


def test_a_replica_killed_mid_run_without_retry_fails_only_its_own_requests(ns):
    out, after, state, victim, killed, _ = _kill_one_replica_mid_run(ns, retry=False)
    failed = [r for r in out if isinstance(r, StageDiedError)]
    ok = [r for r in out if isinstance(r, dict)]
    assert failed, "the killed replica held requests"
    assert len(failed) <= 8, "only the requests it held (8 in flight at most)"
    for e in failed:
        assert "replica 1 of stages b (process 'b.1'" in str(e) and "retry: false" in str(e), str(e)
    for i, r in enumerate(out):  # every request that did not fail has its own right answer
        assert isinstance(r, StageDiedError) or r["x"] == 2 * i + 1, (i, r)
    assert len(ok) + len(failed) == len(out)
    # What was submitted once the death was seen ran on the survivor, every one of it.
    assert all(isinstance(r, dict) and r["pid"] != victim for r in out[-4:]), out[-4:]
    assert after["pid"] != victim
    assert not state["b.1"]["alive"]


def test_replica_settings_are_checked_when_read(tmp_path):
    base = [{"name": "a", "factory": f"{S}:double", "next": "b"},
            {"name": "b", "factory": f"{S}:double", "terminal": True}]
    for bad, match in [({"replicas": 0}, "'replicas' must be an integer in \\[1, 64\\]"),
                       ({"replicas": "2"}, "'replicas' must be an integer"),
                       ({"retry": "yes"}, "'retry' must be true"),
                       ({"replicas": 2, "process": "a"}, "share process 'a' but ask for replicas 1 and 2"),
                       ({"replicas": 2, "max_replicas": 1}, "'max_replicas' must be an integer in \\[replicas"),
                       ({"max_restarts": -1}, "'max_restarts' must be an integer >= 0")]:
        stages = [dict(base[0]), dict(base[1], **bad)]
        with pytest.raises(PipelineConfigError, match=match):
            load_pipeline({"stages": stages})
    with pytest.raises(PipelineConfigError, match="both a process group and a replica"):
        load_pipeline({"stages": [dict(base[0], process="b.0"), dict(base[1], replicas=2)]})
    s = load_pipeline({"stages": [base[0], dict(base[1], replicas=3, retry=True)]})
    assert list(s.processes()) == ["a", "b.0", "b.1", "b.2"] and s.replica_procs("b") == ["b.0", "b.1", "b.2"]
    assert s.group_of("b.2") == "b" and s.stages["b"].retry


class _Load:
    """Requests kept in flight (8) from a thread until stopped; every result checked."""

    def __init__(self, p, sleep=0.02):
        self.p, self.sleep, self.stop = p, sleep, threading.Event()
        self.results, self.errors = [], []
        self.t = threading.Thread(target=self._run)
        self.t.start()

    def _run(self):
        sem = threading.Semaphore(8)
        i = 0
        futs = []
        while not self.stop.is_set():
            if not sem.acquire(timeout=0.1):
                continue
            f = self.p.submit(f"L{i}", {"x": i, "sleep": self.sleep})
            f.add_done_callback(lambda _f: sem.release())
            futs.append((i, f))
            i += 1
        for i, f in futs:
            try:
                r = f.result(60)
                (self.results if r["x"] == 2 * i + 1 else self.errors).append(r)
            except Exception as e:  # noqa: BLE001
                self.errors.append(e)

    def finish(self):
        self.stop.set()
        self.t.join(120)
        return self.results, self.errors


def test_scaling_up_and_down_while_requests_run_loses_none(ns):
    d = spec(ns, [{"name": "a", "factory": f"{S}:double", "next": "b"},
                  {"name": "b", "factory": f"{S}:slow_pid", "terminal": True, "replicas": 1, "max_replicas": 3}])
    with Pipeline.from_config(d) as p:
        assert sorted(p.process_ids()) == ["a", "b.0"]
        load = _Load(p)
        time.sleep(0.5)
        assert p.scale("b", 3) == ["b.0", "b.1", "b.2"]
        t = time.monotonic()
        pids = {}
        while time.monotonic() - t < 10 and len(pids) < 3:  # the new replicas take requests
            pids.update({p2: 1 for p2, v in p.replicas().items() if v["in_flight"]})
            time.sleep(0.01)
        assert len(pids) == 3, p.replicas()
        assert p.scale("b", 1) == ["b.0"]
        time.sleep(0.3)
        results, errors = load.finish()
        state = p.replicas()
        with pytest.raises(Exception, match="replicas must be in \\[1, 3\\]"):
            p.scale("b", 4)
    assert not errors, errors[:3]
    assert len(results) > 40
    assert state["b.1"]["state"] == "stopped" and state["b.2"]["state"] == "stopped" and state["b.0"]["alive"]
    # retired, not dead: their exit after `shutdown` raced the coordinator's death check, which
    # recorded "died: exit code 0" on a replica scale() stopped
    assert state["b.1"]["died"] is None and state["b.2"]["died"] is None, state
    assert len({r["pid"] for r in results}) == 3


def test_a_replica_killed_ten_times_restarts_each_time_and_loses_nothing(ns):
    d = spec(ns, [{"name": "a", "factory": f"{S}:double", "next": "b"},
                  {"name": "b", "factory": f"{S}:slow_pid", "terminal": True, "replicas": 2, "retry": True,
                   "max_restarts": 10}], settings={"request_timeout_s": 60})
    with Pipeline.from_config(d) as p:
        load = _Load(p)
        for k in range(10):
            time.sleep(0.2)
            victim = f"b.{k % 2}"
            os.kill(p.process_ids()[victim], signal.SIGKILL)
            t = time.monotonic()  # noticed, started again, and ready: then the next kill
            while not (p.replicas()[victim]["restarts"] == k // 2 + 1 and p.replicas()[victim]["alive"]) \
                    and time.monotonic() - t < 30:
                time.sleep(0.02)
            assert p.replicas()[victim]["alive"], p.replicas()[victim]
        results, errors = load.finish()
        state = p.replicas()
    assert not errors, errors[:3]
    assert len(results) > 20
    assert state["b.0"]["restarts"] == 5 and state["b.1"]["restarts"] == 5
    assert "killed by SIGKILL" in state["b.0"]["died"]


def test_stagelink_run_reports_per_replica(tmp_path):
    """`stagelink run` on examples/replicas_pipeline.yaml: every result verified, the edges into
    `work` split per replica, and a replicas table."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "r.json"
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "stagelink"), "run",
                        os.path.join(root, "examples", "replicas_pipeline.yaml"), "--requests", "60",
                        "--concurrency", "8", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all results verified end to end" in r.stdout and "replicas" in r.stdout
    rep = json.loads(out.read_text())
    edges = {e["edge"]: e["messages"] for e in rep["edges"]}
    assert edges.get("front->work (work.0)", 0) > 0 and edges.get("front->work (work.1)", 0) > 0, edges
    assert set(rep["replicas"]) == {"front", "work.0", "work.1", "work.2", "work.3"}
    assert rep["replicas"]["work.2"]["state"] == "stopped" and rep["replicas"]["work.0"]["state"] == "alive"
    assert {"work (work.0)", "work (work.1)"} <= set(rep["stages"])


def test_a_single_process_stage_restarts_and_its_requests_wait_for_it(ns):
    """max_restarts on a stage of one process: its death no longer breaks the pipeline. With
    retry, the requests it held wait for the restart and run again; submits made meanwhile wait
    for it too (up to settings.startup_timeout_s)."""
    d = spec(ns, [{"name": "a", "factory": f"{S}:double", "next": "b"},
                  {"name": "b", "factory": f"{S}:slow_pid", "terminal": True, "retry": True, "max_restarts": 2}],
             settings={"request_timeout_s": 60})
    with Pipeline.from_config(d) as p:
        load = _Load(p)
        time.sleep(0.4)
        first = p.process_ids()["b"]
        os.kill(first, signal.SIGKILL)
        t = time.monotonic()
        while p.replicas()["b"]["restarts"] < 1 or not p.replicas()["b"]["alive"]:
            assert time.monotonic() - t < 30, p.replicas()
            time.sleep(0.02)
        time.sleep(0.4)
        results, errors = load.finish()
        assert p.process_ids()["b"] != first
    assert not errors, errors[:3]
    assert len({r["pid"] for r in results}) == 2 and len(results) > 20
