"""A ``g++`` for the test suite: each of MLX's CPU kernels is compiled once, for every worker.

MLX's CPU backend JIT-compiles every fused kernel with
``g++ FLAGS -shared -I MLX_INCLUDE DIR/tmp_x.cpp -o DIR/tmp_x.so`` into ``$TMPDIR/mlx``. The
suite's workers keep separate ``$TMPDIR``s (MLX takes no lock between processes), so they
compiled the same kernels again, one to three seconds apiece, most of it parsing the one
header every kernel includes first. This stand-in, put first on ``PATH`` by ``conftest.py``:

- precompiles that header once per compiler, flags and MLX headers (GCC takes ``NAME.gch``
  from an include directory searched before the header's own; it rejects one made with
  other options but never compares the header's text, hence the key);
- compiles each kernel source once into a pool shared by all workers and later runs, keyed
  by the source's bytes, the compiler, the flags and every MLX header (path, size, mtime);
- hands the pooled library to the path MLX asked for by link or copy, then rename, so MLX
  never sees a half-written file.

Anything that is not such a kernel build (``g++ --version``) runs the real compiler. A failed
compile prints the compiler's output, leaves nothing behind and exits with its status.

Run as ``python -S gxx_pool.py ARGS...`` (standard library only) with ``VOXTRAL_MLX_TESTS_GXX``
naming the real compiler and ``VOXTRAL_MLX_TESTS_JIT_POOL`` the pool directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass
class KernelBuild:
    """One ``-shared`` build of a single C++ source, as MLX issues it."""

    flags: list[str]
    includes: list[str]
    source: str
    output: str

    @property
    def include_args(self) -> list[str]:
        return [arg for d in self.includes for arg in ("-I", d)]


def parse(args: list[str]) -> KernelBuild | None:
    """The kernel build ``args`` describe, or None when they are anything else."""
    flags: list[str] = []
    includes: list[str] = []
    sources: list[str] = []
    output = None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-o" and i + 1 < len(args):
            output = args[i + 1]
            i += 2
            continue
        if arg == "-I" and i + 1 < len(args):
            includes.append(args[i + 1])
            i += 2
            continue
        if arg.startswith("-I"):
            includes.append(arg[2:])
        elif arg.startswith("-"):
            flags.append(arg)
        elif arg.endswith(".cpp"):
            sources.append(arg)
        else:
            return None
        i += 1
    if output is None or len(sources) != 1 or "-shared" not in flags:
        return None
    if any(flag in ("-E", "-S", "-c", "-M", "-MM") or flag.startswith("-x") for flag in flags):
        return None
    return KernelBuild(flags, includes, sources[0], output)


def signature(compiler: str, build: KernelBuild) -> str:
    """What makes two builds of the same source interchangeable: compiler, flags, headers."""
    digest = hashlib.sha256()
    stat = os.stat(compiler)
    digest.update(f"{os.path.realpath(compiler)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    digest.update("\0".join(build.flags).encode() + b"\1")
    for include in build.includes:
        digest.update(os.path.abspath(include).encode() + b"\1")
        for root, dirs, files in os.walk(include):
            dirs.sort()
            for name in sorted(files):
                path = os.path.join(root, name)
                try:
                    info = os.stat(path)
                except OSError:
                    continue
                digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def locked_build(target: Path, make: Callable[[Path], bool]) -> bool:
    """Make ``target`` once across processes: ``make(part)`` writes ``part``; True on success.

    Under an exclusive lock beside the target, a builder that finds the target made by
    another process returns at once; a failed make leaves neither target nor part file.
    """
    if target.exists():
        return True
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return True
        part = target.with_name(f"{target.name}.{os.getpid()}.part")
        try:
            if not make(part):
                return False
            os.replace(part, target)
            return True
        finally:
            part.unlink(missing_ok=True)


def precompiled_header_dir(
    compiler: str, build: KernelBuild, source_text: str, pool: Path, sig: str
) -> Path | None:
    """A directory holding the ``.gch`` of the source's first quoted include, or None."""
    match = _INCLUDE.search(source_text)
    if match is None:
        return None
    name = match.group(1)
    header = next(
        (Path(d) / name for d in build.includes if (Path(d) / name).is_file()),
        None,
    )
    if header is None:
        return None
    pch_dir = pool / f"pch-{sig[:32]}"
    flags = [f for f in build.flags if f != "-shared"]

    def make(part: Path) -> bool:
        command = [compiler, *flags, *build.include_args, "-x", "c++-header", str(header)]
        command += ["-o", str(part)]
        return run(command).returncode == 0

    return pch_dir if locked_build(pch_dir / f"{name}.gch", make) else None


def place(pooled: Path, output: str) -> None:
    """Put the pooled library at ``output`` whole: a link or copy, then a rename."""
    part = f"{output}.{os.getpid()}.part"
    try:
        try:
            os.link(pooled, part)
        except OSError:
            shutil.copyfile(pooled, part)
        os.replace(part, output)
    finally:
        if os.path.lexists(part):
            os.unlink(part)


def compile_kernel(compiler: str, build: KernelBuild, pool: Path) -> int:
    source_text = Path(build.source).read_text()
    sig = signature(compiler, build)
    key = hashlib.sha256(f"{sig}\0{source_text}".encode()).hexdigest()
    pooled = pool / f"{key}.so"
    failed: list[subprocess.CompletedProcess] = []

    def make(part: Path) -> bool:
        pch_dir = precompiled_header_dir(compiler, build, source_text, pool, sig)
        includes = [] if pch_dir is None else ["-I", str(pch_dir)]
        command = [compiler, *build.flags, *includes, *build.include_args, build.source]
        result = run([*command, "-o", str(part)])
        if result.returncode != 0:
            failed.append(result)
        return result.returncode == 0

    if not locked_build(pooled, make):
        sys.stdout.buffer.write(failed[0].stdout)
        sys.stdout.flush()
        return failed[0].returncode
    place(pooled, build.output)
    return 0


def main(args: list[str]) -> int:
    compiler = os.environ.get("VOXTRAL_MLX_TESTS_GXX")
    pool = os.environ.get("VOXTRAL_MLX_TESTS_JIT_POOL")
    if not compiler or not pool:
        sys.stderr.write(
            "gxx_pool: VOXTRAL_MLX_TESTS_GXX and VOXTRAL_MLX_TESTS_JIT_POOL must be set "
            "(tests/conftest.py sets both)\n"
        )
        return 2
    build = parse(args)
    if build is None:
        os.execv(compiler, [compiler, *args])
    return compile_kernel(compiler, build, Path(pool))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
