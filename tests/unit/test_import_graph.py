"""The import graph under ``proxy/``: no cycles, and every import goes down the layers.

Every ``import`` and ``from ... import`` in a module counts -- at module level, inside
functions and classes, in ``try``/``if`` blocks -- except those under
``if TYPE_CHECKING:`` (never run). ``from proxy.x import y`` is an edge to
``proxy.x.y`` when that is a module, else to ``proxy.x``. A cycle makes the import order
matter and the layers impossible to read apart; the failure names one cycle per
strongly connected component, edge by edge.

The layers (:data:`LAYERS`, lowest first) name the architecture: a module may import
its own layer and the ones below; an import that goes up is a failure naming the edge,
unless :data:`UPWARD` lists it with its reason.

``python -m tests.unit.test_import_graph`` prints the graph by package (which imports
which), for reviews.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "proxy"

Graph = dict[str, set[str]]


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                if isinstance(other, (ast.Import, ast.ImportFrom)):
                    yield other
                else:
                    yield from _imports(other)
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        else:
            yield from _imports(child)


def _targets(
    module: str, path: Path, node: ast.Import | ast.ImportFrom, known: Mapping[str, Path]
) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = package[: len(package) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        names = [
            f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source
            for alias in node.names
        ]
    return {name for name in names if name in known}


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> Graph:
    known = modules(root, package)
    graph: Graph = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        deps: set[str] = set()
        for node in _imports(tree):
            deps |= _targets(module, path, node, known)
        deps.discard(module)
        graph[module] = deps
    return graph


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in graph:
                    continue
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def a_cycle(graph: Mapping[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the component's first module, as a path that returns to it."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & members):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # not a component


#: The packages and top-level modules of ``proxy/``, lowest layer first.
LAYERS: tuple[tuple[str, ...], ...] = (
    # foundation: no I/O policy of its own
    ("proxy", "proxy.clock", "proxy.errors", "proxy.client_request", "proxy.speedups",
     "proxy.tracing"),
    # what listeners hear, measured: pure meters, the Prometheus series
    ("proxy.metering",),
    # the configuration and how it is read
    ("proxy.settings",),
    # who gets a slot: the gates, their Redis store
    ("proxy.admission",),
    # sessions relayed to the upstream replicas
    ("proxy.relay", "proxy.upstreams"),
    # one running gateway: its shared state, the ASGI app, its logs and headroom report
    ("proxy.runtime", "proxy.app", "proxy.logs", "proxy.pool_headroom"),
    # the commands: the process, the simulator, the probe
    ("proxy.process", "proxy.sim", "proxy.probe", "proxy.__main__"),
)  # fmt: skip

#: Imports that go up a layer, each with the reason it is allowed.
UPWARD: dict[tuple[str, str], str] = {
    ("proxy.settings.gpus", "proxy.sim.presets"):
        "a GPU given by preset name takes the simulator's figures (imported when named)",
    ("proxy.settings.admission", "proxy.admission.redis_clients"):
        "the Redis URL forms are checked by the module that builds the clients",
    ("proxy.settings.summary", "proxy.admission.redis_clients"):
        "a cluster URL's seeds are listed as the module that builds the clients reads them",
}  # fmt: skip


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of a module's package (or of the module itself)."""
    parts = module.split(".")
    for depth in (2, 1):
        name = ".".join(parts[:depth])
        for index, members in enumerate(LAYERS):
            if name in members:
                return index
    raise KeyError(f"{module} is in no layer: add its package to LAYERS")


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    """Every import from a lower layer to a higher one not listed in :data:`UPWARD`."""
    return [
        f"{module} (layer {layer_of(module)}) imports {dep} (layer {layer_of(dep)})"
        for module in sorted(graph)
        for dep in sorted(graph[module])
        if layer_of(dep) > layer_of(module) and (module, dep) not in UPWARD
    ]


def describe(graph: Mapping[str, set[str]]) -> list[str]:
    return [" -> ".join(a_cycle(graph, c)) for c in strongly_connected(graph)]


def test_the_import_graph_under_proxy_has_no_cycle() -> None:
    graph = import_graph()
    cycles = describe(graph)
    assert cycles == [], "import cycles under proxy/:\n  " + "\n  ".join(cycles)


def test_every_module_is_in_a_layer() -> None:
    unplaced = []
    for module in import_graph():
        try:
            layer_of(module)
        except KeyError as exc:
            unplaced.append(str(exc))
    assert unplaced == []


def test_imports_go_down_the_layers() -> None:
    found = upward_imports(import_graph())
    assert found == [], "imports that go up a layer:\n  " + "\n  ".join(found)


def test_every_allowed_upward_import_exists() -> None:
    """An entry of UPWARD whose import is gone is stale: remove it."""
    graph = import_graph()
    stale = [f"{a} -> {b}" for a, b in UPWARD if b not in graph.get(a, set())]
    assert stale == []


def test_an_upward_import_is_found() -> None:
    """The layer check can fail: the settings importing the relay is named."""
    graph = {"proxy.settings.gateway": {"proxy.relay.listener"}, "proxy.relay.listener": set()}
    assert upward_imports(graph) == [
        "proxy.settings.gateway (layer 2) imports proxy.relay.listener (layer 4)"
    ]


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "proxy.upstreams" in graph["proxy.runtime"]  # module level, from-import
    assert "proxy.relay.failover" in graph["proxy.upstreams"]  # a module inside a package
    assert "proxy.process.demo" in graph["proxy.process.cli"]  # inside a function
    assert "proxy.runtime" not in graph["proxy.relay.services"]  # TYPE_CHECKING only


def test_a_cycle_is_found_and_named(tmp_path: Path) -> None:
    """The check itself can fail: a package whose modules import each other, one of
    them from inside a function, is reported with the path of the cycle."""
    pkg = tmp_path / "loopy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from loopy.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loopy import d\n"
        "import loopy.a\n"
    )
    (pkg / "d.py").write_text("from loopy import c\n")
    graph = import_graph(tmp_path, "loopy")
    assert describe(graph) == ["loopy.a -> loopy.sub.b -> loopy.c -> loopy.a"]


def by_package(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The graph between packages (``proxy.relay``, ``proxy.admission``...) and the
    top-level modules, without edges inside one package."""

    def layer(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:2])

    out: dict[str, set[str]] = defaultdict(set)
    for module, deps in graph.items():
        out[layer(module)] |= {layer(d) for d in deps} - {layer(module)}
    return dict(out)


if __name__ == "__main__":  # pragma: no cover - a listing for reviews
    layers = by_package(import_graph())
    for name in sorted(layers):
        deps = sorted(d.removeprefix("proxy.") for d in layers[name])
        print(f"{name.removeprefix('proxy.') or 'proxy'}: {' '.join(deps) or '-'}")
    print("cycles:", describe(import_graph()) or "none")
    sys.exit(0)
