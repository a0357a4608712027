"""``passthrough-ws`` / ``passthrough-http``: relay and gate only.

No audio is known in these streams, so every upstream frame (WebSocket) or body chunk
(HTTP, status < 400) is a gap-only event: the meter records inter-frame gaps, never audio
seconds, delivery ratios or playback stalls. Client traffic is not metered.
"""

from __future__ import annotations

from collections.abc import Mapping

from proxy.metering.adapters.base import MeterSink

__all__ = ["PassthroughHttpAdapter", "PassthroughWsAdapter"]


class PassthroughWsAdapter:
    """Each upstream message is one metered event."""

    __slots__ = ("_sink", "errors", "reads_binary")

    def __init__(self, sink: MeterSink) -> None:
        self._sink = sink
        self.errors = 0
        self.reads_binary = False

    def upstream_text(self, now: float, text: str) -> None:
        try:
            self._sink.event(now)
        except Exception:
            self.errors += 1

    def upstream_binary(self, now: float, data: bytes, size: int = -1) -> None:
        try:
            self._sink.event(now)
        except Exception:
            self.errors += 1

    def client_text(self, now: float, text: str) -> None:
        """Not metered."""

    def client_binary(self, now: float, data: bytes) -> None:
        """Not metered."""

    def __repr__(self) -> str:
        return f"<PassthroughWsAdapter errors={self.errors}>"


class PassthroughHttpAdapter:
    """Each response-body chunk of a non-error response is one metered event."""

    __slots__ = ("_metered", "_sink", "errors")

    def __init__(self, sink: MeterSink) -> None:
        self._sink = sink
        self._metered = False
        self.errors = 0

    def request(
        self, method: str, query: Mapping[str, str], content_type: str | None, body: bytes
    ) -> None:
        """Not metered."""

    def request_complete(self, now: float) -> None:
        """Not metered."""

    def response_start(self, status: int, headers: Mapping[str, str]) -> None:
        self._metered = status < 400

    def response_chunk(self, now: float, chunk: bytes) -> None:
        if not self._metered:
            return
        try:
            self._sink.event(now)
        except Exception:
            self.errors += 1

    def response_complete(self, now: float) -> None:
        return None

    def __repr__(self) -> str:
        return f"<PassthroughHttpAdapter errors={self.errors}>"
