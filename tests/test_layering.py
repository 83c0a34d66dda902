"""The package's floor plan holds: imports flow one way, from the CLI and the server down to
the platform, no two modules import each other in a circle (function-local imports
included: a cycle hidden inside a function is still a cycle), and no API folder of the server
(`server/*_api/`) imports another: what they share lives outside all of them."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

import mlxkv

PACKAGE = Path(mlxkv.__file__).parent

# Each layer may import the layers below it (and itself); `config` and `errors` are importable
# from anywhere, and import only `platform` and `errors` themselves.
LAYERS = ("platform", "cache", "models", "decoding", "runner", "server", "cli")
ANYWHERE = ("config", "errors")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: str, modules: Collection[str]) -> set[str]:
    """Every mlxkv module (of `modules`) the file at `path` (in `package`) imports, wherever
    the import statement is. `from P import m` of a module m imports m, not what P's
    `__init__` holds."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            named = {f"{base}.{alias.name}" for alias in node.names}
            found.update(named if named <= set(modules) else {base, *named})
    return {name for name in found if name in modules}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = _imports(path, package, modules)
    return graph


def _violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in graph.items():
        layer = _layer(module)
        if layer == "":  # the public API re-exports
            continue
        for target in imported:
            below = _layer(target)
            if below in (layer, "errors"):
                continue
            if layer in ANYWHERE:
                allowed = below == "platform"
            elif below == "config":
                allowed = True
            elif "testing" in (layer, below):
                allowed = False
            else:
                allowed = below in LAYERS and LAYERS.index(below) < LAYERS.index(layer)
            if not allowed:
                wrong.append(f"{module} imports {target}")
    return sorted(wrong)


def test_imports_flow_down_the_layers():
    wrong = _violations(_graph())
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def _api_folder(module: str) -> str | None:
    """The server's API folder `module` is in (`openai_api`...), or None."""
    parts = module.split(".")
    inside = len(parts) > 2 and parts[1] == "server" and parts[2].endswith("_api")
    return parts[2] if inside else None


def _api_crossings(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in graph.items():
        folder = _api_folder(module)
        for target in imported:
            if folder is not None and _api_folder(target) not in (None, folder):
                wrong.append(f"{module} imports {target}")
    return sorted(wrong)


def test_no_api_folder_imports_another():
    wrong = _api_crossings(_graph())
    assert not wrong, "API folders importing each other:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = _graph()
    edges = {module: targets - {module} for module, targets in graph.items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _cycles(edges: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target) :], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    return cycles


def test_the_checks_see_wrong_imports_and_cycles(tmp_path):
    module = tmp_path / "mod.py"
    module.write_text("def f():\n    from ..runner.runner import Runner\n")
    modules = {"mlxkv", "mlxkv.config", "mlxkv.runner.runner"}
    assert _imports(module, "mlxkv.cache", modules) == {"mlxkv.runner.runner"}
    module.write_text("from mlxkv import config\nfrom mlxkv import Runner, config\n")
    assert _imports(module, "mlxkv.cache", modules) == {"mlxkv", "mlxkv.config"}
    assert _violations({"mlxkv.cache.mod": {"mlxkv.runner.runner"}}) == [
        "mlxkv.cache.mod imports mlxkv.runner.runner"
    ]
    assert _violations({"mlxkv.runner.x": {"mlxkv.runner.prompt_cache.pool", "mlxkv.config"}}) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    crossing = {"mlxkv.server.ollama_api.routes": {"mlxkv.server.openai_api.protocol"}}
    assert _api_crossings(crossing) == [
        "mlxkv.server.ollama_api.routes imports mlxkv.server.openai_api.protocol"
    ]
    shared = {"mlxkv.server.ollama_api.routes": {"mlxkv.server.protocol"}}
    assert _api_crossings(shared) == []
