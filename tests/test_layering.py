"""The tree's layers, read from the imports themselves (every import statement, at the top of a module or inside a
function): the engines (engine/, native/, torch_engine/) import neither formats/ nor the CLI, formats/ never
imports the CLI, and no torch import is reachable from the torch-free modules (engine/ and native/), which is what
lets the native path of every command start without torch."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

import manas_cli

PACKAGE = Path(manas_cli.__file__).resolve().parent
ENGINES = ("manas_cli.engine", "manas_cli.native", "manas_cli.torch_engine")
TORCH_FREE = ("manas_cli.engine", "manas_cli.native")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


@cache
def imports(module: str) -> frozenset[str]:
    """Every module `module` imports, relative imports resolved: `from .x import y` counts x, and x.y where that
    is a module."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in MODULES)
    return frozenset(found)


def reachable(module: str) -> set[str]:
    """The modules an import of `module` may load, through manas_cli's own modules."""
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        for name in imports(current):
            if name not in seen:
                seen.add(name)
                if name in MODULES:
                    todo.append(name)
    return seen


def within(name: str, layers: tuple[str, ...]) -> bool:
    return any(name == layer or name.startswith(layer + ".") for layer in layers)


def test_the_layers_hold_real_modules():
    """A guard for the tests below: the layers they name exist and import what they should."""
    assert all(any(within(name, (layer,)) for name in MODULES) for layer in ENGINES)
    assert "manas_cli.torch_engine.model" in reachable("manas_cli.torch_engine.engine")
    assert "torch" in reachable("manas_cli.torch_engine.engine")


@pytest.mark.parametrize("module", [name for name in MODULES if within(name, ENGINES)])
def test_an_engine_module_imports_neither_formats_nor_the_cli(module):
    above = [
        name for name in imports(module) if within(name, ("manas_cli.formats", "manas_cli.cli", "manas_cli.models"))
    ]
    assert not above, f"{module} imports {above}: the engine layer must not reach up"


@pytest.mark.parametrize("module", [name for name in MODULES if within(name, ("manas_cli.formats",))])
def test_a_format_module_never_imports_the_cli(module):
    assert not [name for name in imports(module) if within(name, ("manas_cli.cli",))]


@pytest.mark.parametrize("module", [name for name in MODULES if within(name, TORCH_FREE)])
def test_no_torch_import_is_reachable_from_a_torch_free_module(module):
    torch = sorted(name for name in reachable(module) if within(name, ("torch", "manas_cli.torch_engine")))
    assert not torch, f"{module} can import {torch}"


def import_graph() -> dict[str, list[str]]:
    return {
        module: sorted(name for name in imports(module) if name in MODULES and name != module) for module in MODULES
    }


def import_circles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Every set of modules that import each other round a circle (the strongly connected components of the import
    graph, Tarjan's), each sorted."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        for name in graph[module]:
            if name not in order:
                visit(name)
                low[module] = min(low[module], low[name])
            elif name in stack:
                low[module] = min(low[module], order[name])
        if low[module] == order[module]:
            component = stack[stack.index(module) :]
            del stack[stack.index(module) :]
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in order:
            visit(module)
    return circles


def test_no_two_modules_import_each_other_round_a_circle():
    """Counting imports inside functions too: a circle there is a knot the next change trips on."""
    assert import_circles(import_graph()) == []


def engine_name_switches(source: str) -> list[int]:
    """Lines where a module's source compares something's `.name` with an engine's name ("native", "torch")."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(side, ast.Attribute) and side.attr == "name" for side in sides)
            engine = any(isinstance(side, ast.Constant) and side.value in ("native", "torch") for side in sides)
            if named and engine:
                lines.append(node.lineno)
    return lines


def test_the_checks_find_what_they_look_for():
    """A guard for the two tests around it: they see a circle and a switch when there is one."""
    assert import_circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert import_circles({"a": ["b"], "b": []}) == []
    assert engine_name_switches('x = 1\nif opened.engine.name == "native":\n    pass\n') == [2]
    assert engine_name_switches('if engine == "native" or name == "torch":\n    pass\n') == []


@pytest.mark.parametrize("module", [name for name in MODULES if not within(name, ENGINES)])
def test_no_module_outside_the_engines_switches_on_an_engine_name(module):
    """What differs between the engines is the engines' to say (engine/engines.py's interface), not a branch on
    their names elsewhere."""
    source = MODULES[module].read_text(encoding="utf-8")
    assert engine_name_switches(source) == [], f"{module} branches on an engine's name"


COMMAND_MODULE_IMPORTS = (
    "typer",
    "manas_cli.cli.flags",
    "manas_cli.errors",
    "manas_cli.settings",
    "manas_cli.cli.commands",
)


def top_level_imports(module: str) -> set[str]:
    """What a module imports when it is imported (its top-level statements and `if` blocks, TYPE_CHECKING's aside),
    relative imports resolved."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    statements = list(ast.parse(path.read_text(encoding="utf-8")).body)
    while statements:
        node = statements.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            statements.extend(node.body + node.orelse)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            found.add(".".join([*base, *([node.module] if node.module else [])]))
    return found


@pytest.mark.parametrize("module", [name for name in MODULES if within(name, ("manas_cli.cli.commands",))])
def test_a_command_module_imports_only_the_light_layers_at_its_top(module):
    """Every command's module is imported for `manas --help` and at every start: the engine, the formats and the
    tokenizers wait until the command runs (the standard library is fine)."""
    import sys

    heavy = [
        name
        for name in top_level_imports(module)
        if name.split(".")[0] not in sys.stdlib_module_names
        and not within(name, COMMAND_MODULE_IMPORTS)
        and name != "__future__"
    ]
    if module.rpartition(".")[2] in ("common", "jsonl"):  # helpers the commands import when they run
        return
    assert heavy == [], f"{module} imports {heavy} at its top"


def test_every_command_is_declared_in_its_own_module():
    """`manas NAME`'s flags, help and call are in cli/commands/NAME.py (`batch`'s two in batch.py)."""
    from manas_cli.cli.app import app, batch_app

    for info in app.registered_commands:
        assert info.callback.__module__ == f"manas_cli.cli.commands.{info.name.replace('-', '_')}", info.name
    for info in batch_app.registered_commands:
        assert info.callback.__module__ == "manas_cli.cli.commands.batch", info.name
