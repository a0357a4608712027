"""The one module that uses names uvicorn and websockets do not publish.

Everything else in ``proxy/`` reaches uvicorn through ``uvicorn.Config``/``uvicorn.Server``
and the protocol classes it is given (``Config(http=...)``, ``Config(ws=...)``), and
websockets through its documented API. What is here has no published equivalent;
tests/unit/test_library_contract.py checks each name against the installed release,
and CI runs it on the lowest and the newest releases pyproject.toml allows.

- :func:`fast_mask`: websockets' C masking function (``websockets.speedups``), about
  fifty times faster than the pure-Python XOR on a 10 KB payload; without it (a pure
  wheel, a source build) the framing module masks in pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["fast_mask"]


def fast_mask() -> Callable[[bytes, bytes], bytes] | None:
    """websockets' C ``apply_mask(data, key)``, or None where it is not installed."""
    try:
        from websockets.speedups import apply_mask
    except ImportError:
        return None
    return apply_mask
