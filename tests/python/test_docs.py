"""The documentation stays true: the configuration reference is the code's schemas, the site builds
with no broken link (`mkdocs build --strict`), and the getting-started page's code runs as written."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BIN = os.path.dirname(sys.executable)


def test_the_configuration_reference_is_generated_from_the_schemas():
    out = subprocess.run([os.path.join(BIN, "stagelink"), "config", "reference"], capture_output=True, text=True,
                         check=True).stdout
    with open(os.path.join(ROOT, "docs", "reference", "configuration.md")) as f:
        assert f.read() == out, "docs/reference/configuration.md is stale: stagelink config reference > it"
    for key in ("shm_threshold_bytes", "cuda_ipc", "memory_pool_device", "credits", "slot_size_mb"):
        assert f"`{key}`" in out


def test_the_native_stub_is_current(tmp_path):
    """python/stagelink/_core.pyi (what the API reference, IDEs and type checkers read for the
    native methods: Connector.put and get among them) is what the built module says."""
    out = tmp_path / "_core.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "stagelink._core", "-P", "-o", str(out)],
                   check=True)
    with open(os.path.join(ROOT, "python", "stagelink", "_core.pyi")) as f:
        assert f.read() == out.read_text(), "python/stagelink/_core.pyi is stale: run ./scripts/stubs"
    assert "def put(self, from_stage" in out.read_text()


def test_the_metrics_reference_is_generated_from_the_declarations():
    out = subprocess.run([os.path.join(BIN, "stagelink"), "metrics", "reference"], capture_output=True, text=True,
                         check=True).stdout
    with open(os.path.join(ROOT, "docs", "reference", "metrics.md")) as f:
        assert f.read() == out, "docs/reference/metrics.md is stale: stagelink metrics reference > it"
    assert "`stagelink_connector_puts_total` | counter" in out and "`stagelink_stage_run_seconds` | histogram" in out


def test_the_grafana_dashboard_asks_only_for_metrics_that_exist():
    import json
    out = subprocess.run([os.path.join(BIN, "stagelink"), "metrics", "reference"], capture_output=True, text=True,
                         check=True).stdout
    declared = set(re.findall(r"`(stagelink_[a-z_]+)`", out))
    with open(os.path.join(ROOT, "examples", "grafana-stagelink.json")) as f:
        dash = json.load(f)
    asked = set()
    for panel in dash["panels"]:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            asked |= set(re.findall(r"stagelink_[a-z_]+", t["expr"]))
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in asked}
    assert base <= declared, base - declared
    assert len(dash["panels"]) >= 10


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "mkdocs")), reason="mkdocs is not installed (./scripts/setup)")
def test_the_site_builds_strictly(tmp_path):
    r = subprocess.run([os.path.join(BIN, "mkdocs"), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    for page in ("index.html", "getting-started/index.html", "reference/configuration/index.html",
                 "reference/python/index.html", "security/index.html", "reference/benchmarks/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    ref = tmp_path / "site" / "reference" / "python"
    # a page per main class, docstrings rendered, the native methods (the stub) included
    conn = (ref / "connectors" / "index.html").read_text()
    for method in ("put", "get", "cleanup", "health", "close"):
        assert f'id="stagelink.connector.Connector.{method}"' in conn, method
    assert "create_connector" in conn and "put_async" in (ref / "relay" / "index.html").read_text()
    assert 'id="stagelink.pipeline.stage.StageContext.stream"' in (ref / "pipeline" / "index.html").read_text()
    assert "ReadOnlyInputError" in (ref / "errors" / "index.html").read_text()
    assert ":class:" not in "".join(p.read_text() for p in ref.glob("*/index.html"))


def blocks(page, lang):
    with open(os.path.join(ROOT, "docs", page)) as f:
        return re.findall(rf"```{lang}\n(.*?)```", f.read(), re.S)


OVERVIEW = "# API overview, not a complete program"
PAGES = sorted(f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")])
def test_every_python_block_of_the_docs_runs_or_says_it_is_an_overview(page):
    """A Python block in the docs runs as written, from the repository's root, unless its first line
    declares it an overview of an API (calls across processes or hosts, placeholders)."""
    for c in blocks(page, "python"):
        if c.startswith(OVERVIEW):
            continue
        r = subprocess.run([sys.executable, "-c", c], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, c + r.stderr


def test_the_readme_example_runs_as_written():
    with open(os.path.join(ROOT, "README.md")) as f:
        code = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(code) == 1
    r = subprocess.run([sys.executable, "-c", code[0]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_getting_started_code_runs_as_written(tmp_path):
    py = blocks("getting-started.md", "python")
    assert len(py) == 2
    for code in py:  # each in a fresh interpreter, from an empty directory (a new user's)
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, code + r.stderr
    (yaml,) = blocks("getting-started.md", "yaml")
    (tmp_path / "first.yaml").write_text(yaml)
    stagelink = os.path.join(BIN, "stagelink")
    r = subprocess.run([stagelink, "run", "first.yaml", "--requests", "8", "--concurrency", "4"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "verified end to end" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([stagelink, "config", "check", "first.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0 and "encoder -> thinker (data)" in r.stdout, r.stdout + r.stderr
