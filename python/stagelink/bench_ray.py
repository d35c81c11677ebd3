"""A two-node Ray cluster on one machine, for the Ray placement tests and benchmarks: a head in
one network namespace and a worker in another, joined by a veth pair (bench_te.TwoHosts), each
node's address its veth's (Ray's --node-ip-address), small object stores, `num_cpus` logical
CPUs each, node labels `side=a` / `side=b`, and Ray's token authentication on (a token made
here; HOME a directory of its own, so no ~/.ray of the caller's is read or written). Root only.
`close()` kills every process in both namespaces (Ray's, and the stage processes Ray's actors
started) and removes them.

    with TwoNodeRay() as c:
        subprocess.run(c.a + [python, "driver.py", c.address], env=c.env)  # a driver on the head node
        c.kill_node_b()                                          # the worker node dies
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

from .bench_te import TwoHosts

# Node death found in about 2 s (Ray's default: 5 missed checks of 3 s) so that the tests of a
# dead node finish in seconds; the figures are the GCS's health checks of each raylet.
HEALTH_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "4",
              "RAY_health_check_timeout_ms": "500", "RAY_health_check_initial_delay_ms": "0"}


def _ray_bin() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


class TwoNodeRay:
    def __init__(self, num_cpus: int = 8, port: int = 6390, object_store_bytes: int = 80 << 20,
                 hosts: Optional[TwoHosts] = None):
        self._own_hosts = hosts is None  # else the caller's namespaces, left to it to remove
        self.h = hosts or TwoHosts(True)
        self.a, self.b = self.h.a, self.h.b
        self.addr_a, self.addr_b = self.h.addr_a, self.h.addr_b
        self.address = f"{self.addr_a}:{port}"
        self.tmp = tempfile.mkdtemp(prefix="sl-ray-")
        home = os.path.join(self.tmp, "home")
        os.makedirs(home)
        # Drivers need this environment too (the token): run them with env=self.env.
        self.env = dict(os.environ, **HEALTH_ENV, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token",
                        RAY_AUTH_TOKEN=secrets.token_hex(32), HOME=home)
        try:
            # A default route through the veth: Ray finds a process's node address by the route
            # out (no packet is sent), and namespaces have none.
            vb = self.h.va.replace("sbva", "sbvb")
            subprocess.run(["ip", "-n", self.h.na, "route", "add", "default", "dev", self.h.va], check=True)
            subprocess.run(["ip", "-n", self.h.nb, "route", "add", "default", "dev", vb], check=True)
            t0 = time.monotonic()
            self._ray(self.a, ["start", "--head", "--node-ip-address", self.addr_a, "--port", str(port),
                               "--num-cpus", str(num_cpus), "--object-store-memory", str(object_store_bytes),
                               "--include-dashboard=false", "--disable-usage-stats", "--labels", "side=a",
                               "--temp-dir", os.path.join(self.tmp, "a")])
            self.start_b(num_cpus, object_store_bytes)
            self.start_s = time.monotonic() - t0
        except BaseException:
            self.close()
            raise

    def _ray(self, ns: List[str], args: List[str]) -> None:
        r = subprocess.run(ns + [_ray_bin()] + args, env=self.env, capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise RuntimeError(f"ray {' '.join(args[:2])} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")

    def start_b(self, num_cpus: int = 8, object_store_bytes: int = 80 << 20) -> None:
        """(Re)start the worker node in namespace b."""
        self._ray(self.b, ["start", "--address", self.address, "--node-ip-address", self.addr_b,
                           "--num-cpus", str(num_cpus), "--object-store-memory", str(object_store_bytes),
                           "--disable-usage-stats", "--labels", "side=b", "--temp-dir", os.path.join(self.tmp, "b")])

    def pids(self, ns: str) -> List[int]:
        r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
        return [int(x) for x in r.stdout.split()]

    def kill_node_b(self) -> int:
        """SIGKILL every process of the worker node's namespace (raylet, its workers, the stage
        processes under them): the node dies as a host that loses power. Returns how many."""
        n = 0
        for _ in range(5):  # a dying raylet's children may be mid-fork
            ps = self.pids(self.h.nb)
            if not ps:
                break
            for pid in ps:
                try:
                    os.kill(pid, signal.SIGKILL)
                    n += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        return n

    def close(self) -> None:
        for ns in (self.h.nb, self.h.na):
            for _ in range(10):
                ps = self.pids(ns)
                if not ps:
                    break
                for pid in ps:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.2)
        if self._own_hosts:
            self.h.close()
        else:  # the namespaces stay: only the routes this added go
            subprocess.run(["ip", "-n", self.h.na, "route", "del", "default"], capture_output=True)
            subprocess.run(["ip", "-n", self.h.nb, "route", "del", "default"], capture_output=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
