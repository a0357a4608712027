"""websockets' C speedups are optional: without them the relay masks in pure Python."""

from __future__ import annotations

import importlib
import sys

import pytest

import proxy.relay.frames as wsframes


def test_frames_are_masked_without_websockets_speedups(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = wsframes.apply_mask
    monkeypatch.setitem(sys.modules, "websockets.speedups", None)  # import fails
    try:
        pure = importlib.reload(wsframes)
        assert pure.apply_mask is not fast
        assert pure.apply_mask.__module__ == "websockets.utils"
        data, mask = bytes(range(256)) * 3 + b"odd", b"\x01\x80\xfe\x7f"
        assert pure.apply_mask(data, mask) == fast(data, mask)
        frame = pure.frame(pure.BINARY, data, masked=True)
        assert len(frame) > len(data)
    finally:
        monkeypatch.undo()
        importlib.reload(wsframes)
    assert wsframes.apply_mask is fast
