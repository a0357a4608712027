"""The image's build, run outside Docker: the Dockerfile's own steps (deploy/docker/build.sh)
in a scratch copy of the build context, with the environment each stage gives its RUN
instructions (ARG defaults, or the build argument, and ENV), for both values of
HEADROOM_MYPYC. The wheels are installed by the runtime stage's step into a fresh
virtualenv, whose `headroom serve` then serves a session from a `headroom sim`.

Slow: each build resolves the project's dependencies and HEADROOM_MYPYC=1 compiles the
per-chunk modules.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.client import HTTPConnection
from pathlib import Path
from typing import IO

import pytest

from .support import (
    REPO,
    Instruction,
    copy_sources,
    dockerfile_instructions,
    dockerignore_excludes,
    dockerignore_patterns,
)

pytestmark = pytest.mark.slow

DOCKERFILE = REPO / "Dockerfile"
BUILD_TIMEOUT_S = 1200
START_TIMEOUT_S = 120
SESSION_TIMEOUT_S = 120


@dataclass
class Stage:
    """What one stage of the Dockerfile gives its RUN instructions."""

    instructions: list[Instruction]
    build_args: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"

    def __post_init__(self) -> None:
        for instruction in self.instructions:
            if instruction.keyword == "ARG":
                name, _, default = instruction.args.partition("=")
                self.env[name] = self.build_args.get(name, default)
            elif instruction.keyword == "ENV":
                for pair in shlex.split(instruction.args):
                    name, _, value = pair.partition("=")
                    self.env[name] = value

    def runs(self) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == "RUN"]


def _stages(build_args: dict[str, str], dockerfile: Path = DOCKERFILE) -> list[Stage]:
    instructions = dockerfile_instructions(dockerfile)
    return [
        Stage([i for i in instructions if i.stage == n], build_args)
        for n in range(max(i.stage for i in instructions) + 1)
    ]


def _workdir(stage: Stage) -> str:
    workdirs = [i.args for i in stage.instructions if i.keyword == "WORKDIR"]
    return workdirs[0] if workdirs else "/"


def _copy_context(stage: Stage, into: Path, ignore: Path = REPO / ".dockerignore") -> None:
    """The stage's COPY instructions, from the repository filtered by ``ignore``."""
    patterns = dockerignore_patterns(ignore)
    for instruction in stage.instructions:
        if instruction.keyword != "COPY":
            continue
        *sources, destination = shlex.split(instruction.args)
        assert sources == copy_sources(instruction), "a COPY with flags: not expected here"
        target = into / destination
        for source in sources:
            path = REPO / source
            if path.is_dir():
                for file in sorted(path.rglob("*")):
                    rel = file.relative_to(REPO).as_posix()
                    if file.is_file() and not dockerignore_excludes(patterns, rel):
                        dest = target / file.relative_to(path)
                        dest.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(file, dest)
            else:
                dest = target / path.name if destination.endswith("/") else target
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)


def _mounts(run: str) -> tuple[dict[str, str], str]:
    """``--mount=type=bind,from=STAGE,source=S,target=T`` flags (target -> source) and the
    command after them."""
    mounts: dict[str, str] = {}
    words = run.split(" ")
    while words and words[0].startswith("--mount="):
        options = dict(kv.split("=", 1) for kv in words.pop(0)[len("--mount=") :].split(","))
        assert options["type"] == "bind" and options["from"] == "builder", options
        mounts[options["target"]] = options["source"]
        words = [w for w in words if w]
    return mounts, " ".join(words).strip()


def _host_argv(command: str, paths: dict[str, Path]) -> list[str]:
    """A simple shell command's words with each container path mapped to its host path."""
    assert not any(op in command for op in ("&&", "||", ";", "|", "`", "$(")), command
    argv = []
    for word in shlex.split(command):
        for container, host in paths.items():
            if word == container or word.startswith(container.rstrip("/") + "/"):
                word = str(host) + word[len(container.rstrip("/")) :]
                break
        argv.append(word)
    return argv


def _tree(root: Path) -> set[str]:
    """Every path under ``root``, relative to it."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


def _base_python_dir() -> Path:
    """The directory of this interpreter's base Python (not a virtualenv): the stand-in for
    the image's python:3.11-slim."""
    return Path(getattr(sys, "_base_executable", sys.executable)).resolve().parent


