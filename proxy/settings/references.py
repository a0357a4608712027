"""Checks that span several parts of the configuration: names unique, every reference
to a pool, replica or GPU defined, and rules between sections (ports, tenants).

The ``*_problems(data)`` checks run on the raw (possibly invalid) data, from
:class:`~proxy.settings.schema.Settings`' wrap validator, so they are reported together
with field errors; they never raise. The ``*_problems(settings)`` checks run once every
field is valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from proxy.settings.environment import Loc, format_loc

if TYPE_CHECKING:
    from proxy.settings.schema import Settings


def _entries(value: Any) -> list[tuple[int, Mapping[Any, Any]]]:
    items = value if isinstance(value, list | tuple) else ()
    return [(i, item) for i, item in enumerate(items) if isinstance(item, Mapping)]


def _text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _duplicates(
    entries: Iterable[tuple[Loc, str | None]], what: str, *, show: bool = True
) -> list[tuple[Loc, str]]:
    seen: dict[str, Loc] = {}
    problems = []
    for loc, value in entries:
        if value is None:
            continue
        if value in seen:
            shown = f" {value!r}" if show else ""
            problems.append((loc, f"duplicate {what}{shown} (also {format_loc(seen[value])})"))
        else:
            seen[value] = loc
    return problems


def _reference_problems(data: Any) -> list[tuple[Loc, str]]:
    """Uniqueness and cross-references, on raw (possibly invalid) data; never raises."""
    if not isinstance(data, Mapping):
        return []
    pools, routes = _entries(data.get("pools")), _entries(data.get("routes"))
    auth = data.get("auth")
    keys = _entries(auth.get("keys")) if isinstance(auth, Mapping) else []
    named = [(("pools", i, "name"), _text(p.get("name"))) for i, p in pools]
    problems = _duplicates(named, "pool name")
    names = dict.fromkeys(name for _, name in named if name is not None)  # ordered, a set
    defined = ", ".join(names) or "(none)"

    def check(loc: Loc, target: Any, own: str | None = None) -> None:
        if (name := _text(target)) is None:
            return
        if name == own:
            problems.append((loc, "must name another pool"))
        elif name not in names:
            problems.append((loc, f"unknown pool {name!r}; defined pools: {defined}"))

    for (loc, own), (i, pool) in zip(named, pools, strict=True):
        replicas = _entries(pool.get("replicas"))
        rnames = [((*loc[:2], "replicas", j, "name"), _text(r.get("name"))) for j, r in replicas]
        problems += _duplicates(rnames, "replica name")
        if isinstance(fallback := pool.get("fallback"), Mapping):
            check(("pools", i, "fallback", "pool"), fallback.get("pool"), own)
    problems += _duplicates(
        [(("routes", i, "path"), _text(r.get("path"))) for i, r in routes], "route path"
    )
    for i, route in routes:
        check(("routes", i, "pool"), route.get("pool"))
    problems += _duplicates(
        [(("auth", "keys", i, "name"), _text(k.get("name"))) for i, k in keys], "key name"
    )
    hashes = [(("auth", "keys", i, "sha256"), _text(k.get("sha256"))) for i, k in keys]
    problems += _duplicates(hashes, "key hash", show=False)
    for i, key in keys:
        allowed = key.get("pools")
        for j, target in enumerate(allowed if isinstance(allowed, list | tuple) else ()):
            check(("auth", "keys", i, "pools", j), target)
    return problems


def _gpu_problems(data: Any) -> list[tuple[Loc, str]]:
    """GPU names unique, every engine's replica defined, each replica on one GPU only;
    on raw data like :func:`_reference_problems`; never raises."""
    if not isinstance(data, Mapping):
        return []
    gpus = _entries(data.get("gpus"))
    problems = _duplicates(
        [(("gpus", i, "name"), _text(g.get("name"))) for i, g in gpus], "GPU name"
    )
    defined: set[str] = set()
    for pool in (p for _, p in _entries(data.get("pools"))):
        pname = _text(pool.get("name"))
        defined |= {f"{pname}/{_text(r.get('name'))}" for _, r in _entries(pool.get("replicas"))}
    refs: list[tuple[Loc, str | None]] = []
    for i, gpu in gpus:
        for j, engine in _entries(gpu.get("engines")):
            loc: Loc = ("gpus", i, "engines", j, "replica")
            ref = _text(engine.get("replica"))
            refs.append((loc, ref))
            if ref is not None and "/" in ref and ref not in defined:
                known = ", ".join(sorted(defined)) or "(none)"
                problems.append((loc, f"unknown replica {ref!r}; defined replicas: {known}"))
    problems += _duplicates(refs, "replica (an engine runs on one GPU)")
    return problems


def _pipeline_problems(data: Any) -> list[tuple[Loc, str]]:
    """Pipeline names unique, every stage a defined pool and listed once; on raw data
    like :func:`_reference_problems`; never raises."""
    if not isinstance(data, Mapping):
        return []
    pipelines = _entries(data.get("pipelines"))
    problems = _duplicates(
        [(("pipelines", i, "name"), _text(p.get("name"))) for i, p in pipelines],
        "pipeline name",
    )
    pools = [_text(p.get("name")) for _, p in _entries(data.get("pools"))]
    names = dict.fromkeys(name for name in pools if name is not None)  # ordered, a set
    defined = ", ".join(names) or "(none)"
    for i, pipeline in pipelines:
        stages = pipeline.get("stages")
        entries = list(enumerate(stages)) if isinstance(stages, list | tuple) else []
        locs = [(("pipelines", i, "stages", j), _text(stage)) for j, stage in entries]
        problems += _duplicates(locs, "stage")
        for loc, stage in locs:
            if stage is not None and stage not in names:
                problems.append((loc, f"unknown pool {stage!r}; defined pools: {defined}"))
    return problems


def _port_problems(settings: Settings) -> list[tuple[Loc, str]]:
    listen, admin = settings.listen, settings.admin
    wildcard = {"0.0.0.0", "::"}
    overlap = listen.host == admin.host or bool({listen.host, admin.host} & wildcard)
    if admin.enabled and admin.port and admin.port == listen.port and overlap:
        return [(("admin", "port"), f"clashes with listen.port {listen.port}")]
    return []


def _reconcile_problems(settings: Settings) -> list[tuple[Loc, str]]:
    """``engine_reconcile`` reads the engine's scraped figures: scraping must be on, and
    a reduction's hold time must outlast the interval between two scrapes."""
    interval = settings.health.engine_metrics_interval_s
    problems: list[tuple[Loc, str]] = []
    for i, pool in enumerate(settings.pools):
        if not pool.engine_reconcile:
            continue
        if interval <= 0:
            why = "needs the engine's figures: set health.engine_metrics_interval_s above 0"
            problems.append((("pools", i, "engine_reconcile"), why))
        elif pool.engine_reconcile_hold_s <= 2 * interval:
            why = (
                f"must be more than two engine scrapes (health.engine_metrics_interval_s "
                f"{interval:g} s), or a reduction lapses between the scrapes that confirm it"
            )
            problems.append((("pools", i, "engine_reconcile_hold_s"), why))
    return problems
