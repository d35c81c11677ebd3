"""The binding compiles under CPython's limited API (what the cp312-abi3 wheel is built with), so a
call outside it (PyTuple_GET_ITEM, a list's item array...) added to src/python/ fails here rather
than in ./scripts/wheel on a machine with CPython 3.12+. The calls that differ between the two builds
live in src/python/pyapi.hpp. Needs a CPython 3.12+ with headers on this machine (skipped without)."""
import glob
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python312_include():
    """The include folder of a CPython 3.12 or later here (its Python.h), or None."""
    candidates = [shutil.which(f"python3.{m}") for m in range(12, 16)]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[2-9]*/bin/python3")))
    for py in filter(None, candidates):
        try:
            inc = subprocess.run([py, "-c", "import sys, sysconfig; assert sys.version_info >= (3, 12); "
                                  "print(sysconfig.get_paths()['include'])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if inc and os.path.exists(os.path.join(inc, "Python.h")):
            return inc
    return None


def test_the_binding_compiles_under_the_limited_api():
    inc = _python312_include()
    if inc is None or shutil.which("g++") is None:
        pytest.skip("no CPython 3.12+ with headers, or no g++, on this machine")
    nanobind = pytest.importorskip("nanobind", reason="nanobind (a build dependency) is not installed")
    import numpy
    flags = ["g++", "-std=gnu++20", "-fsyntax-only", "-DPy_LIMITED_API=0x030C0000",
             f"-I{ROOT}/src", f"-I{ROOT}/include", f"-I{inc}", f"-I{nanobind.include_dir()}",
             f"-I{numpy.get_include()}"]
    sources = sorted(glob.glob(os.path.join(ROOT, "src", "python", "*.cpp")))
    assert len(sources) >= 10

    def check(src):
        r = subprocess.run(flags + [src], capture_output=True, text=True, timeout=300)
        return src, r.returncode, r.stderr

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failed = [(s, err) for s, rc, err in pool.map(check, sources) if rc != 0]
    assert not failed, "\n".join(f"{os.path.relpath(s, ROOT)}:\n{err[:2000]}" for s, err in failed)


def test_the_check_fails_on_a_call_outside_the_limited_api(tmp_path):
    # The same flags catch what they are for: a tuple read by the macro does not compile.
    inc = _python312_include()
    if inc is None or shutil.which("g++") is None:
        pytest.skip("no CPython 3.12+ with headers, or no g++, on this machine")
    src = tmp_path / "bad.cpp"
    src.write_text("#include <Python.h>\nPyObject* f(PyObject* t) { return PyTuple_GET_ITEM(t, 0); }\n")
    r = subprocess.run(["g++", "-std=gnu++20", "-fsyntax-only", "-DPy_LIMITED_API=0x030C0000", f"-I{inc}", str(src)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "PyTuple_GET_ITEM" in r.stderr
