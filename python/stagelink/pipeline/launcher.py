"""Where a pipeline's stage processes run, and how the coordinator learns that one ended: the
`Launcher` seam. The coordinator asks a launcher for each process and afterwards sees only
`StageProcess` handles (poll, input lines, stop); it never starts a process itself.

    LocalLauncher   this host: `python -m stagelink.pipeline._entry SPEC.json PROCESS DIR`
    RayLauncher     a Ray cluster (`placement: {engine: ray}`): ray_launcher.py
    HostsLauncher   another host of the file's `hosts:` through its `launch` prefix (ssh by default):
                    `... --remote - PROCESS`, the spec and keys on stdin, which stays open so the
                    process ends when the coordinator does (worker._watch_stdin)

A process's secrets (its CURVE keys) and, on another host, its spec travel on its stdin, never
on a command line, in the environment or in a file another user could read.
"""
from __future__ import annotations

import abc
import json
import os
import signal
import subprocess
import sys
from typing import List, Optional

from .. import _core
from .spec import PipelineSpec
from .worker import remote_args, remote_spec_line


class LaunchError(_core.StagelinkError):
    """A launcher could not start a stage process (the coordinator reports it as a failed start)."""


class StageProcess:
    """One launched stage process: its exit status while it runs (poll), a line on its input, and
    stopping it. `where` says where it runs, for messages ("pid 123", "on host 'gpu1', its
    launcher's pid 123")."""

    def __init__(self, name: str, popen: subprocess.Popen, where: str, keep_input_open: bool):
        self.name, self._p, self.where = name, popen, where
        self.keep_input_open = keep_input_open

    @property
    def pid(self) -> int:
        return self._p.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._p.returncode

    def poll(self) -> Optional[int]:
        """Its exit status, or None while it runs."""
        return self._p.poll()

    def alive(self) -> bool:
        return self._p.poll() is None

    def ready(self, pid: int) -> None:
        """It said it is ready, with its pid on its host (a launcher that started it knows it)."""

    def how(self) -> str:
        """How it ended, for messages: 'exit code 1', 'killed by SIGKILL', or a launcher's reason."""
        return how_it_ended(self.returncode)

    def send_line(self, line: bytes, last: bool = False) -> None:
        """One line on its stdin (`last`: then end of file, unless its input must stay open). A
        process (or launcher) that exited already is reported by poll, not here."""
        pipe = self._p.stdin
        if pipe is None or pipe.closed:
            return
        try:
            pipe.write(line)
            if last and not self.keep_input_open:
                pipe.close()
            else:
                pipe.flush()
        except OSError:
            pass

    def end_input(self) -> None:
        """End of file on its stdin: a process on another host takes it for the coordinator's end."""
        pipe = self._p.stdin
        if pipe is not None and not pipe.closed:
            try:
                pipe.close()
            except OSError:  # its launcher is gone already (what it left unread, never delivered)
                pass

    def wait(self, timeout: float) -> Optional[int]:
        """Wait up to `timeout` s for it to exit; its exit status, or None if it still runs."""
        try:
            return self._p.wait(max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self._p.kill()
        self._p.wait()


class Launcher(abc.ABC):
    """Starts the stage processes of one pipeline. `prepare` runs once before the first launch
    (files, environment); `launch` starts process `proc`, given the line of secrets it reads
    first on stdin (None: none)."""

    @abc.abstractmethod
    def launch(self, proc: str, keys_line: Optional[bytes]) -> StageProcess:
        ...

    def describe(self, proc: str) -> str:
        """Where `proc` would run, for `stagelink config check` and errors."""
        return "this host"

    def refresh(self) -> None:
        """The spec is complete (before the first launch), or changed (a process started again
        gets a fresh endpoint): launches from now on hand out this one."""

    def close(self) -> None:
        """After every process ended: release what the launcher holds (a cluster's reservation)."""


def how_it_ended(rc: Optional[int]) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


def make_launcher(spec: PipelineSpec, sock_dir: str, python: str, env: Optional[dict]) -> Launcher:
    """The launcher the file's placement asks for. A Ray one places the pipeline now (the spec
    learns each process's node), so it is made before anything depends on where processes run."""
    if spec.placement.get("engine") == "ray":
        from .placement import ray_missing
        missing = ray_missing()
        if missing:
            raise LaunchError(missing)
        from .ray_launcher import RayLauncher
        return RayLauncher(spec, python, _Env(spec, env))
    return PlacedLauncher(spec, sock_dir, python, env)


class _Env:
    """The stage processes' environment: the caller's, with the coordinator's import path (the
    stages' own module directories in front) so that stage factories import as they do here."""

    def __init__(self, spec: PipelineSpec, env: Optional[dict]):
        self.env = dict(os.environ if env is None else env)
        self.paths = [p for p in sys.path if p and os.path.isdir(p)]
        self.front = spec.module_dirs()
        self.env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(self.front + self.paths))


