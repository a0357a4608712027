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
dies). Workers never keep serving on configurations that disagree. They also start on one
configuration: the text the supervisor read, the first bytes on each control socket
(:func:`start_frame`), never the file as it is when each worker starts (generation 0).

This module is the channel and the worker's end; the supervisor's is
:mod:`proxy.process.reload_rounds`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import socket
import struct
from typing import Any, Protocol

from proxy.errors import ConfigError
from proxy.process.admin import ReloadAnswer, problem_list
from proxy.settings import Settings
from proxy.settings.loading import MAX_CONFIG_BYTES

__all__ = [
    "RELOAD_DEADLINE_S",
    "Channel",
    "WorkerControl",
    "describe",
    "digest",
    "prepare_problems",
    "read_start",
    "start_frame",
]

log = logging.getLogger("headroom.workers")

#: How long the supervisor waits for every worker's answer to one step of a reload.
RELOAD_DEADLINE_S = 10.0
#: How long a starting worker waits for its configuration from the supervisor.
START_TIMEOUT_S = 60.0
#: The largest message line. The largest message is a reload's ``prepare``: one
#: configuration file, JSON-escaped without ``\\u`` escapes for non-ASCII text, so at
#: most two bytes per byte of YAML text (quotes, backslashes, tabs and newlines take
#: two), plus the round, source path and field names. A file whose escaped text is longer
#: (control characters, which YAML refuses anyway) is refused before it is sent
#: (:func:`prepare_problems`).
MAX_MESSAGE_BYTES = 2 * MAX_CONFIG_BYTES + 64 * 1024
#: Lines up to this size are parsed on the event loop; longer ones in a worker thread.
PARSE_INLINE_BYTES = 64 * 1024
#: The keys a message too large to send keeps (small scalars): its answer becomes a
#: failure the other end reports, never a line the other end would refuse.
_ENVELOPE = ("op", "round", "request", "index", "pid", "gateway", "generation",
             "config_sha256")  # fmt: skip


def _encode(message: dict[str, Any]) -> bytes:
    text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    # a lone surrogate (an exception's repr may carry one) becomes its JSON escape
    return text.encode("utf-8", "backslashreplace") + b"\n"


def prepare_problems(text: str, source: str) -> list[tuple[str, str]]:
    """Why a ``prepare`` message carrying ``text`` could not cross the control channel
    (empty when it can): its JSON-escaped form is over :data:`MAX_MESSAGE_BYTES`."""
    size = len(_encode({"op": "prepare", "round": 0, "text": text, "source": source}))
    if size <= MAX_MESSAGE_BYTES - 32:  # room for the round number
        return []
    return [("<file>", (
        f"escapes to {size} bytes for the workers, over the control channel's "
        f"{MAX_MESSAGE_BYTES}: control characters other than tab and newline are not "
        "YAML; nothing applied"
    ))]  # fmt: skip


def _decode(line: bytes) -> Any:
    return json.loads(line)


def digest(text: str) -> str:
    """The SHA-256 of a configuration text: how workers tell whether they run the same one."""
    return hashlib.sha256(text.encode()).hexdigest()


def start_frame(text: str) -> bytes:
    """The first bytes on a control socket: the configuration the worker starts on (the
    text the supervisor read and validated), length first, so every worker starts on the
    same file whatever happens to it while they start (:func:`read_start`)."""
    data = text.encode()
    return struct.pack("!Q", len(data)) + data


def read_start(sock: socket.socket) -> str:
    """The text of :func:`start_frame`, read (blocking, bounded) before the worker's event
    loop runs; nothing after it is consumed. ConfigError if it does not come whole."""
    sock.settimeout(START_TIMEOUT_S)

    def exactly(size: int) -> bytes:
        data = b""
        while len(data) < size:
            chunk = sock.recv(min(size - len(data), 1 << 16))
            if not chunk:
                raise ConfigError([("<file>", "the supervisor sent no configuration")])
            data += chunk
        return data

    try:
        (size,) = struct.unpack("!Q", exactly(8))
        if size > MAX_CONFIG_BYTES:
            raise ConfigError([("<file>", f"the supervisor sent {size} bytes")])
        return exactly(size).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([("<file>", f"no configuration from the supervisor: {exc}")]) from None


