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
    assert all(r["pid"] != victim or r["x"] % 2 == 1 for r in ok)
    assert after["pid"] != victim
    assert not state["b.1"]["alive"]


def test_replica_settings_are_checked_when_read(tmp_path):
    base = [{"name": "a", "factory": f"{S}:double", "next": "b"},
            {"name": "b", "factory": f"{S}:double", "terminal": True}]
    for bad, match in [({"replicas": 0}, "'replicas' must be an integer in \\[1, 64\\]"),
                       ({"replicas": "2"}, "'replicas' must be an integer"),
                       ({"retry": "yes"}, "'retry' must be true"),
                       ({"replicas": 2, "process": "a"}, "share process 'a' but ask for 1 and 2 replicas")]:
        stages = [dict(base[0]), dict(base[1], **bad)]
        with pytest.raises(PipelineConfigError, match=match):
            load_pipeline({"stages": stages})
    with pytest.raises(PipelineConfigError, match="both a process group and a replica"):
        load_pipeline({"stages": [dict(base[0], process="b.0"), dict(base[1], replicas=2)]})
    s = load_pipeline({"stages": [base[0], dict(base[1], replicas=3, retry=True)]})
    assert list(s.processes()) == ["a", "b.0", "b.1", "b.2"] and s.replica_procs("b") == ["b.0", "b.1", "b.2"]
    assert s.group_of("b.2") == "b" and s.stages["b"].retry
