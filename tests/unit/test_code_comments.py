"""Code comments and docstrings describe today's code, under ``proxy/`` (the simulator
included) and in the Redis scripts (``proxy/admission/lua/*.lua``, whose comments are
``--`` lines):

* no issue or PR numbers (those belong in commit messages and the CHANGELOG). The
  simulator's presets cite their published sources, PR numbers included, as data: in
  strings, which are not comments;
* no measured figures (ranges of milliseconds or ratios, "was N %", "measured: N"):
  those belong in docs/performance.md and bench/RESULTS.md, where the run behind them is
  named;
* every module they name (``proxy/x/y.py``, ``proxy.x.y``, ``proxy.x.y.Name``) exists.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

PROXY = Path(__file__).resolve().parents[2] / "proxy"
ROOT = PROXY.parent
TRACKER = re.compile(r"\bissues? \d+|\(#\d+|\bPR #\d+", re.IGNORECASE)
FIGURE = re.compile(
    r"\d+(?:\.\d+)?\s?-\s?\d+(?:\.\d+)?\s?(?:ms|µs|us|x)\b"  # a measured range: 51-122 ms
    r"|\b(?:was|were)\s+\d+(?:\.\d+)?\s?%"  # GC was 6 %
    r"|\bmeasured:\s*\S*\d"  # (measured: 3.5 s)
)
LITERAL = re.compile(r"``[^`]*``")  # an example of output, not a figure
MODULE_PATH = re.compile(r"\bproxy/[\w/]+\.(?:py|lua)\b")
DOTTED = re.compile(r"(?<![\w/.])proxy(?:\.\w+)+")


def _comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    source = path.read_text()
    found = [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((node.body[0].lineno, docstring))
    return found


def _lua_comments(path: Path) -> list[tuple[int, str]]:
    """The ``--`` comment of each line (the scripts hold no ``--`` inside a string)."""
    return [
        (number, line[line.index("--") :])
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "--" in line
    ]


def _all_comments() -> list[tuple[str, int, str]]:
    out = [
        (str(path.relative_to(ROOT)), line, text)
        for path in sorted(PROXY.rglob("*.py"))
        for line, text in _comments_and_docstrings(path)
    ]
    out += [
        (str(path.relative_to(ROOT)), line, text)
        for path in sorted((PROXY / "admission" / "lua").glob("*.lua"))
        for line, text in _lua_comments(path)
    ]
    return out


def _names_a_module(dotted: str, root: Path = ROOT) -> bool:
    """``proxy.a.b`` is a module or package, or ``proxy.a.B...`` names something the
    module ``proxy.a`` defines or imports (its name appears in the module's source)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        source = (
            base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        )
        if source.is_file():
            rest = parts[n:]
            return (
                not rest or re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()) is not None
            )
    return False


def stale_references(texts: list[tuple[str, int, str]], root: Path = ROOT) -> list[str]:
    out = []
    for where, line, text in texts:
        for found in MODULE_PATH.finditer(text):
            if not (root / found.group(0)).is_file():
                out.append(f"{where}:{line}: {found.group(0)}")
        for found in DOTTED.finditer(text):
            if not _names_a_module(found.group(0), root):
                out.append(f"{where}:{line}: {found.group(0)}")
    return out


def test_no_issue_or_pr_numbers_in_comments_or_docstrings() -> None:
    offenders = [
        f"{where}:{line}: {found.group(0)}"
        for where, line, text in _all_comments()
        if (found := TRACKER.search(text))
    ]
    assert offenders == []


def test_no_measured_figures_in_comments_or_docstrings() -> None:
    offenders = [
        f"{where}:{line}: {found.group(0)}"
        for where, line, text in _all_comments()
        if (found := FIGURE.search(LITERAL.sub("", text)))
    ]
    assert offenders == []


def test_comments_name_modules_that_exist() -> None:
    assert stale_references(_all_comments()) == []


@pytest.mark.parametrize(
    ("text", "caught"),
    [
        ("# Tenants (issue 18): the rules", TRACKER),
        ("-- placement (PR #12)", TRACKER),
        ("# measured: 51-122 ms loop pauses", FIGURE),
        ("# GC was 6 % of the set-up CPU", FIGURE),
        ("it costs 6-11x the CPU", FIGURE),
    ],
)
def test_the_checks_catch_what_they_are_for(text: str, caught: re.Pattern[str]) -> None:
    assert caught.search(text)


def test_the_checks_pass_what_they_allow() -> None:
    assert not FIGURE.search(LITERAL.sub("", "a range such as ``1.57-1.61x``"))
    assert not FIGURE.search("closer than 5 % of the (log) axis; default 30 s")
    assert not TRACKER.search("an issue of ordering: 3 waiters")


def test_a_stale_module_name_is_found(tmp_path: Path) -> None:
    (tmp_path / "proxy" / "relay").mkdir(parents=True)
    (tmp_path / "proxy" / "__init__.py").write_text("")
    (tmp_path / "proxy" / "relay" / "__init__.py").write_text("")
    (tmp_path / "proxy" / "relay" / "relay_core.py").write_text("class RelayCore: ...\n")
    texts = [
        ("a.py", 1, "RelayCore (proxy/relay/relay_core.py, proxy.relay.relay_core.RelayCore)"),
        ("a.lua", 2, "-- the rule of proxy/relay/session_rules.py"),
        ("b.py", 3, "see proxy.relay.session_rules and proxy.relay.relay_core.Gone"),
    ]
    assert stale_references(texts, tmp_path) == [
        "a.lua:2: proxy/relay/session_rules.py",
        "b.py:3: proxy.relay.session_rules",
        "b.py:3: proxy.relay.relay_core.Gone",
    ]
