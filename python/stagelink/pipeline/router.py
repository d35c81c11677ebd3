"""Which stage process runs which request: membership and routing for stage replicas.

A stage with `replicas: N` runs in N copies of its process group (GROUP.0 .. GROUP.N-1). The
coordinator routes each request when it is submitted: one live replica of every replicated
group, the one with the fewest requests in flight (ties go round). The route travels with the
request's messages (metadata "route": {group: replica}), so every payload and every stream chunk
of one request reaches the same replica of each stage, and the stage processes follow it without
knowing anyone's load. When a replica dies, the router names the requests it held: the
coordinator runs them again (`retry: true`) or fails them.

The coordinator calls both classes under its own lock.
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Tuple

from .spec import COORDINATOR, PipelineSpec

Route = Dict[str, int]


class Membership:
    """The stage processes by (process group, replica), and the state of each: `alive` (routed
    to), `starting` (launched, not ready yet), `draining` (finishing what it holds before it
    stops: Pipeline.scale), `stopped` (never started, or retired) or `dead`."""

    def __init__(self, spec: PipelineSpec):
        self.spec = spec
        self.procs: Dict[str, List[str]] = {g: spec.group_procs(g) for g in spec.groups()}
        self._key = {p: (g, i) for g, ps in self.procs.items() for i, p in enumerate(ps)}
        initial = spec.initial_processes()
        self.state: Dict[str, str] = {p: "alive" if p in initial else "stopped" for p in self._key}
        self.why: Dict[str, str] = {}  # process -> how it died
        self.restarts: Dict[str, int] = {p: 0 for p in self._key}

    def key(self, proc: str) -> Tuple[str, int]:
        """(group, replica) of a stage process."""
        return self._key[proc]

    def alive(self, group: str) -> List[int]:
        """The replicas of `group` that take new requests."""
        return [i for i, p in enumerate(self.procs[group]) if self.state[p] == "alive"]

    def running(self, group: str) -> List[str]:
        """The processes of `group` that run or are starting (what Pipeline.scale counts)."""
        return [p for p in self.procs[group] if self.state[p] in ("alive", "starting")]

    def replicated(self, group: str) -> bool:
        return len(self.procs[group]) > 1

    def set(self, proc: str, state: str, why: str = "") -> None:
        self.state[proc] = state
        if why:
            self.why[proc] = why


class Router:
    """Routes requests to replicas (least in flight) and remembers, per replica, what it holds."""

    def __init__(self, members: Membership):
        self.members = members
        self.groups = [g for g in members.procs if members.replicated(g)]
        self.load: Dict[Tuple[str, int], int] = {(g, i): 0 for g in self.groups
                                                 for i in range(len(members.procs[g]))}
        self.routes: Dict[str, Route] = {}  # request (its current attempt's id) -> route
        self._turn = 0

    def route(self, rid: str) -> Optional[Route]:
        """A route for request `rid` (None when no stage is replicated). Raises LookupError when a
        replicated group has no live replica."""
        if not self.groups:
            return None
        self._turn += 1
        r: Route = {}
        for g in self.groups:
            alive = self.members.alive(g)
            if not alive:
                raise LookupError(f"every replica of process '{g}' died")
            n = len(alive)
            # The least loaded; among equals, the next in turn (spreads a burst of submissions).
            best = min(range(n), key=lambda k: (self.load[(g, alive[k])], (k - self._turn) % n))
            r[g] = alive[best]
            self.load[(g, alive[best])] += 1
        self.routes[rid] = r
        return r

    def done(self, rid: str) -> None:
        r = self.routes.pop(rid, None)
        for g, i in (r or {}).items():
            self.load[(g, i)] -= 1

    def holders(self, group: str, replica: int) -> List[str]:
        """The requests routed through replica `replica` of `group`."""
        return [rid for rid, r in self.routes.items() if r.get(group) == replica]

    def in_flight(self) -> Dict[str, int]:
        """Requests in flight per replica process."""
        return {self.members.procs[g][i]: n for (g, i), n in self.load.items()}


def proc_for(spec: PipelineSpec, procs: Dict[str, List[str]], stage: str, route: Optional[Route], rid: str) -> str:
    """The process that runs `stage` for a request with `route`: its group's one process, or the
    replica the route names. A request without a route (a sender that lost it) goes to a replica
    chosen from its id, the same one in every process."""
    if stage == COORDINATOR:
        return COORDINATOR
    group = spec.stages[stage].process
    ps = procs[group]
    if len(ps) == 1:
        return ps[0]
    i = route.get(group) if route else None
    if not isinstance(i, int) or not 0 <= i < len(ps):
        i = zlib.crc32(rid.encode()) % len(ps)
    return ps[i]
