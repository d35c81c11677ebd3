"""Where a pipeline's stage processes run: the pipeline file's `placement:` and the stage keys it
reads (`resources`, `node`, `labels`), checked when the file is read.

    placement:
      engine: ray                 # local (the default): this host and `hosts:`; ray: a Ray cluster
      address: auto               # ray.init's: auto (the cluster this host is a node of) | HOST:PORT
                                  # | ray://HOST:PORT (Ray Client) | local (a Ray of its own, started here)
      strategy: PACK              # the placement group's: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
      timeout_s: 60               # how long Ray may take to find room for the placement group
      python: /opt/venv/bin/python  # the stage processes' interpreter (default: the Ray worker's)
    stages:
      - name: talker
        resources: {CPU: 2, GPU: 1, memory: 8GiB, accel_slot: 1}  # what its process reserves
        node: 10.0.0.6            # only on the Ray node with this address
        labels: {zone: a}         # only on Ray nodes started with these labels (ray start --labels)

Each stage process is one bundle of the pipeline's placement group: the sum of its stages'
`resources` (CPU 1 where none names CPU, as Ray's own actors), so colocated stages share it. The
group reserves a bundle for every process the pipeline may run (replicas up to max_replicas), so
that `Pipeline.scale` never waits for room. The Ray launcher itself is ray_launcher.py.
"""
from __future__ import annotations

import re
from typing import Dict, Optional

from .. import _core

ENGINES = ("local", "ray")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEFAULT_TIMEOUT_S = 60.0
#: The keys this module reads, with their kind, default and meaning: the checks below refuse any
#: other, and `stagelink config reference` prints these tables.
PLACEMENT_SCHEMA = [
    ("engine", "string (local, ray)", "local", "who places the stage processes: this host and `hosts:`, or a Ray "
                                               "cluster"),
    ("address", "string", "auto", "the Ray cluster (ray.init's address): auto, HOST:PORT, ray://HOST:PORT, or local "
                                  "(a Ray of its own, started here)"),
    ("strategy", "string (" + ", ".join(STRATEGIES) + ")", "PACK", "the placement group's strategy"),
    ("timeout_s", "number", f"{DEFAULT_TIMEOUT_S:g}", "how long Ray may take to find room for the placement group"),
    ("python", "path", "", "the stage processes' interpreter on every node (default: the Ray worker's)"),
]
STAGE_SCHEMA = [
    ("resources", "map", "{CPU: 1}", "what the stage's process reserves: CPU, GPU, memory (bytes or 8GiB), custom "
                                     "resources; summed over the stages of one process"),
    ("node", "string", "", "the address of the one Ray node it may run on"),
    ("labels", "map", "", "node labels it needs (as the nodes were started: ray start --labels key=value)"),
]
PLACEMENT_KEYS = {k for k, *_ in PLACEMENT_SCHEMA}
#: Stage keys that only a placement engine reads.
STAGE_KEYS = tuple(k for k, *_ in STAGE_SCHEMA)


def reference() -> list:
    """Markdown lines: the pipeline file's `placement:` and the stage keys it reads."""
    out = ["## Pipeline placement (`placement:` and stage keys)", "",
           "A pipeline file's `placement:` (pipeline/placement.py; the rest of the file's keys are in",
           "[the pipeline guide](../pipeline.md)). Unknown keys are an error.", "",
           "| key | type | default | meaning |", "|---|---|---|---|"]
    out += [f"| `placement.{k}` | {t} | {f'`{d}`' if d else ''} | {m} |" for k, t, d, m in PLACEMENT_SCHEMA]
    out += [f"| stage `{k}` | {t} | {f'`{d}`' if d else ''} | {m} |" for k, t, d, m in STAGE_SCHEMA]
    return out + [""]

_UNITS = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]i?)?[bB]?\s*$")
_RESOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,127}$")
_LABEL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,62}$")


def _err(msg: str) -> Exception:
    from .spec import PipelineConfigError
    return PipelineConfigError(msg)


def parse_placement(v, source: str) -> dict:
    """The file's `placement:` as {"engine", "address", "strategy", "timeout_s", "python"}; {} for
    none (or engine: local)."""
    if v is None:
        return {}
    if isinstance(v, str):
        v = {"engine": v}
    if not isinstance(v, dict):
        raise _err(f"{source}: placement: a map {{engine: ray, address: auto, strategy: PACK}} or 'local'")
    bad = set(v) - PLACEMENT_KEYS
    if bad:
        raise _err(f"{source}: placement: unknown keys {sorted(bad)} (known: {sorted(PLACEMENT_KEYS)})")
    engine = v.get("engine", "local")
    if engine not in ENGINES:
        raise _err(f"{source}: placement.engine: one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "local":
        if set(v) - {"engine"}:
            raise _err(f"{source}: placement: {sorted(set(v) - {'engine'})} need engine: ray")
        return {}
    address = v.get("address", "auto")
    if not isinstance(address, str) or not address or any(c.isspace() for c in address):
        raise _err(f"{source}: placement.address: auto, HOST:PORT or ray://HOST:PORT, got {address!r}")
    strategy = v.get("strategy", "PACK")
    if not isinstance(strategy, str) or strategy.upper() not in STRATEGIES:
        raise _err(f"{source}: placement.strategy: one of {', '.join(STRATEGIES)}, got {strategy!r}")
    timeout = v.get("timeout_s", DEFAULT_TIMEOUT_S)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise _err(f"{source}: placement.timeout_s: a positive number of seconds, got {timeout!r}")
    python = v.get("python", "")
    if not isinstance(python, str):
        raise _err(f"{source}: placement.python: an interpreter's path on every node, got {python!r}")
    return {"engine": "ray", "address": address, "strategy": strategy.upper(), "timeout_s": float(timeout),
            "python": python}


def _amount(v, where: str, key: str) -> float:
    if key == "memory" and isinstance(v, str):
        m = _SIZE.match(v)
        if not m:
            raise _err(f"{where}: resources.memory: bytes, or a size such as 8GiB or 512MB, got {v!r}")
        return float(int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]))
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        raise _err(f"{where}: resources.{key}: a number >= 0, got {v!r}")
    return float(v)


