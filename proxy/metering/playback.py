"""A model of the listener's playback buffer, driven by chunk arrival times.

Pure: no clock reads; every method takes the arrival time ``now`` (monotonic seconds).

The model, for one stream:

- Playback starts ``prebuffer_s`` after the first chunk arrives (a player's jitter
  buffer), then drains at 1 s of audio per wall second. Each chunk adds its seconds.
- ``played_until`` is the wall time at which everything received so far will have played.
  A chunk arriving at or before it is in time. A chunk arriving after it found the buffer
  dry: that is one **underrun**, and ``now - played_until`` is its **stall** (the silence the
  listener heard until this chunk arrived).
- After a stall, playback **resumes immediately** with the chunk that ended it (no new
  prebuffer): a player that re-buffered would add its prebuffer to every stall, which would
  be the player's choice, not the upstream's. One pause gives exactly one underrun.
- :meth:`idle` marks that the upstream delivered everything asked of it (a response
  ended; it waits for the client): the buffer may then run dry without an underrun; if it
  has, the next chunk starts a new stream (with a new prebuffer); if it has not, the next
  chunk simply queues behind the remaining audio.
- :meth:`finish` ends the stream: queued audio plays out and nothing after the last chunk
  is a stall (a finished stream cannot be told from a silent one).
- An underrun ended by a stream's second chunk (the buffer only ever held the first one)
  is also counted as a **first-chunk underrun**: the start-up transient of an engine whose
  first chunk is small and whose second is a full-size one that takes longer to make. It
  says nothing about the replica running slower than realtime, which every later underrun
  does; alerts tell the two apart (``stream_chunks`` is 2 right after such a chunk).

Chunks with no audio (``seconds <= 0``, NaN) are ignored: they neither feed the buffer nor
end a stall, so a pause split by an empty frame is still one underrun.
"""

from __future__ import annotations

__all__ = ["PlaybackBuffer"]


class PlaybackBuffer:
    """Counts modelled underruns and stall seconds of one stream."""

    __slots__ = (
        "_ended",
        "_finished",
        "_play_start",
        "_played_until",
        "_prebuffer",
        "first_chunk_underruns",
        "stall_seconds",
        "stream_chunks",
        "underruns",
    )

    def __init__(self, prebuffer_s: float = 0.2) -> None:
        if not prebuffer_s >= 0.0:
            raise ValueError(f"prebuffer_s must be >= 0, got {prebuffer_s!r}")
        self._prebuffer = prebuffer_s
        self._played_until: float | None = None  # None: not playing (nothing queued yet)
        self._play_start = 0.0  # when playback of the current stream (re)started
        self._ended = False  # idle: the upstream waits for the client; running dry is expected
        self._finished = False
        #: Times the buffer ran dry while more audio of the stream was still to come.
        self.underruns = 0
        #: Seconds of silence heard because of those underruns.
        self.stall_seconds = 0.0
        #: Of :attr:`underruns`, those ended by a stream's second chunk (module docstring).
        self.first_chunk_underruns = 0
        #: Audio chunks of the current stream (since playback last (re)started with a
        #: prebuffer), including the one just added.
        self.stream_chunks = 0

    @property
    def prebuffer_s(self) -> float:
        return self._prebuffer

    @property
    def started(self) -> bool:
        """Whether any audio has arrived."""
        return self._played_until is not None

    def add(self, now: float, seconds: float) -> float:
        """A chunk of ``seconds`` of audio arrived at ``now``.

        Returns the stall this chunk ended (seconds > 0: one new underrun), else 0.0."""
        if not seconds > 0.0 or self._finished:
            return 0.0
        until = self._played_until
        if until is None or (self._ended and now > until):
            self._play_start = now + self._prebuffer
            self._played_until = self._play_start + seconds
            self._ended = False
            self.stream_chunks = 1
            return 0.0
        self._ended = False
        self.stream_chunks += 1
        if now <= until:
            self._played_until = until + seconds
            return 0.0
        stall = now - until
        self.underruns += 1
        self.stall_seconds += stall
        if self.stream_chunks == 2:
            self.first_chunk_underruns += 1
        self._played_until = now + seconds
        return stall

    def idle(self, now: float) -> None:
        """The upstream has nothing more to send until the client asks: drain freely."""
        if self._played_until is not None:
            self._ended = True

    def finish(self, now: float) -> None:
        """The stream is over: queued audio plays out; later chunks are ignored."""
        self._finished = True

    def buffered(self, now: float) -> float:
        """Seconds of audio received but not yet played at ``now``."""
        if self._played_until is None:
            return 0.0
        return max(self._played_until - max(now, self._play_start), 0.0)

    def __repr__(self) -> str:
        return (
            f"<PlaybackBuffer prebuffer={self._prebuffer}s underruns={self.underruns} "
            f"(first-chunk {self.first_chunk_underruns}) stall={self.stall_seconds:.3f}s>"
        )
