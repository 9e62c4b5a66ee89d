"""tests/gxx_pool.py: the suite's shared ``g++`` builds what g++ builds, once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The real compiler: conftest.py resolved it before putting the pool first on PATH.
GXX = os.environ.get("VOXTRAL_MLX_TESTS_GXX") or shutil.which("g++")
POOL_SCRIPT = Path(__file__).with_name("gxx_pool.py")
FLAGS = ["-std=c++17", "-O3", "-Wall", "-fPIC", "-shared"]

pytestmark = pytest.mark.skipif(
    sys.platform == "darwin" or GXX is None, reason="the pool stands in for g++ on Linux only"
)

HEADER = """#pragma once
#include <cmath>
#include <cstdint>
template <typename T> inline T twice(T x) { return x + x; }
"""

KERNEL = """#include "pre/preamble.h"
extern "C" void kernel_{name}(const float* in, float* out, int n) {{
  for (int i = 0; i < n; ++i) out[i] = twice(std::exp(in[i])) * {scale}f;
}}
"""


@pytest.fixture
def project(tmp_path):
    include = tmp_path / "include"
    (include / "pre").mkdir(parents=True)
    (include / "pre" / "preamble.h").write_text(HEADER)
    work = tmp_path / "work"
    work.mkdir()
    # A real g++ that counts its runs, standing in as the compiler the pool calls.
    counter = tmp_path / "runs.log"
    counting = tmp_path / "counting-g++"
    counting.write_text(f'#!/bin/sh\necho run >> "{counter}"\nexec "{GXX}" "$@"\n')
    counting.chmod(0o755)
    env = dict(
        os.environ,
        VOXTRAL_MLX_TESTS_GXX=str(counting),
        VOXTRAL_MLX_TESTS_JIT_POOL=str(tmp_path / "pool"),
    )
    return {
        "include": include,
        "work": work,
        "pool": tmp_path / "pool",
        "env": env,
        "runs": lambda: len(counter.read_text().split()) if counter.exists() else 0,
    }


def kernel(project, name: str, scale: float = 2.0) -> Path:
    source = project["work"] / f"tmp_{name}.cpp"
    source.write_text(KERNEL.format(name=name, scale=scale))
    return source


def pooled(project, source: Path, output: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-S", str(POOL_SCRIPT), *FLAGS]
    command += ["-I", str(project["include"]), str(source), "-o", str(output)]
    return subprocess.run(command, env=project["env"], capture_output=True, text=True)


def test_builds_the_same_library_as_g_plus_plus(project):
    source = kernel(project, "a")
    direct = project["work"] / "direct.so"
    command = [GXX, *FLAGS, "-I", str(project["include"]), str(source), "-o", str(direct)]
    subprocess.run(command, check=True)

    result = pooled(project, source, project["work"] / "tmp_a.so")

    assert result.returncode == 0, result.stdout + result.stderr
    assert (project["work"] / "tmp_a.so").read_bytes() == direct.read_bytes()
    gch = list(project["pool"].glob("pch-*/pre/preamble.h.gch"))
    assert len(gch) == 1 and gch[0].stat().st_size > 0


def test_compiles_each_kernel_and_header_once(project):
    first = kernel(project, "a")
    assert pooled(project, first, project["work"] / "one.so").returncode == 0
    assert project["runs"]() == 2  # the header, then the kernel

    # Another worker asking for the same kernel (another output path) compiles nothing.
    assert pooled(project, first, project["work"] / "two.so").returncode == 0
    assert project["runs"]() == 2
    one, two = (project["work"] / "one.so").read_bytes(), (project["work"] / "two.so").read_bytes()
    assert one == two

    # A new kernel compiles itself only; the header is shared.
    assert pooled(project, kernel(project, "b"), project["work"] / "b.so").returncode == 0
    assert project["runs"]() == 3

    # A changed header makes both stale: it and the kernel are built again.
    header = project["include"] / "pre" / "preamble.h"
    header.write_text(HEADER + "inline int changed() { return 1; }\n")
    os.utime(header, ns=(1, 1))
    assert pooled(project, first, project["work"] / "three.so").returncode == 0
    assert project["runs"]() == 5
    assert not list(project["pool"].rglob("*.part"))


def test_kernels_use_the_precompiled_header(project):
    assert pooled(project, kernel(project, "a"), project["work"] / "a.so").returncode == 0
    # Spoil the header without changing its size or time (what the pool's key sees): a
    # kernel built afterwards compiles only if g++ reads the precompiled header instead.
    header = project["include"] / "pre" / "preamble.h"
    info = header.stat()
    header.write_text("#error read\n".ljust(len(HEADER) - 1) + "\n")
    os.utime(header, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert header.stat().st_size == info.st_size

    result = pooled(project, kernel(project, "b"), project["work"] / "b.so")

    assert result.returncode == 0, result.stdout


def test_a_failed_compile_reports_and_leaves_nothing(project):
    source = project["work"] / "tmp_bad.cpp"
    source.write_text('#include "pre/preamble.h"\nint broken( {\n')
    output = project["work"] / "tmp_bad.so"

    result = pooled(project, source, output)

    assert result.returncode != 0
    assert "tmp_bad.cpp" in result.stdout and "error" in result.stdout
    assert not output.exists()
    assert not list(project["pool"].glob("*.so"))
    assert not list(project["pool"].rglob("*.part"))
    assert not list(project["work"].glob("*.part"))


def test_other_invocations_run_the_real_compiler(project):
    command = [sys.executable, "-S", str(POOL_SCRIPT), "--version"]
    result = subprocess.run(command, env=project["env"], capture_output=True, text=True)
    real = subprocess.run([GXX, "--version"], capture_output=True, text=True)

    assert result.returncode == 0
    assert result.stdout == real.stdout
    assert project["runs"]() == 1


def test_without_its_settings_it_says_what_is_missing(project):
    env = {k: v for k, v in project["env"].items() if not k.startswith("VOXTRAL_MLX_TESTS_")}
    command = [sys.executable, "-S", str(POOL_SCRIPT), "--version"]
    result = subprocess.run(command, env=env, capture_output=True, text=True)

    assert result.returncode == 2
    assert "VOXTRAL_MLX_TESTS_GXX" in result.stderr


def test_the_suite_compiles_through_the_pool():
    found = shutil.which("g++")
    assert found is not None and Path(found).parent.name.startswith("voxtral-mlx-tests-bin-")
    assert Path(found).read_text().count(str(POOL_SCRIPT)) == 1
    # ...and the pool calls the compiler found behind it, never itself.
    real = shutil.which("g++", path=os.environ["PATH"].split(os.pathsep, 1)[1])
    assert real is not None
    assert os.environ["VOXTRAL_MLX_TESTS_GXX"] == os.path.realpath(real)
