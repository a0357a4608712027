"""Lines for the operator on standard error, each written whole.

``headroom serve --workers N`` runs N gateway processes and their supervisor on one
stderr. Python writes ``sys.stderr`` through (no buffer), so ``print(line,
file=sys.stderr)`` is two system calls, the text and then the newline, and another
process's line can land between them: ``headroom: serving on http://...{"ts": ...}``, one
line broken in two for whoever reads the log. :func:`say` writes the line and its newline
in one call; a pipe takes a write of up to 4 KiB whole (POSIX ``PIPE_BUF``).
"""

from __future__ import annotations

import sys

__all__ = ["say"]


def say(line: str) -> None:
    """Write ``line`` and a newline to stderr in one write."""
    stream = sys.stderr
    stream.write(line + "\n")
    stream.flush()
