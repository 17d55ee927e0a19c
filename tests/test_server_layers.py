"""app/server's layers, read from its imports: the shared modules (generation, prompts, errors,
tools, sse ...) never import an API's folder (openai/, embeddings/, anthropic/, responses/),
an API's folder never imports another's, and app.py alone gathers them all; no module in
app/server reaches 400 lines."""

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parent.parent / "app" / "server"
APIS = {"openai", "embeddings", "anthropic", "responses"}


def imported(path: Path) -> set[str]:
    """Every app.server module path a file imports, with the names it takes from each."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return {name for name in out if name.startswith("app.server.")}


def api_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in APIS else None


def test_no_arrow_back_up_and_no_api_imports_another():
    wrong = []
    for path in SERVER.rglob("*.py"):
        relative = path.relative_to(SERVER)
        own = relative.parts[0] if relative.parts[0] in APIS else None
        if relative == Path("app.py"):
            continue
        wrong += [f"{relative}: {name}" for name in imported(path) if api_of(name) not in (None, own)]
    assert not wrong


def test_every_api_folder_holds_its_schemas_responder_and_routes():
    for api in APIS:
        assert {"schemas.py", "responder.py", "routes.py"} <= {p.name for p in (SERVER / api).glob("*.py")}, api


def test_no_module_reaches_400_lines():
    lines = {str(p.relative_to(SERVER)): len(p.read_text().splitlines()) for p in SERVER.rglob("*.py")}
    long = {name: n for name, n in lines.items() if n >= 400}
    assert not long
