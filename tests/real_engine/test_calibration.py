"""The calibration round trip on a real engine: ``headroom sim --calibrate`` measures
llama.cpp's ``llama-server`` (built by ``python -m bench.llama_engine``; .ci/run builds
it), the preset it writes predicts a ceiling, and ``headroom probe`` then measures the
ceiling on the same engine: the prediction must be within one level of what the probe
saw (its range widened by one stream each side).

The engine is CPU-bound on a machine other tests share, so no figure is fixed in
advance; both sides measure the same engine minutes apart, with the probe's own rules
(worst-1 % ratio 1.2, no stalls with a 0.2 s buffer, TTFA p99 within the real-engine
tier's 3 s) given to the simulator's ceiling search. Both send the probe's bundled texts
with ``cache_prompt: false``: the 48 texts come round again every few requests, which a
speech service's text does not, and llama-server would otherwise answer most prompts
from its prompt cache once the calibration had sent them, so the probe that follows
would measure a server whose prompts cost nothing.

What decides this server's ceiling is the step that carries a newcomer's prompt piece
(16 tokens): the streams already speaking wait for it, and at 8 tokens an audio second
a token may take at most 104 ms at 1.2x realtime. That step lies near the bound, so the
calibration measures it where it happens: its levels (1, 2, 3, 4 and 6 streams, the
range the probe's ceiling moves in) see newcomers join streams already decoding, and
the fit takes the cost of those steps beside 1-5 decoding streams and of the steps
without a prompt piece. The test runs ``alone`` (tests/machine_share.py): with a test on
the other worker taking the cores while one side measured and not while the other did,
the probe's ceiling moved over a wider range than the calibrations' steps did
(docs/sim.md §6 lists the runs). Alone, the machine still has slow spells the load
average does not show (it is a virtual machine), which can fall between the calibration
and the probe. So a miss is measured once more, calibration and probe both, on a fresh
server, and the test fails when that round trip misses too: a wrong prediction misses
both times, a slow spell rarely does.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.harness import free_port
from bench.llama_engine import cached_llama_server, default_cache, llama_server
from bench.real_engine import _probe, build_parser
from bench.tiny_model import TinyModel, ensure_model
from proxy.probe.workload import open_workload
from proxy.sim.calibrate import Calibration, measure, render
from proxy.sim.virtual_load import Rules, find_ceiling
from tests.real_engine.calibration_support import agrees, assert_predicts

pytestmark = [pytest.mark.slow, pytest.mark.alone]

TOKENS_PER_AUDIO_SECOND = 8.0
SLOTS = 16  # llama_server()'s default -np
BATCH_TOKENS = 16  # llama_server()'s default -b: the tokens one engine step carries
#: The calibration's levels: where newcomers' prompt pieces join a few decoding streams.
LEVELS = (1, 2, 3, 4, 6)
#: Round trips measured before a miss fails the test (module docstring).
ATTEMPTS = 2
#: The probe as the real-engine tier runs it in CI (tests/real_engine/test_real_engine.py).
PROBE = ["--levels", "2,4,...", "--max-level", str(SLOTS), "--hold", "6", "--warmup", "4",
         "--repeat", "1", "--probe-time-limit", "420"]  # fmt: skip


def workload_file(directory: Path) -> Path:
    """The probe's bundled TTS workload, every request with ``cache_prompt: false``."""
    text = resources.files("proxy.probe").joinpath("data", "tts.yaml").read_text("utf-8")
    doc = yaml.safe_load(text)
    doc.setdefault("defaults", {})["extra"] = {"cache_prompt": False}
    path = directory / "tts-uncached.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    return path


def predicted_ceiling(calibration: Calibration, ttfa_limit_s: float) -> int:
    """The calibrated preset's ceiling under the probe's rules."""
    rules = Rules(ttfa_p99_s=ttfa_limit_s)
    ceiling, _ = find_ceiling(calibration.preset(), rules=rules, limit=4 * SLOTS)
    return ceiling


def test_a_preset_calibrated_from_llama_server_predicts_the_probed_ceiling() -> None:
    binary = cached_llama_server()
    if binary is None:
        message = "llama-server is not built: python -m bench.llama_engine (a few minutes)"
        if os.environ.get("CI"):  # .ci/run builds it: a missing engine is a failure
            pytest.fail(f"{message}; CI must build it")
        pytest.skip(message)
    model = ensure_model(default_cache(), TinyModel())
    args = build_parser().parse_args(PROBE)

    async def main(workload: Path) -> tuple[Calibration, dict[str, Any]]:
        async with llama_server(binary, model, free_port(), slots=SLOTS,
                                batch=BATCH_TOKENS) as url:  # fmt: skip
            calibration = await measure(
                url, tokens_per_audio_second=TOKENS_PER_AUDIO_SECOND,
                levels=LEVELS, hold_s=6.0, warmup_s=3.0, max_num_seqs=SLOTS,
                batch_tokens=BATCH_TOKENS, workload=open_workload(str(workload)),
            )  # fmt: skip
            args.tokens_per_audio_second = TOKENS_PER_AUDIO_SECOND
            args.workload = str(workload)
            probe = await _probe(url, args)
        return calibration, probe

    for attempt in range(1, ATTEMPTS + 1):
        with tempfile.TemporaryDirectory() as tmp:
            calibration, probe = asyncio.run(main(workload_file(Path(tmp))))
        predicted = predicted_ceiling(calibration, args.ttfa_limit)
        assert calibration.per_stream_s > 0, render(calibration)
        assert calibration.prompt_tokens > 0, render(calibration)  # read from its /metrics
        if attempt == ATTEMPTS:
            assert_predicts(calibration, predicted, probe)
        elif agrees(calibration, predicted, probe):
            return
        else:
            print(f"round trip {attempt} of {ATTEMPTS} missed: measuring again")
