"""proxy.process.console.say: an operator line reaches stderr in one write, so lines from
``--workers`` processes sharing one stderr never break into each other."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.process.console import say

ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None: ...


def test_a_line_and_its_newline_are_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    monkeypatch.setattr(sys, "stderr", recorder)
    say("headroom: serving on http://127.0.0.1:8080")
    assert recorder.writes == ["headroom: serving on http://127.0.0.1:8080\n"]


def test_lines_from_processes_sharing_stderr_arrive_whole() -> None:
    """Four processes write 300 lines each into one pipe at once; every line comes out
    whole (print would write the text and its newline apart)."""
    read_end, write_end = os.pipe()
    script = (
        "import sys; from proxy.process.console import say\n"
        "for n in range(300): say(f'headroom: worker {sys.argv[1]} line {n} ' + 'x' * 60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(i)], stderr=write_end, env=env)
        for i in range(4)
    ]
    os.close(write_end)
    with os.fdopen(read_end) as reader:
        lines = reader.read().splitlines()
    assert [p.wait(60) for p in procs] == [0, 0, 0, 0]
    whole = re.compile(r"headroom: worker [0-3] line \d+ x{60}")
    assert len(lines) == 1200
    assert all(whole.fullmatch(line) for line in lines)


@pytest.mark.parametrize("module", ["proxy/process/cli.py", "proxy/process/workers.py"])
def test_the_serve_commands_write_operator_lines_with_say(module: str) -> None:
    """Those two run in every worker and in the supervisor at once."""
    assert "file=sys.stderr" not in (ROOT / module).read_text()
