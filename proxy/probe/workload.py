"""Probe workloads: the requests sessions send, loaded from YAML or JSONL, sampled seeded.

YAML::

    kind: tts                      # tts (text in, audio out) or asr (audio in, text out)
    seed: 7                        # optional default seed (``--seed`` wins)
    defaults: {voice: vivian}      # optional: fields every request inherits
    requests:
      - text: "Your order has shipped."
        weight: 3                  # optional sampling weight (default 1)
      - text: "..."
        voice: ryan
        instructions: "calm, slow"
        ref_audio: clips/me.wav    # voice-clone reference: a file (relative to this
        ref_text: "what me.wav says"  # workload), an http(s) URL or a data: URI
        extra: {language: English} # merged as is into the request / session.config

ASR requests name a WAV file (``audio``, relative to the workload; any rate, mono or
stereo, PCM16) and optionally ``seconds``: the clip is looped or cut to that length.
JSONL: one request object per line (no ``defaults``); the kind follows from the fields.
A bare name ``tts`` or ``asr`` (no such file) means the bundled workload.

Errors are :class:`WorkloadError` naming the file, the request and the field.
"""

from __future__ import annotations

import array
import base64
import bisect
import io
import itertools
import json
import random
import sys
import wave
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from proxy.settings import strict_yaml

__all__ = [
    "ASR_SAMPLE_RATE",
    "AudioRequest",
    "Request",
    "Sampler",
    "SpeechRequest",
    "Workload",
    "WorkloadError",
    "bundled",
    "load_workload",
    "open_workload",
    "read_wav",
]

#: Every ASR clip is converted to PCM16 mono at this rate (vLLM realtime's input rate).
ASR_SAMPLE_RATE = 16000
_TTS_FIELDS = {"text", "voice", "model", "instructions", "ref_audio", "ref_text", "extra", "weight"}
_ASR_FIELDS = {"audio", "seconds", "language", "model", "extra", "weight"}


