"""`placement: {engine: ray, address: local}`: a Ray of the pipeline's own on this host, no
cluster and no root needed (test_ray.py has the two-node cluster)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import ray  # noqa: F401
    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False


def _ray_pids():
    r = subprocess.run(["pgrep", "-f", "ray/core/src/ray/(raylet|gcs)"], capture_output=True, text=True)
    return {int(x) for x in r.stdout.split()}


@pytest.mark.skipif(not HAVE_RAY, reason="needs ray (pip install 'stagelink[ray]')")
def test_address_local_starts_a_ray_of_its_own(tmp_path):
    """`address: local`: no cluster, no root: the pipeline starts a Ray of its own on this host
    (ray.init()), places every process on it (the coordinator's node: every edge on shared
    memory), and stops it when closed (no Ray process left)."""
    code = (
        "import json, sys\n"
        "from stagelink.pipeline import Pipeline\n"
        "d = {'stages': [{'name': 'a', 'factory': 'pipeline_stages:double', 'next': 'b'},\n"
        "                {'name': 'b', 'factory': 'pipeline_stages:slow_pid', 'terminal': True, 'replicas': 2}],\n"
        "     'relay': {'backend': 'auto'}, 'placement': {'engine': 'ray', 'address': 'local'}}\n"
        "with Pipeline.from_config(d) as p:\n"
        "    out = [p.submit(f'r{i}', {'x': i, 'sleep': 0}).result(60) for i in range(8)]\n"
        "    print(json.dumps({'x': [r['x'] for r in out], 'placement': p.placement(),\n"
        "                      'edges': {f'{a}->{b}': p.spec.relay_for(a, b)['backend'] for a, b, _ in p.spec.edges()}}))\n")
    before = _ray_pids()
    # Ray's own ray.init() turns its token authentication on and keeps the token in ~/.ray: a HOME
    # of the test's, so nothing of the caller's is touched (and the stage actors work under it).
    # Its session files in a directory of the test's too (not /tmp/ray; short: Ray's socket paths
    # must fit in 107 bytes).
    ray_tmp = tempfile.mkdtemp(prefix="slr-", dir="/tmp")
    env = dict(os.environ, HOME=str(tmp_path), RAY_TMPDIR=ray_tmp)
    env.pop("RAY_AUTH_MODE", None)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=HERE, timeout=240,
                           env=env)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["x"] == [2 * i + 1 for i in range(8)]
    assert set(out["placement"].values()) == {f"Ray node {out['placement']['a'].split()[2]} (the coordinator's)"}
    assert set(out["edges"].values()) == {"shm"}, out["edges"]
    deadline = time.monotonic() + 20  # ray.shutdown() stops its daemons; give them a moment to exit
    while _ray_pids() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ray_pids() - before, f"Ray processes left: {_ray_pids() - before}"
    assert (tmp_path / ".ray" / "auth_token").exists(), "Ray's default for a local cluster: token auth on"
