"""llama.cpp's own C++ tools (llama-server first), built from the llama.cpp that llama-cpp-python
vendors, so that a C++ baseline runs exactly the llama.cpp that localrun runs. Built once, cached
outside the repository (~/.cache/localrun-bench/llama.cpp-VERSION/, or $LOCALRUN_BENCH_CACHE).

    python benchmarks/llama_tools.py [llama-server llama-bench ...]   # build if needed, print paths

The CPU flags are the Makefile's CMAKE_ARGS (what the Python binding is built with); CMAKE_ARGS in
the environment (e.g. -DGGML_CUDA=on) is passed on as it is to the binding's build, and a build
with other flags gets its own folder. The embedded web UI is left out (it would be downloaded).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PINNED = "0.3.36"  # pyproject.toml pins llama-cpp-python to this version
TOOLS = ("llama-server", "llama-bench", "llama-perplexity", "llama-imatrix", "llama-quantize", "llama-mtmd-cli")
# The Makefile's CMAKE_ARGS with the tools switched on; the web UI and TLS are not needed here.
BASE_FLAGS = (
    "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
)
FORCED_FLAGS = (
    "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)
_PROGRESS = re.compile(r"^\[\s*(\d+)%\]|^\[(\d+)/(\d+)\]")


def log(msg: str) -> None:
    print(f"llama_tools: {msg}", file=sys.stderr, flush=True)


def llama_cpp_version() -> str:
    """The installed llama-cpp-python's version (the pinned one when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return PINNED


def cache_root(version: str | None = None) -> Path:
    """Where the sdist, the source and the builds of one llama-cpp-python version live."""
    base = Path(os.environ.get("LOCALRUN_BENCH_CACHE") or Path.home() / ".cache" / "localrun-bench")
    return base / f"llama.cpp-{version or llama_cpp_version()}"


def cmake_flags() -> list[str]:
    """Configure flags: the Makefile's, then $CMAKE_ARGS, then the switches the tools need."""
    return [*BASE_FLAGS, *shlex.split(os.environ.get("CMAKE_ARGS", "")), *FORCED_FLAGS]


def build_dir(root: Path, flags: list[str]) -> Path:
    """One build folder per set of flags: 'build' for the default CPU build."""
    if flags == cmake_flags_default():
        return root / "build"
    return root / f"build-{hashlib.sha1(' '.join(flags).encode()).hexdigest()[:10]}"


def cmake_flags_default() -> list[str]:
    return [*BASE_FLAGS, *FORCED_FLAGS]


def _run(cmd: list[str], logfile: Path, what: str) -> None:
    """Run a build step, output to a log file, progress lines on stderr at most every 20 s."""
    log(f"{what}: {shlex.join(cmd)}")
    last = 0.0
    with logfile.open("a") as f:
        f.write(f"\n$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if _PROGRESS.match(line) and time.monotonic() - last > 20:
                last = time.monotonic()
                log(f"{what}: {line.strip()[:100]}")
        rc = proc.wait()
    if rc != 0:
        tail = "".join(logfile.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise RuntimeError(f"{what} failed (exit {rc}); log: {logfile}\n{tail}")


def source_dir(root: Path, version: str) -> Path:
    """llama.cpp's source from the llama-cpp-python sdist (downloaded with pip, unpacked once)."""
    src = root / "src"
    if (src / "CMakeLists.txt").exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    sdists = sorted((root / "sdist").glob(f"llama_cpp_python-{version}.tar.gz"))
    if not sdists:
        log(f"downloading the llama-cpp-python {version} sdist from PyPI")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", str(root / "sdist")]
        subprocess.run(cmd, check=True)
        sdists = sorted((root / "sdist").glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise RuntimeError(f"pip downloaded no sdist into {root / 'sdist'}")
    log(f"unpacking {sdists[0].name}")
    prefix = f"{sdists[0].name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".src-"))
    try:
        with tarfile.open(sdists[0]) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=members, **safe)  # type: ignore[arg-type]
        tmp.rename(src)  # only a complete tree gets the final name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def tool_binary(name: str = "llama-server", also: tuple[str, ...] = ()) -> Path:
    """The path of one llama.cpp tool, built on first call (with `also`, in the same build)."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; known: {', '.join(TOOLS)}")
    version = llama_cpp_version()
    root = cache_root(version)
    flags = cmake_flags()
    build = build_dir(root, flags)
    targets = [name, *[t for t in also if t != name]]
    missing = [t for t in targets if not (build / "bin" / t).exists() or not (build / f".built-{t}").exists()]
    if not missing:
        return build / "bin" / name
    root.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(root / ".build.lock")):
        src = source_dir(root, version)
        logfile = root / f"{build.name}.log"
        t0 = time.monotonic()
        if not (build / "CMakeCache.txt").exists():
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run(["cmake", "-S", str(src), "-B", str(build), *gen, *flags], logfile, "configure")
        jobs = os.environ.get("LLAMA_TOOLS_JOBS") or str(os.cpu_count() or 2)
        log(f"building {', '.join(missing)} with {jobs} jobs (about 4 minutes on 2 cores); log: {logfile}")
        _run(["cmake", "--build", str(build), "--target", *missing, "-j", jobs], logfile, "build")
        for t in missing:
            (build / f".built-{t}").write_text(f"{time.monotonic() - t0:.0f} s\n")
        log(f"built {', '.join(missing)} in {time.monotonic() - t0:.0f} s: {build / 'bin'}")
    return build / "bin" / name


def llama_server_binary() -> Path:
    """llama.cpp's llama-server, built on first call."""
    return tool_binary("llama-server")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tools", nargs="*", default=["llama-server"], help=f"any of {', '.join(TOOLS)}")
    ap.add_argument("--all", action="store_true", help="build every tool in the list")
    args = ap.parse_args(argv)
    tools = list(TOOLS) if args.all else args.tools
    first = tool_binary(tools[0], also=tuple(tools[1:]))
    for t in tools:
        print(first.parent / t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
