"""The import rules of docs/architecture.md, as a checker the import test and its own tests share.

Every import counts: module level, inside functions and under `TYPE_CHECKING` alike, since a circle
hidden in a function is still a circle when the code runs. Rules:
- no circle among the project's modules (ballast/, services/, benchmarks/, tests/);
- layers from the ground up; a module imports only from its own layer or a lower one;
- no service package (store, profiler, planner, executor, dashboard) imports another;
- the planner's pure core (cost model, simulator, search engines, online planners, make_plan) imports
  nothing but the contracts, domain errors and itself: no orchestration, no I/O.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

TOPS = ("ballast", "services", "benchmarks", "tests")  # benchmarks and tests' helpers keep the rules too
# (layer, module prefixes), lowest first. A module belongs to the layer of its longest matching prefix.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("contracts and SDK", ("ballast", "ballast.v1", "ballast.config", "ballast.client", "ballast.health")),
    ("runtime", ("services", "services.runtime")),
    ("memory engines", ("services.memory",)),  # pure: chunks, pool, Harmony's schedule (planner and executor)
    ("specs", ("services.specs",)),
    ("zoo", ("services.zoo",)),
    ("data", ("services.data",)),
    ("services", ("services.store", "services.profiler", "services.planner", "services.executor",
                  "services.dashboard")),
    ("CLI", ("ballast.cli", "ballast.__main__")),
    ("tests and benchmarks", ("tests", "benchmarks")),  # may use anything below; nothing below uses them
)
SERVICES = ("services.store", "services.profiler", "services.planner", "services.executor", "services.dashboard")
PURE_CORE = (
    "services.memory",
    "services.planner.cost",
    "services.planner.sim",
    "services.planner.search",
    "services.planner.online",
    "services.planner.plans.make",
    "services.planner.plans.offload",
    "services.planner.admission",
    "services.planner.elastic",
)
# ballast.windows: what a metrics row covers, as pure as the contracts it reads
PURE_MAY_IMPORT = PURE_CORE + ("ballast.v1", "ballast.windows", "services.runtime.errors", "services.memory")
PURE_NEVER_IMPORTS = ("grpc", "sqlalchemy", "celery", "torch")  # third-party packages that mean I/O or devices


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file for the project's own Python files (generated protobuf code left out)."""
    found: dict[str, Path] = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute name a relative `from . import x` refers to."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(module: str, path: Path) -> set[str]:
    """Every name `module` imports anywhere in its file (function bodies and TYPE_CHECKING included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node, path.name == "__init__.py")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def graph(root: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(project edges, all imported names) per module; a package importing its own child is no edge."""
    known = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in known}
    raw: dict[str, set[str]] = {}
    for module, path in known.items():
        raw[module] = imported_names(module, path)
        for name in raw[module]:
            target = _resolve(name, known)
            if target and target != module and not module.startswith(target + "."):
                edges[module].add(target)
    return edges, raw


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _owner(module: str, prefixes: Iterable[str]) -> str | None:
    matches = [p for p in prefixes if module == p or module.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        owner = _owner(module, prefixes)
        if owner and len(owner) > best_len:
            best, best_len = rank, len(owner)
    if best < 0:
        raise ValueError(f"{module} is in no layer of tests/import_rules.LAYERS: add it to the map")
    return best


def violations(root: Path) -> list[str]:
    """Every broken rule, one line each, naming both modules and the rule."""
    edges, raw = graph(root)
    problems = [f"circle: {' <-> '.join(c)}" for c in circles(edges)]
    for module in sorted(edges):
        mine = layer_of(module)
        for target in sorted(edges[module]):
            theirs = layer_of(target)
            if theirs > mine:
                problems.append(f"layer: {module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]}), "
                                "a higher layer")
            a, b = _owner(module, SERVICES), _owner(target, SERVICES)
            if a and b and a != b:
                problems.append(f"service: {module} imports {target}: one service package never imports another")
            if _owner(module, PURE_CORE) and not _owner(target, PURE_MAY_IMPORT):
                problems.append(f"pure core: {module} imports {target}: the cost model, simulator and search "
                                "take (profile, fleet, options) and do no I/O")
        if _owner(module, PURE_CORE):
            for name in sorted(raw[module]):
                if name.split(".")[0] in PURE_NEVER_IMPORTS:
                    problems.append(f"pure core: {module} imports {name}")
    return problems
