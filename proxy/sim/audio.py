"""Audible, deterministic speech-like PCM for the simulator.

The simulator's audio is real PCM16 little-endian mono: text becomes a sequence of
syllables, each a pitched vowel (a harmonic tone shaped by vowel formants, with a
short consonant-like noise onset and a smooth envelope), separated by word gaps and
longer pauses at punctuation, with falling sentence intonation and a rise on
questions. A listener hears speech rhythm; the same text, voice and sample rate
always give the same bytes.

Cost: a syllable's waveform is built once from a single pitch period (tiled, so only
the envelope edges are computed per sample) and cached, so rendering a chunk is
slicing and joining cached ``bytes``: O(bytes), no per-sample Python work.

Timeline contract: :class:`SpeechAudio` maps sample offsets to PCM; the engine counts
tokens, and :meth:`SpeechAudio.token_range` converts tokens ``[a, b)`` to bytes at the
preset's token rate, so chunk ``k`` of an utterance is exactly the audio between its
first and last token.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from array import array
from bisect import bisect_right
from functools import lru_cache

__all__ = [
    "LEXICON",
    "SpeechAudio",
    "pcm_duration_s",
    "split_sentences",
    "synthesize",
    "wav_header",
    "words_for_tokens",
]

_AMPLITUDE = 0.45 * 32767
_FORMANTS: dict[str, tuple[tuple[float, float], ...]] = {
    # (centre Hz, relative gain) of F1-F3 for five cardinal vowels.
    "a": ((730, 1.0), (1090, 0.55), (2440, 0.25)),
    "e": ((530, 1.0), (1840, 0.5), (2480, 0.3)),
    "i": ((270, 1.0), (2290, 0.45), (3010, 0.3)),
    "o": ((570, 1.0), (840, 0.7), (2410, 0.2)),
    "u": ((300, 1.0), (870, 0.5), (2240, 0.15)),
}
_VOWEL_OF = {
    **dict.fromkeys("aàáâäãå", "a"),
    **dict.fromkeys("eèéêë", "e"),
    **dict.fromkeys("iìíîïy", "i"),
    **dict.fromkeys("oòóôöõø", "o"),
    **dict.fromkeys("uùúûü", "u"),
}
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?|[.!?;:,\u3002\uff01\uff1f\uff0c]")
_VOWEL_GROUP = re.compile(r"[aeiouyàáâäãåèéêëìíîïòóôöõøùúûü]+")
_SENTENCE = re.compile(r"[^.!?\u3002\uff01\uff1f]+[.!?\u3002\uff01\uff1f]*")

#: Words for simulated transcripts and babble.
_LEXICON_TEXT = (
    "the a to and of in is it you that we for on this with be are have your "
    "can will not just so what about there time now here more when all people "
    "good know think like want need work see day make well way really right "
    "today call back next order help check account number please thank yes "
    "okay sure maybe later again first last week morning evening service "
    "delivery address payment ticket booking flight hotel weather music news "
    "station minute hour price total update status message voice speech"
)
LEXICON: tuple[str, ...] = tuple(_LEXICON_TEXT.split(" "))


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """A 44-byte PCM16 mono RIFF header; ``None`` size writes the streaming
    placeholder 0xFFFFFFFF (as vLLM-Omni and OpenAI do)."""
    riff = 0xFFFFFFFF if data_bytes is None else 36 + data_bytes
    data = 0xFFFFFFFF if data_bytes is None else data_bytes
    return b"".join(
        (
            b"RIFF",
            riff.to_bytes(4, "little"),
            b"WAVEfmt ",
            (16).to_bytes(4, "little"),
            (1).to_bytes(2, "little"),
            (1).to_bytes(2, "little"),
            sample_rate.to_bytes(4, "little"),
            (sample_rate * 2).to_bytes(4, "little"),
            (2).to_bytes(2, "little"),
            (16).to_bytes(2, "little"),
            b"data",
            data.to_bytes(4, "little"),
        )
    )


def pcm_duration_s(n_bytes: int, sample_rate: int) -> float:
    """Seconds of PCM16 mono audio in ``n_bytes``."""
    return n_bytes / (2 * sample_rate)


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (terminal punctuation kept), stripped, empties dropped."""
    return [s.strip() for s in _SENTENCE.findall(text) if s.strip()]


