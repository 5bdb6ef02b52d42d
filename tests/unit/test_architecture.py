"""The package's shape is part of its contract: trust boundaries are folders.

These tests read the source, not the running code: every `import` statement
anywhere in a module counts (inside functions and `TYPE_CHECKING` blocks
too), so an import cycle cannot be hidden by moving the import into a
function, and the core cannot reach the operating system through a side door.
Modules meet at their public names: none takes another's `_private` ones, and
size is no rule of its own -- a module over 600 lines is listed with why it stays whole.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "bastion"
LARGE_LINES = 600
# Modules over LARGE_LINES, each with why its idea does not split. Kept true both ways:
# an unlisted module over the mark fails, and so does a listed one that is no longer over it.
LARGE_MODULES: dict[str, str] = {
    "bastion/core/gate.py": "the one decision in contract order, with its records and its "
    "words: split, the order would be read across files",
    "bastion/gateway/service.py": "the request path, arrival to outcome, one loop: the "
    "waits and re-checks read in one place",
    "bastion/gateway/sftp.py": "the whole SFTPServer surface, each method overridden so none "
    "serves the gateway's own files",
    "bastion/core/command.py": "the command reader: the decision (argv or shell source), the "
    "listing of that source's constructs and the rules all read text with one set of "
    "character tables; split, the listing could drift from what the decision saw",
    "bastion/core/policy.py": "the policy model and its parser: each field's check beside "
    "its record and its place in the entry digest, so a field cannot be read one way and "
    "digested another",
    "bastion/gateway/lifetime.py": "one gateway lifetime: what it builds, then its start and "
    "its stop in order; split, the order of start-up and shutdown would be read across files",
    "bastion/sandbox/per_run.py": "bwrap's words for a run and the checks before they are "
    "used, in the order bwrap applies them: split, the order of binds and hides (which one "
    "wins) would be read across files",
    "bastion/cli/run.py": "one `bastion run` from its checks to its last reap: registration, "
    "the start, the signals and the end read as the one sequence they are",
    "bastion/sandbox/isolation.py": "strong isolation: its setup, the checks made as the agent "
    "user, and what `run --isolated` may start are the same facts about one uid",
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
    "statistics",
    "tomllib",
    "types",
    "typing",
    "unicodedata",
    "cryptography",
    "bastion",
}


# One module of the core may use one library more: presence reads WebAuthn's formats
# (CBOR, COSE, attestation statements) with `webauthn`, which computes and does no I/O,
# so that no CBOR or COSE is parsed by hand (the issue asks for a maintained library).
CORE_LIBRARIES = {"bastion.core.presence": {"webauthn"}}


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
        allowed = CORE_ALLOWED | CORE_LIBRARIES.get(name, set())
        assert top in allowed, f"{MODULES[name].name}:{line} imports {target}"
        if top == "bastion":
            assert target.startswith("bastion.core"), (
                f"{MODULES[name].name}:{line} imports {target}"
            )


def test_the_proxy_is_standard_library_only() -> None:
    """It runs once per agent ssh call, by path, with -I -S: it must start fast and alone.
    It may import the wire beside it, which is standard library only itself."""
    wire = {"bastion.agent.wire", "wire"}  # as a package's module, and by path
    for name in ("bastion.agent.proxy", "bastion.agent.wire"):
        for target, line in imports(MODULES[name]):
            top = target.split(".")[0]
            fine = top in sys.stdlib_module_names or top == "__future__" or target in wire
            assert fine, f"{MODULES[name].name}:{line}: {target}"


def test_the_gateway_takes_the_wire_from_the_wire_not_from_the_proxy() -> None:
    """The proxy is the agent's program; what both sides say lives in `agent/wire`."""
    for name, path in MODULES.items():
        if name.startswith(("bastion.gateway", "bastion.core")):
            for target, line in imports(path):
                assert target != "bastion.agent.proxy", f"{path}:{line} imports {target}"


