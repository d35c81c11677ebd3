"""The stagelink command."""
from __future__ import annotations

import importlib
import argparse
import json
import os
import sys

from . import _core


# Exit statuses, the same for every command (the epilog of run's and config check's --help).
EXIT_STATUSES = ("exit status: 0 done; 1 what it checked failed (requests that failed or did not verify, a "
                 "connector that cannot be made); 2 it could not start (a file that cannot be read or does not "
                 "resolve, bad arguments); 130 Ctrl-C, 143 SIGTERM")


def _message(e: BaseException) -> str:
    """An error's text (a KeyError subclass's str() quotes it)."""
    return str(e.args[0]) if e.args else str(e)


def _load_config(path):
    """The resolved config, or None after printing the error."""
    from .config import load_transfer_config
    try:
        open(path).close()  # say why a file cannot be read (the loader only says that it cannot)
    except OSError as e:
        print(f"error: cannot read config file {path}: {e.strerror}", file=sys.stderr)
        return None
    try:
        cfg = load_transfer_config(path)
    except _core.StagelinkError as e:
        print(f"error: {_message(e)}", file=sys.stderr)
        return None
    # Each connector and its extra as the connector reads them when made (a pipeline file's are
    # checked by its loader): a misspelt key or a value of the wrong kind refused here, not met in
    # a stage process.
    from .pipeline.spec import PipelineConfigError, check_connector
    named = [(f"runtime.connectors.{ref}", spec) for ref, spec in cfg.named_connectors.items()]
    inline = [(f"edge {e.from_stage} -> {e.to_stage}", e.connector) for e in cfg.edges
              if not e.defaulted and not e.connector.ref]
    try:
        for where, spec in named + inline:
            check_connector(spec.name, spec.extra, f"{path}: {where}")
    except PipelineConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return cfg


def _is_pipeline_file(path) -> bool:
    """A `stagelink run` pipeline file (stages with factories), not a vLLM-Omni transfer config."""
    try:
        import yaml
        with open(path) as f:
            raw = yaml.safe_load(f)
    except Exception:  # noqa: BLE001  the transfer-config loader says what is wrong with it
        return False
    stages = raw.get("stages") if isinstance(raw, dict) else None
    return isinstance(stages, list) and any(isinstance(s, dict) and "factory" in s for s in stages)


def _check_stage_modules(spec) -> None:
    """That each stage of this host can be found as its process would find it (the module of a
    Python factory on the import path with the pipeline's directories in front, a C++ stage's
    library on disk), without running any stage code. Stages of other hosts are theirs to find."""
    import importlib.util
    from .pipeline import PipelineConfigError
    base = os.path.dirname(os.path.abspath(spec.source)) if spec.source != "<dict>" else os.getcwd()
    saved = list(sys.path)
    sys.path[:0] = spec.module_dirs()
    try:
        for name, st in spec.stages.items():
            if spec.stage_host(name):
                continue
            if st.factory.startswith("cpp:"):
                lib = st.factory[4:].rpartition(":")[0]
                lib = lib if os.path.isabs(lib) else os.path.join(base, lib)
                if not os.path.exists(lib):
                    raise PipelineConfigError(f"{spec.source}: stage '{name}': the library of factory "
                                              f"'{st.factory}' does not exist ({lib})")
                continue
            module = st.factory.partition(":")[0]
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise PipelineConfigError(f"{spec.source}: stage '{name}': module '{module}' of factory "
                                          f"'{st.factory}' cannot be found on this host's import path (the "
                                          f"pipeline's directories first: {', '.join(spec.module_dirs())})")
    finally:
        sys.path[:] = saved