def words_for_tokens(seed: int, start: int, end: int, token_rate_hz: float) -> str:
    """Transcript text for tokens ``[start, end)``: about 2.5 words per second of
    audio, chosen deterministically from :data:`LEXICON` by ``seed``."""
    per_token = 2.5 / token_rate_hz
    first = math.ceil(start * per_token - 1e-9)
    last = math.ceil(end * per_token - 1e-9)
    words = []
    for k in range(first, last):
        h = zlib.crc32(f"{seed}:{k}".encode())
        words.append(" " + LEXICON[h % len(LEXICON)])
    return "".join(words)


@lru_cache(maxsize=64)
def _noise(sample_rate: int) -> bytes:
    # 40 ms of soft, slightly low-passed noise: the consonant onset.
    rng = random.Random(sample_rate)
    n = sample_rate // 25
    out = array("h")
    prev = 0.0
    for i in range(n):
        prev = 0.6 * prev + 0.4 * rng.uniform(-1.0, 1.0)
        fade = math.sin(math.pi * i / n)
        out.append(int(0.09 * 32767 * prev * fade))
    return out.tobytes()


@lru_cache(maxsize=256)
def _period(sample_rate: int, vowel: str, period: int, level: float) -> array[int]:
    """One pitch period of the vowel, peak-normalised to ``level`` x the amplitude."""
    f0 = sample_rate / period
    harmonics = []
    k = 1
    while k * f0 < min(4000.0, 0.45 * sample_rate):
        f = k * f0
        gain = sum(g / (1.0 + ((f - c) / 110.0) ** 2) for c, g in _FORMANTS[vowel])
        harmonics.append((k, gain / k**0.5))
        k += 1
    wave = [
        sum(a * math.sin(2 * math.pi * h * n / period + 0.3 * h) for h, a in harmonics)
        for n in range(period)
    ]
    peak = max(abs(v) for v in wave) or 1.0
    return array("h", (int(_AMPLITUDE * level * v / peak) for v in wave))