# What the agent's side may use of bastion: the contract's words, the root exception,
# the refusals' table, and itself. Never the vault, the journal, the CA or the gateway.
AGENT_SIDE_MAY_IMPORT = (
    "bastion.agent",
    "bastion.core.contract",
    "bastion.core.errors",
    "bastion.core.refusals",
)


@pytest.mark.parametrize("name", [n for n in MODULES if n.startswith("bastion.agent")])
def test_the_agent_side_imports_nothing_that_holds_or_decides(name: str) -> None:
    """`bastion/agent/` runs as the agent: it holds no key and decides nothing, so it
    imports none of the code that does (and `mcp_front` only the MCP SDK besides)."""
    for target, line in imports(MODULES[name]):
        top = target.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__":
            continue
        if top in {"mcp", "mcp_types", "pydantic"} and name == "bastion.agent.mcp_front":
            continue
        if target == "wire" and name == "bastion.agent.proxy":
            continue  # agent/wire, imported by path (proxy.py is started by path)
        assert target.startswith(AGENT_SIDE_MAY_IMPORT), f"{MODULES[name]}:{line}: {target}"


def test_only_the_gateway_and_the_operators_commands_import_the_signers() -> None:
    """`bastion/ca/` holds signing keys or the login that reaches them."""
    for name, path in MODULES.items():
        if name.startswith(("bastion.ca.", "bastion.gateway.", "bastion.cli.")) or name in {
            "bastion.ca",
            "bastion.ops.actions",
        }:
            continue
        for target, line in imports(path):
            signer = target == "bastion.ca" or target.startswith("bastion.ca.")
            assert not signer, f"{path}:{line} imports {target}"


def test_the_cli_client_wire_is_standard_library_only() -> None:
    for target, line in imports(MODULES["bastion.ops.opsock"]):
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


