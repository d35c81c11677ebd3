"""stagelink bench pipeline: SGLang-Omni's model-free 3-stage toy pipeline (prep -> enc -> dec;
enc streams 8 chunks to dec, then sends the payload on to dec; dec streams one message per chunk
to the client) on stagelink (`stagelink.examples.toy`: torch tensors, every stage checking its
input), with default settings and with the speed options, beside SGLang-Omni's own runtime when
it can run here (`bench_sglang_omni`), alternating, rounds in one run; medians and same-run ratios."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid

CASES = {"1MiB+8x8KiB": (1 << 20, 8 << 10), "4KiB+8x1KiB": (4 << 10, 1 << 10)}


def toy_spec(speed: bool = False, ns: str = "") -> dict:
    """The toy on stagelink: defaults only, or with the speed options (enc and dec `zero_copy`,
    dec a callback stage). `inline` is no longer one of them: `inline: auto`, the default, runs
    these short stages on their receive threads already."""
    ns = ns or "benchp" + uuid.uuid4().hex[:8]
    fast = {"zero_copy": True} if speed else {}
    return {"name": "toy", "relay": {"extra": {"namespace": ns}},
            "stages": [{"name": "prep", "factory": "stagelink.examples.toy:prep", "next": "enc"},
                       dict({"name": "enc", "factory": "stagelink.examples.toy:enc", "next": "dec",
                             "stream_to": "dec"}, **fast),
                       dict({"name": "dec", "factory": "stagelink.examples.toy:" + ("Dec" if speed else "dec"),
                             "terminal": True}, **fast)]}


def cpu_seconds(pids: dict) -> dict:
    """CPU time (user + system, every thread) of each process {name: pid}, and of this one as
    "client": where a pipeline's CPU goes, read from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"client": time.process_time()}
    for name, pid in pids.items():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return out


def machine_probe_ms() -> float:
    """How fast this machine runs Python now: a fixed loop (200,000 additions), median of 5, in ms.
    On a shared VM it moves by up to 2x from minute to minute with nothing else running (this
    2-core VM on 2026-11-29: 7.7-14.7 ms), and a pipeline's requests/s moves with it: the bench
    prints it beside every round, so a slow round shows as the machine's."""
    ts = []
    for _ in range(5):
        t, acc = time.perf_counter(), 0
        for i in range(200_000):
            acc += i
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def _measure(submit, reqs, verify, sequential: int, concurrent: int, in_flight: int, pids=None) -> dict:
    """e2e p50/p99 one request at a time, then requests/s with `in_flight` in flight; `submit(i,
    req)` returns (future, chunks list); every result is verified. With `pids` ({process: pid}),
    also the CPU each process (and this one, "client") spent per request while `in_flight` ran."""
    for i in range(10):  # warm-up
        f, ch = submit(f"w{i}", reqs[i % len(reqs)])
        verify(reqs[i % len(reqs)], f.result(60), ch)
    lat = []
    for i in range(sequential):
        req = reqs[i % len(reqs)]
        t = time.perf_counter()
        f, ch = submit(f"s{i}", req)
        res = f.result(60)
        lat.append((time.perf_counter() - t) * 1e3)
        verify(req, res, ch)
    pending, t = [], time.perf_counter()
    cpu0 = cpu_seconds(pids) if pids is not None else None
    for i in range(concurrent):
        if len(pending) >= in_flight:
            j, f, ch = pending.pop(0)
            verify(reqs[j % len(reqs)], f.result(60), ch)
        f, ch = submit(f"c{i}", reqs[i % len(reqs)])
        pending.append((i, f, ch))
    for j, f, ch in pending:
        verify(reqs[j % len(reqs)], f.result(60), ch)
    rps = concurrent / (time.perf_counter() - t)
    lat.sort()
    f = {"e2e_ms_p50": statistics.median(lat), "e2e_ms_p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
         "requests_per_s": rps}
    if cpu0 is not None:
        cpu1 = cpu_seconds(pids)
        f["cpu_us_per_request"] = {k: (cpu1[k] - cpu0[k]) / concurrent * 1e6 for k in cpu0 if k in cpu1}
    return f


def stagelink_toy(case: str, speed: bool = False, sequential: int = 200, concurrent: int = 2400,
                  in_flight: int = 8) -> dict:
    """One round of the toy on stagelink: start-up (processes importing torch included), e2e one
    at a time, requests/s with `in_flight` in flight."""
    from .examples import toy
    from .pipeline import Pipeline
    pb, cb = CASES[case]
    reqs = [toy.make_request(i, pb, 8, cb) for i in range(16)]
    t0 = time.monotonic()
    with Pipeline.from_config(toy_spec(speed)) as p:
        startup = p.startup_s

        def submit(rid, req):
            chunks: list = []
            return p.submit(rid, req, on_chunk=chunks.append), chunks
        f = _measure(submit, reqs, toy.verify, sequential, concurrent, in_flight, p.process_ids())
    f.update(startup_s=startup, total_s=time.monotonic() - t0)
    return f