def _check_pipeline(path, place: bool = False) -> int:
    """`stagelink config check` of a pipeline file: where each process runs and serves, and what
    carries each edge's data."""
    from .pipeline import PipelineConfigError, load_pipeline, placement
    from .relay import default_allow_pickle
    try:
        spec = load_pipeline(path)
        _check_stage_modules(spec)
    except PipelineConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    procs = spec.processes()
    initial = spec.initial_processes()
    nodes: dict = {}
    if place and spec.placement.get("engine") == "ray":
        missing = placement.ray_missing()
        if missing:
            print(f"error: {missing}", file=sys.stderr)
            return 1
        from .pipeline.ray_launcher import dry_place
        try:
            nodes = dry_place(spec)
        except Exception as e:  # noqa: BLE001  PlacementError, or Ray's own
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"pipeline {spec.name} ({spec.source}): {len(spec.stages)} stages in {len(initial)} processes, "
          f"entry {spec.entry}, terminal {spec.terminal}")
    c = spec.control
    tcp = c["transport"] == "tcp"
    port = lambda i: "a free port" if spec.free_ports else str(int(c["base_port"]) + i)  # noqa: E731
    ray = spec.placement.get("engine") == "ray"
    coord = "its node's address (from Ray)" if ray and c.get("host") == "auto" else c.get("host")
    print(f"control: {c['transport']}" + (f", the coordinator on {coord}:{port(0)}" if tcp else ""))
    if ray:
        p = spec.placement
        print(f"placement: placed by Ray ({p['address']}), strategy {p['strategy']}: one placement group, a bundle "
              f"per process below (every replica it may run); " +
              ("where Ray would place each now, asked with --place" if nodes else
               f"the nodes are chosen at start-up (within {p['timeout_s']:g} s; --place asks the cluster now), "
               "`stagelink run` shows them"))
    print("\nprocesses:")
    for i, (proc, names) in enumerate(procs.items(), 1):
        host = spec.host_of(proc)
        where = (f"host {host} ({spec.hosts[host]['address']}, launched by {' '.join(spec.hosts[host]['launch'])})"
                 if host else f"{nodes[proc]} ({placement.describe(spec, proc)})" if proc in nodes
                 else f"a Ray node with {placement.describe(spec, proc)}" if ray else "this host")
        line = f"  {proc}: {', '.join(names)} on {where}"
        st = spec.stages[names[0]]
        if len(spec.group_procs(st.process)) > 1:
            i_rep = spec.group_procs(st.process).index(proc)
            line += (f" (replica {i_rep}" + (", started by Pipeline.scale" if proc not in initial else "") +
                     (", retry" if st.retry else "") + (f", up to {st.max_restarts} restarts" if st.max_restarts
                                                         else "") + ")")
        if tcp and not ray:
            line += f", control on {spec.address_of(proc)}:{port(i)}"
        env = spec.env_of(proc)
        if env:
            line += ", env " + " ".join(f"{k}={v}" for k, v in env.items())
        print(line)
    print("\nedges:")
    for a, b, kind in spec.edges():
        r = spec.relay_for(a, b)
        what = r.get("connector") if r.get("backend") == "connector" else f"relay {r.get('backend')}"
        cross = " (between hosts)" if spec.stage_host(a) != spec.stage_host(b) else ""
        if ray and spec.edge_relays.get(f"{a}->{b}", spec.relay).get("backend") == "auto":
            what, cross = "relay auto", " (shm within a node, ucx between nodes: as Ray places them)"
        pickle = r["allow_pickle"] if "allow_pickle" in r else default_allow_pickle(r)
        how = ("pickle allowed (opted in: relay.allow_pickle)" if pickle and "allow_pickle" in r
               else "pickle allowed (same host, same user)" if pickle else "no pickle")
        print(f"  {a} -> {b} ({kind}): {what}{cross}, {how}; CUDA tensors {spec.cuda_path(a, b)}")
    return 0


def config_reference() -> str:
    """The configuration reference as Markdown, from the option schemas (`_core.option_schemas()`)."""
    from . import _core

    def bound(v):
        return "" if v is None else (str(int(v)) if float(v).is_integer() else str(v))

    out = ["# Configuration reference", "",
           "Every option a connector's `extra` and the relay's configuration take, generated from the schemas",
           "they are read through (`stagelink config reference`; `stagelink._core.option_schemas()`). A key not",
           "listed is refused where the schema is closed and otherwise named in `health()[\"ignored_extra_keys\"]`;",
           "a near miss of a known key is refused with the key it resembles. Sizes take units (`256 MiB`, `1G`).",
           "The pipeline file's own keys are in [the pipeline guide](../pipeline.md).", "",
           "## Connectors", "",
           "Each connector's descriptor (`stagelink._core.connectors()`), the one place its names and traits are",
           "written: `host_local` (its data reaches only this host's processes of this user), `side_channel` (a",
           "sender serves a side channel its receivers reach), `pickle_default` (`allow_pickle` on unless set),",
           "`device_slots` (CUDA tensors may stay on their GPU), `lookup_gets` (a get by metadata never waits),",
           "`python_made` (made by the Python layer).", "",
           "| connector | also named | traits | what it moves data through |", "|---|---|---|---|"]
    seen = set()
    for d in _core.connectors().values():
        if d["name"] in seen:
            continue
        seen.add(d["name"])
        out.append(f"| `{d['name']}` | {', '.join(f'`{a}`' for a in d['aliases'])} | "
                   f"{', '.join(sorted(d['traits']))} | {d['doc']} |")
    out += ["", "Relay backends (`stagelink._core.relay_backends()`; the pipeline adds `auto`: `shm` within a host,",
            "`ucx` between hosts):", "", "| backend | connector | within one host | |", "|---|---|---|---|"]
    for b in _core.relay_backends().values():
        out.append(f"| `{b['name']}` | {('`' + b['connector'] + '`') if b['connector'] else ''} | "
                   f"{'yes' if b['host_local'] else 'by connector' if b['name'] == 'connector' else 'no'} | {b['doc']} |")
    out.append("")
    from .pipeline import placement
    out += placement.reference()
    for s in _core.option_schemas():
        owner = s["owner"]
        where = f"Keys under `{s['prefix']}`" if s.get("prefix") else "Keys at the top level"
        out += [f"## {owner}", "", where + (" (closed: an unknown key is an error)." if s.get("closed") else "."), "",
                "| key | type | default | range | meaning |", "|---|---|---|---|---|"]
        for k in s["keys"]:
            t = k["type"] + (f" ({k['choices'].replace('|', ', ')})" if k.get("choices") else "")
            rng = ""
            if k.get("max") and k["type"] in ("size", "integer", "number"):
                rng = f"{bound(k.get('min'))} .. {bound(k.get('max'))}"
            doc = k["doc"].replace("|", "\\|").replace("[", "\\[")  # Markdown: not a table cell, not a link
            default = f"`{k['default']}`" if k["default"] else ""
            out.append(f"| `{k['name']}` | {t} | {default} | {rng} | {doc} |")
        out.append("")
    return "\n".join(out)


