"""Stage processes on a Ray cluster (`placement: {engine: ray}`), behind the `Launcher` seam.

Placement. One placement group per pipeline, a bundle per stage process it may run
(placement.bundle: its stages' resources; replicas up to max_replicas), under the file's
strategy. Once Ray has reserved it, the bundle -> node table says where every process runs
before any starts: a process on the coordinator's node is on "this host", the others on a host
named after their node's address (spec.hosts, spec.placed), so `relay: auto` puts the edges
within a node on shared memory and the ones between nodes on the transfer engine, and control
messages go over TCP with the pipeline's CURVE keys as with `hosts:`.

Starting a process. The process runs under a `_StageHost` actor in its bundle (holding its
resources, so Ray's CUDA_VISIBLE_DEVICES reaches it): `python -m stagelink.pipeline._entry
--remote - PROC`, its stdin held open by the actor, as ssh holds it under `hosts:`. What the
process reads first on stdin (its spec, which may hold expanded secrets, and its CURVE keys)
never travels as an actor argument or through Ray's object store: the actor binds a CURVE
socket admitting only this launcher's key and returns its public key; the launcher connects and
sends one `launch` message (protocol.Launch), encrypted.

Failure. The actor's `run` call returns the process's exit status; an actor that dies (killed,
its node gone, as Ray's health checks decide) fails that call, and the handle reports the
process dead with the reason and node. A process started again goes back to its bundle.
"""
from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, Optional

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .. import _core
from ..control import Inbox, Outbox
from . import placement as pl
from . import protocol as proto
from .launcher import Launcher, LaunchError, StageProcess, _Env
from .spec import PipelineConfigError, PipelineSpec, _check_hosts
from .worker import remote_args, remote_spec_line

#: The exit status reported for a process whose actor died (the process with it).
ACTOR_DIED = -9
#: The object store of a Ray started for one pipeline (`address: local`): Ray's smallest.
_LOCAL_STORE = 80 << 20


def _tcp(addr: str, port: int = 0) -> str:
    return f"tcp://[{addr}]:{port}" if ":" in addr else f"tcp://{addr}:{port}"


class _StageHost:
    """The actor under one stage process. Not threaded: after `hello`, its one thread stays in
    `run` for the process's life (an actor parked in a call costs 0.5% of a core on this VM; an
    idle or threaded one 1.75%, its task loop polling)."""

    def __init__(self, launcher_key: str):
        self.address = ray.util.get_node_ip_address()
        pub, sec = _core.curve_keypair()
        self.key = pub
        self.inbox = Inbox(_tcp(self.address), {"secret_key": sec, "public_key": pub,
                                                "allowed_clients": [launcher_key]})
        self.code: Optional[int] = None

    def hello(self) -> dict:
        return {"address": self.address, "hostname": socket.gethostname(),
                "endpoint": self.inbox.endpoint, "key": self.key, "pid": os.getpid()}

    def run(self, proc: str, python: str, timeout: float) -> int:
        """Wait for the launcher's `launch` message, start the stage process with its lines on
        stdin (held open), and return its exit status when it ends. This thread lives as long as
        the process, so the process's PR_SET_PDEATHSIG (worker._die_with_parent) fires only if the
        actor dies."""
        try:
            m = proto.Launch.decode(self.inbox.recv(timeout))
        finally:
            self.inbox.close()
        if m.proc != proc:
            raise RuntimeError(f"launch message for '{m.proc}', expected '{proc}'")
        p = subprocess.Popen([python or sys.executable, "-m", "stagelink.pipeline._entry"] + remote_args(proc),
                             stdin=subprocess.PIPE)
        try:
            p.stdin.write(m.lines)
            p.stdin.flush()
        except OSError:
            pass  # it exited at once: its status says why
        self.code = p.wait()
        return self.code

    def exit_code(self) -> Optional[int]:
        """The process's exit status (None: it never started). Queued behind `run`, so it answers
        once the process ended: what a caller that lost `run`'s result asks instead."""
        return self.code


_Host = ray.remote(_StageHost)