# SGLang-Omni 0.1.9's runtime, installed without its dependencies (sglang itself pulls CUDA
# kernels, transformers and more) into a directory of its own, with only the packages its pipeline
# runtime imports: what a model-free pipeline needs. Versions pinned as measured.
PEER = "sglang-omni-0.1.9"
PEER_PACKAGES = [
    "sglang-omni==0.1.9", "sglang==0.5.22", "triton==3.9.0", "pyzmq==27.3.0", "msgpack==1.2.4", "msgspec==0.22.0",
    "pydantic==2.14.4", "pydantic_core==2.50.5", "annotated_types==0.8.0", "typing_inspection==0.4.5",
    "orjson==3.13.0", "psutil==7.2.2", "pybase64==1.5.1", "requests==2.34.2", "urllib3==2.8.0", "idna==3.20",
    "certifi==2026.10.19.post1", "pillow==13.0.0", "starlette==1.10.0", "anyio==4.16.0", "tqdm==4.70.1",
    "ipython==9.18.1", "traitlets==5.16.1", "aiohttp==3.14.5", "multidict==7.2.1", "attrs==26.1.0",
    "yarl==1.25.1", "propcache==0.5.4", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0",
    "huggingface_hub==2.4.0",
]


def peer_dir() -> str:
    base = os.environ.get("STAGELINK_PEERS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "stagelink", "peers")
    return os.path.join(base, PEER)


def _peer_env(path: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def setup_peer(log=sys.stderr) -> tuple:
    """(directory, None) with SGLang-Omni's runtime importable from it, installing it the first
    time (pip --no-deps --target; about 300 MB, triton most of it), or (None, why not)."""
    path = peer_dir()
    ok = os.path.join(path, ".stagelink-ok")
    if not os.path.exists(ok):
        print(f"  ... installing SGLang-Omni 0.1.9's runtime into {path} (once; pip --no-deps)", file=log)
        os.makedirs(path, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", path]
                           + PEER_PACKAGES, capture_output=True, text=True)
        if r.returncode != 0:
            return None, "pip could not install it: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    check = subprocess.run([sys.executable, "-c", "import sglang_omni.pipeline.mp_runner, "
                            "stagelink.examples.sglang_omni_toy"], env=_peer_env(path), capture_output=True,
                           text=True, timeout=600)
    if check.returncode != 0:
        return None, "its runtime does not import: " + (check.stderr.strip().splitlines() or ["?"])[-1]
    open(ok, "w").close()
    return path, None


def sglang_omni_toy(path: str, case: str, sequential: int = 100, concurrent: int = 400, in_flight: int = 8) -> dict:
    """One round of the toy on SGLang-Omni's own runtime, in a process of its own."""
    pb, cb = CASES[case]
    r = subprocess.run([sys.executable, "-m", "stagelink.examples.sglang_omni_toy", str(pb), str(cb),
                        str(sequential), str(concurrent), str(in_flight)], env=_peer_env(path),
                       capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"SGLang-Omni's toy pipeline failed (exit {r.returncode}): "
                           + "\n".join(r.stderr.strip().splitlines()[-8:]))
    return json.loads(lines[-1])


VARIANTS = ("sglang-omni", "stagelink", "stagelink-speed")