def private_uses(path: Path) -> list[tuple[str, int]]:
    """Every `_private` name `path` takes from another bastion module, with its line:
    `from bastion.x import _y`, `import bastion.x._y`, and `x._y` on a name bound to an
    imported bastion module. `from bastion.x import y as _y` is fine: `y` is public."""
    tree = ast.parse(path.read_text(), str(path))

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    bound: dict[str, str] = {}  # a local name -> the bastion module it is bound to
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "bastion":
                continue
            for alias in node.names:
                if private(alias.name):
                    out.append((f"{node.module}.{alias.name}", node.lineno))
                elif f"{node.module}.{alias.name}" in MODULES:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "bastion":
                    continue
                if any(map(private, alias.name.split("."))):
                    out.append((alias.name, node.lineno))
                bound[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = dotted(node.value)
            if owner is not None and owner in bound:
                out.append((f"{bound[owner]}.{node.attr}", node.lineno))
    return out


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` as written, or None if it is not a plain dotted name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := dotted(node.value)) is not None:
        return f"{base}.{node.attr}"
    return None


@pytest.mark.parametrize("name", list(MODULES))
def test_no_module_imports_another_modules_private_names(name: str) -> None:
    """A module's `_private` names are its own business. A split that follows a line
    count, not an idea, shows up here: the halves still need each other's insides.
    What two modules truly share is public, under a name that says what it is."""
    path = MODULES[name]
    uses = [f"{path.name}:{line} uses {target}" for target, line in private_uses(path)]
    assert not uses, "; ".join(uses)


def test_the_private_name_rule_sees_every_way_in(tmp_path: Path) -> None:
    """The rule above would pass vacuously if it missed a form of reaching in."""
    src = tmp_path / "probe.py"
    src.write_text(
        "from bastion.journal import _RAW\n"
        "from bastion.journal import head as _head\n"  # a public name, aliased: fine
        "from bastion import vault\n"
        "import bastion.journal\n"
        "import bastion.journal as jn\n"
        "def f():\n"
        "    return vault._x, bastion.journal._y, jn._z, vault.__name__, jn.head\n"
    )
    assert sorted(target for target, _ in private_uses(src)) == [
        "bastion.journal._RAW",
        "bastion.journal._y",
        "bastion.journal._z",
        "bastion.vault._x",
    ]


def module_lines() -> dict[str, int]:
    return {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in MODULES.values()
    }


def test_a_module_over_600_lines_says_why() -> None:
    """Size alone is no reason to split a module (that made the private imports above);
    a big one is listed with the idea that keeps it whole, so its size is a decision."""
    big = {rel: n for rel, n in module_lines().items() if n > LARGE_LINES}
    unlisted = [f"{rel} has {n} lines" for rel, n in big.items() if rel not in LARGE_MODULES]
    assert not unlisted, "list in LARGE_MODULES with its reason: " + "; ".join(unlisted)


def test_every_listed_large_module_is_still_large() -> None:
    """So the list stays true: a module that shrank back under the mark leaves it."""
    lines = module_lines()
    stale = [rel for rel in LARGE_MODULES if lines.get(rel, 0) <= LARGE_LINES]
    assert not stale, f"no longer over {LARGE_LINES} lines (or gone): {stale}"
    assert all(reason.strip() for reason in LARGE_MODULES.values())


def test_no_module_is_named_like_the_standard_library() -> None:
    for name in MODULES:
        leaf = name.rsplit(".", 1)[-1]
        assert leaf == "bastion" or leaf not in sys.stdlib_module_names, name


def test_test_files_have_names_of_their_own_across_the_tiers() -> None:
    """pytest imports each test file by its basename (no packages): two tiers holding
    `test_x.py` each stop the whole run at collection."""
    seen: dict[str, Path] = {}
    for path in sorted((PACKAGE.parent / "tests").rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]}"
        seen[path.name] = path


def test_the_core_package_docstring_names_every_core_module() -> None:
    """`core/__init__` is the reviewer's map: a module it does not name is one they miss."""
    doc = (PACKAGE / "core" / "__init__.py").read_text()
    for path in sorted((PACKAGE / "core").glob("*.py")):
        if path.name != "__init__.py":
            assert f"`{path.stem}`" in doc, f"core/__init__.py does not name {path.stem}"


# What may sit at the package root: the package face and the home's own files (its
# layout, bastion.toml, the policy files). Everything else lives in the room of its idea.
ROOT_MODULES = {"bastion", "bastion.home", "bastion.config", "bastion.policy_files"}
ROOMS = {"agent", "ca", "cli", "core", "devtools", "gateway", "identity", "journal", "ops"}
ROOMS |= {"sandbox", "vault", "data"}  # data: files the wheel ships, no code


def test_no_module_at_the_package_root_but_the_face_and_the_homes_files() -> None:
    """A flat package hides its architecture: 25 modules side by side say nothing of who
    may import whom. A new module goes into a room, or a new room is named here."""
    at_root = {name for name in MODULES if name.count(".") <= 1 and name != "bastion"}
    rooms = {name for name in at_root if MODULES[name].name == "__init__.py"}
    assert at_root - rooms == ROOT_MODULES - {"bastion"}
    assert {name.split(".")[1] for name in rooms} == ROOMS


def test_every_room_says_what_it_holds() -> None:
    """A room's face names each of its modules, as `core/__init__` does for the core."""
    for room in sorted(ROOMS):
        doc = (PACKAGE / room / "__init__.py").read_text()
        for path in sorted((PACKAGE / room).glob("*.py")):
            if path.name != "__init__.py" and room not in {"cli", "devtools", "gateway"}:
                assert f"`{path.stem}`" in doc, f"{room}/__init__.py does not name {path.stem}"


# -- reading the world only reads ------------------------------------------------------------

# What `Service.world` may call, by the attribute it calls it on, and the class whose method
# that is (None: an observing function handed in, `service.Edges`). Each method listed here
# is itself read below: it stores nothing on its object and calls only other readers.
WORLD_READS: dict[tuple[str, str], tuple[str, str] | None] = {
    ("book", "session_for"): ("gateway/approvals.py", "ApprovalBook"),
    ("book", "command_grant"): ("gateway/approvals.py", "ApprovalBook"),
    ("book", "pending"): ("gateway/approvals.py", "ApprovalBook"),
    ("book", "grants_for"): ("gateway/approvals.py", "ApprovalBook"),
    ("book", "other_exec"): ("gateway/approvals.py", "ApprovalBook"),
    ("policy", "seen"): ("gateway/recorder.py", "PolicyWatch"),
    ("actions", "blocking"): ("gateway/actions.py", "ActionKeys"),
    ("certifier", "problem"): ("gateway/certify.py", "Certifier"),
    ("edges", "alive"): None,
    ("edges", "clock"): None,
}
# What a reader may call on the containers and sources it holds.
CONTAINER_READS = {"get", "values", "items", "keys", "current", "problem"}


def _method(path: str, cls: str, name: str) -> ast.FunctionDef | None:
    """The method `name` of `cls`, or None (an attribute holding a function)."""
    tree = ast.parse((PACKAGE / path).read_text())
    (klass,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    found = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return found[0] if found else None


def _self_calls(fn: ast.FunctionDef) -> list[tuple[str, ...]]:
    """Every call on `self` in `fn`: ("x",) for `self.x()`, ("a", "b") for `self.a.b()`."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            chain, value = [node.func.attr], node.func.value
            while isinstance(value, ast.Attribute):
                chain.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "self":
                found.append(tuple(chain))
    return found


def _stores_on_self(fn: ast.FunctionDef) -> list[int]:
    """Lines where `fn` assigns to, or deletes, anything reached from `self`."""
    lines = []
    for node in ast.walk(fn):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute | ast.Subscript):
                base = base.value
            if isinstance(base, ast.Name) and base.id == "self" and base is not target:
                lines.append(node.lineno)
    return lines


def _reads_only(path: str, cls: str, name: str, seen: set[str] | None = None) -> list[str]:
    """Why `cls.name` (and what it calls on itself) is not a pure read; empty if it is."""
    seen = seen if seen is not None else set()
    if name in seen:
        return []
    seen.add(name)
    fn = _method(path, cls, name)
    if fn is None:
        return [f"{cls} calls self.{name}, a function it was handed"]
    problems = [f"{cls}.{name}:{line} stores on self" for line in _stores_on_self(fn)]
    for chain in _self_calls(fn):
        if len(chain) == 1:
            problems += _reads_only(path, cls, chain[0], seen)
        elif chain[-1] not in CONTAINER_READS:
            problems.append(f"{cls}.{name} calls self.{'.'.join(chain)}")
    return problems


def test_building_the_world_only_reads() -> None:
    """`Service.world` calls only readers, and each reader stores nothing and calls only
    readers: what is journaled or ended around a look is `Service.look`'s, carried out
    as core says. (Before issue 33, `session_for` ended the old exec's sessions,
    `grants_for` ended spent grants and `policy.current` journaled a new digest.)"""
    world = _method("gateway/service.py", "Service", "world")
    assert world is not None
    for chain in _self_calls(world):
        assert chain in WORLD_READS, f"Service.world calls self.{'.'.join(chain)}"
    assert not _stores_on_self(world)
    for (_, name), owner in WORLD_READS.items():
        if owner is not None:
            assert _reads_only(*owner, name) == [], owner


def test_the_read_rule_sees_a_write() -> None:
    """The control: the methods that end and journal are caught by the same rule."""
    book = ("gateway/approvals.py", "ApprovalBook")
    assert _reads_only(*book, "end_for_exec")
    assert _reads_only(*book, "end_spent_grants")
    assert _reads_only("gateway/recorder.py", "PolicyWatch", "current")


async def test_building_the_world_journals_nothing_and_ends_nothing() -> None:
    """Run, not read: an approved process exec's into another program; building the
    world then writes no record and ends no session, though it sees the old exec's.
    The control: `look` at the same moment ends that session, as `process_changed`."""
    from bastion.core.events import EventType
    from bastion.core.gate import Request
    from bastion.gateway.service import Case, new_request_id
    from tests.unit.test_service import Rig

    rig = Rig()
    await rig.unlock()
    agent = rig.tree.spawn()
    task = rig.send(rig.life.connect(agent))
    await rig.approve()
    await task
    agent.exe = "/usr/bin/other"  # the same process, exec'd into another executable
    conn = rig.life.connect(agent)
    req = Request(new_request_id(), conn.host, conn.user, b"echo hi", conn.peer.subject.key)
    case, service = Case(conn, req), rig.life.service
    records, sessions = len(rig.journal.records), rig.life.book.sessions()
    world = service.world(case)
    assert world.session is None and len(world.other_exec) == 1
    assert len(rig.journal.records) == records and rig.life.book.sessions() == sessions
    service.look(case)
    assert rig.life.book.sessions() == []
    assert rig.journal.of(EventType.SESSION_ENDED)[-1].meta["reason"] == "process_changed"


# -- one word per idea ------------------------------------------------------------------------

GLOSSARY = PACKAGE.parent / "docs" / "architecture.md"


def banned_words() -> dict[str, str]:
    """Each identifier the glossary bans (`*Not in code:* `X`, `Y`.`), with its entry."""
    text = GLOSSARY.read_text().split("\n## Glossary\n", 1)[1]
    banned = {}
    for entry in text.split("\n- **")[1:]:
        term = entry.split("**", 1)[0]
        for clause in entry.replace("\n", " ").split("*Not in code:*")[1:]:
            for word in clause.split(".", 1)[0].split("`")[1::2]:
                banned[word] = term
    return banned


def identifiers(tree: ast.AST) -> list[tuple[str, int]]:
    """Every name the code gives or uses: classes, functions, arguments, variables,
    attributes, imported names and keyword arguments."""
    found = []
    for node in ast.walk(tree):
        names: list[str | None] = []
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            names = [node.name]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.alias):
            names = [node.name.rsplit(".", 1)[-1], node.asname]
        elif isinstance(node, ast.keyword):
            names = [node.arg]
        found += [(n, getattr(node, "lineno", 0)) for n in names if n]
    return found


