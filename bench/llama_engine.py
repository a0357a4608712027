"""llama.cpp's ``llama-server``, built from a pinned source and run on 127.0.0.1: a real
continuous-batching engine that speaks OpenAI-compatible streaming completions.

    python -m bench.llama_engine [--cache DIR]      # build (or find) it; print its path

The source is the PyPI sdist of ``llama-cpp-python`` :data:`VERSION`, which vendors
llama.cpp under ``vendor/llama.cpp``; ``pip download`` fetches it (any index pip is set
up for). Only the ``llama-server`` target is built, with cmake, statically, without the
web UI download (``LLAMA_USE_PREBUILT_UI=OFF``), OpenSSL, tests or examples, and with
``GGML_NATIVE=OFF``: the binary runs on any x86-64 CPU with the instruction sets this
one has among AVX, AVX2, FMA, F16C and BMI2 (those are switched off when this CPU lacks
them), so a cached build can be reused on another machine of the same level. The cache
directory holds one binary per instruction-set level, with a stamp of what built it; a
binary whose stamp matches is reused.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

__all__ = [
    "VERSION",
    "build_flags",
    "cached_llama_server",
    "default_cache",
    "ensure_llama_server",
    "llama_server",
]

VERSION = "0.3.36"
_SDIST = f"llama_cpp_python-{VERSION}"
_ISA = ("avx", "avx2", "fma", "f16c", "bmi2")


def default_cache() -> Path:
    """``$HEADROOM_ENGINE_CACHE``, else ``~/.cache/headroom/engine``."""
    env = os.environ.get("HEADROOM_ENGINE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "headroom" / "engine"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def build_flags() -> tuple[str, list[str]]:
    """``(level, cmake flags)``: the level names the instruction sets the build uses."""
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DGGML_NATIVE=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
    ]
    if platform.machine() not in ("x86_64", "AMD64"):
        return platform.machine(), flags
    have = _cpu_flags()
    used = [isa for isa in _ISA if isa in have]
    flags += [f"-DGGML_{isa.upper()}={'ON' if isa in have else 'OFF'}" for isa in _ISA]
    return "x86_64-" + ("-".join(used) or "baseline"), flags


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    with log.open("ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        done = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}); {log}:\n" + "\n".join(tail))


def _home(cache: Path) -> tuple[Path, list[str]]:
    level, flags = build_flags()
    return cache / f"llama-server-{VERSION}-{level}", flags


def cached_llama_server(cache: Path | None = None) -> Path | None:
    """The cached ``llama-server`` built for this version and CPU level, or None."""
    home, flags = _home(cache or default_cache())
    binary, want = home / "llama-server", {"version": VERSION, "flags": flags}
    with contextlib.suppress(OSError, ValueError):
        if binary.is_file() and json.loads((home / "stamp.json").read_text()) == want:
            return binary
    return None


def ensure_llama_server(cache: Path | None = None, jobs: int | None = None) -> Path:
    """The path of a built ``llama-server``: the cached one, or one built now (minutes)."""
    cache = cache or default_cache()
    found = cached_llama_server(cache)
    if found is not None:
        return found
    home, flags = _home(cache)
    want = {"version": VERSION, "flags": flags}
    binary, stamp = home / "llama-server", home / "stamp.json"
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake (apt-get install cmake)")
    home.mkdir(parents=True, exist_ok=True)
    log = home / "build.log"
    log.write_bytes(b"")
    sdist = cache / f"{_SDIST}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "--disable-pip-version-check", "-d", str(cache), f"llama-cpp-python=={VERSION}"],
             log)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(f"{_SDIST}/vendor/llama.cpp/")]  # fmt: skip
            tar.extractall(tmp, members=members, filter="data")
        source = Path(tmp) / _SDIST / "vendor" / "llama.cpp"
        build = Path(tmp) / "build"
        _run(["cmake", "-S", str(source), "-B", str(build), *flags], log)
        jobs = jobs or os.cpu_count() or 1
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], log)
        shutil.copy2(build / "bin" / "llama-server", binary.with_suffix(".new"))
    binary.with_suffix(".new").replace(binary)
    stamp.write_text(json.dumps(want, indent=1) + "\n")
    return binary


@contextlib.asynccontextmanager
async def llama_server(
    binary: Path, model: Path, port: int, *, slots: int = 16, context: int = 16384,
    threads: int = 1, batch: int = 16, ready_s: float = 120.0,
) -> AsyncIterator[str]:  # fmt: skip
    """Run ``llama-server`` on 127.0.0.1:``port`` with ``slots`` continuous-batching slots
    and a unified KV cache; yield its base URL once ``/health`` answers 200; always stop
    it (SIGTERM, then SIGKILL after 10 s).

    ``batch`` bounds the tokens of one engine step (``-b``/``-ub``): a new stream's prompt
    is taken in pieces over several steps (chunked prefill), so it holds up the streams
    already generating for one short step at a time; the server needs it to be at least
    ``slots`` (below, it aborts on its first batch of outputs). ``threads`` is 1 by default: on a
    machine whose other processes take a core now and then, two compute threads wait for
    each other at every operation and a step can take many times longer."""
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-cb", "-c", str(context), "-t", str(threads),
           "-b", str(batch), "-ub", str(batch), "--no-webui", "--metrics",
           "--kv-unified"]  # fmt: skip
    log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in the finally below
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if proc.returncode is not None:
                    log.seek(0)
                    tail = log.read().decode(errors="replace").splitlines()[-20:]
                    raise RuntimeError("llama-server exited:\n" + "\n".join(tail))
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server not ready within {ready_s:g} s")
                await asyncio.sleep(0.2)
        yield url
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, help="cache directory (default: %(default)s)")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs (default: CPUs)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    binary = ensure_llama_server(args.cache, args.jobs)
    print(f"{binary} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