class RayStageProcess(StageProcess):
    """A stage process under a `_StageHost` actor. poll/wait read the actor's `run` call; the
    launch itself (the actor's hello, the encrypted `launch` message) runs on a thread, and a
    failure there reports the process as exited with the reason in `how()`."""

    def __init__(self, launcher: "RayLauncher", proc: str, actor, lines: bytes, timeout: float):
        self.name, self._actor, self._l = proc, actor, launcher
        self.keep_input_open = True
        self._code: Optional[int] = None
        self._why = ""
        self._pid: Optional[int] = None
        self.where = f"on Ray node {launcher.spec.address_of(proc)}"
        # In this order: the actor runs one call at a time, and `run` waits for what `hello` enables.
        hello = actor.hello.remote()
        self._run = actor.run.remote(proc, launcher.python, timeout)
        self._thread = threading.Thread(target=self._send, args=(hello, lines, timeout), daemon=True,
                                        name=f"stagelink-ray-launch-{proc}")
        self._thread.start()

    def _send(self, hello_ref, lines: bytes, timeout: float) -> None:
        try:
            hello = ray.get(hello_ref, timeout=timeout)
            self.where = f"on Ray node {hello['address']} ({hello['hostname']}), actor pid {hello['pid']}"
            ob = Outbox(hello["endpoint"], {"secret_key": self._l.secret, "public_key": self._l.public,
                                            "server_key": hello["key"]})
            try:
                ob.send(proto.Launch(self.name, lines).encode(), timeout=timeout)
            finally:
                ob.close()
        except Exception as e:  # noqa: BLE001  reported as the process's end
            self._fail(f"its Ray actor did not start: {_reason(e)}")

    def _fail(self, why: str) -> None:
        if self._code is None:
            self._code, self._why = ACTOR_DIED, why
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:  # noqa: BLE001  gone already
                pass

    @property
    def pid(self) -> int:
        """The stage process's pid on its node, from its `ready` message (0 until then)."""
        return self._pid or 0

    def ready(self, pid: int) -> None:
        self._pid = pid

    @property
    def returncode(self) -> Optional[int]:
        return self._code

    def poll(self) -> Optional[int]:
        if self._code is None:
            done, _ = ray.wait([self._run], timeout=0)
            if done:
                self._collect()
        return self._code

    def _collect(self) -> None:
        try:
            code = ray.get(self._run, timeout=5)
        except ray.exceptions.ActorUnavailableError:
            # Ray cannot tell (its connection to the actor dropped: a node gone, or a network
            # blip): alive until Ray says dead. Ask again; the call waits behind `run` while the
            # actor lives, and fails with ActorDiedError once Ray's health checks give it up.
            self._run = self._actor.exit_code.remote()
            return
        except Exception as e:  # noqa: BLE001  the actor died (killed, its node lost)
            self._fail(_reason(e))
            return
        if self._code is None:
            if code is None:
                self._fail("its Ray actor never started the process")
            else:
                self._code = code

    def how(self) -> str:
        return self._why or super().how()

    def alive(self) -> bool:
        return self.poll() is None

    def send_line(self, line: bytes, last: bool = False) -> None:
        raise LaunchError("a Ray stage process reads its stdin from its actor only")

    def end_input(self) -> None:
        """Nothing to do: its actor holds its stdin, and ends (with it) when killed or when the
        coordinator, its Ray driver, exits. The `shutdown` message it was sent ends it first."""

    def wait(self, timeout: float) -> Optional[int]:
        if self._code is None:
            done, _ = ray.wait([self._run], timeout=max(0.0, timeout))
            if done:
                self._collect()
        return self._code

    def kill(self) -> None:
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001  gone already
            pass
        if self.wait(10.0) is None:
            self._fail("killed")


def _reason(e: BaseException) -> str:
    """How a Ray call failed, in one line (an actor Ray declared dead, or a launch that failed)."""
    text = str(e).strip().splitlines()
    head = f"{type(e).__name__}: " + (text[0] if text else "")
    if isinstance(e, (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)):
        return f"its Ray actor was lost ({head[:240]})"
    return head[:400]


def dry_place(spec: PipelineSpec) -> Dict[str, str]:
    """Where Ray would place each process of `spec` now, in words (`stagelink config check
    --place`): the placement group is made, read and removed; no actor or process starts."""
    spec = dataclasses.replace(spec, control=dict(spec.control), hosts=dict(spec.hosts), placed=dict(spec.placed))
    launcher = RayLauncher(spec, "", _Env(spec, None))
    try:
        return {proc: launcher.describe(proc) for proc in spec.processes()}
    finally:
        launcher.close()


def _probe(address: str, timeout: float) -> None:
    """A HOST:PORT (or ray://HOST:PORT) address answers TCP within `timeout`: ray.init itself
    retries a silent address for minutes."""
    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    if address in ("auto", "local") or ":" not in hostport:
        return
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as e:
        raise pl.PlacementError(f"placement: ray: no Ray cluster answers at {address!r} (within {timeout:g} s: "
                                f"{e}); start one (ray start --head) or fix placement.address") from None