def _cmd_config_reference(args):
    print(config_reference(), end="")
    return 0


def metrics_reference() -> str:
    """docs/reference/metrics.md: every metric family stagelink declares, from the declarations."""
    from . import metrics
    importlib.import_module("stagelink.pipeline.observe")  # the pipeline runtime's, declared when imported
    fams = [f for f in metrics.families() if f["name"].startswith("stagelink_")]
    groups = [("connector", "Connectors (every connector, counted once in put/get/cleanup)"),
              ("shm", "The shared-memory connector"), ("te", "The transfer engine"), ("store", "The store"),
              ("relay", "The relay"), ("stage", "Pipeline stages (in each stage process)"),
              ("pipeline", "The pipeline (its coordinator)")]
    out = ["# Metrics", "",
           "Generated by `stagelink metrics reference` from the metrics' declarations (C++ `metrics::Family`",
           "constants and `stagelink.pipeline.observe`): it cannot drift from the code. How to serve and read",
           "them: [Watching a pipeline](../observability.md). Histograms are of seconds, in the buckets",
           "1 us to 30 s (`_bucket`, `_sum`, `_count`); counters are exported with the `_total` suffix.", ""]
    seen = set()
    for key, title in groups:
        rows = [f for f in fams if f["name"].split("_")[1] == key or
                (key == "connector" and f["name"].startswith("stagelink_connectors_"))]
        if not rows:
            continue
        out += [f"## {title}", "", "| metric | kind | labels | meaning |", "|---|---|---|---|"]
        for f in rows:
            seen.add(f["name"])
            labels = ", ".join(f"`{x}`" for x in f["labels"]) or "-"
            out.append(f"| `{f['name']}` | {f['kind']} | {labels} | {f['help']} |")
        out.append("")
    rest = [f for f in fams if f["name"] not in seen]
    if rest:
        out += ["## Other", "", "| metric | kind | labels | meaning |", "|---|---|---|---|"]
        out += [f"| `{f['name']}` | {f['kind']} | {', '.join(f['labels']) or '-'} | {f['help']} |" for f in rest]
        out.append("")
    out += ["A pipeline's endpoint adds `process` (the stage process, or `coordinator`) to every sample but",
            "the coordinator's own `stagelink_pipeline_*`, which name the process they are about.", ""]
    return "\n".join(out)


def _cmd_metrics_reference(args):
    print(metrics_reference(), end="")
    return 0


