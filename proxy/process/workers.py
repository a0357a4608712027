"""``headroom serve --workers N``: N gateway processes on one listen socket (redis backend).

Caps and the queue live in Redis with ``admission.backend: redis``, so several processes on
one host hold one cap per GPU, exactly as several pods do (docs/shared-admission.md). The
memory backend is refused: each process would own the full caps.

The supervisor (the ``headroom serve`` process) binds the listen socket, and the admin
socket if enabled, then starts N workers (``python -m proxy serve ... --worker-index i``)
that inherit the bound sockets: every worker accepts on the same socket, so a worker that
is busy, paused or gone leaves its connections to the others. Each worker builds its own
runtime and so its own gateway id (``<host>-<pid>-<random>``) in lease and waiter ids.

Signals go to the supervisor (PID 1 in a container) and reach every worker:

* SIGTERM/SIGINT: forwarded to every worker (the first drains, a second closes at once);
* SIGHUP: one reload round over every worker's control channel
  (:mod:`proxy.process.worker_control`): the supervisor reads the file once, every worker
  validates that text, and it is applied by all of them or by none;
* the admin listener runs in worker 0 only (only it inherits the admin socket); its
  ``POST /admin/reload`` asks the supervisor for the same round and answers with every
  worker's state; ``POST /admin/drain`` asks the supervisor (SIGUSR2) to drain every
  worker.

If the supervisor itself dies (SIGKILL), each worker sees its lifeline pipe close and drains.
A worker that fails (exits non-zero) while the others are not draining makes the
supervisor drain the rest and exit 1 (the container's restart policy starts a fresh set),
so a pod never keeps serving with fewer workers than it was given. A worker exits 0 only
after draining, and its drain has already asked the supervisor to drain the others: that
exit is taken as the request, even when the signal is seen after it.

``/metrics`` is per worker: the admin listener's is worker 0's; with
``metrics.client_port`` a scrape of the listen port sees whichever worker accepted it (its
own sessions, counters since its start). Pool-wide figures (every worker, every
pod) come from Redis in ``headroom_shared_*{scope="pool"}``; see docs/shared-admission.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from proxy.errors import ConfigError
from proxy.process.admin import ReloadAnswer
from proxy.process.console import say
from proxy.process.gateway import Gateway, _listen
from proxy.process.reload_rounds import ReloadRounds
from proxy.process.worker_control import WorkerControl, digest, read_start, start_frame
from proxy.runtime import Runtime
from proxy.settings import Settings, read_config_text, settings_from_text

__all__ = [
    "WorkerGateway",
    "WorkerStart",
    "make_worker",
    "supervise",
    "worker_argv",
    "worker_start",
]

log = logging.getLogger("headroom.workers")

#: Sent by worker 0 to the supervisor: the admin listener asked for a drain.
DRAIN_ALL = signal.SIGUSR2


def memory_refusal(workers: int) -> str:
    """The refusal of ``--workers N`` (N > 1) with the memory backend, and why."""
    return (
        f"headroom: --workers {workers} needs admission.backend: redis. With the memory "
        "backend each worker process would hold its own copy of every per-GPU cap and "
        "queue, multiplying the real concurrency on each GPU. Share the caps through Redis "
        "(docs/shared-admission.md) or run one process per set of caps."
    )


def worker_argv(
    config: str | None, host: str | None, port: int | None, index: int, fds: Sequence[int]
) -> list[str]:
    """The command line that starts worker ``index`` on the inherited sockets ``fds``."""
    argv = [sys.executable, "-m", "proxy", "serve", "--worker-index", str(index)]
    argv += ["--worker-fds", ",".join(str(fd) for fd in fds)]
    if config is not None:
        argv += ["--config", config]
    if host is not None:
        argv += ["--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    return argv


class WorkerGateway(Gateway):
    """A gateway serving on sockets its supervisor bound (``listen``, ``admin`` or None).

    Only worker 0 gets the admin socket; its reload and drain reach the other workers
    through the supervisor. Reloads come over the ``control`` socket
    (:class:`~proxy.process.worker_control.WorkerControl`)."""

    def __init__(
        self,
        settings: Settings,
        listen: socket.socket,
        admin: socket.socket | None,
        *,
        index: int,
        control: socket.socket,
        config_path: str | None = None,
    ) -> None:
        # Gateway binds its own sockets from settings: let it bind throwaway ones on
        # 127.0.0.1 port 0, then serve on the inherited ones instead.
        throwaway = settings.model_copy(
            update={
                "listen": settings.listen.model_copy(update={"host": "127.0.0.1", "port": 0}),
                "admin": settings.admin.model_copy(
                    update={"host": "127.0.0.1", "port": 0, "enabled": admin is not None}
                ),
            }
        )
        super().__init__(throwaway, Runtime(settings), config_path=config_path)
        self.settings = settings
        self.index = index
        self._sock.close()
        self._sock = listen
        self.port = listen.getsockname()[1]
        if self._admin_sock is not None:
            self._admin_sock.close()
            self._admin_sock = admin
            self.admin_port = admin.getsockname()[1] if admin is not None else None
        self._drain_asked = False
        self._parent = os.getppid()
        self.control = WorkerControl(self, control, index, self.runtime.gate.gateway_id)
        #: The read end of a pipe whose write end only the supervisor holds.
        self.lifeline: int | None = None

    async def serve(self, *, install_signals: bool = True) -> None:
        """Serve until drained or stopped: the supervisor's lifeline watched (the worker
        stops when the supervisor dies), signals taken unless ``install_signals`` is False."""
        loop = asyncio.get_running_loop()
        if self.lifeline is not None:
            loop.add_reader(self.lifeline, self._on_lifeline)
        control = asyncio.ensure_future(self.control.run())
        try:
            await super().serve(install_signals=install_signals)
        finally:
            control.cancel()
            with contextlib.suppress(BaseException):
                await control
            self.control.channel.close()
            if self.lifeline is not None:
                loop.remove_reader(self.lifeline)
                os.close(self.lifeline)
                self.lifeline = None

    def _on_lifeline(self) -> None:
        """The supervisor's end of the lifeline closed: it died without forwarding
        anything (SIGKILL, OOM), leaving this worker orphaned in its own process group.
        Drain as if sent SIGTERM."""
        assert self.lifeline is not None
        if os.read(self.lifeline, 1):
            return  # (nothing is ever written; EOF is the message)
        asyncio.get_running_loop().remove_reader(self.lifeline)
        self._drain_asked = True  # nobody to tell
        if self._signals:  # draining already: a second signal would close at once
            log.warning("supervisor (pid %d) is gone; draining goes on", self._parent)
            return
        log.warning("supervisor (pid %d) is gone: draining", self._parent)
        self._on_signal()

    async def admin_reload(self) -> ReloadAnswer:
        """``POST /admin/reload`` (worker 0): one round over every worker, run by the
        supervisor; its answer lists what every worker now runs."""
        return await self.control.request_reload()

    def _on_sighup(self) -> None:
        # The supervisor never forwards SIGHUP: one sent here goes to the supervisor.
        self.control.forward_sighup()

    def drain(self, timeout_s: float | None = None) -> asyncio.Task[None]:
        """Drain this worker (and, asked first here, every worker through the supervisor);
        the task that finishes when it has stopped."""
        if not self._drain_asked:
            # From the admin listener or a signal: either way every worker must drain.
            # The supervisor forwards SIGTERM once (a second one would close at once).
            self._drain_asked = True
            os.kill(os.getppid(), DRAIN_ALL)
        return super().drain(timeout_s)


def _inherited(fds: str) -> tuple[int, socket.socket, socket.socket, socket.socket | None]:
    """``lifeline,control,listen[,admin]``: the pipe, the control socket and the sockets
    the supervisor bound."""
    lifeline, *numbers = [int(fd) for fd in fds.split(",") if fd]
    socks = [socket.socket(fileno=fd) for fd in numbers]
    for sock in socks:
        sock.setblocking(False)
    return lifeline, socks[0], socks[1], (socks[2] if len(socks) > 2 else None)


def worker_start(fds: str, config_path: str | None, overrides: dict[str, Any]) -> WorkerStart:
    """The configuration the supervisor started this worker on (never the file as it is
    now: it may have changed since the supervisor read it)."""
    control = int(fds.split(",")[1])
    with socket.socket(fileno=os.dup(control)) as sock:
        text = read_start(sock)
    source = config_path or "<file>"
    settings = settings_from_text(text, source=source)
    if overrides:
        listen = settings.listen.model_copy(update=overrides)
        settings = settings.model_copy(update={"listen": listen})
    return WorkerStart(settings, digest(text))


class WorkerStart(NamedTuple):
    settings: Settings
    config_sha256: str


def make_worker(start: WorkerStart, fds: str, index: int, config_path: str | None) -> WorkerGateway:
    """The worker gateway of worker ``index`` on the sockets its supervisor passed in
    ``fds``."""
    lifeline, control, listen, admin = _inherited(fds)
    gateway = WorkerGateway(
        start.settings, listen, admin, index=index, control=control, config_path=config_path
    )
    gateway.control.config_sha256 = start.config_sha256
    gateway.lifeline = lifeline
    return gateway


class Supervisor:
    """Starts the workers, forwards signals, and exits when they have all exited."""

    def __init__(
        self, settings: Settings, workers: int, argv: Callable[[int, list[int]], list[str]],
        config_path: str | None,
    ) -> None:  # fmt: skip
        self.settings = settings
        self.workers = workers
        self._argv = argv
        self.processes: list[subprocess.Popen[bytes]] = []
        self._signals = 0
        self._draining = False
        self._split = False
        self._failed = False
        self.rounds = ReloadRounds(
            config_path, draining=lambda: self._draining, on_split=self.on_split
        )

    def start(self, shared: Sequence[int], admin: int | None, text: str) -> None:
        """Start the workers: each inherits ``shared`` (the lifeline's read end, then the
        listen socket) and its own control socket, on which it first reads ``text``, the
        configuration to start on; worker 0 also inherits ``admin``."""
        lifeline, *sockets = shared
        for i in range(self.workers):
            ours, theirs = socket.socketpair()
            fds = [lifeline, theirs.fileno(), *sockets]
            if i == 0 and admin is not None:
                fds.append(admin)
            try:
                # Their own process group: a Ctrl-C in a terminal (SIGINT to the
                # foreground group) reaches the supervisor only, which forwards one
                # SIGTERM, so the workers drain instead of taking it as a second signal.
                process = subprocess.Popen(self._argv(i, fds), pass_fds=fds, process_group=0)
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()  # the worker's end: its exit then closes the pair
            self.processes.append(process)
            self.rounds.add(i, process.pid, ours, start_frame(text))

    def on_split(self, message: str) -> None:
        """A reload applied by some workers only: never serve on two configurations."""
        say(f"headroom: {message}")
        self._split = True
        if not self._draining:
            self._draining = True
            self._send(signal.SIGTERM)

    def _send(self, sig: int, skip: int | None = None) -> None:
        for i, process in enumerate(self.processes):
            if i != skip and process.poll() is None:
                os.kill(process.pid, sig)

    def on_term(self) -> None:
        self._signals += 1
        if self._signals == 1 and self._draining:
            return  # already draining (asked by the admin listener): nothing new to say
        self._draining = True
        self._send(signal.SIGTERM)

    def on_drain_all(self) -> None:
        """A worker started draining (its admin listener asked): drain the others too.
        Not counted as a signal: a SIGTERM after it is the first (drain, already running),
        a second one closes at once, as for one process."""
        if not self._draining:
            self._draining = True
            self._send(signal.SIGTERM)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        handlers: dict[int, Any] = {
            signal.SIGTERM: self.on_term,
            signal.SIGINT: self.on_term,
            signal.SIGHUP: lambda: self.rounds.spawn_reload("SIGHUP to the supervisor"),
            DRAIN_ALL: self.on_drain_all,
        }
        for sig, handler in handlers.items():
            loop.add_signal_handler(sig, handler)
        try:
            codes: dict[int, int] = {}
            while len(codes) < len(self.processes):
                for i, process in enumerate(self.processes):
                    if i in codes or process.poll() is None:
                        continue
                    codes[i] = process.returncode
                    if not self._draining and process.returncode == 0:
                        # A worker exits 0 only once drained, and every drain first asks
                        # us to drain the others (DRAIN_ALL): a signal the loop may not
                        # have handled yet when the exit is seen. The exit is the request.
                        self.on_drain_all()
                    elif not self._draining:
                        say(
                            f"headroom: worker {i} (pid {process.pid}) exited with "
                            f"{process.returncode}; draining the others"
                        )
                        self._draining = True
                        self._send(signal.SIGTERM)
                        self._failed = True  # the supervisor's own verdict
                await asyncio.sleep(0.1)
            failed = 1 if self._failed or self._split else 0
            return max([failed, *(c if c >= 0 else 1 for c in codes.values())])
        finally:
            for sig in handlers:
                loop.remove_signal_handler(sig)
            await self.rounds.close()


def supervise(settings: Settings, workers: int, args: Any) -> int:
    """Bind the sockets, run ``workers`` worker processes, return the exit code."""
    from proxy.process.eventloop import run_async

    config_path = args.config or os.environ.get("HEADROOM_CONFIG")
    if config_path is None:
        raise ConfigError([("<file>", "--workers needs a configuration file")])
    # Read once for every worker (validated again here: it may have changed since the
    # settings were loaded), so all of them start on one text.
    text = read_config_text(config_path)
    settings_from_text(text, source=config_path)
    listen = _listen("listener", settings.listen.host, settings.listen.port)
    admin = None
    if settings.admin.enabled:
        try:
            admin = _listen("admin listener", settings.admin.host, settings.admin.port)
        except BaseException:
            listen.close()
            raise
    # The lifeline: workers inherit the read end; the write end (not inheritable) closes
    # only when this process dies, however it dies.
    lifeline_read, lifeline_write = os.pipe()
    port = listen.getsockname()[1]
    supervisor = Supervisor(
        settings, workers,
        lambda i, fds: worker_argv(args.config, args.host, args.port, i, fds),
        config_path,
    )  # fmt: skip
    code = 0

    async def run() -> None:
        nonlocal code
        admin_fd = admin.fileno() if admin else None
        supervisor.start([lifeline_read, listen.fileno()], admin_fd, text)
        say(
            f"headroom: serving on http://{settings.listen.host}:{port} with {workers} "
            f"workers (pids {' '.join(str(p.pid) for p in supervisor.processes)})"
        )
        if admin is not None:
            host, admin_port = admin.getsockname()[:2]
            say(f"headroom: admin listener on http://{host}:{admin_port} (worker 0)")
        code = await supervisor.run()

    try:
        run_async(run())
    finally:
        os.close(lifeline_read)
        os.close(lifeline_write)
        listen.close()
        if admin is not None:
            admin.close()
    return code
