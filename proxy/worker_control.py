"""One reload for every worker of ``headroom serve --workers N``, or for none.

The supervisor and each worker share a control channel: one end of a Unix socket pair
each, newline-delimited JSON messages. A reload -- ``POST /admin/reload`` (the admin
listener runs in worker 0, which forwards the request) or SIGHUP (to the supervisor; one
sent to a worker is forwarded too) -- is a round run by the supervisor, one at a time:

1. The supervisor reads the file once (:func:`~proxy.settings.read_config_text`) and
   refuses a file cut short (:func:`~proxy.settings.cut_short_problems`).
2. **prepare**: every worker gets that exact text and a generation number, validates it
   (the schema, then what a live reload may not change) and answers whether it could
   apply it. Nothing is applied yet.
3. If every worker answered yes within :data:`RELOAD_DEADLINE_S`, **commit**: each
   applies the configuration it prepared and answers with what it now runs (pid,
   gateway id, generation, the text's SHA-256, the changes). Otherwise **abort**:
   nothing is applied anywhere, and the answer names the worker and its reason.

A worker that does not confirm a commit the others confirmed leaves the set running two
configurations: the supervisor answers 500 naming it and drains every worker, exits 1,
and the container's restart policy starts a fresh set on the file (as when a worker
dies). Workers never keep serving on configurations that disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.admin import ReloadAnswer
from proxy.errors import ConfigError
from proxy.settings import Settings, cut_short_problems, read_config_text
from proxy.settings.loading import MAX_CONFIG_BYTES

__all__ = ["RELOAD_DEADLINE_S", "Channel", "ReloadRounds", "WorkerControl"]

log = logging.getLogger("headroom.workers")

#: How long the supervisor waits for every worker's answer to one step of a reload.
RELOAD_DEADLINE_S = 10.0
#: A message carries at most one configuration file, JSON-escaped.
MAX_MESSAGE_BYTES = 8 * MAX_CONFIG_BYTES


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class Channel:
    """One end of a control socket pair: JSON objects, one per line."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._early: list[bytes] = []  # sent before open(): written by it

    async def open(self) -> None:
        self._sock.setblocking(False)
        self._reader, self._writer = await asyncio.open_unix_connection(
            sock=self._sock, limit=MAX_MESSAGE_BYTES
        )
        self._writer.writelines(self._early)
        self._early.clear()

    def send(self, message: dict[str, Any]) -> None:
        line = json.dumps(message).encode() + b"\n"
        if self._writer is None:
            self._early.append(line)
        elif not self._writer.is_closing():  # else the other end is gone (EOF for it)
            self._writer.write(line)

    async def receive(self) -> dict[str, Any] | None:
        """The next message; None once the other end has closed (or sent garbage)."""
        assert self._reader is not None
        try:
            line = await self._reader.readline()
            message = json.loads(line) if line else None
        except (ValueError, ConnectionError):
            return None
        return message if isinstance(message, dict) else None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            self._sock.close()


class ReloadTarget(Protocol):
    """What a worker's gateway does with a reload (:class:`~proxy.gateway.Gateway`)."""

    def validate_reload(self, text: str, source: str) -> Settings: ...

    def apply_reload(self, settings: Settings) -> list[str]: ...


def _problems(err: ConfigError) -> list[dict[str, str]]:
    return [{"field": f, "reason": r} for f, r in err.problems]