def _cmd_trace_show(args):
    """The requests of a trace, slowest first, and one request's spans as a tree."""
    from rich.console import Console
    from rich.table import Table

    from . import trace
    err = Console(stderr=True, soft_wrap=True)
    try:
        spans = trace.load_chrome(args.file)
    except (OSError, ValueError, KeyError) as e:
        err.print(f"error: {args.file}: not a trace stagelink wrote ({type(e).__name__}: {e})")
        return 2
    per = trace.requests_of(spans)
    if not per:
        err.print(f"error: {args.file}: no traced request in it")
        return 1

    def span_of(rid):
        req = [s for s in per[rid] if s["name"] == "request"]
        return req[0] if req else None
    total = {rid: (span_of(rid) or {"dur_us": max(s["ts_us"] + s["dur_us"] for s in ss) - ss[0]["ts_us"]})["dur_us"]
             for rid, ss in per.items()}
    order = sorted(per, key=lambda r: -total[r])
    out = Console()
    t = Table(title=f"{len(per)} traced requests, slowest first", title_justify="left")
    for col in ("request", "result", "total ms", "in stage runs ms", "queued ms", "in hops ms", "spans"):
        t.add_column(col, justify="left" if col in ("request", "result") else "right")
    for rid in order[:args.top]:
        ss = per[rid]
        runs = sum(s["dur_us"] for s in ss if s["name"] == "run")
        queued = sum(s["dur_us"] for s in ss if s["name"] == "queue")
        hops = sum(s["dur_us"] for s in ss if s["name"] in ("put", "get", "put_chunk", "get_chunk"))
        req = span_of(rid)
        t.add_row(rid, str(req["args"].get("result", "")) if req else "?", f"{total[rid] / 1e3:.3f}",
                  f"{runs / 1e3:.3f}", f"{queued / 1e3:.3f}", f"{hops / 1e3:.3f}", str(len(ss)))
    out.print(t)
    rid = args.request or order[0]
    if rid not in per:
        err.print(f"error: no request '{rid}' in {args.file}")
        return 1
    t0 = per[rid][0]["ts_us"]
    tree = Table(title=f"request {rid}: its spans (start from the first, duration)", title_justify="left")
    for col in ("span", "process", "start ms", "ms", "detail"):
        tree.add_column(col, justify="right" if col in ("start ms", "ms") else "left")
    keys = ("stage", "to", "frm", "chunk", "bytes", "path", "edge", "key", "result", "error")
    for depth, s in trace.tree_lines(per[rid]):
        detail = ", ".join(f"{k}={s['args'][k]}" for k in keys if k in s["args"])
        tree.add_row("  " * depth + s["name"], s["proc"].split(" ")[0], f"{(s['ts_us'] - t0) / 1e3:.3f}",
                     "" if s["instant"] else f"{s['dur_us'] / 1e3:.3f}", detail[:80])
    out.print(tree)
    if args.svg:
        with open(args.svg, "w", encoding="utf-8") as f:
            f.write(trace.svg_timeline(per[rid], f"request {rid}"))
        out.print(f"timeline: {args.svg}")
    return 0


def _cmd_config_check(args):
    from . import transfer_engine_port
    if _is_pipeline_file(args.file):
        return _check_pipeline(args.file, place=args.place)
    cfg = _load_config(args.file)
    if cfg is None:
        return 2
    print(f"config {cfg.source}: {len(cfg.stages)} stages, {len(cfg.edges)} edges")
    for n in cfg.notes:
        print(f"note: {n}")
    print("\nconnectors:")
    for ref, spec in cfg.named_connectors.items():
        print(f"  {ref}: {spec.name} {json.dumps(spec.extra)}")
    print("\nedges:")
    for e in cfg.edges:
        src = "(default)" if e.defaulted else (e.connector.ref or "(inline)")
        print(f"  {e.from_stage} -> {e.to_stage}: {e.connector.name} {src}")
    print("\nroles and ports:")
    for s in cfg.stages:
        for d in cfg.stage_connectors(s):
            line = f"  stage {s} {d['direction']:6} {'from' if d['direction']=='input' else 'to':4} {d['peer']}: {d['connector'].name} role={d['role']}"
            if "TransferEngine" in d["connector"].name:
                base = int(d["connector"].extra.get("zmq_port", 50051))
                frm = d["peer"] if d["direction"] == "input" else s
                try:
                    f = int(frm)
                    line += (f" ports: request_forwarding={transfer_engine_port(base, 'request_forwarding', f)}"
                             f" kv_transfer={transfer_engine_port(base, 'kv_transfer', f)}"
                             f" orchestrator={transfer_engine_port(base, 'orchestrator', f)}")
                except ValueError:
                    line += " ports: stage id is not an integer"
            print(line)
    return 0


def _cmd_shm_ls(args):
    rows = _core.shm_list(args.shm_dir)
    if not rows:
        print(f"no stagelink shared memory under {args.shm_dir} (prefix {_core.shm_user_prefix()})")
        return 0
    # size: what the segment spans; held: what the shm directory holds for it (an arena is
    # reserved as puts reach into it, so it may hold much less than its size).
    print(f"{'name':40} {'kind':22} {'owner':>8} {'alive':>5} {'size':>12} {'held':>12} {'age s':>9} "
          f"{'entries':>7} {'procs':>5}")
    for r in rows:
        print(f"{r['name']:40} {r['kind']:22} {r['owner_pid']:>8} {str(r['owner_alive']):>5} {r['size']:>12} "
              f"{r['held']:>12} {r['age_s']:>9.1f} {r['live_entries']:>7} {r['attached']:>5}")
    print(f"held in all: {sum(r['held'] for r in rows)} bytes")
    return 0


def _cmd_shm_reap(args):
    removed = _core.shm_reap(args.shm_dir)
    for r in removed:
        print(f"reclaimed {r}")
    print(f"{len(removed)} resources reclaimed")
    return 0