def _run(argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
    with log.open("ab") as out:
        result = subprocess.run(
            argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, timeout=BUILD_TIMEOUT_S,
        )  # fmt: skip
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-6000:]
        pytest.fail(f"{shlex.join(argv)} exited {result.returncode}:\n{tail}")


class _Lines:
    """A process's stdout and stderr lines, read by threads as they come."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.queue: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.seen: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.threads = [
            threading.Thread(target=self._read, args=(name, pipe), daemon=True)
            for name, pipe in (("stdout", process.stdout), ("stderr", process.stderr))
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, name: str, pipe: IO[str] | None) -> None:
        assert pipe is not None
        for line in pipe:
            self.queue.put((name, line))
        self.queue.put((name, None))

    def wait_for(self, stream: str, want: str) -> str:
        """The first line of ``stream`` containing ``want``."""
        ended: set[str] = set()
        while stream not in ended:
            try:
                name, line = self.queue.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                break
            if line is None:
                ended.add(name)
                continue
            self.seen[name].append(line)
            if name == stream and want in line:
                return line
        shown = "".join(self.seen["stdout"] + self.seen["stderr"])[-4000:]
        raise AssertionError(f"no {stream} line with {want!r}:\n{shown}")

    def rest(self, stream: str) -> str:
        """Everything ``stream`` said, once the process has exited."""
        for thread in self.threads:
            thread.join(timeout=60)
        while not self.queue.empty():
            name, line = self.queue.get()
            if line is not None:
                self.seen[name].append(line)
        return "".join(self.seen[stream])


@contextmanager
def _process(argv: list[str], cwd: Path, env: dict[str, str]) -> Iterator[_Lines]:
    process = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines = _Lines(process)
    try:
        yield lines
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for thread in lines.threads:
            thread.join(timeout=60)
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()


CONFIG = """\
listen: {{host: 127.0.0.1, port: 0}}
admin: {{enabled: false}}
pools:
  - name: tts
    replicas: [{{name: gpu0, url: "{url}", max_sessions: 2}}]
routes:
  - {{path: /v1/audio/speech, pool: tts, protocol: openai-speech-http}}
