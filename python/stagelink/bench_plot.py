"""Charts of benchmark results: `stagelink bench plot FILE.json...` writes one SVG per chart, and the
documentation's Benchmarks page draws the same charts from bench/results/ when the site is built.

Each chart puts stagelink beside the peers measured in the same run (grouped bars, one group per
payload size or case, a log scale where the values span decades). Plain SVG written here, with no
plotting library: the docs build and the CLI need nothing beyond the standard library, and this
module imports nothing from stagelink, so the docs hook can load it from the source tree."""
import json
import math
import os
from html import escape

PALETTE = ["#1f6feb", "#8250df", "#d1242f", "#bf8700", "#1a7f37", "#57606a"]
# One colour per system, the same in every chart: stagelink's blues (its fastest way darkest), each
# peer its own colour, the hardware's limits (memcpy, a device copy) grey.
SYSTEM_COLOURS = {
    "stagelink": "#0a3069", "stagelink C++": "#0a3069", "stagelink copy": "#0a3069", "stagelink (copy)": "#0a3069",
    "stagelink Python": "#218bff", "stagelink view": "#218bff", "stagelink (view)": "#218bff",
    "stagelink-speed": "#54aeff", "2 replicas": "#218bff", "1 replica": "#0a3069",
    "the seed's Python design": "#8250df", "the seed's design": "#8250df",
    "memcpy": "#8c959f", "device-to-device copy": "#8c959f",
    "ZeroMQ": "#d1242f", "zeromq": "#d1242f", "iceoryx2": "#bf8700",
    "ucx_perftest": "#e16f24", "Mooncake TE": "#1a7f37", "Mooncake Store": "#1a7f37",
    "redis-benchmark": "#a40e26", "sglang-omni": "#bf3989", "torch primitives (copy)": "#6e7781",
    "torch.multiprocessing": "#6e7781",
    "vllm": "#116329", "vLLM shm_broadcast": "#116329",
}


def colour(name):
    """The colour of system `name` in every chart (an unknown one: a fixed pick by its name)."""
    if name in SYSTEM_COLOURS:
        return SYSTEM_COLOURS[name]
    return PALETTE[sum(map(ord, name)) % len(PALETTE)]