def _cmd_bench_plot(args):
    from .bench_plot import plot_files
    if not args.files:
        print("stagelink bench plot: name the result files to draw (written by `stagelink bench KIND --json FILE`)",
              file=sys.stderr)
        return 2
    try:
        written = plot_files(args.files, args.out or "bench-charts")
    except OSError as e:
        print(f"stagelink bench plot: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyError as e:
        print(f"stagelink bench plot: not a stagelink benchmark result (no {e} field)", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"stagelink bench plot: not a stagelink benchmark result: {e}", file=sys.stderr)
        return 2
    for w in written:
        print(w)
    return 0


def _cmd_bench(args):
    if args.kind == "plot":
        return _cmd_bench_plot(args)
    if args.files:
        print(f"stagelink bench {args.kind}: takes no files (only `bench plot` does)", file=sys.stderr)
        return 2
    if args.out or args.only:
        if args.kind != "all" or not args.out:
            print("stagelink bench: --out DIR (and --only) go with `all` (a report of the run) or `plot`", file=sys.stderr)
            return 2
        from .bench_report import ABOUT, run_all
        kinds = [k.strip() for k in args.only.split(",")] if args.only else None
        bad = [k for k in kinds or [] if k not in ABOUT]
        if bad:
            print(f"stagelink bench all --only: unknown {', '.join(bad)} (known: {', '.join(ABOUT)})", file=sys.stderr)
            return 2
        run_all(args.out, quick=args.quick, rounds=args.rounds, peer=not args.no_peer, kinds=kinds)
        return 0
    from .bench import parse_size, run_shm
    from .bench_mq import run_mq
    from .bench_relay import run_relay
    from .bench_te import run_te
    from .bench_store import run_store
    def json_for(kind):
        if not args.json or args.kind != "all":
            return args.json
        root, ext = os.path.splitext(args.json)
        return f"{root}-{kind}{ext or '.json'}"
    if args.kind in ("shm", "all"):
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
        run_shm(sizes, args.iters, json_for("shm"), peer=not args.no_peer)
    if args.kind in ("mq", "all"):
        run_mq(quick=args.quick, json_path=json_for("mq"), peer=not args.no_peer)
    if args.kind in ("relay", "all"):
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
        run_relay(sizes, args.iters, json_for("relay"))
    if args.kind in ("te", "all"):
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
        run_te(sizes, json_for("te"))
    if args.kind in ("store", "all"):
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
        run_store(sizes, json_for("store"))
    if args.kind in ("pipeline", "all"):
        from .bench_pipeline import run_pipeline
        run_pipeline(args.rounds, json_for("pipeline"), peer=not args.no_peer, quick=args.quick)
    if args.kind in ("replicas", "all"):
        from .bench_replicas import run_replicas
        run_replicas(args.rounds, json_for("replicas"), quick=args.quick)
    if args.kind in ("kv", "all"):
        from .bench_kv import run_kv
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
        run_kv(sizes, json_for("kv"))
    if args.kind in ("cuda", "all"):
        from .bench_cuda import run_cuda
        sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
        run_cuda(sizes, json_for("cuda"))
    return 0


def _pipeline_health(path) -> int:
    """`stagelink health` of a pipeline file: make each relay its edges use, here, and report it."""
    from .pipeline import PipelineConfigError, load_pipeline
    from .pipeline.worker import keyed_relay
    from .relay import Relay
    try:
        spec = load_pipeline(path)
    except PipelineConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"pipeline {spec.name} ({path}): the relays of its edges, made on this host")
    groups: dict = {}
    for a, b, _ in spec.edges():
        cfg = spec.relay_for(a, b)
        groups.setdefault(json.dumps(cfg, sort_keys=True), (cfg, []))[1].append(f"{a} -> {b}")
    bad = 0
    for cfg, edges in groups.values():
        try:
            # With a side-channel key, as the pipeline gives its transfer-engine relays one.
            r = Relay(keyed_relay(cfg, _core.curve_keypair()[1]))
            try:
                h = r.health()
                print(f"{', '.join(edges)}: relay {cfg.get('backend', 'shm')}: ok "
                      f"({h.get('credits', '?')} credits per edge)")
            finally:
                r.close()
        except _core.StagelinkError as ex:
            bad += 1
            print(f"{', '.join(edges)}: relay {cfg.get('backend', 'shm')}: FAILED: {ex}")
    return 1 if bad else 0