def parse_stage(s: dict, where: str) -> Dict[str, object]:
    """A stage's `resources` ({name: amount}; memory may be a size string), `node` (a Ray node's
    address) and `labels` ({key: value}), checked."""
    res = s.get("resources") or {}
    if not isinstance(res, dict):
        raise _err(f"{where}: resources: a map such as {{CPU: 2, GPU: 1, memory: 8GiB}}")
    resources = {}
    for k, v in res.items():
        if not isinstance(k, str) or not _RESOURCE.match(k):
            raise _err(f"{where}: resources: {k!r} is not a resource name")
        resources[k] = _amount(v, where, k)
    node = s.get("node") or ""
    if not isinstance(node, str) or any(c.isspace() for c in node):
        raise _err(f"{where}: node: the address of a Ray node (as `ray status` lists it), got {node!r}")
    labels = s.get("labels") or {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and _LABEL.match(k) and isinstance(x, str)
                                               for k, x in labels.items()):
        raise _err(f"{where}: labels: a map of label -> value (strings), as the nodes were started with "
                   "(ray start --labels key=value)")
    return {"resources": resources, "node": node, "labels": dict(labels)}


def check(spec, source: str) -> None:
    """The placement keys against each other: stage keys only with an engine, the stages of one
    process on one node, and Ray's placement in place of `hosts:`."""
    placed = [s for s in spec.stages.values() if s.resources or s.node or s.labels]
    if not spec.placement:
        if placed:
            raise _err(f"{source}: stage '{placed[0].name}': resources, node and labels are read by a "
                       "placement engine: add placement: {engine: ray}")
        return
    if spec.hosts or any(s.host for s in spec.stages.values()):
        raise _err(f"{source}: placement: ray places every stage process itself (the coordinator learns each "
                   "node's address from Ray): drop hosts: and the stages' host:")
    if spec.control.get("transport") != "tcp":
        raise _err(f"{source}: placement: ray: control messages cross nodes, so control is tcp (the default "
                   f"under Ray), not {spec.control.get('transport')}")
    for g, names in spec.groups().items():
        st = [spec.stages[n] for n in names]
        for key in ("node", "labels"):
            vals = {repr(getattr(s, key)) for s in st if getattr(s, key)}
            if len(vals) > 1:
                raise _err(f"{source}: stages {names} share process '{g}' but name different {key} ({sorted(vals)})")


def bundle(spec, proc: str) -> Dict[str, float]:
    """The resources process `proc` reserves: its stages' summed, CPU 1 where none names CPU, and
    the `node:ADDRESS` resource Ray gives each node where a stage names one."""
    out: Dict[str, float] = {}
    node = ""
    for n in spec.processes()[proc]:
        s = spec.stages[n]
        for k, v in s.resources.items():
            out[k] = out.get(k, 0.0) + v
        node = node or s.node
    out.setdefault("CPU", 1.0)
    if node:
        out[f"node:{node}"] = 0.001
    return {k: v for k, v in out.items() if v > 0}


def labels(spec, proc: str) -> Dict[str, str]:
    for n in spec.processes()[proc]:
        if spec.stages[n].labels:
            return dict(spec.stages[n].labels)
    return {}


def describe(spec, proc: str) -> str:
    """A process's request, for `stagelink config check` and errors: 'CPU 1, GPU 1, memory 8.0 GiB'."""
    parts = []
    for k, v in bundle(spec, proc).items():
        if k.startswith("node:"):
            parts.append(f"on node {k[5:]}")
        elif k == "memory":
            parts.append(f"memory {v / (1 << 30):.1f} GiB")
        else:
            parts.append(f"{k} {v:g}")
    lab = labels(spec, proc)
    if lab:
        parts.append("labels " + ",".join(f"{k}={v}" for k, v in lab.items()))
    return ", ".join(parts)


def ray_missing() -> Optional[str]:
    """Why Ray cannot be used here (not installed), or None."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return (f"placement: ray needs the ray package, which this interpreter cannot import ({e}): "
                "pip install 'stagelink[ray]'")
    return None


class PlacementError(_core.StagelinkError):
    """The cluster could not place the pipeline (no room, no cluster, a node gone)."""
