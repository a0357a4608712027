"""A human-readable digest of the configuration, for ``headroom check``."""

from __future__ import annotations

from proxy.settings.schema import Settings


def summary(settings: Settings) -> str:
    """A human-readable digest for ``headroom check`` (warnings are listed separately)."""
    admin, guard = settings.admin, settings.guard
    keyed = " (key required)" if admin.api_key_sha256 else ""
    lines = [
        f"listen  {settings.listen.host}:{settings.listen.port}",
        f"admin   {admin.host}:{admin.port}{keyed}" if admin.enabled else "admin   off",
        f"pools   {len(settings.pools)}, {settings.total_slots} slots in all",
    ]
    for pool in settings.pools:
        queue = pool.queue
        waiting = (
            f"queue up to {queue.max_depth}, wait up to {queue.max_wait_s:g} s"
            if queue.max_depth
            else "no queue (refuse when full)"
        )
        lines.append(
            f"  {pool.name}: {len(pool.replicas)} replica(s), {pool.total_slots} slots; {waiting}"
        )
        lines += [f"    {r.name}  {r.url}  {r.max_sessions} slots" for r in pool.replicas]
        if pool.fallback:
            hint = pool.fallback.as_hint().as_json().items()
            lines.append("    fallback " + ", ".join(f"{k}={v}" for k, v in hint if v))
    lines.append(f"routes  {len(settings.routes)}")
    for route in settings.routes:
        protocol = route.protocol + (f"/{route.inner_protocol}" if route.inner_protocol else "")
        upstream = f", upstream {route.upstream_path}" if route.upstream_path else ""
        lines.append(
            f"  {route.path} -> {route.pool}  {protocol}, refusal {route.refusal}{upstream}"
        )
    if settings.pipelines:
        lines.append(f"pipelines {len(settings.pipelines)}")
        lines += [f"  {p.name}: {' -> '.join(p.stages)}" for p in settings.pipelines]
    lines.append(
        f"guard   {guard.mode} (worst-1% delivery ratio < {guard.threshold:g}, "
        f"hysteresis {guard.hysteresis:g}, hold {guard.hold_s:g} s)"
    )
    keys = settings.auth.keys if settings.auth else ()
    names = ", ".join(key.name for key in keys)
    off = "off (auth.enabled: false)" if settings.auth_disabled else "off (no API keys)"
    lines.append(f"auth    {len(keys)} key(s): {names}" if keys else f"auth    {off}")
    return "\n".join(lines)