class RayLauncher(Launcher):
    """Places the pipeline on a Ray cluster (a placement group) when made, then starts each stage
    process under an actor in its bundle. `close()` removes the group (every actor with it)."""

    def __init__(self, spec: PipelineSpec, python: str, env: _Env):
        self.spec, self.env = spec, env
        p = spec.placement
        self.python = p.get("python") or ""
        self.public, self.secret = _core.curve_keypair()  # the launch channel's (not the pipeline's)
        self.actors: Dict[str, object] = {}
        self.pg = None
        self._own = not ray.is_initialized()
        if self._own:
            _probe(p["address"], min(10.0, p["timeout_s"]))
            try:
                if p["address"] == "local":  # a Ray of its own on this host, for this process
                    # As many logical CPUs as the pipeline asks (Ray counts this host's cores,
                    # and a process asks 1), and a small object store: no payload goes there.
                    need = sum(pl.bundle(spec, proc).get("CPU", 0.0) for proc in spec.processes())
                    ray.init(include_dashboard=False, logging_level="WARNING", object_store_memory=_LOCAL_STORE,
                             num_cpus=max(os.cpu_count() or 1, int(need + 0.999)))
                else:
                    ray.init(address=p["address"], logging_level="WARNING")
            except Exception as e:  # noqa: BLE001  ConnectionError, RuntimeError, ValueError by version
                raise pl.PlacementError(f"placement: ray: cannot join the Ray cluster at {p['address']!r}: "
                                        f"{type(e).__name__}: {e}") from None
        try:
            self._place()
        except BaseException:
            self.close()
            raise

    def _place(self) -> None:
        spec, p = self.spec, self.spec.placement
        procs = list(spec.processes())
        self.index = {proc: i for i, proc in enumerate(procs)}
        bundles = [pl.bundle(spec, proc) for proc in procs]
        selectors = [pl.labels(spec, proc) for proc in procs]
        t0 = time.monotonic()
        self.pg = placement_group(bundles, strategy=p["strategy"],
                                  name=f"stagelink-{spec.name}-{secrets.token_hex(4)}",
                                  bundle_label_selector=selectors if any(selectors) else None)
        try:
            ray.get(self.pg.ready(), timeout=p["timeout_s"])
        except ray.exceptions.GetTimeoutError:
            have = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
            asked = "; ".join(f"{proc}: {pl.describe(spec, proc)}" for proc in procs)
            raise pl.PlacementError(
                f"placement: Ray found no room for the pipeline's {len(procs)} processes ({p['strategy']}) within "
                f"{p['timeout_s']:g} s (placement.timeout_s): they ask {asked}; the cluster has {have} free "
                f"on {len([n for n in ray.nodes() if n['Alive']])} node(s)") from None
        self.place_s = time.monotonic() - t0
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        table = placement_group_table(self.pg)["bundles_to_node_id"]
        try:
            mine = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001  a Ray client (ray://) is on no node of the cluster
            mine = None
        self.nodes: Dict[str, dict] = {}
        for proc, i in self.index.items():
            n = nodes[table[i]]
            addr = n["NodeManagerAddress"]
            self.nodes[proc] = {"address": addr,
                                "hostname": n.get("NodeManagerHostname", ""), "here": n["NodeID"] == mine}
            if n["NodeID"] == mine:
                spec.placed[proc] = ""
            else:
                spec.hosts[addr] = {"address": addr, "launch": [], "python": self.python, "env": {}}
                spec.placed[proc] = addr
        if spec.control.get("host") == "auto":
            spec.control["host"] = (nodes[mine]["NodeManagerAddress"] if mine in nodes else _core.host_address())
        try:  # edges the file put on a one-host relay that the placement split across nodes
            _check_hosts(spec, f"{spec.source} (as Ray placed it)")
        except PipelineConfigError as e:
            raise pl.PlacementError(str(e)) from None

    def describe(self, proc: str) -> str:
        n = self.nodes.get(proc)
        if not n:
            return "a Ray node"
        return f"Ray node {n['address']}" + (" (the coordinator's)" if n["here"] else "")

    def launch(self, proc: str, keys_line: Optional[bytes]) -> StageProcess:
        old = self.actors.pop(proc, None)
        if old is not None:  # a restart: free its bundle first
            try:
                ray.kill(old, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        b = pl.bundle(self.spec, proc)
        custom = {k: v for k, v in b.items() if k not in ("CPU", "GPU", "memory") and not k.startswith("node:")}
        opts = dict(num_cpus=b.get("CPU", 0), num_gpus=b.get("GPU", 0), resources=custom,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, self.index[proc]))
        if b.get("memory"):
            opts["memory"] = b["memory"]
        try:
            actor = _Host.options(**opts).remote(self.public)
        except Exception as e:  # noqa: BLE001
            raise LaunchError(f"Ray could not create the actor of stage process '{proc}': {e}") from None
        self.actors[proc] = actor
        lines = remote_spec_line(self.spec, self.env.front, self.env.paths) + (keys_line or b"")
        return RayStageProcess(self, proc, actor, lines, self.spec.settings["startup_timeout_s"])

    def close(self) -> None:
        for a in self.actors.values():
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors.clear()
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001  the cluster is gone
                pass
            self.pg = None
        if self._own and ray.is_initialized():
            ray.shutdown()
