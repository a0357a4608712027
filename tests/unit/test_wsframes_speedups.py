"""websockets' C speedups are optional: without them the relay masks in pure Python."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import proxy.relay.wsframes as wsframes
from proxy.relay import library_contract


def _fresh_copy(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """proxy/relay/wsframes.py imported again as a module of its own (the one the relay
    uses is left as it is: its classes stay the ones other modules hold). The source,
    not ``__file__``: in the compiled build that is the extension module."""
    source = Path(wsframes.__file__ or "").with_name("wsframes.py")
    spec = importlib.util.spec_from_file_location("wsframes_copy", source)
    assert spec is not None and spec.loader is not None
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, copy)  # dataclasses look their module up
    spec.loader.exec_module(copy)
    return copy


def test_frames_are_masked_without_websockets_speedups(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = wsframes.apply_mask
    assert fast is library_contract.fast_mask()  # installed here: the C function
    assert _fresh_copy(monkeypatch).apply_mask is fast
    monkeypatch.setitem(sys.modules, "websockets.speedups", None)  # import fails
    assert library_contract.fast_mask() is None
    pure = _fresh_copy(monkeypatch)
    assert pure.apply_mask is pure.mask_bytes
    data, mask = bytes(range(256)) * 3 + b"odd", b"\x01\x80\xfe\x7f"
    assert pure.apply_mask(data, mask) == fast(data, mask)
    frame = pure.frame(pure.BINARY, data, masked=True)
    assert len(frame) > len(data)
