"""The models of client authentication: the API keys (one per tenant, stored as its
SHA-256, with its pools, caps and scheduling class) and whether keys are checked."""

from __future__ import annotations

import functools

from pydantic import Field, model_validator

from proxy.settings.environment import Problems
from proxy.settings.fields import Frozen, Name, Sha256

__all__ = ["ApiKeySettings", "AuthSettings"]


class ApiKeySettings(Frozen):
    """One tenant's key, stored as its SHA-256. ``pools`` empty = every pool;
    ``max_sessions`` caps the tenant's concurrent sessions (429 ``tenant_limit``).

    Scheduling (README "Tenants and priorities"): ``priority`` is the key's
    class (higher first; negative: sheddable), ``weight`` its share of session-seconds
    within the class (unset: the key shares its class's plain FIFO), ``max_queued`` its
    waiters in one pool's queue (429 ``tenant_limit`` past it). A key without them behaves
    as before."""

    name: Name
    sha256: Sha256
    pools: tuple[str, ...] = ()
    max_sessions: int | None = Field(None, ge=1)
    priority: int = Field(0, ge=-1000, le=1000)
    weight: float | None = Field(None, gt=0, le=1000)
    max_queued: int | None = Field(None, ge=0)

    @property
    def schedules(self) -> bool:
        """Whether the key sets any of the scheduling fields."""
        return self.priority != 0 or self.weight is not None or self.max_queued is not None

    def allows(self, pool: str) -> bool:
        """Whether this key may open sessions on ``pool`` (no pools listed: every pool)."""
        return not self.pools or pool in self.pools


class AuthSettings(Frozen):
    """Client API keys; when present, every request needs one.

    ``enabled: false`` turns client authentication off *explicitly* (the keys, if any, are
    kept but not checked). A reload may turn authentication off only this way: a file that
    merely lacks ``auth`` -- which is also what a file cut short by a partial write looks
    like -- is refused while authentication is on (:func:`reload_problems`)."""

    enabled: bool = True
    keys: tuple[ApiKeySettings, ...] = ()

    @model_validator(mode="after")
    def _keys_when_enabled(self) -> AuthSettings:
        if self.enabled and not self.keys:
            why = (
                "needs at least 1 key; to turn client authentication off on purpose, "
                "write auth: {enabled: false}"
            )
            raise Problems([(("keys",), why)])
        return self

    @functools.cached_property
    def keys_by_sha256(self) -> tuple[tuple[ApiKeySettings, ...], dict[str, ApiKeySettings]]:
        """``keys`` and the index of them by SHA-256 (built once: a lookup is per request,
        and a gateway may hold tens of thousands of keys)."""
        return self.keys, {key.sha256: key for key in reversed(self.keys)}  # the first wins

    def key_for(self, sha256_hex: str) -> ApiKeySettings | None:
        """The key whose SHA-256 (hex) is ``sha256_hex``, or None."""
        keys, index = self.keys_by_sha256
        if keys is not self.keys:  # a model_copy that replaced the keys copied the index too
            del self.__dict__["keys_by_sha256"]
            keys, index = self.keys_by_sha256
        return index.get(sha256_hex)