def _cmd_health(args):
    from .connector import create_connector
    if _is_pipeline_file(args.file):  # a `stagelink run` file: its relays, not vLLM-Omni connectors
        return _pipeline_health(args.file)
    cfg = _load_config(args.file)
    if cfg is None:
        return 2
    seen, bad = set(), 0
    for e in cfg.edges:
        key = (e.connector.name, json.dumps(e.connector.extra, sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        try:
            with create_connector(e.connector.name, e.connector.extra) as c:
                h = c.health()
                print(f"{e.from_stage} -> {e.to_stage} {e.connector.name}: {h.get('status')}")
        except _core.StagelinkError as ex:
            bad += 1
            print(f"{e.from_stage} -> {e.to_stage} {e.connector.name}: FAILED: {ex}")
    return 1 if bad else 0


def _cmd_examples(args):
    from . import examples
    if args.name:
        path = examples.path_of(args.name)
        if path is None:
            print(f"error: no example '{args.name}' (stagelink examples lists them: "
                  f"{', '.join(examples.available())})", file=sys.stderr)
            return 2
        with open(path) as f:
            sys.stdout.write(f.read())
        return 0
    from rich.console import Console
    from rich.table import Table
    t = Table(title="example pipelines (stagelink run NAME; stagelink examples NAME > mine.yaml to edit one)",
              title_justify="left")
    t.add_column("name")
    t.add_column("what it is")
    for name, path in examples.available().items():
        t.add_row(name, examples.describe(path))
    Console().print(t)
    return 0


def _cmd_run(args):
    from .pipeline.worker import raise_nofile
    from .run import run
    raise_nofile()  # the coordinator's process is ours here, as the stages' are
    if not os.path.exists(args.pipeline):  # `stagelink run omni`: an example that came with the package
        from . import examples
        args.pipeline = examples.path_of(args.pipeline) or args.pipeline
    return run(args.pipeline, args.requests, args.concurrency, args.json, metrics_port=args.metrics_port,
               metrics_host=args.metrics_host, metrics_linger_s=args.metrics_linger, trace=args.trace,
               trace_sample=args.trace_sample, otel=args.otel)


def _cmd_demo(args):
    from .demo import main as demo_main
    return demo_main(args.sizes)


class _CmakeDir(argparse.Action):
    """`stagelink --cmake-dir`: where find_package(stagelink) looks (stagelink_DIR), as
    `pybind11 --cmakedir` does."""

    def __call__(self, parser, namespace, values, option_string=None):
        from . import get_cmake_dir
        try:
            print(get_cmake_dir())
        except FileNotFoundError as e:
            parser.exit(1, f"stagelink: {e}\n")
        parser.exit(0)


def main(argv=None):
    p = argparse.ArgumentParser(prog="stagelink", description="Move data between the stages of inference pipelines.")
    from . import __version__
    p.add_argument("--version", action="version", version=f"stagelink {__version__}")
    p.add_argument("--cmake-dir", action=_CmakeDir, nargs=0,
                   help="print the directory of the CMake package (C++ headers and library) and exit")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    b = sub.add_parser(
        "bench", help="measure a transport against its peers in the same run",
        description="Measure a transport and, in the same run, the peers it is judged against; medians, "
                    "and ratios to the peers (this machine's timings may drift: compare within a run).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="what each measures, and its peers:\n"
               "  shm    shared-memory connector, C++ and Python put+get by size and payload kind;\n"
               "         peers: memcpy, the seed's Python design, the pickle path, vLLM-Omni's own\n"
               "         SharedMemoryConnector (from build/frameworks/site or STAGELINK_FRAMEWORKS_SITE)\n"
               "  mq     broadcast MessageQueue latency, throughput, bandwidth, idle CPU; peers: ZeroMQ\n"
               "         PUB/SUB, iceoryx2 when installed, vLLM's own shm_broadcast.MessageQueue (as above)\n"
               "  relay  a relay hop between processes, control messages over tcp with and without\n"
               "         CURVE; peers: memcpy, ZeroMQ\n"
               "  te     transfer engine over loopback, and across two network namespaces when root;\n"
               "         peers: ucx_perftest, iperf3, Mooncake TE when installed\n"
               "  store  store connector with a redis-server it starts (across namespaces when root);\n"
               "         peers: redis-benchmark, Mooncake Store when installed\n"
               "  pipeline  SGLang-Omni's toy pipeline on stagelink (defaults, speed options) and on\n"
               "         SGLang-Omni 0.1.9's own runtime (installed once into ~/.cache/stagelink/peers),\n"
               "         alternating, --rounds rounds; peers: SGLang-Omni\n"
               "  replicas  stage replicas: req/s of a CPU-bound stage with 1 and 2 replicas, and the\n"
               "         gap in completions when one is SIGKILLed mid-run (retry: true; none lost)\n"
               "  kv     a transformers DynamicCache (bf16, 32 layers) from a prefill to a decode process,\n"
               "         copying and zero-copy get; peers: torch.multiprocessing's tensor passing, memcpy\n"
               "  cuda   CUDA tensors between processes (says why and stops without a GPU); peers:\n"
               "         pinned/pageable/device copies, CUDA IPC, the seed's design\n"
               "  all    each of the above in turn; with --out DIR: DIR/report.md (every table, ratio and\n"
               "         chart of the run, the machine), the result files and charts (--quick: < 5 min)\n"
               "  plot   draw result files as SVG charts: stagelink bench plot FILE.json... [--out DIR]")
    b.add_argument("kind", choices=["shm", "mq", "relay", "te", "store", "pipeline", "replicas", "kv", "cuda", "all",
                                    "plot"],
                   help="what to measure (below), or plot to draw results")
    b.add_argument("files", nargs="*", metavar="FILE", help="plot: result files written with --json")
    b.add_argument("--out", metavar="DIR",
                   help="plot: the folder the SVG charts go to (default bench-charts); all: the folder of the "
                        "run's report.md, result files and charts")
    b.add_argument("--only", metavar="KINDS", help="all: these benchmarks only, comma-separated (e.g. shm,relay)")
    b.add_argument("--sizes", help="comma-separated sizes, e.g. 1KiB,64KiB,1MiB,16MiB,186MiB")
    b.add_argument("--iters", type=int, default=2000, help="iterations for small sizes (default 2000)")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON (all: FILE-shm.json, FILE-mq.json, FILE-relay.json, FILE-te.json, FILE-store.json, FILE-pipeline.json, FILE-replicas.json, FILE-cuda.json)")
    b.add_argument("--quick", action="store_true", help="mq: fewer messages and shorter idle gaps; pipeline: fewer requests; all --out: fewer sizes, iterations and rounds everywhere (a smoke run)")
    b.add_argument("--rounds", type=int, default=3, help="pipeline, replicas: rounds of every variant, alternating (default 3)")
    b.add_argument("--no-peer", action="store_true", help="pipeline: stagelink only, without installing or running SGLang-Omni; "
                   "shm, mq: without vLLM-Omni's connector, vLLM's queue")
    b.set_defaults(fn=_cmd_bench)

    c = sub.add_parser("config", help="configuration tools")
    csub = c.add_subparsers(dest="sub", required=True)
    cc = csub.add_parser("check", help="resolve a config; print edges, connectors, roles and ports",
                         description="Load a vLLM-Omni transfer config (stage_args or stages, connectors, edges, "
                                     "base_config overlays, ${VAR} expansion) as the runtime would, and print "
                                     "every edge's connector, each stage's role and the transfer-engine ports. "
                                     "Exit status 2 with the key and file named when it cannot be read or does not resolve. "
                                     "A `stagelink run` pipeline file is checked as `stagelink run` would: "
                                     "where each process runs and serves, and what carries each edge. "
                                     "Example: stagelink config check stages.yaml")
    cc.epilog = EXIT_STATUSES
    cc.add_argument("file", help="the YAML (or JSON) config")
    cc.add_argument("--place", action="store_true",
                    help="a pipeline file placed by Ray: ask the cluster where each process would run now (a "
                         "placement group is made, read and removed; nothing starts). Exit 1 if it cannot place it")
    cc.set_defaults(fn=_cmd_config_check)
    cr = csub.add_parser("reference", help="print every connector's and the relay's options as Markdown",
                         description="Print the configuration reference (docs/reference/configuration.md) from "
                                     "the schemas the options are read through: every key with its type, default, "
                                     "range and meaning. It cannot drift from the code: it is the code's.")
    cr.set_defaults(fn=_cmd_config_reference)

    mt = sub.add_parser("metrics", help="metrics tools")
    msub = mt.add_subparsers(dest="sub", required=True)
    mr = msub.add_parser("reference", help="print every metric stagelink exports as Markdown",
                         description="Print the metrics reference (docs/reference/metrics.md) from the metrics' "
                                     "declarations: name, kind, labels and meaning of each.")
    mr.set_defaults(fn=_cmd_metrics_reference)

    tr = sub.add_parser("trace", help="read a trace written with --trace")
    tsub = tr.add_subparsers(dest="sub", required=True)
    ts = tsub.add_parser("show", help="the requests of a trace, slowest first, and one request's spans",
                         description="Read a trace that `stagelink run --trace FILE` or Pipeline(trace=FILE) wrote "
                                     "and print its requests, slowest first (time in stage runs, queued, in hops), "
                                     "then the spans of one request (the slowest, or --request) as a tree with their "
                                     "start and duration. For the timeline itself open FILE in "
                                     "https://ui.perfetto.dev. Example: stagelink trace show run.trace.json --top 5")
    ts.add_argument("file", help="the trace (Chrome JSON)")
    ts.add_argument("--request", metavar="ID", help="the request whose spans to show (default: the slowest)")
    ts.add_argument("--top", type=int, default=10, metavar="N", help="requests in the table (default 10)")
    ts.add_argument("--svg", metavar="OUT", help="also draw that request's timeline into OUT (an SVG)")
    ts.set_defaults(fn=_cmd_trace_show)

    s = sub.add_parser("shm", help="list and reclaim shared-memory resources")
    ssub = s.add_subparsers(dest="sub", required=True)
    for name, fn, hlp, desc in (
            ("ls", _cmd_shm_ls, "list segments with owner, size, bytes held in the shm directory and age",
             "List stagelink's shared memory of this user (sl.<uid>.*: connector arenas and directories, "
             "queue rings, control rings): each segment with its owner process, whether that process is alive, "
             "its size, the bytes it holds and its age. Example: stagelink shm ls"),
            ("reap", _cmd_shm_reap, "reclaim what dead processes left",
             "Reclaim what processes that died left in shared memory: their segments and directory entries "
             "(a dead reader's unfinished read is given back for a retry), directories nobody is attached to, "
             "and the CUDA driver's file of a killed process that used CUDA IPC. Live processes' memory is "
             "never touched. Prints what it removed. Example: stagelink shm reap")):
        sp = ssub.add_parser(name, help=hlp, description=desc)
        sp.add_argument("--shm-dir", default="/dev/shm", help="where the segments live (default /dev/shm)")
        sp.set_defaults(fn=fn)

    h = sub.add_parser("health", help="create every connector a config names and report",
                       description="Create each distinct connector the config's edges use (a network connector "
                                   "dials its peers or server here), print its health, close it. Exit status 1 "
                                   "when any cannot be made, with the reason. Example: stagelink health stages.yaml")
    h.add_argument("file", help="the YAML (or JSON) config")
    h.set_defaults(fn=_cmd_health)

    r = sub.add_parser("run", help="run a pipeline from YAML: progress, per-edge figures, verified results",
                       description="Start every stage process of PIPELINE (a YAML file, see docs/pipeline.md), "
                                   "send it N requests with K in flight, verify each result with the file's "
                                   "client.verify, then print per-edge bytes and hop latency (p50, p99), "
                                   "throughput, end-to-end latency and time to first chunk. Stage processes "
                                   "and shared memory are gone when it returns, also after Ctrl-C. Stages "
                                   "with a `host` run on that host of the file's `hosts:`, started over ssh "
                                   "(examples/omni_two_hosts.yaml). "
                                   "Example: stagelink run omni --requests 32 (an example that came with "
                                   "stagelink; examples/omni_pipeline.yaml in a checkout)",
                       epilog=EXIT_STATUSES)
    r.add_argument("pipeline", help="the pipeline file, or the name of an example that came with stagelink "
                                    "(stagelink examples lists them: omni, toy, fanin, replicas)")
    r.add_argument("--requests", type=int, default=16, metavar="N", help="requests to send (default 16)")
    r.add_argument("--concurrency", type=int, default=4, metavar="K", help="requests in flight (default 4)")
    r.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    r.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve the pipeline's Prometheus metrics (every process's, one scrape target) at "
                        "http://HOST:PORT/metrics while it runs (0: a free port, printed)")
    r.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address --metrics-port binds (default 127.0.0.1; 0.0.0.0 for a Prometheus on "
                        "another host)")
    r.add_argument("--metrics-linger", type=float, default=0.0, metavar="S",
                   help="keep the pipeline and its metrics up S seconds after the last request (a last scrape)")
    r.add_argument("--trace", metavar="FILE",
                   help="write a trace of the requests (every stage's run, each hop's put and get, stream chunks, "
                        "credit waits, aborts; every process on one timeline) to FILE, a Chrome JSON trace: open "
                        "it in https://ui.perfetto.dev or chrome://tracing")
    r.add_argument("--trace-sample", type=float, metavar="R",
                   help="the share of requests traced, 0..1 (default: the file's settings.trace_sample, else 1)")
    r.add_argument("--otel", action="store_true",
                   help="also export the spans over OTLP/HTTP (OTEL_EXPORTER_OTLP_ENDPOINT; needs "
                        "pip install 'stagelink[otel]')")
    r.set_defaults(fn=_cmd_run)

    ex = sub.add_parser("examples", help="the example pipelines that came with stagelink",
                        description="List the example pipelines installed with stagelink (run one with "
                                    "`stagelink run NAME`, no checkout needed), or print one's pipeline file "
                                    "to start your own from: stagelink examples omni > mine.yaml")
    ex.add_argument("name", nargs="?", help="print this example's pipeline file")
    ex.set_defaults(fn=_cmd_examples)

    d = sub.add_parser("demo", help="producer and consumer processes over the shared-memory connector",
                       description="Start a producer process ('thinker') and a consumer process ('talker') that "
                                   "pass one payload of each size over the shared-memory connector, verify each "
                                   "by checksum, and print per payload its frame bytes, whether it travelled "
                                   "inline or through the arena, put and get times and get bandwidth, then "
                                   "whether shared memory was left behind. Example: stagelink demo --sizes 1KiB,16MiB")
    d.add_argument("--sizes", default="0,1,1KiB,64KiB,1MiB,16MiB,64MiB",
                   help="payload sizes, comma-separated, with units (default 0,1,1KiB,64KiB,1MiB,16MiB,64MiB)")
    d.set_defaults(fn=_cmd_demo)

    args = p.parse_args(argv)
    if args.cmd is None:  # a bare `stagelink`: what it can do, not an error
        p.print_help()
        return 0
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C while loading or starting: a line, not a traceback
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
