"""What proxy/relay/library_contract.py takes from uvicorn and websockets beyond their
published API still exists and behaves as Headroom uses it. CI runs this module on the
newest releases pyproject.toml allows and again on the lowest (.ci/run)."""

from __future__ import annotations

import os

from proxy.relay import library_contract
from proxy.relay.wsframes import mask_bytes


def test_websockets_c_masking_is_the_rfc_6455_xor() -> None:
    fast = library_contract.fast_mask()
    assert fast is not None  # the wheels CI installs carry it
    key = b"\x01\x80\xfe\x7f"
    for size in (0, 1, 3, 4, 5, 125, 126, 9600, 65537):
        data = os.urandom(size)
        assert bytes(fast(data, key)) == mask_bytes(data, key), size
