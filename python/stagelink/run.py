"""`stagelink run PIPELINE.yaml`: start a pipeline, push requests through it with a live progress
bar, verify every result, and report per-edge bytes and hop latency, throughput, end-to-end
latency and time to first chunk."""
from __future__ import annotations

import json
import signal
import statistics
import sys
import threading
import time
from typing import List, Optional

from . import _core


def _pct(xs: List[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run(path: str, requests: int = 16, concurrency: int = 4, json_path: Optional[str] = None,
        quiet: bool = False, metrics_port: Optional[int] = None, metrics_host: str = "127.0.0.1",
        metrics_linger_s: float = 0.0, trace: Optional[str] = None, trace_sample: Optional[float] = None,
        otel: bool = False) -> int:
    from rich.console import Console

    from .pipeline import PipelineConfigError, load_pipeline
    from .pipeline.spec import resolve

    console = Console(stderr=False, quiet=quiet)
    err = Console(stderr=True, soft_wrap=True)  # an error line stays one line (paths, grep)
    if requests < 1 or concurrency < 1:
        err.print("error: --requests and --concurrency must be at least 1")
        return 2
    try:
        spec = load_pipeline(path)
        # The client's functions import as the stages' factories do (the same directories first).
        sys.path[:0] = [d for d in spec.module_dirs() if d not in sys.path]
        make = resolve(spec.client["request"]) if "request" in spec.client else (lambda i, **_: {"request": i})
        verify = resolve(spec.client["verify"]) if "verify" in spec.client else None
    except PipelineConfigError as e:
        err.print(f"error: {e}")
        return 2
    args = dict(spec.client.get("args") or {})
    procs = spec.processes()
    layout = ", ".join(f"{name}: {'+'.join(st)}" + (f" on {spec.host_of(name)}" if spec.host_of(name) else "")
                       for name, st in procs.items())
    console.print(f"[bold]{spec.name}[/]: {len(spec.stages)} stages in {len(procs)} processes ({layout})")
    t_start = time.monotonic()
    # SIGTERM (systemd, `docker stop`, kill) stops the run as Ctrl-C does: the stages are shut
    # down and their shared memory freed; the exit status is then 143 (128 + SIGTERM).
    terminated = []

    def on_term(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt
    old_term = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
    try:
        obs = {"metrics_port": metrics_port, "metrics_host": metrics_host, "linger_s": metrics_linger_s,
               "trace": trace, "trace_sample": trace_sample, "otel": otel}
        return _run(console, err, spec, make, verify, args, requests, concurrency, json_path, t_start, terminated,
                    obs)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)


def _run(console, err, spec, make, verify, args, requests, concurrency, json_path, t_start, terminated,
         obs) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .pipeline import Pipeline
    try:
        p = Pipeline(spec, metrics_port=obs["metrics_port"], metrics_host=obs["metrics_host"], trace=obs["trace"],
                     trace_sample=obs["trace_sample"], otel=obs["otel"])
    except _core.StagelinkError as e:
        if getattr(e, "config_error", None):  # the file is at fault: one line, as for any bad file
            err.print(f"error: {spec.source or 'the pipeline'}: {e.config_error}", markup=False)
            return 2
        err.print(f"error: the pipeline did not start: {e}", markup=False)
        return 1
    except OSError as e:  # the metrics port (taken, an address not of this host), the trace file
        what = (f"--trace {obs['trace']}" if obs["trace"] and getattr(e, "filename", None) == obs["trace"]
                else f"--metrics-port {obs['metrics_port']} on {obs['metrics_host']}")
        err.print(f"error: {what}: {e}")
        return 1
    except KeyboardInterrupt:  # what started was stopped by Pipeline's own roll-back
        err.print(("terminated (SIGTERM)" if terminated else "interrupted") + " during start-up")
        return 128 + signal.SIGTERM if terminated else 130
    console.print(f"started in {p.startup_s * 1000:.0f} ms")
    if p.metrics_server is not None:
        console.print(f"metrics: {p.metrics_server.url}", highlight=False)
    if obs["trace"]:
        console.print(f"trace: {obs['trace']} (sampling {p.trace_sample:g}; open it in https://ui.perfetto.dev)",
                      highlight=False)
    if spec.placement or spec.hosts:  # where each went (a placement engine decides it at start)
        console.print("placed: " + ", ".join(f"{proc} on {where}" for proc, where in p.placement().items()
                                             if proc in p.spec.initial_processes()), highlight=False)
    paths: dict = {}  # how CUDA tensors cross each data and stream edge (docs/cuda.md)
    for a, b, kind in p.spec.edges():
        if kind in ("data", "stream"):
            edges = paths.setdefault(p.spec.cuda_path(a, b), [])
            if f"{a}->{b}" not in edges:  # a data and a stream edge of one pair: one path
                edges.append(f"{a}->{b}")
    # Only where CUDA tensors can be: this host has a GPU, or stages run on other hosts.
    if paths and (_core.cuda_status().get("available") or p.spec.hosts or p.spec.placement):
        console.print("CUDA tensors: " + "; ".join(f"{', '.join(e)}: {how}" for how, e in paths.items()),
                      highlight=False)
    lock = threading.Lock()
    failures: List[str] = []
    done = [0]
    chunk_bytes = [0]
    interrupted = False
    wall = None  # the requests' wall time (not the metrics' linger)
    t0 = time.monotonic()
    try:
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console,
                      transient=False) as bar:
            task = bar.add_task("requests", total=requests, rate="")
            sem = threading.Semaphore(concurrency)
            all_done = threading.Event()

            def finished(i, req, chunks, fut):
                try:
                    res = fut.result()
                    if verify is not None:
                        verify(req, res, chunks)
                except AssertionError as e:
                    with lock:
                        failures.append(f"request {i}: wrong result: {e}")
                except BaseException as e:  # noqa: BLE001  reported below
                    with lock:
                        failures.append(f"request {i}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                with lock:
                    done[0] += 1
                    n = done[0]
                el = time.monotonic() - t0
                bar.update(task, advance=1, rate=f"{n / el:.1f} req/s" if el > 0 else "")
                sem.release()
                if n == requests:
                    all_done.set()

            for i in range(requests):
                while not sem.acquire(timeout=0.2):
                    pass
                req = make(i, **args)
                chunks: list = []

                def on_chunk(c, chunks=chunks):
                    chunks.append(c)
                    with lock:
                        chunk_bytes[0] += _nbytes(c)

                try:
                    fut = p.submit(f"run-{i}", req, on_chunk=on_chunk)
                except _core.StagelinkError as e:
                    failures.append(f"request {i}: not submitted: {e}")
                    done[0] += 1
                    sem.release()
                    if done[0] == requests:
                        all_done.set()
                    continue
                fut.add_done_callback(lambda f, i=i, req=req, chunks=chunks: finished(i, req, chunks, f))
            while not all_done.wait(0.2):
                pass
            wall = time.monotonic() - t0
            if obs["linger_s"] > 0 and p.metrics_server is not None:
                console.print(f"metrics stay up {obs['linger_s']:g} s at {p.metrics_server.url}", highlight=False)
                time.sleep(obs["linger_s"])
    except KeyboardInterrupt:
        interrupted = True
        err.print(("terminated (SIGTERM)" if terminated else "interrupted") + ": stopping the stages")
    finally:
        if wall is None or interrupted:
            wall = time.monotonic() - t0
        p.close()
    stats = p.stats()
    report = _report(p.spec, p, stats, wall, requests, failures, chunk_bytes[0], time.monotonic() - t_start)
    _print_report(console, report)
    if failures:
        for f in failures[:10]:
            err.print(f"[red]FAIL[/] {f}")
        if len(failures) > 10:
            err.print(f"... and {len(failures) - 10} more")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {json_path}")
    if interrupted:
        return 128 + signal.SIGTERM if terminated else 130
    ok = not failures and report["completed"] == requests
    console.print("[green]all results verified end to end[/]" if ok and verify else
                  "[green]all requests completed[/]" if ok else f"[red]{len(failures)} requests failed[/]")
    return 0 if ok else 1


def _nbytes(obj) -> int:
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    return 0


def _report(spec, p, stats, wall, requests, failures, chunk_bytes, total_s) -> dict:
    edges = []
    per_proc = sorted(stats.items()) + [("coordinator", {"edges": p.coordinator_edges()})]
    for proc, s in per_proc:
        for name, e in sorted(s.get("edges", {}).items()):
            lat = [x / 1e3 for x in e["lat_ns"]]
            # Per receiving replica where a stage has several (router.py): "front->work (work.1)".
            dst = name.split("->")[-1]
            label = name if dst not in spec.stages or spec.stages[dst].process == proc else f"{name} ({proc})"
            src = name.split("->")[0]
            r = spec.relay_for(src, dst) if src in spec.stages or src == "coordinator" else {}
            via = r.get("connector") if r.get("backend") == "connector" else r.get("backend")
            edges.append({"edge": label, "process": proc, "via": via, "messages": e["messages"], "bytes": e["bytes"],
                          "hop_us_p50": statistics.median(lat) if lat else None,
                          "hop_us_p99": _pct(lat, 0.99) if lat else None,
                          "gb_per_s": e["bytes"] / wall / 1e9 if wall > 0 else None})
    e2e = [c["e2e_s"] * 1e3 for c in p.completed]  # the last settings.completed_window requests
    ttfc = [c["ttfc_s"] * 1e3 for c in p.completed if c["ttfc_s"] is not None]
    return {"pipeline": spec.name, "source": spec.source, "requests": requests, "completed": p.completed_count,
            "failed": len(failures), "startup_ms": p.startup_s * 1e3, "wall_s": wall,
            "requests_per_s": p.completed_count / wall if wall > 0 else None,
            "e2e_ms_p50": statistics.median(e2e) if e2e else None, "e2e_ms_p99": _pct(e2e, 0.99) if e2e else None,
            "ttfc_ms_p50": statistics.median(ttfc) if ttfc else None,
            "ttfc_ms_p99": _pct(ttfc, 0.99) if ttfc else None,
            "streamed_to_client_bytes": chunk_bytes, "edges": edges,
            "stages": {(n if spec.stages[n].process == proc else f"{n} ({proc})"): v
                       for proc, s in stats.items() for n, v in s.get("stages", {}).items() if n in spec.stages},
            "replicas": p.replicas() if spec.replicated else {},
            "placement": p.placement(),
            "failures": failures[:100], "total_s": total_s}


def _print_report(console, r):
    from rich.table import Table
    t = Table(title="edges (data plane)", title_justify="left")
    for col in ("edge", "via", "messages", "bytes", "hop p50", "hop p99", "GB/s"):
        t.add_column(col, justify="left" if col in ("edge", "via") else "right")
    for e in r["edges"]:
        t.add_row(e["edge"], e.get("via") or "-", str(e["messages"]), _fmt_bytes(e["bytes"]),
                  f"{e['hop_us_p50']:.0f} us" if e["hop_us_p50"] is not None else "-",
                  f"{e['hop_us_p99']:.0f} us" if e["hop_us_p99"] is not None else "-",
                  f"{e['gb_per_s']:.2f}" if e["gb_per_s"] else "-")
    console.print(t)
    s = Table(title="requests", title_justify="left")
    for col in ("done", "failed", "req/s", "e2e p50", "e2e p99", "ttfc p50", "ttfc p99", "startup"):
        s.add_column(col, justify="right")

    def ms(x):
        return f"{x:.1f} ms" if x is not None else "-"
    s.add_row(f"{r['completed']}/{r['requests']}", str(r["failed"]),
              f"{r['requests_per_s']:.1f}" if r["requests_per_s"] else "-", ms(r["e2e_ms_p50"]), ms(r["e2e_ms_p99"]),
              ms(r["ttfc_ms_p50"]), ms(r["ttfc_ms_p99"]), ms(r["startup_ms"]))
    console.print(s)
    if r.get("replicas"):
        t = Table(title="replicas", title_justify="left")
        for col in ("process", "state", "restarts", "died"):
            t.add_column(col, justify="left" if col in ("process", "died") else "right")
        for proc, v in r["replicas"].items():
            t.add_row(proc, v["state"], str(v["restarts"]), v["died"] or "")
        console.print(t)