class WorkerControl:
    """A worker's end: prepares, commits or drops what the supervisor sends, and asks
    it for a reload (the admin listener's, or a SIGHUP sent to this worker)."""

    def __init__(self, target: ReloadTarget, sock: socket.socket, index: int, gateway: str) -> None:
        self.target = target
        self.index = index
        self.gateway = gateway
        self.channel = Channel(sock)
        #: The configuration this worker runs: 0 is the file as it read it at start.
        self.generation = 0
        self.config_sha256: str | None = None
        self._prepared: dict[int, tuple[Settings, str]] = {}
        self._requests: dict[int, asyncio.Future[ReloadAnswer]] = {}
        self._ids = itertools.count(1)
        self._closed = False

    async def run(self) -> None:
        await self.channel.open()
        self.channel.send({"op": "hello", **self._state()})
        try:
            while (message := await self.channel.receive()) is not None:
                await self._on(message)
        finally:
            self._closed = True
            for future in self._requests.values():
                if not future.done():
                    future.set_result(_unavailable("the supervisor is gone"))

    def _state(self) -> dict[str, Any]:
        return {"index": self.index, "pid": os.getpid(), "gateway": self.gateway,
                "generation": self.generation, "config_sha256": self.config_sha256}  # fmt: skip

    async def _on(self, message: dict[str, Any]) -> None:
        op, generation = message.get("op"), message.get("round")
        if op == "prepare" and isinstance(generation, int):
            text, source = str(message.get("text", "")), str(message.get("source", ""))
            try:
                settings = await asyncio.to_thread(self.target.validate_reload, text, source)
            except ConfigError as err:
                reply = {"ok": False, "problems": _problems(err)}
            except Exception as exc:  # a fault here must not end this channel
                log.exception("validating generation %d failed", generation)
                reply = {"ok": False, "reason": f"validating failed: {exc!r}"}
            else:
                self._prepared = {generation: (settings, digest(text))}
                reply = {"ok": True}
            self.channel.send({"op": "prepared", "round": generation, **reply})
        elif op == "commit" and isinstance(generation, int):
            self.channel.send({"op": "applied", "round": generation,
                               **self._commit(generation)})  # fmt: skip
        elif op == "abort":
            self._prepared.pop(generation if isinstance(generation, int) else -1, None)
        elif op == "answer":
            future = self._requests.pop(int(message.get("request", 0)), None)
            if future is not None and not future.done():
                body = message.get("body")
                status = int(message.get("status", 500))
                future.set_result(ReloadAnswer(status, body if isinstance(body, dict) else {}))

    def _commit(self, generation: int) -> dict[str, Any]:
        prepared = self._prepared.pop(generation, None)
        if prepared is None:
            return {"ok": False, "reason": f"generation {generation} was not prepared here",
                    **self._state()}  # fmt: skip
        settings, sha256 = prepared
        try:
            changes = self.target.apply_reload(settings)
        except Exception as exc:  # reported to the supervisor, which ends the set
            log.exception("applying generation %d failed", generation)
            return {"ok": False, "reason": f"applying failed: {exc!r}", **self._state()}
        self.generation, self.config_sha256 = generation, sha256
        return {"ok": True, "changes": changes, **self._state()}

    async def request_reload(self, origin: str = "POST /admin/reload") -> ReloadAnswer:
        """Have the supervisor reload every worker; its answer (or why there is none)."""
        if self._closed:
            return _unavailable("the supervisor is gone")
        request = next(self._ids)
        future: asyncio.Future[ReloadAnswer] = asyncio.get_running_loop().create_future()
        self._requests[request] = future
        self.channel.send({"op": "reload", "request": request, "origin": origin})
        try:
            # The supervisor answers within its two deadlines (prepare, commit) once the
            # rounds queued before this one are done.
            return await asyncio.wait_for(asyncio.shield(future), 4 * RELOAD_DEADLINE_S)
        except TimeoutError:
            return _unavailable("the supervisor did not answer")
        finally:
            self._requests.pop(request, None)

    def forward_sighup(self) -> None:
        """A SIGHUP sent to this worker: reload every worker, as one sent to the
        supervisor does (a reload of this worker alone would split the set)."""

        async def forward() -> None:
            answer = await self.request_reload("SIGHUP")
            log.info("SIGHUP to worker %d, forwarded to the supervisor: reload %s",
                     self.index, describe(answer))  # fmt: skip

        task = asyncio.ensure_future(forward())
        _keep.add(task)
        task.add_done_callback(_keep.discard)


_keep: set[asyncio.Task[None]] = set()


def _unavailable(why: str) -> ReloadAnswer:
    return ReloadAnswer(503, {"reloaded": False, "error": {
        "type": "supervisor_unavailable", "message": f"{why}: nothing applied"}})  # fmt: skip