class LocalLauncher(Launcher):
    """Processes on this host, reading their spec from a file in the pipeline's 0700 directory."""

    def __init__(self, spec: PipelineSpec, sock_dir: str, python: str, env: _Env):
        self.spec, self.dir, self.python, self.env = spec, sock_dir, python, env
        self.spec_path = os.path.join(sock_dir, "pipeline.json")  # written by refresh(), before the first launch

    def refresh(self) -> None:
        tmp = self.spec_path + ".new"
        with open(tmp, "w") as f:
            json.dump(self.spec.to_dict(), f)
        os.replace(tmp, self.spec_path)  # a process starting now reads the old one or the new one whole

    def launch(self, proc: str, keys_line: Optional[bytes]) -> StageProcess:
        p = subprocess.Popen([self.python, "-m", "stagelink.pipeline._entry", self.spec_path, proc, self.dir],
                             env=self.env.env, stdin=subprocess.PIPE if keys_line else subprocess.DEVNULL)
        sp = StageProcess(proc, p, f"pid {p.pid}", keep_input_open=False)
        if keys_line:
            sp.send_line(keys_line, last=True)  # then end of file: it watches no stdin
        return sp


class HostsLauncher(Launcher):
    """Processes on the hosts of the file's `hosts:`, each through its host's `launch` prefix."""

    def __init__(self, spec: PipelineSpec, python: str, env: _Env):
        self.spec, self.python, self.env = spec, python, env

    def describe(self, proc: str) -> str:
        return f"host '{self.spec.host_of(proc)}'"

    def launch(self, proc: str, keys_line: Optional[bytes]) -> StageProcess:
        host = self.spec.host_of(proc)
        h = self.spec.hosts[host]
        argv: List[str] = list(h["launch"]) + [h.get("python") or self.python, "-m", "stagelink.pipeline._entry"]
        argv += remote_args(proc)
        try:
            # Its stdin is a pipe this process holds open: when this process ends, however it ends,
            # the stage process reads end of file and exits (worker._watch_stdin).
            p = subprocess.Popen(argv, env=self.env.env, stdin=subprocess.PIPE)
        except OSError as err:
            raise LaunchError(f"cannot launch stage process '{proc}' on host '{host}' with {h['launch']}: "
                              f"{err}") from None
        sp = StageProcess(proc, p, f"on host '{host}', its launcher's pid {p.pid}", keep_input_open=True)
        sp.send_line(remote_spec_line(self.spec, self.env.front, self.env.paths))
        if keys_line:
            sp.send_line(keys_line)
        return sp


class PlacedLauncher(Launcher):
    """The launcher of each process by where the file places it: `hosts:` through HostsLauncher,
    the rest on this host."""

    def __init__(self, spec: PipelineSpec, sock_dir: str, python: str, env: Optional[dict]):
        e = _Env(spec, env)
        self.spec = spec
        self.local = LocalLauncher(spec, sock_dir, python, e)
        self.hosts = HostsLauncher(spec, python, e) if spec.hosts else None

    def _of(self, proc: str) -> Launcher:
        return self.hosts if self.spec.host_of(proc) and self.hosts is not None else self.local

    def describe(self, proc: str) -> str:
        return self._of(proc).describe(proc)

    def refresh(self) -> None:
        self.local.refresh()

    def launch(self, proc: str, keys_line: Optional[bytes]) -> StageProcess:
        return self._of(proc).launch(proc, keys_line)
