"""The package's shape is part of its contract: trust boundaries are folders.

These tests read the source, not the running code: every `import` statement
anywhere in a module counts (inside functions and `TYPE_CHECKING` blocks
too), so an import cycle cannot be hidden by moving the import into a
function, and the core cannot reach the operating system through a side door.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "bastion"
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
# Where a module may be bigger, and why.
LARGE_MODULES: dict[str, str] = {
    # The format and its one writer: records, the chain, reading lines back with their
    # damage told apart (torn, unterminated, a torn write), appending whole lines only.
    # Its readers and its writer share the private format helpers; split them and each
    # would import the other's `_private` names.
    "bastion/journal.py": "the journal's format, read and written in one place",
}
# The core may use these and nothing else: no asyncio, asyncssh, psutil, sockets or files.
CORE_ALLOWED = {
    "__future__",
    "base64",
    "binascii",
    "collections",
    "dataclasses",
    "difflib",
    "enum",
    "fnmatch",
    "hashlib",
    "ipaddress",
    "json",
    "math",
    "re",
    "tomllib",
    "types",
    "typing",
    "unicodedata",
    "cryptography",
    "bastion",
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()


def imports(path: Path) -> list[tuple[str, int]]:
    """Every module an import statement in `path` names, with its line."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, node.lineno))
            # `from bastion import journal` names the module bastion.journal.
            out += [
                (f"{node.module}.{alias.name}", node.lineno)
                for alias in node.names
                if f"{node.module}.{alias.name}" in MODULES
            ]
    return out


def internal_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _ in imports(path):
            if target in MODULES and target != name and MODULES[target].name != "__init__.py":
                graph[name].add(target)
    return graph


def test_no_import_cycles_even_through_function_level_imports() -> None:
    graph = internal_graph()
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_graph_sees_function_level_imports() -> None:
    """The walk above would miss a cycle if it missed imports inside functions."""
    graph = internal_graph()
    assert "bastion.gateway.lifetime" in graph["bastion.cli.daemon"]  # imported in `daemon`


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith("bastion.core")])
def test_the_core_imports_only_the_standard_library_pure_parts_and_cryptography(name: str) -> None:
    for target, line in imports(MODULES[name]):
        top = target.split(".")[0]
        assert top in CORE_ALLOWED, f"{MODULES[name].name}:{line} imports {target}"
        if top == "bastion":
            assert target.startswith("bastion.core"), (
                f"{MODULES[name].name}:{line} imports {target}"
            )


def test_the_proxy_is_standard_library_only() -> None:
    """It runs once per agent ssh call, by path, with -I -S: it must start fast and alone."""
    for target, line in imports(MODULES["bastion.proxy"]):
        top = target.split(".")[0]
        assert top in sys.stdlib_module_names or top == "__future__", f"proxy.py:{line}: {target}"


def test_the_cli_client_wire_is_standard_library_only() -> None:
    for target, line in imports(MODULES["bastion.opsock"]):
        top = target.split(".")[0]
        allowed = top in sys.stdlib_module_names or target in {"__future__", "bastion.core.errors"}
        assert allowed, f"opsock.py:{line}: {target}"


def test_nothing_outside_devtools_imports_devtools() -> None:
    for name, path in MODULES.items():
        if name.startswith("bastion.devtools"):
            continue
        for target, line in imports(path):
            if target.startswith("bastion.devtools"):
                assert name == "bastion.cli.main", f"{path}:{line} imports {target}"


@pytest.mark.parametrize("name", list(MODULES))
def test_modules_and_classes_stay_small(name: str) -> None:
    path = MODULES[name]
    rel = str(path.relative_to(PACKAGE.parent))
    lines = len(path.read_text().splitlines())
    if rel not in LARGE_MODULES:
        assert lines <= MAX_MODULE_LINES, f"{rel} has {lines} lines"
    else:
        assert lines <= MAX_MODULE_LINES * 1.1, f"{rel} has {lines} lines"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            assert size <= MAX_CLASS_LINES, f"{rel}: class {node.name} has {size} lines"


def test_no_module_is_named_like_the_standard_library() -> None:
    for name in MODULES:
        leaf = name.rsplit(".", 1)[-1]
        assert leaf == "bastion" or leaf not in sys.stdlib_module_names, name