class Channel:
    """One end of a control socket pair: JSON objects, one per line."""

    def __init__(self, sock: socket.socket, preamble: bytes = b"") -> None:
        self._sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        # written by open(): the start frame (:func:`start_frame`), then what was sent
        # before open()
        self._early: list[bytes] = [preamble] if preamble else []

    async def open(self) -> None:
        self._sock.setblocking(False)
        self._reader, self._writer = await asyncio.open_unix_connection(
            sock=self._sock, limit=MAX_MESSAGE_BYTES
        )
        self._writer.writelines(self._early)
        self._early.clear()

    def send(self, message: dict[str, Any]) -> None:
        """Queue ``message``. One over :data:`MAX_MESSAGE_BYTES` (the other end would
        refuse it and close the channel) is sent as its envelope with ``ok`` false and
        the reason, which the other end reports as a failed step."""
        line = _encode(message)
        if len(line) > MAX_MESSAGE_BYTES:
            log.error("control message %r of %d bytes is over the channel's %d; sent as a "
                      "failure", message.get("op"), len(line), MAX_MESSAGE_BYTES)  # fmt: skip
            reason = f"its {message.get('op')} message was over {MAX_MESSAGE_BYTES} bytes"
            failed = {k: message[k] for k in _ENVELOPE if k in message}
            failed.update(ok=False, reason=reason)
            if message.get("op") == "answer":
                failed.update(status=500, body={"reloaded": False, "error": {
                    "type": "control_message_too_large", "message": reason}})  # fmt: skip
            line = _encode(failed)
        if self._writer is None:
            self._early.append(line)
        elif not self._writer.is_closing():  # else the other end is gone (EOF for it)
            self._writer.write(line)

    async def receive(self) -> dict[str, Any] | None:
        """The next message; None once the other end has closed (or sent garbage)."""
        assert self._reader is not None
        try:
            line = await self._reader.readline()
            if not line:
                return None
            if len(line) > PARSE_INLINE_BYTES:
                message = await asyncio.to_thread(_decode, line)
            else:
                message = _decode(line)
        except (ValueError, ConnectionError):
            return None
        return message if isinstance(message, dict) else None

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        else:
            self._sock.close()


class ReloadTarget(Protocol):
    """What a worker's gateway does with a reload (:class:`~proxy.process.gateway.Gateway`)."""

    def validate_reload(self, text: str, source: str) -> Settings: ...

    def apply_reload(self, settings: Settings) -> list[str]: ...


class WorkerControl:
    """A worker's end: prepares, commits or drops what the supervisor sends, and asks
    it for a reload (the admin listener's, or a SIGHUP sent to this worker)."""

    def __init__(
        self, target: ReloadTarget, sock: socket.socket, index: int, gateway: str,
        config_sha256: str | None = None,
    ) -> None:  # fmt: skip
        self.target = target
        self.index = index
        self.gateway = gateway
        self.channel = Channel(sock)
        #: The configuration this worker runs: 0 is the one the supervisor started it on.
        self.generation = 0
        self.config_sha256 = config_sha256
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
        # "round" numbers each attempt (a late reply to an aborted one matches no other);
        # "generation" numbers what was applied.
        op, attempt = message.get("op"), message.get("round")
        if op == "prepare" and isinstance(attempt, int):
            text, source = str(message.get("text", "")), str(message.get("source", ""))
            try:
                settings = await asyncio.to_thread(self.target.validate_reload, text, source)
            except ConfigError as err:
                reply = {"ok": False, "problems": problem_list(err.problems)}
            except Exception as exc:  # a fault here must not end this channel
                log.exception("validating reload round %d failed", attempt)
                reply = {"ok": False, "reason": f"validating failed: {exc!r}"}
            else:
                self._prepared = {attempt: (settings, digest(text))}
                reply = {"ok": True}
            self.channel.send({"op": "prepared", "round": attempt, **reply})
        elif op == "commit" and isinstance(attempt, int):
            generation = message.get("generation")
            reply = self._commit(attempt, generation if isinstance(generation, int) else -1)
            self.channel.send({"op": "applied", "round": attempt, **reply})
        elif op == "abort":
            self._prepared.pop(attempt if isinstance(attempt, int) else -1, None)
        elif op == "answer":
            future = self._requests.pop(int(message.get("request", 0)), None)
            if future is not None and not future.done():
                body = message.get("body")
                status = int(message.get("status", 500))
                future.set_result(ReloadAnswer(status, body if isinstance(body, dict) else {}))

    def _commit(self, attempt: int, generation: int) -> dict[str, Any]:
        prepared = self._prepared.pop(attempt, None)
        if prepared is None:
            return {"ok": False, "reason": f"reload round {attempt} was not prepared here",
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
