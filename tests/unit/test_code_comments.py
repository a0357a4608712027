"""Code comments and docstrings describe today's code: no issue or PR numbers in them
(those belong in commit messages and the CHANGELOG). ``proxy/sim`` is left out: its
presets cite their published sources, PR numbers included, as data."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PROXY = Path(__file__).resolve().parents[2] / "proxy"
TRACKER = re.compile(r"\bissues? \d+|\(#\d+|\bPR #\d+", re.IGNORECASE)


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


def test_no_issue_or_pr_numbers_in_comments_or_docstrings() -> None:
    offenders = [
        f"{path.relative_to(PROXY.parent)}:{line}: {found.group(0)}"
        for path in sorted(PROXY.rglob("*.py"))
        if path.relative_to(PROXY).parts[0] != "sim"
        for line, text in _comments_and_docstrings(path)
        if (found := TRACKER.search(text))
    ]
    assert offenders == []
