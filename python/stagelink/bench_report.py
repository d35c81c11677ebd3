"""`stagelink bench all --out DIR`: every benchmark in one run, its result files, charts and
DIR/report.md (every table and ratio as printed, every chart, the machine), for a reader who was not
there. `--quick` runs each with fewer sizes, iterations and rounds (under 5 minutes on a 2-core VM)."""
from __future__ import annotations

import io
import json
import os
import platform
import socket
import sys
import time
import traceback

from ._version import __version__

# kind -> what it compares (the report's lead line for its section)
ABOUT = {
    "shm": "the shared-memory connector's put + get, C++ and Python, against memcpy and the seed's Python design",
    "mq": "the broadcast queue (1 -> N) against ZeroMQ PUB/SUB (and iceoryx2 where installed)",
    "relay": "one relay hop between processes against memcpy and raw ZeroMQ; the control plane plain and CURVE",
    "te": "the transfer engine's get against iperf3, ucx_perftest and Mooncake's transfer engine",
    "store": "the store connector over Redis against redis-benchmark and Mooncake Store",
    "pipeline": "SGLang-Omni's toy pipeline on stagelink and on SGLang-Omni's own runtime",
    "replicas": "a CPU-bound stage with 1 and 2 replicas, and the gap when a replica is killed",
    "kv": "a transformers KV cache (DynamicCache) from a prefill to a decode process against torch.multiprocessing",
    "cuda": "CUDA tensors between processes (a GPU machine only)",
}


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy for the report."""

    def __init__(self, term):
        self.term, self.buf = term, io.StringIO()

    def write(self, s):
        self.term.write(s)
        self.buf.write(s)
        return len(s)

    def flush(self):
        self.term.flush()


def _machine() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(ln.split()[1] for ln in f if ln.startswith("MemTotal")))
        mem = f", {kb / (1 << 20):.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{socket.gethostname()}: {cpus} CPUs{f' ({model})' if model else ''}{mem}, Linux {platform.release()}"


def _runners(quick: bool, rounds: int, peer: bool):
    """kind -> a function of (json_path, out) running that benchmark."""
    from .bench import run_shm
    from .bench_mq import run_mq
    from .bench_relay import run_relay
    from .bench_store import run_store
    from .bench_te import run_te
    k, m = 1 << 10, 1 << 20
    q = quick

    def pipeline(j, out):
        from .bench_pipeline import run_pipeline
        return run_pipeline(1 if q else rounds, j, peer=peer, out=out, quick=q)

    def replicas(j, out):
        from .bench_replicas import run_replicas
        return run_replicas(1 if q else rounds, j, quick=q, out=out)

    def kv(j, out):
        from .bench_kv import run_kv
        return run_kv([m, 16 * m] if q else None, j, out=out)

    def cuda(j, out):
        from .bench_cuda import run_cuda
        return run_cuda([k, m, 16 * m] if q else None, j, out=out)
    return {
        "shm": lambda j, out: run_shm([k, 64 * k, m, 16 * m] if q else None, 300 if q else 2000, j, out=out,
                                         peer=peer),
        "mq": lambda j, out: run_mq(quick=q, json_path=j, out=out, peer=peer),
        "relay": lambda j, out: run_relay([k, m, 16 * m] if q else None, 300 if q else 2000, j, out=out),
        "te": lambda j, out: run_te([4 * k, m, 16 * m] if q else None, j, out=out),
        "store": lambda j, out: run_store([4 * k, m] if q else None, j, out=out, rounds=1 if q else 3),
        "pipeline": pipeline,
        "replicas": replicas,
        "kv": kv,
        "cuda": cuda,
    }


def run_all(out_dir: str, quick: bool = False, rounds: int = 3, peer: bool = True, kinds=None,
            term=None) -> str:
    """Run every benchmark (or `kinds`), writing DIR/KIND.json, DIR/KIND-N.svg and DIR/report.md;
    returns the report's path. A benchmark that fails is reported as such and the others still run."""
    from .bench_plot import charts, machine_of
    term = term or sys.stdout
    os.makedirs(out_dir, exist_ok=True)
    runners = _runners(quick, rounds, peer)
    kinds = list(kinds or runners)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t_all = time.monotonic()
    sections = []
    for kind in kinds:
        print(f"\n== bench {kind}: {ABOUT[kind]}", file=term, flush=True)
        tee = _Tee(term)
        path = os.path.join(out_dir, f"{kind}.json")
        t0 = time.monotonic()
        error = None
        try:
            runners[kind](path, tee)
        except Exception as e:  # noqa: BLE001  one benchmark failing must not lose the others
            error = f"{type(e).__name__}: {e}"
            tee.write(traceback.format_exc())
        took = time.monotonic() - t0
        figures = []
        skipped = None
        if os.path.exists(path):
            try:
                with open(path) as f:
                    result = json.load(f)
                skipped = result.get("skipped")  # nothing to measure here (cuda without a GPU)
                for i, (title, svg) in enumerate([] if skipped else charts(result), 1):
                    name = f"{kind}-{i}.svg"
                    with open(os.path.join(out_dir, name), "w") as f:
                        f.write(svg)
                    figures.append((title, name))
                where = machine_of(result)
            except (OSError, ValueError, KeyError, TypeError) as e:
                error = error or f"its result file could not be drawn: {e}"
                where = ""
        else:
            where = ""
        if skipped and not error:
            error = f"skipped: {skipped}"
        sections.append((kind, took, tee.buf.getvalue(), figures, error, where))
    total = time.monotonic() - t_all
    lines = [f"# stagelink benchmarks{' (quick)' if quick else ''}", "",
             f"- stagelink {__version__}, Python {platform.python_version()}",
             f"- machine: {_machine()}",
             f"- started {started}; took {total / 60:.1f} min in all",
             "- every table below is as the benchmark printed it, with the peers measured in the same run and "
             "the ratios against them; each chart draws the result file beside it (`KIND.json`).", ""]
    if quick:
        lines += ["A `--quick` run: fewer sizes, iterations and rounds than a full one. Its figures show the shape, "
                  "not the settled numbers (run `stagelink bench all --out DIR` for those).", ""]
    lines += ["| benchmark | compares | took | result |", "|---|---|---|---|"]
    for kind, took, _, figures, error, _ in sections:
        state = (error if error.startswith("skipped") else "failed: " + error).splitlines()[0][:160] if error else \
            f"{len(figures)} chart{'s' if len(figures) != 1 else ''}"
        lines.append(f"| [{kind}](#{kind}) | {ABOUT[kind]} | {took:.0f} s | {state} |")
    for kind, took, text, figures, error, where in sections:
        lines += ["", f"## {kind}", "", f"{ABOUT[kind]}; {took:.0f} s" + (f"; measured on {where}" if where else "")
                  + ".", ""]
        if error:
            lines += [f"**{'Skipped' if error.startswith('skipped') else 'Failed'}**: "
                      f"{error.removeprefix('skipped: ')}", ""]
        for title, name in figures:
            lines += [f"![{title}]({name})", ""]
        lines += ["```text", text.rstrip() or "(nothing printed)", "```"]
    report = os.path.join(out_dir, "report.md")
    with open(report, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"\nreport: {report} ({total / 60:.1f} min)", file=term)
    return report
