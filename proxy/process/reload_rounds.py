"""The supervisor's end of a reload under ``headroom serve --workers N``: rounds over
every worker's control channel (:mod:`proxy.process.worker_control`, which describes a round),
one at a time, and the answer that lists what every worker now runs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.errors import ConfigError
from proxy.process.admin import ReloadAnswer
from proxy.process.worker_control import (
    RELOAD_DEADLINE_S,
    Channel,
    describe,
    digest,
    prepare_problems,
)
from proxy.settings import cut_short_problems, read_config_text

__all__ = ["ReloadRounds"]

log = logging.getLogger("headroom.workers")

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

    def expect(self, op: str, attempt: int) -> asyncio.Future[dict[str, Any]]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if not self.alive:
            future.set_result({"ok": False, "reason": "exited"})
        self.replies[(op, attempt)] = future
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
        self._attempts = itertools.count(1)
        self._draining = draining
        self._on_split = on_split
        self._deadline_s = deadline_s
        self._workers: list[_Worker] = []
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()

    def add(self, index: int, pid: int, sock: socket.socket, start: bytes = b"") -> None:
        """Worker ``index`` on its end ``sock``; ``start``: its :func:`start_frame`."""
        worker = _Worker(index, pid, Channel(sock, start))
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
            return ReloadAnswer.invalid([("<file>", "this gateway was not started from a file")])
        try:
            text = await asyncio.to_thread(read_config_text, self.config_path)
        except ConfigError as err:
            return ReloadAnswer.invalid(err.problems)
        if problems := cut_short_problems(text):
            return ReloadAnswer.invalid(problems)
        if problems := await asyncio.to_thread(prepare_problems, text, self.config_path):
            return ReloadAnswer.invalid(problems)
        generation, attempt = self.generation + 1, next(self._attempts)
        workers = list(self._workers)
        prepared = await self._step(workers, "prepare", attempt,
                                    text=text, source=self.config_path)  # fmt: skip
        refusals = [(w, r) for w, r in prepared if not r.get("ok")]
        if refusals:
            for w in workers:
                w.channel.send({"op": "abort", "round": attempt})
            return _not_prepared(refusals, [self._view(w) for w in workers])
        committed = await self._step(workers, "commit", attempt, generation=generation)
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
        self, workers: list[_Worker], op: str, attempt: int, **extra: Any
    ) -> list[tuple[_Worker, dict[str, Any]]]:
        """Send ``op`` of round ``attempt`` to every worker and wait for each one's reply,
        or the deadline."""
        reply_op = "prepared" if op == "prepare" else "applied"
        futures = [w.expect(reply_op, attempt) for w in workers]
        for w in workers:
            w.channel.send({"op": op, "round": attempt, **extra})
        await asyncio.wait(futures, timeout=self._deadline_s)
        replies = []
        for w, future in zip(workers, futures, strict=True):
            w.replies.pop((reply_op, attempt), None)
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


def _refused(status: int, kind: str, message: str, views: list[dict[str, Any]]) -> ReloadAnswer:
    return ReloadAnswer(status, {"reloaded": False, "error": {"type": kind, "message": message},
                                 "workers": views})  # fmt: skip


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