@lru_cache(maxsize=2048)
def _syllable(
    sample_rate: int, vowel: str, period: int, centis: int, level: float, onset: bool
) -> bytes:
    """A syllable ``centis`` hundredths of a second long (cached)."""
    n = sample_rate * centis // 100
    body = array("h")
    body.frombytes(_period(sample_rate, vowel, period, level).tobytes() * (n // period + 1))
    del body[n:]
    attack = min(n // 3, sample_rate // 50)
    release = min(n // 2, sample_rate // 20)
    for i in range(attack):
        body[i] = int(body[i] * 0.5 * (1 - math.cos(math.pi * i / attack)))
    for i in range(release):
        j = n - 1 - i
        body[j] = int(body[j] * 0.5 * (1 - math.cos(math.pi * i / release)))
    pcm = body.tobytes()
    if onset:
        noise = _noise(sample_rate)
        pcm = noise[: min(len(noise), len(pcm) // 4) & ~1] + pcm
    return pcm


def _period_for(sample_rate: int, f0: float) -> int:
    # Quantise pitch to quarter-tones so the cache stays small.
    q = round(math.log2(f0 / 55.0) * 24) / 24
    return max(8, round(sample_rate / (55.0 * 2**q)))


def _voice_f0(voice: str) -> float:
    return 95.0 + (zlib.crc32(voice.encode()) % 130)


class SpeechAudio:
    """The PCM timeline of one utterance; grows with :meth:`extend`."""

    def __init__(self, sample_rate: int, voice: str = "default", speed: float = 1.0) -> None:
        if not 4000 <= sample_rate <= 96000:
            raise ValueError("sample_rate must be within 4000..96000 Hz")
        if not 0.25 <= speed <= 4.0:
            raise ValueError("speed must be within 0.25..4.0")
        self.sample_rate = sample_rate
        self.voice = voice
        self.speed = speed
        self._f0 = _voice_f0(voice)
        self._starts: list[int] = []
        self._pieces: list[bytes] = []
        self.total_samples = 0
        self.text = ""

    @property
    def duration_s(self) -> float:
        return self.total_samples / self.sample_rate

    def _append(self, pcm: bytes) -> None:
        if pcm:
            self._starts.append(self.total_samples)
            self._pieces.append(pcm)
            self.total_samples += len(pcm) // 2

    def _silence(self, seconds: float) -> None:
        self._append(bytes(2 * int(self.sample_rate * seconds / self.speed)))

    def extend(self, text: str) -> None:
        """Append the speech for ``text`` (may be called again to continue)."""
        self.text += text
        tokens = _WORD.findall(text.lower())
        words = [t for t in tokens if t[0].isalnum()]
        if not self.total_samples:
            self._silence(0.08)
        question = text.rstrip().endswith(("?", "\uff1f"))
        spoken = 0
        for token in tokens:
            if not token[0].isalnum():
                self._silence(0.38 if token in ".!?\u3002\uff01\uff1f" else 0.2)
                continue
            spoken += 1
            progress = spoken / max(1, len(words))
            semis = 2.0 - 4.0 * progress + (5.0 if question and spoken == len(words) else 0.0)
            groups = _VOWEL_GROUP.findall(token) or [""]
            if len(token) > 1 and all(ord(c) > 0x2E80 for c in token):
                groups = list(token)  # CJK: one syllable per character
            for i, group in enumerate(groups):
                h = zlib.crc32(f"{token}:{i}".encode())
                vowel = _VOWEL_OF.get(group[:1], "aeiou"[h % 5])
                stress = 1.5 if i == 0 else 0.0
                f0 = self._f0 * 2 ** ((semis + stress + (h % 5 - 2) * 0.4) / 12)
                centis = round((15 + h % 8) / self.speed)
                level = 1.0 if i == 0 else 0.8
                onset = i == 0 or h % 3 == 0
                self._append(
                    _syllable(
                        self.sample_rate,
                        vowel,
                        _period_for(self.sample_rate, f0),
                        max(4, centis),
                        level,
                        onset,
                    )
                )
            self._silence(0.05)

    def render(self, start: int, end: int) -> bytes:
        """PCM bytes of samples ``[start, end)`` (clipped to the timeline)."""
        start, end = max(0, start), min(end, self.total_samples)
        if end <= start:
            return b""
        i = bisect_right(self._starts, start) - 1
        parts = []
        pos = start
        while pos < end:
            piece_start = self._starts[i]
            piece = self._pieces[i]
            piece_end = piece_start + len(piece) // 2
            take_to = min(end, piece_end)
            parts.append(piece[2 * (pos - piece_start) : 2 * (take_to - piece_start)])
            pos = take_to
            i += 1
        return b"".join(parts)

    def tokens(self, token_rate_hz: float) -> int:
        """Codec tokens needed for the whole timeline at ``token_rate_hz``."""
        return max(1, math.ceil(self.duration_s * token_rate_hz - 1e-9))

    def sample_at(self, token: int, token_rate_hz: float) -> int:
        return min(self.total_samples, int(token * self.sample_rate / token_rate_hz))

    def token_range(self, start: int, end: int, token_rate_hz: float, *, final: bool) -> bytes:
        """PCM for tokens ``[start, end)``; ``final`` also takes the remainder."""
        a = self.sample_at(start, token_rate_hz)
        b = self.total_samples if final else self.sample_at(end, token_rate_hz)
        return self.render(a, b)


def synthesize(text: str, sample_rate: int, voice: str = "default", speed: float = 1.0) -> bytes:
    """The whole utterance as PCM16 bytes (convenience for non-streaming responses)."""
    audio = SpeechAudio(sample_rate, voice, speed)
    audio.extend(text)
    return audio.render(0, audio.total_samples)
