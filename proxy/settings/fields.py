"""The field types and checks the configuration's models share, and their frozen base.

Every model is a :class:`Frozen`: frozen and hashable (a reload compares old and new
settings), unknown keys refused, numbers accepted where text is expected, no NaN or
infinity.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "HASH_HOWTO",
    "Frozen",
    "Host",
    "Name",
    "Port",
    "PositiveSeconds",
    "Seconds",
    "Sha256",
    "UrlPath",
    "is_loopback",
]

#: The shell command that prints a key's SHA-256, quoted in error messages.
HASH_HOWTO = 'printf %s "$KEY" | sha256sum'


def _check_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
        raise ValueError(f"must use only letters, digits, '_', '.' and '-' (got {value!r})")
    return value


def _check_sha256(value: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        # Never echo the value: it may be the key itself, pasted by mistake.
        raise ValueError(
            f"must be 64 lowercase hex characters (got {len(value)} characters), the "
            f"SHA-256 of the key: {HASH_HOWTO}"
        )
    return value


def _check_path(value: str) -> str:
    if not value.startswith("/") or any(c in value for c in "?# \t\r\n"):
        raise ValueError(f"must start with '/' and have no query or spaces (got {value!r})")
    return value


Name = Annotated[str, AfterValidator(_check_name)]
Sha256 = Annotated[str, AfterValidator(_check_sha256)]
UrlPath = Annotated[str, AfterValidator(_check_path)]
Host = Annotated[str, Field(min_length=1)]
Port = Annotated[int, Field(ge=0, le=65535)]  # 0 = any free port (tests)
Seconds = Annotated[float, Field(ge=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]


class Frozen(BaseModel):
    """The base of every section's model."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP address) is this machine's loopback."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
