"""The presets against every published figure: fails when a preset drifts.

``python -m proxy.sim.validate --write docs/sim.md`` regenerates the table; this test
re-runs it and checks both the tolerance and that the doc shows what the code gives.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.sim.validate import BEGIN, END, PUBLISHED, TOLERANCE, compare, main, table

DOC = Path(__file__).resolve().parents[2] / "docs" / "sim.md"


@pytest.fixture(scope="module")
def rows() -> list:
    return compare()


def test_every_published_point_is_within_tolerance(rows: list) -> None:
    assert len(rows) == len(PUBLISHED)
    off = [
        f"{r.point.preset} c={r.point.concurrency} {r.point.metric}: {r.error:+.1%}"
        for r in rows
        if abs(r.error) > TOLERANCE
    ]
    assert off == []


def test_rtf_and_ttfa_are_both_checked_for_each_fitted_curve() -> None:
    metrics = {(p.preset, p.metric) for p in PUBLISHED}
    for preset in ("h200-qwen3tts-1.7b", "h200-voxtral-tts-4b"):
        assert {(preset, "rtf"), (preset, "ttfa")} <= metrics
    assert all(p.sample in ("in-sample", "held-out") for p in PUBLISHED)


def test_docs_show_the_table_the_code_gives(rows: list) -> None:
    doc = DOC.read_text(encoding="utf-8")
    section = doc.split(BEGIN, 1)[1].split(END, 1)[0]
    assert section.strip() == table(rows).strip()


def test_write_replaces_only_the_marked_section(tmp_path: Path) -> None:
    doc = tmp_path / "sim.md"
    doc.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n", encoding="utf-8")
    assert main(["--write", str(doc)]) == 0
    text = doc.read_text(encoding="utf-8")
    assert text.startswith(f"before\n{BEGIN}\n| preset |") and text.endswith(f"{END}\nafter\n")
    assert "old" not in text
