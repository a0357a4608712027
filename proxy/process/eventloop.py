"""How every ``headroom`` command runs its event loop: uvloop where the platform has it.

Its own module so that the commands (:mod:`proxy.process.cli`, :mod:`proxy.process.demo`,
:mod:`proxy.process.workers`) share it without importing each other
(``tests/unit/test_import_graph.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

__all__ = ["run_async"]


def run_async(coro: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where the platform has it (cheaper per relayed frame)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        asyncio.run(coro)
        return
    uvloop.run(coro)