_STATE = ("pid", "gateway", "generation", "config_sha256")


@dataclass
class _Worker:
    """The supervisor's view of one worker."""

    index: int
    pid: int
    channel: Channel
    alive: bool = True
    state: dict[str, Any] = field(default_factory=dict)
    replies: dict[tuple[str, int], asyncio.Future[dict[str, Any]]] = field(default_factory=dict)

    def expect(self, op: str, generation: int) -> asyncio.Future[dict[str, Any]]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if not self.alive:
            future.set_result({"ok": False, "reason": "exited"})
        self.replies[(op, generation)] = future
        return future

    def name(self) -> str:
        return f"worker {self.index} (pid {self.pid})"


class ReloadRounds:
    """The supervisor's end: runs reload rounds over every worker's channel."""

    def __init__(
        self,
        config_path: str | None,
        *,
        draining: Callable[[], bool],
        on_split: Callable[[str], None],
        deadline_s: float = RELOAD_DEADLINE_S,
    ) -> None:
        self.config_path = config_path
        self.generation = 0
        self._draining = draining
        self._on_split = on_split
        self._deadline_s = deadline_s
        self._workers: list[_Worker] = []
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    def add(self, index: int, pid: int, sock: socket.socket) -> None:
        worker = _Worker(index, pid, Channel(sock))
        self._workers.append(worker)
        self._spawn(self._listen(worker))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        for worker in self._workers:
            worker.channel.close()

    async def _listen(self, worker: _Worker) -> None:
        await worker.channel.open()
        while (message := await worker.channel.receive()) is not None:
            op = message.get("op")
            if op == "hello":
                worker.state = {k: message.get(k) for k in _STATE}
            elif op == "reload":
                request = message.get("request")
                origin = f"{str(message.get('origin'))[:40]} on {worker.name()}"
                self._spawn(self._answer(worker, request, origin))
            elif op in ("prepared", "applied"):
                key = (str(op), int(message.get("round", -1)))
                future = worker.replies.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(message)
        worker.alive = False
        for future in worker.replies.values():
            if not future.done():
                future.set_result({"ok": False, "reason": "exited"})

    async def _answer(self, worker: _Worker, request: Any, origin: str) -> None:
        answer = await self.reload(origin)
        worker.channel.send({"op": "answer", "request": request, "status": answer.status,
                             "body": answer.body})  # fmt: skip

    def spawn_reload(self, origin: str) -> None:
        """A reload round in the background (SIGHUP); its outcome is logged."""
        self._spawn(self.reload(origin))

    async def reload(self, origin: str) -> ReloadAnswer:
        """One reload round (queued behind a running one); the answer for the admin."""
        async with self._lock:
            answer = await self._round()
        level = logging.INFO if answer.status == 200 else logging.ERROR
        log.log(level, "reload (%s) %s", origin, describe(answer))
        return answer

    async def _round(self) -> ReloadAnswer:
        if self._draining():
            return _refused(503, "draining", "the workers are draining: nothing applied", [])
        if self.config_path is None:
            return _problems_answer([("<file>", "this gateway was not started from a file")])
        try:
            text = await asyncio.to_thread(read_config_text, self.config_path)
        except ConfigError as err:
            return _problems_answer(err.problems)
        if problems := cut_short_problems(text):
            return _problems_answer(problems)
        generation = self.generation + 1
        workers = list(self._workers)
        prepared = await self._step(workers, "prepare", generation,
                                    text=text, source=self.config_path)  # fmt: skip
        refusals = [(w, r) for w, r in prepared if not r.get("ok")]
        if refusals:
            for w in workers:
                w.channel.send({"op": "abort", "round": generation})
            return _not_prepared(refusals, [self._view(w) for w in workers])
        committed = await self._step(workers, "commit", generation)
        for w, reply in committed:
            if "generation" in reply:
                w.state = {k: reply.get(k) for k in _STATE}
        views = [self._view(w, reply) for w, reply in committed]
        failed = [(w, r) for w, r in committed if not r.get("ok")]
        if failed:
            names = ", ".join(f"{w.name()}: {r.get('reason')}" for w, r in failed)
            message = (
                f"generation {generation} was applied by some workers but not by {names}; "
                "draining every worker so the set restarts on one configuration"
            )
            self._on_split(message)
            return _refused(500, "workers_disagree", message, views)
        self.generation = generation
        body = {"reloaded": True, "generation": generation, "config_sha256": digest(text),
                "changes": committed[0][1].get("changes", []) if committed else [],
                "workers": views}  # fmt: skip
        return ReloadAnswer(200, body)

    async def _step(
        self, workers: list[_Worker], op: str, generation: int, **extra: Any
    ) -> list[tuple[_Worker, dict[str, Any]]]:
        """Send ``op`` to every worker and wait for each one's reply, or the deadline."""
        reply_op = "prepared" if op == "prepare" else "applied"
        futures = [w.expect(reply_op, generation) for w in workers]
        for w in workers:
            w.channel.send({"op": op, "round": generation, **extra})
        await asyncio.wait(futures, timeout=self._deadline_s)
        replies = []
        for w, future in zip(workers, futures, strict=True):
            w.replies.pop((reply_op, generation), None)
            if future.done():
                replies.append((w, future.result()))
            else:
                future.cancel()
                why = f"did not answer within {self._deadline_s:g} s"
                replies.append((w, {"ok": False, "reason": why}))
        return replies

    def _view(self, worker: _Worker, reply: dict[str, Any] | None = None) -> dict[str, Any]:
        view: dict[str, Any] = {"index": worker.index, "pid": worker.pid,
                                "gateway": worker.state.get("gateway"),
                                "generation": worker.state.get("generation", 0),
                                "config_sha256": worker.state.get("config_sha256")}  # fmt: skip
        if reply is not None:
            view["applied"] = bool(reply.get("ok"))
            if reply.get("ok"):
                view["changes"] = reply.get("changes", [])
            else:
                view["reason"] = reply.get("reason")
        return view


