"""`stagelink bench shm`'s peer: vLLM-Omni's own ``SharedMemoryConnector`` (its code, unmodified)
against stagelink's, put+get in one process, by payload size and kind, in the same run.

vLLM-Omni's connector imports vLLM (and torch), so it runs in a process of its own with vLLM-Omni
on its path: ``STAGELINK_FRAMEWORKS_SITE``, else ``build/frameworks/site`` (where
``./scripts/setup`` installs vLLM-Omni 0.30.0 for the plugin tests). Both connectors run in that
process, round by round alternately, each round a median of its put+gets.

A copying put+get moves the bytes twice (into shared memory, then out into the caller's array);
``2 x memcpy`` is two copies of the same bytes measured in the same round (``np.copyto`` into a
reused array), the floor of any copying put+get, and ``omni / floor`` the most any copying
connector can lead vLLM-Omni's by at that size. ``zero_copy`` is stagelink's get as a read-only
view (one copy in all).
"""
import json
import os
import stat
import statistics
import subprocess
import sys
import time

import numpy as np

KINDS = ("numpy", "torch", "dict", "bytes")


def site() -> tuple:
    """(the directory the frameworks are imported from, None), or (None, why not).

    ``STAGELINK_FRAMEWORKS_SITE`` is the caller's own choice. The default, ``build/frameworks/site``
    under the current directory, is code this command would run: taken only where that directory
    and those above it up to the current one belong to this user (or root) and no one else may
    write them, so that a bench run from a shared directory (/tmp) never imports what another
    user planted there."""
    named = os.environ.get("STAGELINK_FRAMEWORKS_SITE")
    if named:
        return named, None
    cwd = os.getcwd()
    path = os.path.join(cwd, "build", "frameworks", "site")
    for d in (os.path.join(cwd, "build"), os.path.join(cwd, "build", "frameworks"), path):
        try:
            st = os.lstat(d)
        except FileNotFoundError:
            return None, (f"vLLM-Omni/vLLM not found in {path} (./scripts/setup installs them there; "
                          "STAGELINK_FRAMEWORKS_SITE names another)")
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            return None, (f"{d} is not a directory of this user's that only it may write: not importing "
                          "from it (STAGELINK_FRAMEWORKS_SITE names a site to use)")
    return path, None


