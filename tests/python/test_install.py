"""What an installed stagelink gives its users beyond Python: one version everywhere, and the C++
package (headers, static library, CMake config, pkg-config file) that a stage library is built
against, then loaded by `stagelink run`."""
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest

import stagelink

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
STAGELINK = os.path.join(os.path.dirname(sys.executable), "stagelink")


def test_one_version_everywhere():
    """python/stagelink/_version.py is the one place: the package, its metadata, the command and the
    C++ package (CMake version file, pkg-config) all say the same."""
    v = stagelink.__version__
    assert v == importlib.metadata.version("stagelink")
    out = subprocess.run([STAGELINK, "--version"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"stagelink {v}"
    cmake_dir = stagelink.get_cmake_dir()
    assert f'set(PACKAGE_VERSION "{v}")' in open(os.path.join(cmake_dir, "stagelinkConfigVersion.cmake")).read()
    pc = [os.path.join(r, f) for r, _, fs in os.walk(os.path.dirname(os.path.dirname(cmake_dir))) for f in fs
          if f == "stagelink.pc"]
    assert pc and f"Version: {v}\n" in open(pc[0]).read()


@pytest.mark.skipif(not shutil.which("cmake"), reason="cmake is not installed")
def test_a_stage_library_builds_against_the_installed_package_and_runs(tmp_path):
    cmake_dir = subprocess.run([STAGELINK, "--cmake-dir"], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.isfile(os.path.join(cmake_dir, "stagelinkConfig.cmake"))
    build = tmp_path / "stages"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    r = subprocess.run(["cmake", "-S", os.path.join(ROOT, "examples", "cpp_stage"), "-B", str(build),
                        f"-Dstagelink_DIR={cmake_dir}", *gen], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run(["cmake", "--build", str(build)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    lib = build / "libexample_stages.so"
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert {"scale_stage", "chunker_stage", "sum_stage"} <= {ln.split()[-1] for ln in exported.splitlines()}
    pipeline = open(os.path.join(ROOT, "examples", "cpp_pipeline.yaml")).read().replace(
        "../build/cpp/libstagelink_example_stages.so", str(lib))
    (tmp_path / "p.yaml").write_text(pipeline)
    out = tmp_path / "r.json"
    r = subprocess.run([STAGELINK, "run", str(tmp_path / "p.yaml"), "--requests", "8", "--json", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(out.read_text())["completed"] == 8 and "verified end to end" in r.stdout


@pytest.mark.skipif(not shutil.which("cmake"), reason="cmake is not installed")
def test_the_cxx_package_names_the_packages_it_needs_when_they_are_missing(tmp_path):
    """Issue 64: find_package(stagelink) where the -dev packages it links are missing said only that
    one pkg-config module was not found; it now says every one missing and the apt-get line.
    (pkg-config pointed at an empty directory stands for a host without them.)"""
    cmake_dir = subprocess.run([STAGELINK, "--cmake-dir"], capture_output=True, text=True, check=True).stdout.strip()
    r = subprocess.run(["cmake", "-S", os.path.join(ROOT, "examples", "cpp_stage"), "-B", str(tmp_path / "b"),
                        f"-Dstagelink_DIR={cmake_dir}"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PKG_CONFIG_LIBDIR=str(tmp_path / "none")))
    assert r.returncode != 0
    out = " ".join((r.stdout + r.stderr).split())
    assert "sudo apt-get install libzmq3-dev libucx-dev libhiredis-dev libxxhash-dev" in out, out
    assert "CMake 3.22 or later" in out