"""


def _one_session(port: int) -> tuple[int, bytes]:
    body = json.dumps(
        {"input": "Hello from the image.", "response_format": "pcm", "stream": True}
    ).encode()
    connection = HTTPConnection("127.0.0.1", port, timeout=SESSION_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/audio/speech", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.mark.parametrize("mypyc", [None, "0"], ids=["default", "HEADROOM_MYPYC=0"])
def test_the_image_builds_and_serves(tmp_path: Path, mypyc: str | None) -> None:
    build_args = {} if mypyc is None else {"HEADROOM_MYPYC": mypyc}
    builder, runtime = _stages(build_args)[0], _stages(build_args)[-1]
    compiled = builder.env["HEADROOM_MYPYC"] == "1"
    assert compiled is (mypyc is None), "the default build compiles the per-chunk modules"
    base = _base_python_dir()
    system_path = f"{base}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    home = tmp_path / "home"
    home.mkdir()
    log = tmp_path / "build.log"

    # --- builder stage: its RUN instructions, in the copied context, with its environment
    src = tmp_path / "src"
    _copy_context(builder, src)
    wheels = tmp_path / "wheels"
    builder_paths = {_workdir(builder): src, "/wheels": wheels}
    assert builder.runs(), "the builder stage runs the build script"
    context = _tree(src)
    for run in builder.runs():
        argv = _host_argv(run, builder_paths)
        _run(argv, src, {**builder.env, "PATH": system_path, "HOME": str(home)}, log)
    # The build cleans up after itself: no build/, .egg-info or .mypy_cache left behind.
    assert _tree(src) == context, sorted(_tree(src) ^ context)[:20]
    built = sorted(p.name for p in wheels.glob("headroom_proxy-*.whl"))
    assert len(built) == 1, built
    assert ("-cp311-" in built[0]) is compiled, built  # a compiled wheel is per-interpreter
    assert list(wheels.glob("redis-*.whl")), "the redis extra's wheel is built"

    # --- runtime stage: its install step into a fresh virtualenv ("the image's Python")
    venv = tmp_path / "image"
    subprocess.run([str(base / "python3"), "-m", "venv", str(venv)], check=True, timeout=300)
    image_path = f"{venv / 'bin'}:{system_path}"
    installs = [run for run in runtime.runs() if "build.sh" in run]
    assert len(installs) == 1, runtime.runs()
    others = [run for run in runtime.runs() if run not in installs]
    assert all(run.startswith("groupadd ") for run in others), "only the user is made besides"
    mounts, command = _mounts(installs[0])
    builder_files = {"/wheels": wheels, **{f"/src/{p.relative_to(src)}": p for p in
                                           src.rglob("build.sh")}}  # fmt: skip
    runtime_paths = {target: builder_files[source] for target, source in mounts.items()}
    env = {**runtime.env, "PATH": image_path, "HOME": str(home)}
    _run(_host_argv(command, runtime_paths), tmp_path, env, log)
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import proxy; print(proxy.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert where.startswith(str(venv)), where

    # --- the installed `headroom`: a simulator, the gateway in front, one session
    headroom = str(venv / "bin" / "headroom")
    sim_argv = [headroom, "sim", "--preset", "l40s-qwen3tts-1.7b", "--port", "0", "--json"]
    with _process([*sim_argv, "--exit-after", "600"], tmp_path, env) as sim:
        (url,) = json.loads(sim.wait_for("stdout", '"urls"'))["urls"]
        config = tmp_path / "config.yaml"
        config.write_text(CONFIG.format(url=url))
        serve_env = {**env, "HEADROOM_CONFIG": str(config)}
        serve = [headroom, "serve", "--config", str(config)]
        with _process(serve, tmp_path, serve_env) as gateway:
            line = gateway.wait_for("stderr", "serving on http://127.0.0.1:")
            port = int(line.rsplit(":", 1)[1].strip().rstrip("/"))
            status, audio = _one_session(port)
            assert status == 200, audio[:500]
            assert len(audio) > 0 and len(audio) % 2 == 0, len(audio)  # 16-bit PCM
            # The image's HEALTHCHECK, its command found on the image's PATH.
            (healthcheck,) = [i.args for i in runtime.instructions if i.keyword == "HEALTHCHECK"]
            argv = json.loads(healthcheck.partition("CMD ")[2])
            program = shutil.which(argv[0], path=image_path)
            assert program is not None and program.startswith(str(venv)), program
            health_env = {**serve_env, "HEADROOM_LISTEN__PORT": str(port)}
            health = subprocess.run(
                [program, *argv[1:]], cwd=tmp_path, env=health_env, capture_output=True,
                timeout=60,
            )  # fmt: skip
            assert health.returncode == 0, health.stderr
            gateway.process.send_signal(signal.SIGTERM)
            assert gateway.process.wait(timeout=60) == 0
            stderr = gateway.rest("stderr")
    build = "per-chunk modules compiled with mypyc" if compiled else "modules interpreted"
    assert build in stderr, stderr[-2000:]


def test_the_build_script_refuses_an_unknown_mypyc_value(tmp_path: Path) -> None:
    script = REPO / "deploy" / "docker" / "build.sh"
    result = subprocess.run(
        ["sh", str(script), "wheels", str(tmp_path / "w")], cwd=REPO,
        env={"PATH": os.environ.get("PATH", ""), "HEADROOM_MYPYC": "yes"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "HEADROOM_MYPYC must be 0 or 1, got 'yes'" in result.stderr
    assert not (tmp_path / "w").exists()


def test_the_sagemaker_image_builds_its_wheel(tmp_path: Path) -> None:
    """deploy/sagemaker/Dockerfile's wheel stage, run the same way: a pure-Python wheel of
    the project alone (the vLLM image's Python resolves the dependencies), whatever
    HEADROOM_MYPYC the environment holds, since the stage copies no setup.py."""
    sagemaker = REPO / "deploy" / "sagemaker"
    wheel_stage = _stages({}, sagemaker / "Dockerfile")[0]
    src = tmp_path / "src"
    _copy_context(wheel_stage, src, sagemaker / "Dockerfile.dockerignore")
    assert not (src / "setup.py").exists()
    wheels = tmp_path / "wheels"
    paths = {_workdir(wheel_stage): src, "/wheels": wheels}
    base = _base_python_dir()
    venv = tmp_path / "builder"
    subprocess.run([str(base / "python3"), "-m", "venv", str(venv)], check=True, timeout=300)
    env = {**wheel_stage.env, "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "HEADROOM_MYPYC": "1"}  # fmt: skip
    for run in wheel_stage.runs():
        _run(_host_argv(run, paths), src, env, tmp_path / "build.log")
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.startswith("headroom_proxy-") and wheel.name.endswith("-py3-none-any.whl")
