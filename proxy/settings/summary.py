"""A human-readable digest of the configuration, for ``headroom check``."""

from __future__ import annotations

from urllib.parse import urlsplit

from proxy.admission.redis_clients import cluster_nodes
from proxy.settings.schema import Settings

__all__ = ["admission_line", "operations_line", "summary"]


def summary(settings: Settings) -> str:
    """A human-readable digest for ``headroom check`` (warnings are listed separately)."""
    admin, guard = settings.admin, settings.guard
    keyed = " (key required)" if admin.api_key_sha256 else ""
    lines = [
        f"listen  {settings.listen.host}:{settings.listen.port}",
        f"admin   {admin.host}:{admin.port}{keyed}" if admin.enabled else "admin   off",
        admission_line(settings),
        operations_line(settings),
        f"pools   {len(settings.pools)}, {settings.total_slots} slots in all",
    ]
    for pool in settings.pools:
        queue = pool.queue
        waiting = (
            f"queue up to {queue.max_depth}, wait up to {queue.max_wait_s:g} s, "
            f"handshake wait up to {queue.handshake_wait_s:g} s"
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
        if pool.engine_reconcile:
            lines.append(
                "    engine_reconcile: streams the engine runs that Headroom did not admit "
                f"take slots off the caps (lapsing {pool.engine_reconcile_hold_s:g} s after "
                "the last scrape that saw them)"
            )
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


def operations_line(settings: Settings) -> str:
    """What ``/readyz`` follows, where ``/metrics`` is served and whether traces go out."""
    where = "admin listener" + (" and client listener" if settings.metrics.client_port else "")
    if not settings.admin.enabled:
        where = "client listener" if settings.metrics.client_port else "nowhere (admin off)"
    tracing = settings.tracing
    traces = "off"
    if tracing.enabled:
        to = tracing.endpoint or "OTEL_EXPORTER_OTLP_* default"
        traces = f"OTLP to {to}, sampled {tracing.sample_ratio:g}, as {tracing.service_name}"
    return f"ops     readiness {settings.readiness}; /metrics on {where}; traces {traces}"


def admission_line(settings: Settings) -> str:
    """Where the caps live: this process, or the Redis every gateway shares (its address
    without the credentials the URL may carry)."""
    admission = settings.admission
    if admission.backend != "redis":
        return "admission memory (caps in this process: one gateway per set of GPUs)"
    redis = admission.redis
    cluster = cluster_nodes(redis.url)
    if cluster is not None:  # seeds, not one host (urlsplit cannot read the list)
        scheme, _, rest = redis.url.partition("://")
        where = ",".join(f"{host}:{port}" for host, port in cluster.seeds)
        if "@" in rest.partition("/")[0]:
            where = "***@" + where
        address, kind = f"{scheme}://{where}", "a Redis Cluster: each pool on its slot's shard; "
    else:
        parts = urlsplit(redis.url)
        where = parts.hostname or ""
        if parts.port is not None:
            where += f":{parts.port}"
        if redis.sentinel is not None:  # the URL's host is not used: the sentinels name it
            where = f"<primary of {redis.sentinel.master}>"
        if parts.username or parts.password:
            where = "***@" + where
        via = f" via sentinels {', '.join(redis.sentinel.nodes)}" if redis.sentinel else ""
        address, kind = f"{parts.scheme}://{where}{parts.path}{via}", ""
    return (
        f"admission redis {address} ({kind}caps shared by every gateway "
        f"on it; lease {redis.lease_ttl_s:g} s, renew {redis.renew_interval_s:g} s, fence "
        f"{redis.fence_margin_s:g} s; on backend loss: {admission.on_backend_loss})"
    )