def test_the_glossary_bans_words() -> None:
    """The list is read from the glossary; a glossary that lost it would pass vacuously."""
    banned = banned_words()
    assert {"SessionGrant", "Grant", "Answer", "Deny", "refused_sessions"} <= set(banned)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_identifier_is_a_word_the_glossary_bans(name: str) -> None:
    banned = banned_words()
    for word, line in identifiers(ast.parse(MODULES[name].read_text())):
        assert word not in banned, (
            f"{MODULES[name]}:{line}: `{word}` -- the glossary's word is **{banned[word]}**"
        )


def test_the_identifier_rule_sees_each_way_to_name() -> None:
    """The control: a class, an argument, an attribute, a keyword and an import."""
    source = (
        "from x import SessionGrant\nclass Grant: ...\ndef f(refused_sessions): ...\n"
        "a.Answer\ng(Deny=1)\n"
    )
    banned = banned_words()
    assert sorted({w for w, _ in identifiers(ast.parse(source))} & set(banned)) == [
        "Answer", "Deny", "Grant", "SessionGrant", "refused_sessions",
    ]  # fmt: skip


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_logger_is_named_after_its_module(name: str) -> None:
    """`bastion.agent` inside the gateway named the wrong room; `__name__` cannot."""
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "getLogger":
            (arg,) = node.args or [ast.Constant("")]
            literal = isinstance(arg, ast.Constant) and str(arg.value)
            assert not (literal is not False and literal.startswith("bastion")), (
                f"{MODULES[name]}:{node.lineno}: getLogger({literal!r}); use __name__"
            )
