"""The shape of the code, checked: every import in `server/` runs down its layers, none forms a
circle, only `server.engine` imports vLLM, the package root stays small, and `tests/` and
`benchmarks/` share libraries but never each other's drivers.

The layers, lowest first (a module imports its own package and lower layers only):
0 the shared vocabulary: `server` (its version), `errors`, `metrics`, `request_state`,
  `settings`, `protocol`;
1 `engine` (the vLLM seam) and `tenants` (keys, limiter, usage);
2 `lifecycle` (the engine's ownership);
3 `serving` (request logic, no FastAPI) and `middleware` (auth, limits, access);
4 `routes`; 5 `app`; 6 `runner` and `model_prep`; 7 `__main__`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "server"

LAYERS = {
    "server": 0, "server.errors": 0, "server.metrics": 0, "server.request_state": 0, "server.settings": 0,
    "server.protocol": 0,
    "server.engine": 1, "server.tenants": 1,
    "server.lifecycle": 2,
    "server.serving": 3, "server.middleware": 3,
    "server.routes": 4,
    "server.app": 5,
    "server.runner": 6, "server.model_prep": 6,
    "server.replicas": 7,
    "server.__main__": 8,
}
MAX_ROOT_MODULES = 8


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path) -> dict[str, Path]:
    return {module_name(p): p for p in sorted(package.rglob("*.py"))}


def imported(path: Path, known: set[str] | None = None) -> Iterator[tuple[str, int]]:
    """(module, line) for every import in the file, wherever it sits (functions and
    TYPE_CHECKING blocks too); `from pkg import name` counts as `pkg.name` when that is a module
    (of `known`), and as `pkg` when it is a name defined in `pkg`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = [f"{node.module}.{a.name}" for a in node.names
                          if known is not None and f"{node.module}.{a.name}" in known]
            if len(submodules) < len(node.names):  # names defined in the module itself
                yield node.module, node.lineno
            for submodule in submodules:
                yield submodule, node.lineno


def layer_of(module: str) -> tuple[str, int]:
    """The layer entry (longest prefix) a server module belongs to, and its rank."""
    best = max((k for k in LAYERS if module == k or module.startswith(k + ".")), key=len)
    return best, LAYERS[best]


def server_graph() -> dict[str, set[str]]:
    found = modules(SERVER)
    graph: dict[str, set[str]] = {name: set() for name in found}
    for name, path in found.items():
        for target, _ in imported(path, set(found)):
            if target in found and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_server_module_has_a_layer() -> None:
    for name in modules(SERVER):
        assert any(name == k or name.startswith(k + ".") for k in LAYERS), f"{name}: add its layer to LAYERS"


def test_server_imports_run_down_the_layers() -> None:
    found = modules(SERVER)
    wrong = []
    for name, path in found.items():
        home, rank = layer_of(name)
        for target, line in imported(path, set(found)):
            if target not in found or target == name:
                continue
            target_home, target_rank = layer_of(target)
            # Within a package anything goes, and the shared vocabulary (layer 0) may use itself;
            # circles are the next test's. Otherwise only downward.
            if target_home != home and target_rank >= rank and not rank == target_rank == 0:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {name} (layer {rank}) imports {target} "
                             f"(layer {target_rank})")
    assert not wrong, "imports that run up or across the layers:\n" + "\n".join(wrong)


def test_server_has_no_import_circles() -> None:
    assert cycles(server_graph()) == []


def test_the_circle_finder_finds_one() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_engine_package_imports_vllm() -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line}" for name, path in modules(SERVER).items()
             if not name.startswith("server.engine")
             for target, line in imported(path) if target == "vllm" or target.startswith("vllm.")]
    assert not wrong, f"vLLM imported outside server/engine: {wrong}"


def test_the_package_root_stays_small() -> None:
    root_modules = sorted(p.name for p in SERVER.glob("*.py"))
    assert len(root_modules) <= MAX_ROOT_MODULES, root_modules


# -- tests/ and benchmarks/ --------------------------------------------------------------------

BENCHMARKS = ROOT / "benchmarks"
TESTS = ROOT / "tests"
LIBRARIES = ("benchmarks.lib", "benchmarks.fixtures")
"""What tests may import from benchmarks: its libraries, never a driver or an experiment."""
OLD_TREE_FALLBACKS = {("benchmarks/lib/scripted_server.py", "tests.fakes")}
"""The scripted server also serves trees from before testbed/ existed, whose engine is there."""


def test_benchmarks_are_a_package_without_path_edits() -> None:
    edits = [f"{p.relative_to(ROOT)}:{n}" for p in BENCHMARKS.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if "sys.path" in line]
    assert not edits, edits
    for folder in (BENCHMARKS, BENCHMARKS / "lib", BENCHMARKS / "fixtures", BENCHMARKS / "experiments"):
        assert (folder / "__init__.py").is_file(), folder


def test_benchmarks_never_import_tests_and_have_no_circles() -> None:
    found = modules(BENCHMARKS)
    wrong = [f"{path.relative_to(ROOT)}:{line}: {target}" for path in found.values()
             for target, line in imported(path)
             if (target == "tests" or target.startswith("tests."))
             and (str(path.relative_to(ROOT)), target) not in OLD_TREE_FALLBACKS]
    assert not wrong, wrong
    graph = {name: {t for t, _ in imported(path, set(found)) if t in found and t != name}
             for name, path in found.items()}
    assert cycles(graph) == []


def test_tests_import_only_benchmark_libraries() -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line}: {target}" for path in sorted(TESTS.rglob("*.py"))
             for target, line in imported(path, set(modules(BENCHMARKS)))
             if target.startswith("benchmarks.") and not target.startswith(LIBRARIES)]
    assert not wrong, "tests import benchmark drivers:\n" + "\n".join(wrong)