def describe(answer: ReloadAnswer) -> str:
    """One line for the log: what every worker now runs, or why nothing was applied."""
    body = answer.body
    if body.get("reloaded"):
        workers = ", ".join(f"worker {w['index']} (pid {w['pid']})" for w in body["workers"])
        return (f"applied: generation {body['generation']} (config sha256 "
                f"{str(body['config_sha256'])[:12]}) on {workers}")  # fmt: skip
    if "problems" in body:
        return "refused, nothing applied: " + "; ".join(
            f"{p['field']}: {p['reason']}" for p in body["problems"])  # fmt: skip
    return f"refused: {body.get('error', {}).get('message')}"


def _refused(status: int, kind: str, message: str, views: list[dict[str, Any]]) -> ReloadAnswer:
    return ReloadAnswer(status, {"reloaded": False, "error": {"type": kind, "message": message},
                                 "workers": views})  # fmt: skip


def _problems_answer(problems: list[tuple[str, str]]) -> ReloadAnswer:
    return ReloadAnswer(400, {"reloaded": False, "problems": [
        {"field": f, "reason": r} for f, r in problems]})  # fmt: skip


def _not_prepared(
    refusals: list[tuple[_Worker, dict[str, Any]]], views: list[dict[str, Any]]
) -> ReloadAnswer:
    """Nothing applied: one or more workers refused the file or did not answer."""
    for view in views:
        reply = next((r for w, r in refusals if w.index == view["index"]), None)
        view["applied"] = False
        view["reason"] = "aborted" if reply is None else (reply.get("reason") or "refused")
    problems = next((r["problems"] for _, r in refusals if r.get("problems")), None)
    if problems is not None and len(refusals) == len(views):
        # The same text and environment: every worker found the same problems.
        return ReloadAnswer(400, {"reloaded": False, "problems": problems, "workers": views})
    names = ", ".join(f"{w.name()}: {r.get('reason') or r.get('problems')}" for w, r in refusals)
    return _refused(503, "worker_unavailable", f"not applied on any worker ({names})", views)
