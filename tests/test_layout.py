"""The map (DESIGN.md) as tests: modules small enough to read, imports that point down only, the
server's APIs in folders side by side, and no import circle. Imports are read from the source, every `import` and `from` at any depth but
those under `if TYPE_CHECKING:`, so a lazy import inside a function counts as an arrow too."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "model")
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def under_type_checking(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The project's modules that this module imports (a name imported from a package counts as
    its submodule when one exists, else as the package)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                out.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in out if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imported(name, path, set(found)) for name, path in found.items()}


def test_no_module_is_over_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("lower, upper, allowed", [
    ("model", "app", ()),                # numbers never know a request exists
    ("app.engine", "app.server", ()),    # the engine never knows a wire
    # the socket layer knows no route: only the error shape and the limits it enforces
    ("app.server.http", "app.server", ("app.server.errors", "app.server.limits")),
])
def test_arrows_point_down(graph, lower, upper, allowed):
    back = sorted(f"{a} -> {b}" for a, targets in graph.items() if inside(a, lower)
                  for b in targets if inside(b, upper) and not inside(b, lower) and b not in allowed)
    assert not back, "\n".join(back)


API_FOLDERS = ("app.server.openai", "app.server.embeddings", "app.server.anthropic", "app.server.responses")


def test_api_folders_stand_side_by_side(graph):
    """The shared server modules (generation, prompts, errors, tools, sse ...) never import an
    API's folder, nor one folder another; app.server.app alone gathers their routes."""
    def folder(name):
        return next((f for f in API_FOLDERS if inside(name, f)), None)

    wrong = sorted(f"{a} -> {b}" for a, targets in graph.items() if inside(a, "app.server") and a != "app.server.app"
                   for b in targets if folder(b) not in (None, folder(a)))
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("api", API_FOLDERS)
def test_an_api_folder_holds_its_schemas_responder_and_routes(api):
    assert {f"{api}.{part}" for part in ("schemas", "responder", "routes")} <= set(modules())


def test_model_never_imports_trio():
    users = [name for name, path in modules().items() if name.startswith("model")
             and any(isinstance(n, (ast.Import, ast.ImportFrom)) and "trio" in ast.unparse(n).split()
                     for n in ast.walk(ast.parse(path.read_text())))]
    assert not users


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle, as the modules around it, or [] when there is none."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_import_circle(graph):
    """A package's __init__ that re-exports its own submodules is not a circle of ideas, so the
    edges from a package to its own children are left out."""
    edges = {a: {b for b in targets if not b.startswith(a + ".")} for a, targets in graph.items()}
    assert not (found := cycle(edges)), " -> ".join(found)


def test_the_circle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
