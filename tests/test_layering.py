"""The package's floor plan holds: imports flow one way, from the CLI and the server down to
the platform, and no two modules import each other in a circle (function-local imports
included: a cycle hidden inside a function is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

import mlxkv

PACKAGE = Path(mlxkv.__file__).parent

# Each layer may import the layers below it (and itself); `config` and `errors` are importable
# from anywhere, and import only `platform` and `errors` themselves.
LAYERS = ("platform", "cache", "models", "decoding", "engine", "server", "cli")
ANYWHERE = ("config", "errors")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, package: str) -> set[str]:
    """Every mlxkv module the file at `path` (in `package`) imports, wherever the import
    statement is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name.startswith("mlxkv.")}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = {m for m in _imports(path, package) if m in modules}
    return graph


def _violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, imported in graph.items():
        layer = _layer(module)
        if layer in ("", "factory"):  # the public API and the old factory location re-export
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


def test_no_import_cycles():
    graph = _graph()
    # A package's __init__ importing its own modules is how re-exports work, not a cycle.
    edges = {
        module: {t for t in targets if not module.startswith(t + ".") and t != module}
        for module, targets in graph.items()
    }
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
    module.write_text("def f():\n    from ..engine.runner import Runner\n")
    assert _imports(module, "mlxkv.cache") == {"mlxkv.engine.runner", "mlxkv.engine.runner.Runner"}
    assert _violations({"mlxkv.cache.mod": {"mlxkv.engine.runner"}}) == [
        "mlxkv.cache.mod imports mlxkv.engine.runner"
    ]
    assert _violations({"mlxkv.engine.x": {"mlxkv.cache.pool", "mlxkv.config"}}) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