def _size(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def _num(v):
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
        if v >= scale:  # three significant digits: 33.2k, 525k, 1.2M
            x = v / (1e3 if scale == 1e4 else scale)
            t = f"{x:.3g}"
            return (t if "e" not in t else f"{x:.0f}") + suffix
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _wrap(text, width):
    """A group label in lines of at most `width` characters (two lines at most, then cut)."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    if len(lines) > 2:
        lines = [lines[0], " ".join(lines[1:])]
    return [ln if len(ln) <= width else ln[:width - 1] + "\u2026" for ln in lines]


def bar_chart(title, groups, series, unit, better="lower", machine=""):
    """An SVG grouped bar chart. groups: the x labels; series: [(name, [value or None per group])].
    A log scale when the values span more than a factor of 20; None leaves a gap (not measured).
    Each bar carries its value (a log axis hides a 200x gap; the numbers do not); each system has
    its colour (colour()); `machine` names where it was measured, under the title."""
    values = [v for _, vs in series for v in vs if v is not None and v > 0]
    if not values:
        raise ValueError(f"{title}: nothing to plot")
    lo, hi = min(values), max(values)
    log = hi / lo > 20
    if log:
        ymin, ymax = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
        ticks = [10 ** e for e in range(round(math.log10(ymin)), round(math.log10(ymax)) + 1)]
    else:
        raw = hi / 6  # about six gridlines, at 1, 2 or 5 times a power of ten
        mag = 10 ** math.floor(math.log10(raw))
        step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
        ymin, ymax = 0.0, math.ceil(hi / step) * step
        ticks = [ymin + i * step for i in range(int(round(ymax / step)) + 1)]
    W, H, left, right, top, bottom = 720, 370, 60, 10, 56, 90
    pw, ph = W - left - right, H - top - bottom

    def y(v):
        f = (math.log10(v) - math.log10(ymin)) / (math.log10(ymax) - math.log10(ymin)) if log else (v - ymin) / (ymax - ymin)
        return top + ph * (1 - f)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
           f'font-family="sans-serif" font-size="11" role="img" aria-label="{escape(title)}">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{escape(title)}</text>',
           f'<text x="{W / 2}" y="32" text-anchor="middle" fill="#57606a">{escape(unit)}, '
           f'{"lower" if better == "lower" else "higher"} is better{", log scale" if log else ""}</text>']
    if machine:
        out.append(f'<text x="{W / 2}" y="46" text-anchor="middle" fill="#57606a">measured on {escape(machine)}</text>')
    for t in ticks:
        out.append(f'<line x1="{left}" x2="{W - right}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#d0d7de"/>')
        label = _num(t) if t >= 1e4 else f"{t:g}"
        out.append(f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{label}</text>')
    gw = pw / len(groups)
    bw = gw * 0.8 / len(series)
    for gi, g in enumerate(groups):
        x0 = left + gi * gw + gw * 0.1
        for li, line in enumerate(_wrap(g, max(8, int(gw / 6.5)))):
            out.append(f'<text x="{left + gi * gw + gw / 2:.1f}" y="{top + ph + 16 + 13 * li}" '
                       f'text-anchor="middle">{escape(line)}</text>')
        for si, (name, vs) in enumerate(series):
            v = vs[gi]
            if v is None or v <= 0:
                continue
            yv = y(max(v, ymin))
            x = x0 + si * bw
            out.append(f'<rect x="{x:.1f}" y="{yv:.1f}" width="{bw - 1:.1f}" height="{top + ph - yv:.1f}" '
                       f'fill="{colour(name)}"><title>{escape(name)}, {escape(g)}: {_num(v)} {escape(unit)}</title></rect>')
            # The value on its bar: above it, turned upright where the bar is too narrow for it.
            # Near the top of the plot it goes inside the bar, in white.
            label, cx = _num(v), x + (bw - 1) / 2
            flat = bw - 1 >= 6.2 * len(label)
            room = 12 if flat else 5.5 * len(label) + 4
            inside = yv - top < room
            ty = yv + (room if inside else -3)
            fill = ' fill="white"' if inside else ""
            if flat:
                out.append(f'<text x="{cx:.1f}" y="{ty:.1f}" text-anchor="middle" font-size="10"{fill}>{label}</text>')
            else:
                out.append(f'<text x="{cx + 3:.1f}" y="{ty:.1f}" font-size="9"{fill} '
                           f'transform="rotate(-90 {cx + 3:.1f} {ty:.1f})">{label}</text>')
    lx, ly = left, H - 36
    for si, (name, _) in enumerate(series):
        if lx + 14 + 7 * len(name) > W - right:
            lx, ly = left, ly + 16
        out.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{colour(name)}"/>')
        out.append(f'<text x="{lx + 14}" y="{ly}">{escape(name)}</text>')
        lx += 14 + 7 * len(name) + 18
    out.append("</svg>")
    return "\n".join(out)


def _med(d, *keys):
    """The sum of the medians d[k]["median_us"] (or plain numbers d[k]); None when one is missing."""
    total = 0.0
    for k in keys:
        v = d.get(k) if isinstance(d, dict) else None
        if isinstance(v, dict):
            v = v.get("median_us")
        if not isinstance(v, (int, float)):
            return None
        total += v
    return total


def _shm(r):
    rows = r["rows"]
    return [("Shared-memory connector: put + get, same process", [_size(x["size"]) for x in rows], [
        ("stagelink C++", [_med(x.get("cpp", {}), "put", "get") for x in rows]),
        ("stagelink Python", [_med(x.get("python", {}), "put", "get") for x in rows]),
        ("the seed's Python design", [_med(x.get("python", {}), "seed_put_get") for x in rows]),
        ("memcpy", [_med(x.get("cpp", {}), "memcpy") for x in rows]),
    ], "microseconds (median)", "lower")]


def _mq(r):
    res = r["results"]
    names = [n for n in res if isinstance(res[n], dict) and "latency_64B_1to1" in res[n]]
    groups = ["64 B, 1 reader", "64 B, 4 readers", "wake-up after idle"]
    keys = ["latency_64B_1to1", "latency_64B_1to4", "wakeup_after_idle"]
    return [("Broadcast queue: latency", groups, [(n, [_med(res[n], k) for k in keys]) for n in names],
             "microseconds (median)", "lower"),
            ("Broadcast queue: bandwidth", ["1 MiB", "16 MiB"],
             [(n, [res[n].get("gbps_1MiB"), res[n].get("gbps_16MiB")]) for n in names], "GB/s", "higher")]


def _relay(r):
    hops = r["hops"]
    return [("Relay: one hop between processes", [_size(h["size"]) for h in hops], [
        ("stagelink copy", [h.get("hop_us_copy") for h in hops]),
        ("stagelink view", [h.get("hop_us_view") for h in hops]),
        ("ZeroMQ", [h.get("hop_us_zmq") for h in hops]),
        ("memcpy", [h.get("memcpy_us") for h in hops]),
    ], "microseconds (median)", "lower")]


def _per_path(r, title, series):
    """One chart per network path (loopback, namespaces) of a te or store result, in GB/s;
    series(rows) gives [(name, values)]."""
    return [(f"{title} ({path})", [_size(x["size"]) for x in p["rows"]], series(p["rows"]), "GB/s", "higher")
            for path, p in r["paths"].items()]


def _te(r):
    return _per_path(r, "Transfer engine: get of a remote buffer", lambda rows: [
        ("stagelink copy", [x.get("copy", {}).get("gbps") for x in rows]),
        ("stagelink view", [x.get("view", {}).get("gbps") for x in rows]),
        ("ucx_perftest", [x.get("ucx_perftest_gbps") for x in rows]),
        ("Mooncake TE", [x.get("mooncake_gbps") for x in rows]),
    ])


def _store(r):
    return _per_path(r, "Store connector over Redis", lambda rows: [
        ("stagelink", [x.get("gbps") for x in rows]),
        ("redis-benchmark", [x.get("redis_benchmark_gbps") for x in rows]),
        ("Mooncake Store", [x.get("mooncake_gbps") for x in rows]),
    ])


def _pipeline(r):
    cases = r["cases"]
    names = sorted({n for c in cases.values() for n in c}, key=lambda n: (n != "stagelink", n))
    return [("SGLang-Omni's toy pipeline: throughput", list(cases),
             [(n, [cases[c].get(n, {}).get("requests_per_s") for c in cases]) for n in names],
             "requests per second", "higher")]


def _pipeline_hosts(r):
    rows = r["rows"]
    return [("Omni pipeline on one host and across two (network namespaces)", [x["variant"] for x in rows],
             [("stagelink", [x.get("requests_per_s") for x in rows])], "requests per second", "higher")]


def _cuda(r):
    rows = r["rows"]
    return [("CUDA tensors between processes: put + get", [_size(x["size"]) for x in rows], [
        ("stagelink (copy)", [x.get("stagelink_ipc") for x in rows]),
        ("stagelink (view)", [x.get("stagelink_ipc_view") for x in rows]),
        ("torch primitives (copy)", [x.get("torch_arena") for x in rows]),
        ("the seed's design", [x.get("seed_design") for x in rows]),
        ("device-to-device copy", [x.get("d2d_copy") for x in rows]),
    ], "milliseconds (median)", "lower")]


def _kv(r):
    rows = r["rows"]
    return [("A DynamicCache (bf16, 32 layers) from a prefill to a decode process", [_size(x["size"]) for x in rows], [
        ("stagelink (copy)", [x["copying get"]["median_ms"] for x in rows]),
        ("stagelink (view)", [x["zero-copy"]["median_ms"] for x in rows]),
        ("torch.multiprocessing", [x["torch.mp"]["median_ms"] for x in rows]),
        ("memcpy", [x["memcpy_ms"] for x in rows]),
    ], "milliseconds (median)", "lower")]


def _replicas(r):
    rounds = [f"round {i + 1}" for i in range(len(r["req_s"]["1"]))]
    fo = r.get("failover") or []
    return [("A CPU-bound stage with 1 and 2 replicas", rounds,
             [("1 replica", r["req_s"]["1"]), ("2 replicas", r["req_s"]["2"])], "requests per second", "higher"),
            ("Gap in completions after a replica is SIGKILLed (longest per run)", [f"run {i + 1}" for i in range(len(fo))],
             [("stagelink", [f.get("failover_gap_ms") for f in fo])], "milliseconds", "lower")]


CHARTS = {"shm": _shm, "mq": _mq, "relay": _relay, "te": _te, "store": _store, "pipeline": _pipeline,
          "pipeline-hosts": _pipeline_hosts, "replicas": _replicas, "kv": _kv, "cuda": _cuda}


def charts(result):
    """[(title, svg)] for one result file's content (the dict `stagelink bench ... --json` writes)."""
    kind = result.get("kind")
    if kind not in CHARTS:
        raise ValueError(f"unknown benchmark kind {kind!r} (known: {', '.join(CHARTS)})")
    when = f" ({result['date'][:10]})" if isinstance(result.get("date"), str) else ""
    return [(t + when, bar_chart(t + when, g, s, u, b, machine_of(result))) for t, g, s, u, b in CHARTS[kind](result)]


def machine_of(result):
    """Where a result was measured, in words: its `machine` and CPUs (cores), or "" when unknown."""
    m = result.get("machine")
    cpus = result.get("cpus") or result.get("cores")
    parts = [str(m)] if m else []
    if isinstance(cpus, int):
        parts.append(f"{cpus} CPUs")
    return ", ".join(parts)


def plot_files(paths, out_dir):
    """Writes OUT_DIR/<file>-<n>.svg for every chart of every result file; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for path in paths:
        with open(path) as f:
            result = json.load(f)
        stem = os.path.splitext(os.path.basename(path))[0]
        for i, (_, svg) in enumerate(charts(result), 1):
            target = os.path.join(out_dir, f"{stem}-{i}.svg")
            with open(target, "w") as f:
                f.write(svg)
            written.append(target)
    return written