def _objects(size):
    n = max(1, size // 4)
    out = {"numpy": np.random.default_rng(size).random(n, dtype=np.float32), "bytes": os.urandom(size)}
    try:
        import torch
    except ImportError:
        return out
    out["torch"] = torch.from_numpy(out["numpy"].copy())
    out["dict"] = {"hidden": torch.from_numpy(out["numpy"].copy()), "ids": list(range(300))}
    return out


def _median_put_get(c, obj, n, tag, **get_kw):
    ts = []
    for i in range(n):
        key = f"bo{tag}_{os.getpid()}_{i}"
        t0 = time.perf_counter()
        ok, _, meta = c.put("0", "1", key, obj)
        got = c.get("0", "1", key, meta, **get_kw)
        t1 = time.perf_counter()
        if not ok or got is None:
            raise RuntimeError(f"put+get of {key} failed")
        del got
        ts.append((t1 - t0) * 1e6)
    return statistics.median(ts)


def _copies(a, n):
    dst = np.empty_like(a)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        np.copyto(dst, a)
        np.copyto(dst, a)
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def measure(sizes, rounds):
    """In the peer's process: {size: {kind: {omni, stagelink, zero_copy, floor: [per round]}}}."""
    import logging
    logging.disable(logging.CRITICAL)
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector as Omni

    import stagelink
    omni = Omni({"stage_id": 0})
    sl = stagelink.SharedMemoryConnector({"stage_id": 0, "namespace": f"bo{os.getpid()}",
                                          "arena_bytes": max(64 << 20, 3 * max(sizes))})
    res = {}
    try:
        for size in sizes:
            objs = _objects(size)
            n = 200 if size <= 64 << 10 else (40 if size <= 1 << 20 else 8)
            for kind in KINDS:
                if kind not in objs:
                    continue
                obj, d = objs[kind], {"omni": [], "stagelink": [], "zero_copy": [], "floor": []}
                _median_put_get(sl, obj, 3, "w")  # the arena's pages, the plans: warm
                _median_put_get(omni, obj, 1, "w")
                for _ in range(rounds):
                    d["omni"].append(_median_put_get(omni, obj, n, "o"))
                    d["stagelink"].append(_median_put_get(sl, obj, 4 * n, "s"))
                    d["zero_copy"].append(_median_put_get(sl, obj, 4 * n, "z", zero_copy=True))
                    d["floor"].append(_copies(objs["numpy"], 4 * n))
                res.setdefault(size, {})[kind] = d
    finally:
        sl.close()
    return res


def run(sizes, rounds=3, log=sys.stderr):
    """(result, None) from a process with vLLM-Omni on its path, or (None, why not)."""
    path, why = site()
    if path is None:
        return None, why
    if not os.path.isdir(os.path.join(path, "vllm_omni")):
        return None, (f"vLLM-Omni not found in {path} (./scripts/setup installs it there; "
                      "STAGELINK_FRAMEWORKS_SITE names another)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("PYTHONWARNINGS", "ignore")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    print(f"  ... vLLM-Omni's SharedMemoryConnector from {path} (importing vLLM takes ~20 s)", file=log, flush=True)
    r = subprocess.run([sys.executable, "-m", "stagelink.bench_omni", ",".join(map(str, sizes)), str(rounds)],
                       env=env, capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return None, f"its process failed (exit {r.returncode}): " + " | ".join(r.stderr.strip().splitlines()[-3:])
    return {int(k): v for k, v in json.loads(lines[-1]).items()}, None


def summarize(res):
    """Rows with medians and the per-round ratio ranges."""
    rows = []
    for size, kinds in sorted(res.items()):
        for kind, d in kinds.items():
            rs = [o / s for o, s in zip(d["omni"], d["stagelink"])]
            rz = [o / z for o, z in zip(d["omni"], d["zero_copy"])]
            rf = [o / f for o, f in zip(d["omni"], d["floor"])]
            rows.append({"size": size, "kind": kind, "omni_us": statistics.median(d["omni"]),
                         "stagelink_us": statistics.median(d["stagelink"]),
                         "zero_copy_us": statistics.median(d["zero_copy"]),
                         "two_memcpy_us": statistics.median(d["floor"]),
                         "ratio": [min(rs), max(rs)], "ratio_zero_copy": [min(rz), max(rz)],
                         "ratio_floor": [min(rf), max(rf)]})
    return rows


def print_rows(rows, out=sys.stdout, fmt_size=str):
    print("\nvs vLLM-Omni 0.30.0's SharedMemoryConnector (its own code; put+get in one process, medians in "
          "microseconds, ratios: range over the rounds)", file=out)
    hdr = (f"{'size':>8} {'kind':>6} | {'vLLM-Omni':>10} {'stagelink':>10} {'zero_copy':>10} {'2x memcpy':>10} | "
           f"{'omni/stagelink':>15} {'omni/zero_copy':>15} {'omni/2 memcpy':>14}")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    rng = lambda r: f"{r[0]:.1f}-{r[1]:.1f}x"  # noqa: E731
    for w in rows:
        print(f"{fmt_size(w['size']):>8} {w['kind']:>6} | {w['omni_us']:10.1f} {w['stagelink_us']:10.1f} "
              f"{w['zero_copy_us']:10.1f} {w['two_memcpy_us']:10.1f} | {rng(w['ratio']):>15} "
              f"{rng(w['ratio_zero_copy']):>15} {rng(w['ratio_floor']):>14}", file=out)


if __name__ == "__main__":  # the peer's process: python -m stagelink.bench_omni SIZES ROUNDS
    out = measure([int(s) for s in sys.argv[1].split(",")], int(sys.argv[2]))
    print(json.dumps(out), flush=True)
