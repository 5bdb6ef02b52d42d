"""One root exception, and its tree drawn true.

Every exception class the package defines subclasses `BastionError`, so one
`except BastionError` tells what bastion decided from a bug; the tree in
`BastionError`'s docstring is the reader's map of them, checked here against
the classes themselves: every class is in it, with its real parents.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from types import ModuleType
from typing import Any

import pytest

import bastion
from bastion.core.errors import BastionError

pytestmark = pytest.mark.unit

ROOT = "BastionError"
# One entry of the drawing: the branch, `module.Class`, then `[Base, ...]` for its
# second bases; anything after is the gloss for the reader.
ENTRY = re.compile(
    r"^(?P<branch>(?:[│ ]   )*(?:[├└]── )?)(?P<name>[\w.]+)(?: \[(?P<also>[\w, ]+)\])?"
)


def package_modules() -> list[ModuleType]:
    """Every module of the package, imported (a `__main__` would run the CLI)."""
    names = [m.name for m in pkgutil.walk_packages(bastion.__path__, "bastion.")]
    return [importlib.import_module(n) for n in names if not n.endswith("__main__")]


def short(cls: type) -> str:
    """`module.Class` under `bastion`, as the drawing names it."""
    return f"{cls.__module__.removeprefix('bastion.')}.{cls.__qualname__}"


def exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in package_modules():
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
                and value is not BastionError
            ):
                found[short(value)] = value
    return found


def drawn() -> dict[str, tuple[str, frozenset[str]]]:
    """The docstring's tree: each class with its parent and its second bases."""
    doc = inspect.getdoc(BastionError) or ""
    lines = [line for line in doc.splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.strip() == ROOT)
    indent = len(lines[start]) - len(lines[start].lstrip())
    tree: dict[str, tuple[str, frozenset[str]]] = {}
    parents = [ROOT]  # parents[d] is the class at depth d on the current branch
    for line in lines[start + 1 :]:
        match = ENTRY.match(line[indent:])
        assert match and match["branch"], f"not a line of the tree: {line!r}"
        depth = len(match["branch"]) // 4
        del parents[depth:]
        also = frozenset(b.strip() for b in (match["also"] or "").split(",") if b.strip())
        tree[match["name"]] = (parents[-1], also)
        parents.append(match["name"])
    return tree


def real(cls: type) -> tuple[str, frozenset[str]]:
    """A class's parent inside bastion (the root by its plain name) and its other bases."""
    ours = [b for b in cls.__bases__ if b.__module__.startswith("bastion")]
    parent = ROOT if ours[:1] == [BastionError] else (short(ours[0]) if ours else "Exception")
    others = frozenset(b.__name__ for b in cls.__bases__ if b not in ours and b is not Exception)
    return parent, others


def test_the_package_defines_exceptions_and_the_walk_finds_them() -> None:
    """The checks below would pass on nothing if the walk found nothing."""
    found = exception_classes()
    assert "core.contract.Refusal" in found
    assert "ops.opsock.GatewayNotRunning" in found


def test_every_exception_class_descends_from_the_root() -> None:
    outside = sorted(
        name for name, cls in exception_classes().items() if not issubclass(cls, BastionError)
    )
    assert not outside, f"not under BastionError: {outside}"


def test_the_tree_in_the_docstring_is_every_class_with_its_real_parents() -> None:
    tree, found = drawn(), exception_classes()
    missing = sorted(set(found) - set(tree))
    gone = sorted(set(tree) - set(found))
    wrong = sorted(
        f"{name}: drawn under {tree[name]}, is under {real(found[name])}"
        for name in set(tree) & set(found)
        if tree[name] != real(found[name])
    )
    assert not (missing or gone or wrong), (
        f"not drawn: {missing}; drawn but not defined: {gone}; wrong parents: {wrong}"
    )


def test_no_two_exception_classes_share_a_name() -> None:
    """One word per idea: `except Refused` must not depend on which module it came from."""
    by_name: dict[str, list[str]] = {}
    for name in exception_classes():
        by_name.setdefault(name.rsplit(".", 1)[1], []).append(name)
    shared = {leaf: names for leaf, names in by_name.items() if len(names) > 1}
    assert not shared, f"one name, several classes: {shared}"


def test_the_drawing_is_read_as_drawn() -> None:
    """The reader of the tree: depth from the branch, the parent from the line above."""
    tree = drawn()
    assert tree["core.contract.Refusal"] == (ROOT, frozenset())
    assert tree["core.certs.CertError"] == (ROOT, frozenset({"ValueError"}))
    assert tree["ops.opsock.GatewayNotRunning"] == ("ops.opsock.OperatorError", frozenset())
    assert tree["vault.file_format.KeyFilePassphraseNeeded"] == (
        "vault.file_format.VaultError",
        frozenset(),
    )
    assert tree["journal.courier.Undelivered"] == (ROOT, frozenset())


def test_a_refusal_passes_through_a_context_manager_and_stays_frozen() -> None:
    """`contextlib` sets `__traceback__` on an exception that leaves a `with`: a plain
    frozen dataclass would turn the refusal into a FrozenInstanceError there."""
    import asyncio
    import contextlib
    import dataclasses

    from bastion.core.contract import Code, Refusal

    @contextlib.asynccontextmanager
    async def held() -> Any:
        yield

    async def carry() -> Refusal:
        try:
            async with held():
                raise Refusal(Code.GATEWAY_BUSY, "no slot")
        except Refusal as refusal:
            return refusal
        raise AssertionError("not raised")

    refusal = asyncio.run(carry())
    assert refusal.code is Code.GATEWAY_BUSY and refusal.__traceback__ is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        refusal.message = "other"  # type: ignore[misc]
