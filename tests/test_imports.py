"""Imports among `eqx_models` modules flow one way: no module reaches, through any
chain of imports (those inside functions included), back to itself."""

import ast
from pathlib import Path

import eqx_models

PACKAGE = Path(eqx_models.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The `eqx_models` modules that `name` imports anywhere in its source. `from
    package import name` counts as importing the submodule when `name` is one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _path_between(graph: dict[str, set[str]], start: str, members: set[str]) -> list[str]:
    """One loop through `start` within a component, for the message."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                return paths[node] + [start]
            if target not in paths:
                paths[target] = paths[node] + [target]
                frontier.append(target)
    return [start]


def test_no_module_imports_itself_through_others():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    loops = [" -> ".join(_path_between(graph, c[0], set(c))) for c in _cycles(graph)]
    assert not loops, "import cycles among eqx_models modules:\n" + "\n".join(loops)


def _dynamic_imports(path: Path) -> list[int]:
    """Lines of `path` that import by a computed name (`importlib.import_module`,
    `__import__`), which the graph above cannot follow."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("importlib.import_module", "import_module", "__import__"):
                lines.append(node.lineno)
    return lines


def test_every_import_is_a_statement_the_graph_sees():
    found = {name: lines for name, path in _modules().items() if (lines := _dynamic_imports(path))}
    assert not found, f"imports by computed name (write them as import statements): {found}"


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _path_between(graph, "a", {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_to_modules(tmp_path):
    modules = {"eqx_models.nn": PACKAGE / "nn/__init__.py", "eqx_models.nn.linear": PACKAGE / "nn/linear.py",
               "eqx_models.sharding": PACKAGE / "sharding.py", "eqx_models.nn.decoder": PACKAGE / "nn/decoder.py"}
    source = tmp_path / "decoder.py"
    source.write_text("from .. import sharding\ndef f():\n    from .linear import Linear\n")
    assert _imports("eqx_models.nn.decoder", source, modules) == {"eqx_models.sharding", "eqx_models.nn.linear"}