def run_pipeline(rounds: int = 3, json_path=None, peer: bool = True, out=sys.stdout, quick: bool = False) -> dict:
    """`stagelink bench pipeline`: each case, each variant, alternating, `rounds` rounds; medians and
    the ratios to SGLang-Omni measured in the same run."""
    from .bench import write_json
    print("stagelink bench pipeline: SGLang-Omni 0.1.9's model-free toy pipeline (prep -> enc -> dec; enc streams "
          "8 chunks to dec, then sends the payload on to dec; dec streams one message per chunk to the client), "
          "torch tensors, every stage checking its input, each stage its own process. Variants, alternating, in "
          "one run: SGLang-Omni's own runtime; stagelink with default settings; stagelink with the speed options "
          "(enc and dec zero_copy, dec a callback stage).\n", file=out)
    path, why = (setup_peer() if peer else (None, "not asked for (--no-peer)"))
    if path is None:
        print(f"SGLang-Omni is not measured: {why}\n", file=out)
    seq, conc = (30, 120) if quick else (200, 2400)
    pseq, pconc = (20, 80) if quick else (100, 400)
    runs: dict = {c: {v: [] for v in VARIANTS} for c in CASES}
    for rnd in range(rounds):
        for case in CASES:
            order = list(VARIANTS) if rnd % 2 == 0 else list(reversed(VARIANTS))
            for v in order:
                if v == "sglang-omni" and path is None:
                    continue
                print(f"  ... round {rnd + 1}/{rounds}: {case}, {v}", file=sys.stderr, flush=True)
                probe = machine_probe_ms()
                if v == "sglang-omni":
                    f = sglang_omni_toy(path, case, pseq, pconc)
                else:
                    f = stagelink_toy(case, v == "stagelink-speed", seq, conc)
                f["probe_ms"] = [probe, machine_probe_ms()]  # before and after the round
                runs[case][v].append(f)
    result = {"kind": "pipeline", "machine": os.uname().nodename, "cpus": os.cpu_count(), "rounds": rounds,
              "peer": PEER if path else None, "peer_missing": why, "cases": {}}
    print(f"{'case':>12} {'variant':>16} {'e2e p50':>9} {'e2e p99':>9} {'req/s, 8 in flight':>19} {'start-up':>9}"
          f" {'e2e vs peer':>12} {'req/s vs peer':>14} {'start-up vs peer':>17}", file=out)
    for case in CASES:
        med = {}
        for v in VARIANTS:
            fs = runs[case][v]
            if fs:
                med[v] = {k: statistics.median(f[k] for f in fs) for k in ("e2e_ms_p50", "e2e_ms_p99",
                                                                          "requests_per_s", "startup_s")}
                med[v]["rounds"] = fs
        peer_m = med.get("sglang-omni")
        for v, m in med.items():
            if peer_m and v != "sglang-omni":
                m["e2e_vs_peer"] = m["e2e_ms_p50"] / peer_m["e2e_ms_p50"]
                m["rps_vs_peer"] = m["requests_per_s"] / peer_m["requests_per_s"]
                m["startup_vs_peer"] = m["startup_s"] / peer_m["startup_s"]
            ratios = (f"{m['e2e_vs_peer']:>11.2f}x {m['rps_vs_peer']:>13.1f}x {m['startup_vs_peer']:>16.2f}x"
                      if "e2e_vs_peer" in m else f"{'':>12} {'':>14} {'':>17}")
            print(f"{case:>12} {v:>16} {m['e2e_ms_p50']:>6.2f} ms {m['e2e_ms_p99']:>6.2f} ms "
                  f"{m['requests_per_s']:>19.0f} {m['startup_s']:>7.2f} s {ratios}", file=out)
        result["cases"][case] = med
    print("\nCPU per request with 8 in flight (us; user + system of each process, /proc; client: the process "
          "submitting, its coordinator included):", file=out)
    procs = ("client", "prep", "enc", "dec")
    print(f"{'case':>12} {'variant':>16} " + " ".join(f"{n:>7}" for n in procs) + f" {'total':>7}", file=out)
    for case in CASES:
        for v, m in result["cases"][case].items():
            per = [f["cpu_us_per_request"] for f in m["rounds"] if "cpu_us_per_request" in f]
            if not per:
                continue
            m["cpu_us_per_request"] = cpu = {n: statistics.median(c.get(n, 0.0) for c in per) for n in procs}
            print(f"{case:>12} {v:>16} " + " ".join(f"{cpu[n]:>7.0f}" for n in procs) +
                  f" {sum(cpu.values()):>7.0f}", file=out)
    print("\nEach round's req/s, and before/after it the time of a fixed Python loop (ms; lower is faster: the "
          "machine's own speed, which moves by up to 2x on a shared VM):", file=out)
    for case in CASES:
        for v, m in result["cases"][case].items():
            print(f"{case:>12} {v:>16} " + ", ".join(
                f"{f['requests_per_s']:.0f} ({f['probe_ms'][0]:.1f}/{f['probe_ms'][1]:.1f})" for f in m["rounds"]),
                  file=out)
    print("\naims (issue 51): with default settings at least 10x SGLang-Omni's req/s and at most 0.2x its e2e p50; "
          "with the speed options at least 15x its req/s; one request at a time, e2e p50 under 1 ms; start-up at "
          "most 0.5x. Medians of the rounds; every result verified.", file=out)
    return write_json(result, json_path, out)


def main(argv=None) -> int:  # a quick look: python -m stagelink.bench_pipeline [rounds]
    rounds = int((argv or sys.argv[1:] or ["1"])[0])
    for r in range(rounds):
        for case in CASES:
            for speed in (False, True):
                f = stagelink_toy(case, speed)
                print(f"round {r} {case:>12} {'speed' if speed else 'defaults':>8}: e2e p50 {f['e2e_ms_p50']:.2f} ms "
                      f"p99 {f['e2e_ms_p99']:.2f} ms, {f['requests_per_s']:.0f} req/s, start-up {f['startup_s']:.2f} s",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
