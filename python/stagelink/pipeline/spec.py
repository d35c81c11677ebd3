"""The pipeline file: stages, their edges and where each stage runs, checked before anything starts.

    name: omni
    relay: {backend: shm, credits: 8, slot_size_mb: 16, timeout_s: 30}   # every edge's default
    # relay: {backend: auto}    # shm between processes of one host, ucx between hosts
    control: shm                                      # control messages: shm rings | ipc | tcp (below)
    # control: {transport: tcp, host: 10.0.0.5, base_port: 47100}  # coordinator 47100, stages 47101...
    #                                                 # (base_port 0, the default: free ports, chosen at start)
    hosts:                                            # optional: stage processes on other hosts
      gpu2: {address: 10.0.0.6, launch: "ssh -o BatchMode=yes 10.0.0.6", python: /opt/venv/bin/python}
    settings: {request_timeout_s: 120, startup_timeout_s: 120}
    stages:
      - name: encoder
        factory: "stagelink.examples.omni:encoder"   # module:callable
        args: {dim: 1024}                             # optional: factory(**args) builds the stage
        next: thinker                                 # one target or a list (fan-out)
      - name: thinker
        factory: ...
        stream_to: [talker]                           # chunks sent with ctx.stream()
        process: lm                                   # stages sharing a value share a process
        host: gpu2                                    # run its process there (control: tcp, relay: ucx)
        env: {CUDA_VISIBLE_DEVICES: "1"}              # set in its process before any stage is built
      - name: talker
        factory: ...
        merge: "mod:fn"                               # fan-in: combine {source: payload}
        concurrency: 8                                # requests run at once (threads); or
        inline: auto                                  # true: on the receive thread, one at a time;
                                                      # false: a pool thread; auto (default): inline
                                                      # while its runs stay short
        zero_copy: false                              # true: relay inputs as read-only views
        terminal: true                                # its result completes the request
    edges:                                            # optional: a connector per edge
      - {from: thinker, to: talker, connector: big}
    connectors:                                       # or runtime.connectors (vLLM-Omni syntax)
      big: {name: SharedMemoryConnector, extra: {arena_bytes: 1073741824}}
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .. import _core
from ..connector import has_trait
from . import placement

_STAGE_KEYS = {"name", "factory", "args", "next", "stream_to", "terminal", "process", "merge", "concurrency",
               "inline", "zero_copy", "host", "env", "replicas", "retry", "max_replicas", "max_restarts",
               *placement.STAGE_KEYS}
MAX_REPLICAS = 64
_TOP_KEYS = {"name", "relay", "settings", "stages", "edges", "connectors", "runtime", "description", "client",
             "control", "hosts", "placement"}
# startup_timeout_s counts per process from when it starts building its stages (importing their
# modules): three processes importing torch at once on a loaded 2-core machine took over 20 s.
_SETTINGS = {"request_timeout_s": 120.0, "startup_timeout_s": 120.0, "abort_timeout_s": 5.0,
             "shutdown_timeout_s": 10.0, "inline_bytes": 16384, "completed_window": 10000,
             "early_chunk_bytes": 256 << 20, "chunk_timeout_s": None, "trace_sample": 1.0}
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
COORDINATOR = "coordinator"


class PipelineConfigError(_core.InvalidArgumentError):
    """A pipeline file that cannot run, with what is wrong and where."""


@dataclass
class StageSpec:
    name: str
    factory: str
    args: Optional[dict] = None
    next: List[str] = field(default_factory=list)
    stream_to: List[str] = field(default_factory=list)
    terminal: bool = False
    process: str = ""
    merge: Optional[str] = None
    concurrency: int = 8
    # Run on the process's receive thread instead of a pool thread: no thread handoff per request
    # (the fastest for short stages), one request at a time, aborts seen between requests. Not for
    # stages that read streams (they wait for chunks the receive thread must deliver).
    # None (auto, the default): inline while its runs stay short (stage.AUTO_INLINE_NS), else on
    # the pool; a stage that reads ctx.chunks() only for a request whose streams have all ended.
    inline: Optional[bool] = None
    # Inputs that came through the relay are read-only views of its shared memory (no copy); each
    # holds its slot, and its edge's credit, until the stage drops it.
    zero_copy: bool = False
    host: str = ""  # a name under `hosts:`; "" is the coordinator's host
    env: Dict[str, str] = field(default_factory=dict)  # set in its process before any stage is built
    # Copies of its process (the whole `process` group: its stages share the count); each request
    # goes to one replica of each stage (the least loaded when it is submitted).
    replicas: int = 1
    # Safe to run again: a request whose replica of this stage died is run again from the entry
    # stage on the surviving replicas instead of failing.
    retry: bool = False
    # The most replicas Pipeline.scale may grow it to (0: `replicas`); their names, keys and
    # control endpoints are made at start-up.
    max_replicas: int = 0
    # Times a dead replica of it is started again (0: never); it rejoins once it says it is ready.
    max_restarts: int = 0
    # Read by a placement engine (placement.py): what its process reserves ({CPU: 2, GPU: 1,
    # memory: bytes, custom: n}), the Ray node it must run on (an address), node labels it needs.
    resources: Dict[str, float] = field(default_factory=dict)
    node: str = ""
    labels: Dict[str, str] = field(default_factory=dict)
    sources: List[str] = field(default_factory=list)         # stages whose `next` names this one
    stream_sources: List[str] = field(default_factory=list)  # stages whose `stream_to` names it


@dataclass
class PipelineSpec:
    name: str
    stages: Dict[str, StageSpec]
    entry: str
    terminal: str
    relay: dict
    edge_relays: Dict[str, dict]  # "from->to" -> relay config of that edge
    settings: dict
    source: str = "<dict>"
    client: dict = field(default_factory=dict)  # for `stagelink run`: request, args, verify
    # Control-message transport: {"transport": "shm"} (rings, one host), "ipc" (ZeroMQ sockets in
    # the private directory) or "tcp" (ZeroMQ, with "host" and "base_port"; base_port 0: free
    # ports, the coordinator's in "coordinator" and the stage processes' in "peers" once known).
    control: dict = field(default_factory=lambda: {"transport": "shm"})
    # Other hosts: name -> {"address", "launch" (argv prefix that runs a command there), "python"}.
    hosts: Dict[str, dict] = field(default_factory=dict)
    # `placement:` (placement.py): {} places by `hosts:`; {"engine": "ray", ...} on a Ray cluster.
    placement: dict = field(default_factory=dict)
    # Where a placement engine put each process: process -> a name under `hosts` ("" or absent:
    # the coordinator's host). Made by the launcher before any process starts.
    placed: Dict[str, str] = field(default_factory=dict)

    def groups(self) -> Dict[str, List[str]]:
        """Process group (a stage's `process`) -> its stages, in file order."""
        out: Dict[str, List[str]] = {}
        for s in self.stages.values():
            out.setdefault(s.process, []).append(s.name)
        return out

    def processes(self) -> Dict[str, List[str]]:
        """Stage process name -> its stages, in file order: one per group, or with `replicas: N`
        (`max_replicas: M`) M of them, named GROUP.0 .. GROUP.M-1, the first N started with the
        pipeline (initial_processes) and the others by Pipeline.scale."""
        out: Dict[str, List[str]] = {}
        for g, names in self.groups().items():
            for p in self.group_procs(g):
                out[p] = names
        return out

    def initial_processes(self) -> Dict[str, List[str]]:
        """The stage processes started with the pipeline: `replicas` of each group."""
        out: Dict[str, List[str]] = {}
        for g, names in self.groups().items():
            n = self._first(g).replicas
            for p in self.group_procs(g)[:n]:
                out[p] = names
        return out

    def _first(self, group: str) -> "StageSpec":
        return next(s for s in self.stages.values() if s.process == group)

    def group_procs(self, group: str) -> List[str]:
        """The stage processes of a process group: its replicas (up to max_replicas)."""
        st = self._first(group)
        n = max(st.replicas, st.max_replicas)
        return [group] if n == 1 else [f"{group}.{i}" for i in range(n)]

    def replica_procs(self, stage: str) -> List[str]:
        """The processes that run `stage`: one per replica."""
        return self.group_procs(self.stages[stage].process)

    def group_of(self, proc: str) -> str:
        """The process group stage process `proc` belongs to (a replica's group)."""
        if proc == COORDINATOR or any(s.process == proc for s in self.stages.values()):
            return proc
        base, _, idx = proc.rpartition(".")
        if idx.isdigit() and any(s.process == base and max(s.replicas, s.max_replicas) > 1
                                 for s in self.stages.values()):
            return base
        raise KeyError(proc)

    @property
    def replicated(self) -> bool:
        """Whether any stage has (or may grow to) more than one replica."""
        return any(max(s.replicas, s.max_replicas) > 1 for s in self.stages.values())

    @property
    def multi_host(self) -> bool:
        """Whether any stage runs on another host (`host:`, or placed there)."""
        return any(s.host for s in self.stages.values()) or any(self.placed.values())

    @property
    def free_ports(self) -> bool:
        """Control over TCP on free ports (base_port 0), learned at start-up."""
        return self.control.get("transport") == "tcp" and int(self.control["base_port"]) == 0

    def stage_host(self, stage: str) -> str:
        """The `hosts:` name stage `stage` (or the coordinator) runs on; "" for the coordinator's host.
        Placed by an engine, its processes' host where they all share one, else the hosts joined
        by '+' (replicas on several nodes: unlike every single host, so edges to it cross hosts)."""
        if stage == COORDINATOR:
            return ""
        if self.placed:
            hosts = sorted({self.placed.get(p, "") for p in self.replica_procs(stage)})
            return hosts[0] if len(hosts) == 1 else "+".join(h or "coordinator" for h in hosts)
        return self.stages[stage].host

    def edges(self) -> List[tuple]:
        """Every edge as (src, dst, kind): the coordinator's request to the entry stage, `next`
        (data) and `stream_to` (stream) edges, the terminal stage's result to the coordinator."""
        out = [(COORDINATOR, self.entry, "request")]
        for s in self.stages.values():
            out += [(s.name, t, "data") for t in s.next] + [(s.name, t, "stream") for t in s.stream_to]
        return out + [(self.terminal, COORDINATOR, "result")]

    def relay_for(self, src: str, dst: str) -> dict:
        """The relay config of edge src -> dst (either end may be the coordinator). `backend: auto`
        is shared memory between two processes of one host, the transfer engine between hosts."""
        cfg = self.edge_relays.get(f"{src}->{dst}", self.relay)
        if cfg.get("backend") == "auto":
            cfg = dict(cfg, backend="shm" if self.stage_host(src) == self.stage_host(dst) else "ucx")
        return cfg

    def module_dirs(self) -> List[str]:
        """Where the pipeline's own modules (stage factories, client functions) import from, first
        on the import path: the working directory, then the pipeline file's directory."""
        dirs = [os.getcwd()]
        if self.source != "<dict>":
            dirs.append(os.path.dirname(os.path.abspath(self.source)))
        return list(dict.fromkeys(dirs))

    def cuda_path(self, src: str, dst: str) -> str:
        """How CUDA tensors cross edge src -> dst (docs/cuda.md): left on their GPU and read over
        CUDA IPC (a shared-memory relay: same host), by reference (`local`), or staged through
        pinned host memory (the transfer engine, other connectors, `cuda_ipc: false`)."""
        r = self.relay_for(src, dst)
        backend = r.get("backend", "shm")
        if backend == "local":
            return "by reference"
        if has_trait(relay_connector(r), "device_slots") and (r.get("extra") or {}).get("cuda_ipc", True):
            return "stay on their GPU (device arena, CUDA IPC)"
        return "staged through pinned host memory" + (" (transfer engine)" if backend == "ucx" else "")

    def relay_at(self, proc: str, src: str, dst: str) -> dict:
        """The relay config process `proc` uses for edge src -> dst. With stages on other hosts, a
        transfer-engine relay serves on the address of the host the process runs on."""
        cfg = self.relay_for(src, dst)
        if cfg.get("backend") == "ucx" and self.multi_host:
            cfg = dict(cfg, extra=dict(cfg.get("extra") or {}, host=self.address_of(proc)))
        return cfg

    def host_of(self, proc: str) -> str:
        """The `hosts:` name process `proc` runs on; "" for the coordinator's host."""
        if proc == COORDINATOR:
            return ""
        if self.placed:
            return self.placed.get(proc, "")
        group = self.group_of(proc)
        return next(s.host for s in self.stages.values() if s.process == group)

    def env_of(self, proc: str) -> Dict[str, str]:
        """The environment process `proc` sets for itself: its host's `env`, then its stages'."""
        h = self.host_of(proc)
        out = dict(self.hosts[h].get("env") or {}) if h else {}
        group = self.group_of(proc)
        for s in self.stages.values():
            if s.process == group:
                out.update(s.env)
        return out

    def address_of(self, proc: str) -> str:
        """The address process `proc` serves control messages on (`control: tcp`)."""
        h = self.host_of(proc)
        return self.hosts[h]["address"] if h else self.control["host"]

    def to_dict(self) -> dict:
        return {"name": self.name, "entry": self.entry, "terminal": self.terminal, "relay": self.relay,
                "edge_relays": self.edge_relays, "settings": self.settings, "source": self.source,
                "client": self.client, "control": self.control, "hosts": self.hosts,
                "placement": self.placement, "placed": self.placed,
                "stages": [{k: getattr(s, k) for k in ("name", "factory", "args", "next", "stream_to", "terminal",
                                                       "process", "merge", "concurrency", "inline", "zero_copy",
                                                       "host", "env", "replicas", "retry", "max_replicas",
                                                       "max_restarts", "resources", "node", "labels", "sources",
                                                       "stream_sources")} for s in self.stages.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> "PipelineSpec":
        stages = {s["name"]: StageSpec(**s) for s in d["stages"]}
        return cls(d["name"], stages, d["entry"], d["terminal"], d["relay"], d["edge_relays"], d["settings"],
                   d.get("source", "<dict>"), d.get("client") or {}, d.get("control") or {"transport": "shm"},
                   d.get("hosts") or {}, d.get("placement") or {}, d.get("placed") or {})


def _inline(v, where: str) -> Optional[bool]:
    if v is None or v == "auto":
        return None
    if not isinstance(v, bool):
        raise PipelineConfigError(f"{where}: 'inline' must be true, false or auto (the default: on the receive "
                                  "thread while the stage's runs stay short)")
    return v


def _list(v, where) -> List[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return list(v)
    raise PipelineConfigError(f"{where}: expected a stage name or a list of them, got {v!r}")


def load_pipeline(path_or_dict) -> PipelineSpec:
    """Read and check a pipeline file (or an already-parsed dict). Raises PipelineConfigError
    naming the stage and key at fault: unknown keys, unknown targets, cycles, no single entry or
    terminal stage, bad factories (``module:callable``)."""
    source = "<dict>"
    if isinstance(path_or_dict, (str, os.PathLike)):
        import yaml
        source = str(path_or_dict)
        try:
            with open(path_or_dict) as f:
                raw = yaml.safe_load(f)
        except OSError as e:
            raise PipelineConfigError(f"cannot read pipeline file {source}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise PipelineConfigError(f"{source}: not valid YAML: {e}") from None
    else:
        raw = path_or_dict
    if not isinstance(raw, dict):
        raise PipelineConfigError(f"{source}: a pipeline file is a map with 'stages'")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise PipelineConfigError(f"{source}: unknown top-level keys {sorted(unknown)} (known: {sorted(_TOP_KEYS)})")
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise PipelineConfigError(f"{source}: 'stages' must be a non-empty list")
    stages: Dict[str, StageSpec] = {}
    for i, s in enumerate(stages_raw):
        where = f"{source}: stages[{i}]"
        if not isinstance(s, dict):
            raise PipelineConfigError(f"{where}: a stage is a map with name and factory")
        bad = set(s) - _STAGE_KEYS
        if bad:
            raise PipelineConfigError(f"{where}: unknown keys {sorted(bad)} (known: {sorted(_STAGE_KEYS)})")
        name = s.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name == COORDINATOR:
            raise PipelineConfigError(f"{where}: 'name' must be 1-64 letters, digits, '_', '.', '-' (not "
                                      f"'{COORDINATOR}'), got {name!r}")
        where = f"{source}: stage '{name}'"
        if name in stages:
            raise PipelineConfigError(f"{where}: declared twice")
        factory = s.get("factory")
        if not isinstance(factory, str) or not (factory.count(":") == 1 or
                                                (factory.startswith("cpp:") and factory.count(":") >= 2)):
            raise PipelineConfigError(f"{where}: 'factory' must be 'module:callable' (Python) or "
                                      f"'cpp:path/to/lib.so:symbol' (C++), got {factory!r}")
        args = s.get("args")
        if args is not None and not isinstance(args, dict):
            raise PipelineConfigError(f"{where}: 'args' must be a map of keyword arguments")
        conc = s.get("concurrency", 8)
        if not isinstance(conc, int) or not 1 <= conc <= 256:
            raise PipelineConfigError(f"{where}: 'concurrency' must be an integer in [1, 256]")
        merge = s.get("merge")
        if merge is not None and (not isinstance(merge, str) or merge.count(":") != 1):
            raise PipelineConfigError(f"{where}: 'merge' must be 'module:callable'")
        proc = s.get("process", name)
        if not isinstance(proc, str) or not _NAME.match(proc):
            raise PipelineConfigError(f"{where}: 'process' must be a name like a stage's")
        host = s.get("host") or ""
        if not isinstance(host, str):
            raise PipelineConfigError(f"{where}: 'host' must be a name under 'hosts:'")
        env = _env(s.get("env"), f"{where}: env")
        replicas = s.get("replicas", 1)
        if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= MAX_REPLICAS:
            raise PipelineConfigError(f"{where}: 'replicas' must be an integer in [1, {MAX_REPLICAS}] (copies of its "
                                      f"process), got {replicas!r}")
        max_replicas = s.get("max_replicas", replicas)
        if not isinstance(max_replicas, int) or isinstance(max_replicas, bool) or \
                not replicas <= max_replicas <= MAX_REPLICAS:
            raise PipelineConfigError(f"{where}: 'max_replicas' must be an integer in [replicas, {MAX_REPLICAS}] (what "
                                      f"Pipeline.scale may grow it to), got {max_replicas!r}")
        max_restarts = s.get("max_restarts", 0)
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or not 0 <= max_restarts <= 1_000_000:
            raise PipelineConfigError(f"{where}: 'max_restarts' must be an integer >= 0 (times a dead replica is "
                                      f"started again), got {max_restarts!r}")
        retry = s.get("retry", False)
        if not isinstance(retry, bool):
            raise PipelineConfigError(f"{where}: 'retry' must be true (safe to run again: a request whose replica "
                                      "died is run again) or false")
        where_placed = placement.parse_stage(s, where)
        stages[name] = StageSpec(name=name, factory=factory, args=args, next=_list(s.get("next"), f"{where}: next"),
                                 stream_to=_list(s.get("stream_to"), f"{where}: stream_to"),
                                 terminal=bool(s.get("terminal", False)), process=proc, merge=merge,
                                 concurrency=conc, inline=_inline(s.get("inline"), where),
                                 zero_copy=bool(s.get("zero_copy", False)), host=host, env=env,
                                 replicas=replicas, retry=retry, max_replicas=max_replicas,
                                 max_restarts=max_restarts, **where_placed)
    for s in stages.values():
        for key in ("next", "stream_to"):
            for t in getattr(s, key):
                if t not in stages:
                    raise PipelineConfigError(f"{source}: stage '{s.name}': {key} names '{t}', which is not a stage "
                                              f"(stages: {', '.join(stages)})")
                if t == s.name:
                    raise PipelineConfigError(f"{source}: stage '{s.name}': {key} names itself")
            if len(set(getattr(s, key))) != len(getattr(s, key)):
                raise PipelineConfigError(f"{source}: stage '{s.name}': {key} names a stage twice")
        if s.terminal and s.next:
            raise PipelineConfigError(f"{source}: stage '{s.name}' is terminal and has next {s.next}")
        for t in s.next:
            stages[t].sources.append(s.name)
        for t in s.stream_to:
            stages[t].stream_sources.append(s.name)
    terminals = [s.name for s in stages.values() if s.terminal]
    if len(terminals) != 1:
        raise PipelineConfigError(f"{source}: exactly one stage must be 'terminal: true' (its result completes a "
                                  f"request); found {terminals or 'none'}")
    entries = [s.name for s in stages.values() if not s.sources and not s.stream_sources]
    if len(entries) != 1:
        raise PipelineConfigError(f"{source}: exactly one stage must have no inputs (the entry, where submit "
                                  f"sends requests); found {entries or 'none'}")
    for s in stages.values():
        if not s.terminal and not s.next and not s.stream_to:
            raise PipelineConfigError(f"{source}: stage '{s.name}' sends nothing: give it next, stream_to, or "
                                      "terminal: true")
        if s.inline and s.stream_sources:
            raise PipelineConfigError(f"{source}: stage '{s.name}' reads a stream ({s.stream_sources}) and cannot be "
                                      "inline: it would block the thread that delivers its chunks")
        if len(s.sources) > 1 and s.stream_sources:
            raise PipelineConfigError(f"{source}: stage '{s.name}': fan-in and stream inputs together are not "
                                      "supported")
    _check_acyclic(stages, source)
    _check_reaches(stages, entries[0], terminals[0], source)
    _check_replicas(stages, source)
    relay = _relay_cfg(raw.get("relay"), f"{source}: relay")
    settings = dict(_SETTINGS)
    st = raw.get("settings") or {}
    if not isinstance(st, dict) or set(st) - set(_SETTINGS):
        raise PipelineConfigError(f"{source}: settings: known keys are {sorted(_SETTINGS)}")
    for k, v in st.items():
        if k == "inline_bytes":
            if not isinstance(v, int) or not 0 <= v <= (1 << 20):
                raise PipelineConfigError(f"{source}: settings.inline_bytes must be an integer in [0, 1048576] "
                                          "(payloads up to it travel inside the control message; 0: never)")
            settings[k] = v
            continue
        if k == "early_chunk_bytes":
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= (1 << 40):
                raise PipelineConfigError(f"{source}: settings.early_chunk_bytes must be an integer in [0, 2**40] "
                                          "(stream chunks a stage process copies out of the relay while their "
                                          "stage waits for its payload)")
            settings[k] = v
            continue
        if k == "trace_sample":
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
                raise PipelineConfigError(f"{source}: settings.trace_sample must be a number in [0, 1] (the share "
                                          "of requests traced when the pipeline traces: --trace, Pipeline(trace=))")
            settings[k] = float(v)
            continue
        if k == "completed_window":
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 10_000_000:
                raise PipelineConfigError(f"{source}: settings.completed_window must be an integer in [1, 10000000] "
                                          "(how many finished requests Pipeline.completed keeps)")
            settings[k] = v
            continue
        if not isinstance(v, (int, float)) or v <= 0:
            raise PipelineConfigError(f"{source}: settings.{k} must be a positive number of seconds")
        settings[k] = float(v)
    edge_relays = _edges(raw, stages, relay, source)
    name = raw.get("name") or (os.path.splitext(os.path.basename(source))[0] if source != "<dict>" else "pipeline")
    if not isinstance(name, str) or not _NAME.match(name):
        raise PipelineConfigError(f"{source}: 'name' must be 1-64 letters, digits, '_', '.', '-', got {name!r}")
    client = raw.get("client") or {}
    if not isinstance(client, dict) or set(client) - {"request", "args", "verify"}:
        raise PipelineConfigError(f"{source}: client: a map of request ('module:callable' making request i), "
                                  "args (its keyword arguments) and verify ('module:callable')")
    for k in ("request", "verify"):
        if k in client and (not isinstance(client[k], str) or client[k].count(":") != 1):
            raise PipelineConfigError(f"{source}: client.{k} must be 'module:callable'")
    n_procs = sum(next(max(s.replicas, s.max_replicas) for s in stages.values() if s.process == g)
                  for g in {s.process for s in stages.values()})
    placed_by = placement.parse_placement(raw.get("placement"), source)
    # Under Ray, control messages cross nodes: TCP on free ports by default, the coordinator's
    # address learnt from Ray at start-up (ray_launcher.py).
    default_control = {"transport": "tcp", "host": "auto", "base_port": 0} if placed_by else "shm"
    control = _control(raw.get("control", default_control), n_procs, source)
    if placed_by and control["transport"] == "tcp" and not (isinstance(raw.get("control"), dict)
                                                            and "host" in raw["control"]):
        control["host"] = "auto"
    if control["transport"] == "tcp" and not placed_by and (control["host"] == "auto" or (
            not (isinstance(raw.get("control"), dict) and "host" in raw["control"]) and
            any(s.host for s in stages.values()))):
        # this host's address: STAGELINK_HOST_IP (or VLLM_HOST_IP), else its first interface's
        # that is up and not loopback
        control["host"] = _core.host_address()
    spec = PipelineSpec(str(name), stages, entries[0], terminals[0], relay, edge_relays, settings, source, client,
                        control, _hosts(raw.get("hosts"), source), placed_by)
    placement.check(spec, source)
    _check_hosts(spec, source)
    return spec


def relay_connector(cfg: dict) -> Optional[str]:
    """The connector a relay config makes (its backend's, or the one it names; None: `local`), from
    the core's relay backend table (`_core.relay_backends()`). `auto` is resolved first (relay_for)."""
    backend = cfg.get("backend", "shm")
    if backend == "connector":
        return cfg.get("connector")
    return _core.relay_backends()[backend]["connector"]


def relay_host_local(cfg: dict) -> bool:
    """Whether a relay config's data reaches only its own host (or process): its backend's say, or
    its connector's `host_local` trait."""
    backend = cfg.get("backend", "shm")
    if backend != "connector":
        return _core.relay_backends()[backend]["host_local"]
    return has_trait(cfg.get("connector"), "host_local")

_SHELL_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def _check_replicas(stages: Dict[str, StageSpec], source: str) -> None:
    """Stages that share a process share its replica count; a replica's name (GROUP.i) is no
    other process group's."""
    groups: Dict[str, StageSpec] = {}
    for s in stages.values():
        first = groups.setdefault(s.process, s)
        for key in ("replicas", "max_replicas", "max_restarts"):
            if getattr(first, key) != getattr(s, key):
                raise PipelineConfigError(f"{source}: stages '{first.name}' and '{s.name}' share process '{s.process}' "
                                          f"but ask for {key} {getattr(first, key)} and {getattr(s, key)}: a process "
                                          "group is replicated whole")
    for g, s in groups.items():
        n = max(s.replicas, s.max_replicas)
        for i in range(n if n > 1 else 0):
            if f"{g}.{i}" in groups:
                raise PipelineConfigError(f"{source}: process '{g}.{i}' is both a process group and a replica of "
                                          f"'{g}' (replicas: {n}): rename one")


def _map_of(v, where: str, what: str) -> dict:
    """An optional map of the file: {} when absent, else it must be a map (`what` says of what)."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise PipelineConfigError(f"{where}: {what}")
    return v


def _hosts(v, source) -> Dict[str, dict]:
    out = {}
    for name, h in _map_of(v, f"{source}: hosts", "a map of host name -> {address, launch, python, env}").items():
        where = f"{source}: hosts.{name}"
        if not isinstance(name, str) or not _NAME.match(name):
            raise PipelineConfigError(f"{where}: a host name is 1-64 letters, digits, '_', '.', '-'")
        if not isinstance(h, dict) or set(h) - {"address", "launch", "python", "env"}:
            raise PipelineConfigError(f"{where}: a map of address (required), launch, python and env")
        addr = h.get("address")
        if not isinstance(addr, str) or not addr or not _SHELL_SAFE.match(addr):
            raise PipelineConfigError(f"{where}.address: the address its stage processes serve on and the "
                                      f"coordinator reaches them at (a name or IP), got {addr!r}")
        if _loopback(addr):
            raise PipelineConfigError(f"{where}.address: {addr} is loopback, which names the coordinator's own host; "
                                      "give the address the other hosts reach it at")
        launch = h.get("launch", ["ssh", "-o", "BatchMode=yes", addr])
        if isinstance(launch, str):
            launch = shlex.split(launch)
        if not isinstance(launch, list) or not launch or not all(isinstance(a, str) and a for a in launch):
            raise PipelineConfigError(f"{where}.launch: a command prefix that runs a command on that host (a string "
                                      f"or a list of arguments, e.g. 'ssh {addr}'), got {h.get('launch')!r}")
        python = h.get("python")
        if python is not None and (not isinstance(python, str) or not _SHELL_SAFE.match(python)):
            raise PipelineConfigError(f"{where}.python: the Python interpreter there, a path without spaces or shell "
                                      f"characters, got {python!r}")
        out[name] = {"address": addr, "launch": launch, "python": python, "env": _env(h.get("env"), f"{where}.env")}
    return out


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env(v, where) -> Dict[str, str]:
    """Environment variables: names as the shell's, values strings (numbers are written out)."""
    out = {}
    for k, x in _map_of(v, where, "a map of environment variables, e.g. {CUDA_VISIBLE_DEVICES: '1'}").items():
        if not isinstance(k, str) or not _ENV_NAME.match(k):
            raise PipelineConfigError(f"{where}: {k!r} is not an environment variable name")
        if isinstance(x, bool) or not isinstance(x, (str, int, float)) or "\0" in str(x):
            raise PipelineConfigError(f"{where}.{k}: a string or number, got {x!r}")
        out[k] = str(x)
    return out


def _loopback(addr: str) -> bool:
    return addr == "localhost" or addr.startswith("127.") or addr in ("::1", "[::1]")


def _check_hosts(spec: PipelineSpec, source):
    """Stages on other hosts: a known host per process, control messages over TCP on an address the
    other hosts reach, and every edge between two hosts on a relay that crosses hosts."""
    where_of = {}
    for s in spec.stages.values():
        if s.host and s.host not in spec.hosts:
            raise PipelineConfigError(f"{source}: stage '{s.name}': host '{s.host}' is not under 'hosts:' "
                                      f"(hosts: {', '.join(spec.hosts) or 'none'})")
        other = where_of.setdefault(s.process, (s.host, s.name))
        first = spec.stages[other[1]]
        for k in set(first.env) & set(s.env):
            if first.env[k] != s.env[k]:
                raise PipelineConfigError(f"{source}: stages '{first.name}' and '{s.name}' share process '{s.process}' "
                                          f"but set env {k} differently ({first.env[k]!r}, {s.env[k]!r})")
        if other[0] != s.host:
            raise PipelineConfigError(f"{source}: stages '{other[1]}' and '{s.name}' share process '{s.process}' but "
                                      f"name different hosts ('{other[0] or 'the coordinator'}', "
                                      f"'{s.host or 'the coordinator'}')")
    remote = sorted({s.host for s in spec.stages.values() if s.host})
    if not remote:
        return
    c = spec.control
    if c.get("transport") != "tcp":
        raise PipelineConfigError(f"{source}: stages run on other hosts ({', '.join(remote)}): control must be "
                                  "{transport: tcp, host: ADDRESS, base_port: PORT}, ADDRESS the coordinator's "
                                  "address as those hosts reach it (shm and ipc reach one host only)")
    if _loopback(c["host"]):
        raise PipelineConfigError(f"{source}: stages run on other hosts ({', '.join(remote)}): control.host "
                                  f"{c['host']} is loopback; give the coordinator's address as those hosts reach it")
    for a, b, _ in spec.edges():
        ha, hb = spec.stage_host(a), spec.stage_host(b)
        if ha == hb:
            continue
        r = spec.relay_for(a, b)
        if relay_host_local(r):
            what = r.get("connector") if r.get("backend") == "connector" else f"relay backend '{r.get('backend')}'"
            raise PipelineConfigError(
                f"{source}: edge {a} -> {b} joins two hosts ('{ha or 'the coordinator'}', "
                f"'{hb or 'the coordinator'}') but its data goes through {what}, which reaches one host only: "
                "use relay: {backend: ucx} (the transfer engine) or an edge connector that crosses hosts")


def _control(v, n_procs, source) -> dict:
    c = {"transport": v} if isinstance(v, str) else dict(v) if isinstance(v, dict) else None
    if (c is None or c.get("transport", "shm") not in ("shm", "ipc", "tcp")
            or set(c) - {"transport", "host", "base_port", "curve"} or not isinstance(c.get("curve", True), bool)):
        raise PipelineConfigError(f"{source}: control is 'shm' (shared-memory rings, the default), 'ipc' (ZeroMQ "
                                  "sockets) or {transport: tcp, host: ADDRESS, base_port: PORT, curve: true}; got "
                                  + repr(v))
    c.setdefault("transport", "shm")
    if c["transport"] == "tcp":
        port = c.setdefault("base_port", 0)
        if not isinstance(port, int) or isinstance(port, bool) or not (port == 0 or 1024 <= port <= 65535 - n_procs):
            raise PipelineConfigError(f"{source}: control.base_port must be 0 (free ports, chosen at start) or a port "
                                      f"in [1024, {65535 - n_procs}]: the coordinator takes it and the {n_procs} stage "
                                      "processes the ports after it")
        c.setdefault("host", "127.0.0.1")
    return c


# The core's relay backends, and `auto`: shm within a host, ucx between hosts (the pipeline's own).
_RELAY_BACKENDS = tuple(_core.relay_backends()) + ("auto",)


def _relay_cfg(v, where) -> dict:
    cfg = {"backend": "shm", "credits": 8, "slot_size_mb": 16, "timeout_s": 30}
    if v is None:
        return cfg
    if not isinstance(v, dict):
        raise PipelineConfigError(f"{where}: a map of relay settings (backend, credits, slot_size_mb, timeout_s, ...)")
    cfg.update(v)
    if cfg["backend"] not in _RELAY_BACKENDS:
        raise PipelineConfigError(f"{where}: backend must be one of {', '.join(_RELAY_BACKENDS)} (auto: shm within a "
                                  f"host, ucx between hosts), got {cfg['backend']!r}")
    if not isinstance(cfg.get("allow_pickle", False), bool):
        raise PipelineConfigError(f"{where}: allow_pickle is true or false (unset: pickle only over shared memory)")
    try:  # the core's checks: unknown keys, ranges
        _core._Relay({k: v for k, v in cfg.items() if k != "allow_pickle"} | {"backend": "local"}, True).close()
    except _core.StagelinkError as e:
        raise PipelineConfigError(f"{where}: {e}") from None
    if cfg["backend"] == "connector" and not isinstance(cfg.get("connector"), str):
        raise PipelineConfigError(f"{where}: backend connector names its class in `connector`")
    backends = ("shm", "ucx") if cfg["backend"] == "auto" else (cfg["backend"],)
    names = [n for n in (relay_connector(dict(cfg, backend=b)) for b in backends) if n]
    for name in names:  # the connectors' own checks, now, not in a stage process at run time
        check_connector(name, cfg.get("extra"), where)
    return cfg


def check_connector(name: str, extra, where: str) -> None:
    """A connector class name and its `extra` as the connector reads them when made (each value's
    type, range and choice; a misspelt key names the key meant), without making it. Raises
    PipelineConfigError saying `where`."""
    known = sorted(_core.registered_connectors())
    if name not in known:
        import difflib
        near = difflib.get_close_matches(str(name), known, n=1, cutoff=0.8)
        raise PipelineConfigError(f"{where}: connector class {name!r} is not available" +
                                  (f" (did you mean {near[0]!r}?)" if near else f" (registered: {', '.join(known)})"))
    try:  # the connector's own option reader (MooncakeStoreConnector's are Python's: none here)
        _core.check_connector_options(name, extra if extra is not None else {})
    except _core.UnsupportedError:
        pass  # needs something this host may lack (a GPU for memory_pool_device: cuda), not a bad file
    except _core.StagelinkError as e:
        raise PipelineConfigError(f"{where}: {e}") from None


def _edges(raw, stages, relay, source) -> Dict[str, dict]:
    """Per-edge connectors, in vLLM-Omni's syntax: `edges: [{from, to, connector}]` naming an entry
    of `connectors:` or `runtime.connectors` ({name, extra}), or a spec inline. Read by the C++
    loader `load_transfer_config` uses (one reader of connector specs: references, `${VAR}`,
    its errors); only what is the pipeline's own is checked here (the edge exists, the class is
    available). An edge without a connector keeps the relay."""
    edges = raw.get("edges")
    if not edges:
        return {}
    if not isinstance(edges, list):
        raise PipelineConfigError(f"{source}: edges is a list of {{from, to, connector}}")
    sub: Dict[str, Any] = {"edges": edges}
    if raw.get("connectors") is not None:
        sub["connectors"] = raw["connectors"]
    rt = raw.get("runtime")
    if isinstance(rt, dict) and rt.get("connectors") is not None:
        sub["runtime"] = {"connectors": rt["connectors"]}
    try:  # the values as read, not text: the loader's errors name the file and the key
        cfg = _core.load_config_value(sub, source)
    except (_core.StagelinkError, TypeError, ValueError) as e:  # TypeError: a value YAML has and configs do not
        raise PipelineConfigError(str(e)) from None
    out = {}
    for i, e in enumerate(cfg["edges"]):
        src, dst = str(e["from"]), str(e["to"])
        if src not in stages or (dst not in stages[src].next and dst not in stages[src].stream_to):
            raise PipelineConfigError(f"{source}: edges[{i}]: {src} -> {dst} is not an edge of the pipeline "
                                      "(edges name a stage's `next` or `stream_to` target)")
        if e.get("defaulted"):
            continue
        c = e["connector"]
        check_connector(c["name"], c.get("extra"), f"{source}: edges[{i}]")  # as the connector would, now
        out[f"{src}->{dst}"] = dict(relay, backend="connector", connector=c["name"], extra=dict(c.get("extra") or {}))
    return out


def _check_acyclic(stages, source):
    state: Dict[str, int] = {}

    def visit(n, path):
        state[n] = 1
        for t in stages[n].next + stages[n].stream_to:
            if state.get(t) == 1:
                raise PipelineConfigError(f"{source}: the stages form a cycle: {' -> '.join(path + [n, t])}")
            if not state.get(t):
                visit(t, path + [n])
        state[n] = 2

    for n in stages:
        if not state.get(n):
            visit(n, [])


def _check_reaches(stages, entry, terminal, source):
    seen, todo = set(), [entry]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += stages[n].next + stages[n].stream_to
    unreached = [n for n in stages if n not in seen]
    if unreached:
        raise PipelineConfigError(f"{source}: stages {unreached} cannot be reached from the entry '{entry}'")
    if terminal not in seen:
        raise PipelineConfigError(f"{source}: the terminal stage '{terminal}' cannot be reached from '{entry}'")


def resolve(ref: str):
    """The object a 'module:callable' names. Raises PipelineConfigError saying what is missing."""
    mod_name, _, attr = ref.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise PipelineConfigError(f"cannot import module '{mod_name}' of '{ref}': {e}") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PipelineConfigError(f"module '{mod_name}' has no '{attr}' (from '{ref}')")
        obj = getattr(obj, part)
    return obj


def _takes_payload_and_ctx(f) -> bool:
    """Whether `f` can be called as f(payload, ctx) (True where Python cannot tell: a builtin)."""
    try:
        inspect.signature(f).bind(None, None)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def build_stage(spec: StageSpec, base_dir: str = "."):
    """(the stage object, its callable): factory(**args) when args are given or the factory is a
    class, else the factory itself. The callable is fn(payload, ctx) (or process(payload, ctx));
    an object with on_chunk(chunk, ctx) and finish(payload, ctx) is a callback stage. A factory
    'cpp:LIB:SYMBOL' is a C++ stage in a shared library (relative LIB: from `base_dir`)."""
    if spec.factory.startswith("cpp:"):
        from .cpp_stage import CppStage
        lib, _, symbol = spec.factory[4:].rpartition(":")
        st = CppStage(lib if os.path.isabs(lib) else os.path.join(base_dir, lib), symbol, spec.name)
        return st, st
    f = resolve(spec.factory)
    if spec.args is None and (inspect.isfunction(f) or inspect.ismethod(f)) and not _takes_payload_and_ctx(f):
        # A factory written as a function: taken for the stage itself it would fail only at the
        # first request ("takes from 0 to 1 positional arguments but 2 were given").
        raise PipelineConfigError(f"stage '{spec.name}': '{spec.factory}' cannot be called as a stage, "
                                  f"fn(payload, ctx): is it a factory? Add `args: {{}}` to the stage to call it "
                                  "(with its keyword arguments) and run what it returns")
    obj = f(**(spec.args or {})) if (spec.args is not None or isinstance(f, type)) else f
    if callable(getattr(obj, "on_chunk", None)):
        return obj, None
    fn = getattr(obj, "process", None) or obj
    if not callable(fn):
        raise PipelineConfigError(f"stage '{spec.name}': factory '{spec.factory}' gave {type(obj).__name__}, which "
                                  "is not callable as fn(payload, ctx)")
    return obj, fn
