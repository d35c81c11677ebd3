"""mkdocs hooks (mkdocs.yml): pages made from files that live outside docs/, so that each is written
once: the security page is SECURITY.md (the name error messages and GitHub point at), and the
benchmarks page is README.md's "Measured" table, charts of bench/results/*.json and that folder's list
of runs."""
import glob
import importlib.util
import json
import os
import re

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def _relink(text):
    """Links written from the repository's root, made to work from the site: docs/x.md -> x.md;
    other files of the repository are named, not linked."""
    text = re.sub(r"\]\(docs/([^)]+)\)", r"](\1)", text)
    return re.sub(r"\]\((?!https?:|#)([^)]+)\)", lambda m: m.group(0) if m.group(1).endswith(".md") and
                  os.path.exists(os.path.join(ROOT, "docs", m.group(1))) else f"] (`{m.group(1)}`)", text)


def _charts(files, config):
    """The charts of bench/results/*.json (python/stagelink/bench_plot.py, loaded from the source tree
    as a lone module: the site builds without the compiled package), as generated SVG files; returns
    the Markdown that shows them."""
    spec = importlib.util.spec_from_file_location("bench_plot", os.path.join(ROOT, "python", "stagelink", "bench_plot.py"))
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    md = ["\n## Charts\n", "Drawn from the result files when this site is built (`stagelink bench plot FILE.json` "
          "draws the same from a run of yours).\n"]
    for path in sorted(glob.glob(os.path.join(ROOT, "bench", "results", "*.json"))):
        stem = os.path.splitext(os.path.basename(path))[0]
        with open(path) as f:
            result = json.load(f)
        for i, (title, svg) in enumerate(plot.charts(result), 1):
            files.append(File.generated(config, f"reference/charts/{stem}-{i}.svg", content=svg))
            md.append(f"![{title}](charts/{stem}-{i}.svg)\n")
    return "\n".join(md)


def on_files(files, config):
    security = _relink(_read("SECURITY.md"))
    readme = _read("README.md")
    measured = readme.split("\n## Measured", 1)[1].split("\n## ", 1)[0]
    results = _read("bench/results/README.md").split("\n", 1)[1]
    bench = ("# Benchmarks\n\nThe headline figures, each with the peers measured in the same run (README.md's table)."
             "\n" + _relink(measured) + _charts(files, config) +
             "\n## The result files (bench/results/)\n" + _relink(results))
    for path, content in (("security.md", security), ("reference/benchmarks.md", bench)):
        files.append(File.generated(config, path, content=content))
    return files