class WorkloadError(ValueError):
    """The workload file cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    """One TTS request. ``ref_audio`` is a URL or a ``data:`` URI by now."""

    text: str
    voice: str | None = None
    model: str | None = None
    instructions: str | None = None
    ref_audio: str | None = None
    ref_text: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class AudioRequest:
    """One ASR request: ``pcm`` is PCM16 mono at :data:`ASR_SAMPLE_RATE`."""

    pcm: bytes
    name: str = "clip"
    language: str | None = None
    model: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    weight: float = 1.0

    @property
    def seconds(self) -> float:
        return len(self.pcm) / (2 * ASR_SAMPLE_RATE)


Request = SpeechRequest | AudioRequest


class Sampler:
    """Draws requests by weight from one seeded generator (same seed, same sequence)."""

    def __init__(self, requests: tuple[Request, ...], seed: int) -> None:
        self._requests = requests
        self._cumulative = list(itertools.accumulate(r.weight for r in requests))
        self._rng = random.Random(seed)

    def next(self) -> Request:
        point = self._rng.random() * self._cumulative[-1]
        index = bisect.bisect_right(self._cumulative, point)
        return self._requests[min(index, len(self._requests) - 1)]


@dataclass(frozen=True, slots=True)
class Workload:
    """A validated workload: every request of one ``kind``, at least one."""

    kind: Literal["tts", "asr"]
    requests: tuple[Request, ...]
    source: str
    seed: int | None = None

    def sampler(self, seed: int) -> Sampler:
        return Sampler(self.requests, seed)

    def preflight_request(self) -> Request:
        """What the pre-flight check sends: the shortest TTS text, or the median-length
        ASR clip (long enough for several transcript events, to learn their share)."""

        def size(r: Request) -> float:
            return len(r.text) if isinstance(r, SpeechRequest) else r.seconds

        ordered = sorted(self.requests, key=size)
        return ordered[0] if self.kind == "tts" else ordered[len(ordered) // 2]


def read_wav(data: bytes, where: str = "audio") -> bytes:
    """PCM16 mono at :data:`ASR_SAMPLE_RATE` from a PCM16 WAV (mixed down, resampled)."""
    try:
        with wave.open(io.BytesIO(data)) as wav:
            width, channels = wav.getsampwidth(), wav.getnchannels()
            rate, frames = wav.getframerate(), wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as exc:
        raise WorkloadError(f"{where}: not a readable WAV file ({exc})") from None
    if width != 2:
        raise WorkloadError(f"{where}: WAV must be 16-bit PCM, got {8 * width}-bit")
    samples = array.array("h")
    samples.frombytes(frames[: len(frames) - len(frames) % (2 * channels)])
    if sys.byteorder == "big":
        samples.byteswap()
    if channels > 1:
        samples = array.array(
            "h",
            (sum(samples[i : i + channels]) // channels for i in range(0, len(samples), channels)),
        )
    if rate != ASR_SAMPLE_RATE and len(samples) > 1:
        step = rate / ASR_SAMPLE_RATE
        out = array.array("h")
        for i in range(int((len(samples) - 1) / step)):
            pos = i * step
            j = int(pos)
            frac = pos - j
            out.append(round(samples[j] * (1 - frac) + samples[j + 1] * frac))
        samples = out
    if not samples:
        raise WorkloadError(f"{where}: the WAV file holds no audio")
    if sys.byteorder == "big":
        samples.byteswap()
    return samples.tobytes()


def _loop(pcm: bytes, seconds: float) -> bytes:
    want = max(int(seconds * ASR_SAMPLE_RATE), 1) * 2
    return (pcm * (want // len(pcm) + 1))[:want]


def _str(item: Mapping[str, Any], key: str, where: str) -> str | None:
    value = item.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise WorkloadError(f"{where}: '{key}' must be a non-empty string")
    return value


def _ref_audio(value: str, base: Path | None, where: str) -> str:
    if value.startswith(("http://", "https://", "data:", "file:")):
        return value
    path = (base / value) if base is not None else Path(value)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WorkloadError(f"{where}: cannot read ref_audio {str(path)!r}: {exc}") from None
    return "data:audio/wav;base64," + base64.b64encode(data).decode("ascii")


def _request(
    item: Any, kind: str, base: Path | None, where: str, clips: dict[str, bytes]
) -> Request:
    if not isinstance(item, dict):
        raise WorkloadError(f"{where}: a request must be a mapping of fields")
    allowed = _TTS_FIELDS if kind == "tts" else _ASR_FIELDS
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise WorkloadError(
            f"{where}: unknown field(s) {', '.join(unknown)} for a {kind} request; "
            f"use {', '.join(sorted(allowed))}"
        )
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise WorkloadError(f"{where}: 'weight' must be a number > 0")
    extra = item.get("extra", {})
    if not isinstance(extra, dict):
        raise WorkloadError(f"{where}: 'extra' must be a mapping")
    if kind == "tts":
        text = _str(item, "text", where)
        if text is None or not text.strip():
            raise WorkloadError(f"{where}: 'text' is required and must not be blank")
        ref = _str(item, "ref_audio", where)
        return SpeechRequest(
            text=text,
            voice=_str(item, "voice", where),
            model=_str(item, "model", where),
            instructions=_str(item, "instructions", where),
            ref_audio=_ref_audio(ref, base, where) if ref else None,
            ref_text=_str(item, "ref_text", where),
            extra=extra,
            weight=float(weight),
        )
    name = _str(item, "audio", where)
    if name is None:
        raise WorkloadError(f"{where}: 'audio' (a WAV file) is required")
    if name not in clips:
        path = (base / name) if base is not None else Path(name)
        try:
            clips[name] = read_wav(path.read_bytes(), f"{where}: {path}")
        except OSError as exc:
            raise WorkloadError(f"{where}: cannot read audio {str(path)!r}: {exc}") from None
    pcm = clips[name]
    seconds = item.get("seconds")
    if seconds is not None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
            raise WorkloadError(f"{where}: 'seconds' must be a number > 0")
        pcm = _loop(pcm, float(seconds))
    return AudioRequest(
        pcm=pcm,
        name=name,
        language=_str(item, "language", where),
        model=_str(item, "model", where),
        extra=extra,
        weight=float(weight),
    )


def _parse(text: str, source: str) -> tuple[dict[str, Any], list[Any]]:
    """``(header, request items)`` of a YAML or JSONL document."""
    if source.endswith(".jsonl"):
        items = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise WorkloadError(f"{source}:{n}: invalid JSON ({exc.msg})") from None
        return {}, items
    try:
        doc = strict_yaml.load(text, name=source)
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{source}: invalid YAML: {exc}") from None
    if isinstance(doc, list):
        return {}, doc
    if not isinstance(doc, dict) or not isinstance(doc.get("requests"), list):
        raise WorkloadError(f"{source}: expected a mapping with a 'requests' list")
    return doc, doc["requests"]


def load_workload(text: str, source: str, base: Path | None = None) -> Workload:
    """Validate a workload document (``source`` names it in errors; ``.jsonl`` selects
    JSONL); relative file names resolve against ``base``."""
    header, items = _parse(text, source)
    unknown = sorted(set(header) - {"kind", "seed", "defaults", "requests"})
    if unknown:
        raise WorkloadError(f"{source}: unknown top-level field(s) {', '.join(unknown)}")
    defaults = header.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise WorkloadError(f"{source}: 'defaults' must be a mapping")
    if not items:
        raise WorkloadError(f"{source}: the workload has no requests")
    kind = header.get("kind")
    if kind is None:
        first = {**defaults, **items[0]} if isinstance(items[0], dict) else {}
        kind = "asr" if "audio" in first else "tts"
    if kind not in ("tts", "asr"):
        raise WorkloadError(f"{source}: 'kind' must be tts or asr, got {kind!r}")
    seed = header.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise WorkloadError(f"{source}: 'seed' must be an integer")
    clips: dict[str, bytes] = {}
    requests = tuple(
        _request(
            {**defaults, **item} if isinstance(item, dict) else item,
            kind,
            base,
            f"{source}: requests[{i}]",
            clips,
        )
        for i, item in enumerate(items)
    )
    return Workload("asr" if kind == "asr" else "tts", requests, source, seed)


def bundled(kind: str) -> Workload:
    """The workload shipped with Headroom for ``kind`` (tts or asr)."""
    data = resources.files("proxy.probe").joinpath("data")
    text = data.joinpath(f"{kind}.yaml").read_text(encoding="utf-8")
    with resources.as_file(data) as base:
        return load_workload(text, f"bundled:{kind}", Path(base))


def open_workload(name: str) -> Workload:
    """A workload file, or the bundled ``tts`` / ``asr`` workload for those bare names."""
    path = Path(name)
    if name in ("tts", "asr") and not path.exists():
        return bundled(name)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {name!r}: {exc}") from None
    return load_workload(text, name, path.parent)
