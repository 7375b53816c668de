"""The package's wings and the one-way direction of their imports, read from the source (ast), not described.

The floors, from the bottom: ground → maths and net (side by side) → sync → top → testnet → cli.
- ground floor (`errors`, `tensor_layout`, `dict_to_dataclass`, `timing`): imports nothing of the package but
  `errors`;
- `maths/` (training maths): the ground floor only, and no networking (hivemind's p2p, DHT or averaging);
- `net/` (libp2p, DHT, wire, exchanges): the ground floor only, and no optimizers;
- `sync/` (the strategies): where maths and net meet; never the top level or the testnet;
- top (`peer`, `config`, `joining`, `memory/`, `node/`, ...): the round loop and what it needs;
- `testnet/`: imported by the CLI only; `cli` (and `__main__`): imported by nobody.
Every import counts, at any depth of a file: function-level ones and those under `if TYPE_CHECKING:` too, so
no module imports one on a higher floor and the modules' import graph has no circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "p2ptrain"
GROUND_FLOOR = {"p2ptrain.errors", "p2ptrain.tensor_layout", "p2ptrain.dict_to_dataclass", "p2ptrain.timing",
                "p2ptrain.choices"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (function-level imports included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from p2ptrain.net import wire`
    return found


MODULES = {module_name(path): imports_of(path) for path in sorted(PACKAGE.rglob("*.py"))}


WINGS = ("maths", "net", "sync", "testnet")
ENTRY_POINTS = {"p2ptrain.cli", "p2ptrain.__main__"}
FLOORS = {"ground": 0, "maths": 1, "net": 1, "sync": 2, "top": 3, "testnet": 4, "cli": 5}


def wing(module: str) -> str:
    """'maths', 'net', 'sync', 'testnet', 'ground', 'cli' (the entry points) or 'top' (peer, config, ... and the
    top level's own packages, such as memory/ and node/)."""
    if module in GROUND_FLOOR:
        return "ground"
    if module in ENTRY_POINTS:
        return "cli"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else "top"


def package_imports(module: str, modules: dict[str, set[str]] = MODULES) -> set[str]:
    return {name for name in modules[module] if name.startswith("p2ptrain.") and name in modules and name != module}


def upward_imports(modules: dict[str, set[str]]) -> list[str]:
    """Imports of a module on a higher floor than the importer's."""
    return [f"{module} ({wing(module)}) imports {target} ({wing(target)})" for module in modules
            for target in package_imports(module, modules) if FLOORS[wing(target)] > FLOORS[wing(module)]]


def import_circles(modules: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module in the import graph (Tarjan), each sorted."""
    graph = {module: sorted(package_imports(module, modules)) for module in modules}
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:  # recursion depth is bounded by the package's module count
        index[module] = lowlink[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                lowlink[module] = min(lowlink[module], lowlink[target])
            elif target in on_stack:
                lowlink[module] = min(lowlink[module], index[target])
        if lowlink[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return circles


def offences(allowed_wings: set[str], of_wing: str) -> list[str]:
    return [f"{module} imports {target}" for module in MODULES if wing(module) == of_wing
            for target in package_imports(module) if wing(target) not in allowed_wings | {of_wing}]


def test_the_source_tree_has_all_four_wings() -> None:
    assert {wing(m) for m in MODULES} == {"ground", "top", "maths", "net", "sync", "testnet", "cli"}
    assert len([m for m in MODULES if wing(m) == "maths"]) >= 5 and len(MODULES) >= 30


def test_the_ground_floor_imports_nothing_of_the_package_but_errors() -> None:
    bad = [f"{m} imports {t}" for m in GROUND_FLOOR for t in package_imports(m) if t != "p2ptrain.errors"]
    assert not bad, bad


@pytest.mark.parametrize("maths_or_net", ["maths", "net"])
def test_maths_and_net_stand_on_the_ground_floor_alone(maths_or_net: str) -> None:
    """Neither wing imports the other, the sync strategies, the top level or the testnet."""
    assert not offences({"ground"}, maths_or_net)


def test_maths_uses_no_networking_and_net_uses_no_optimizer() -> None:
    networking = ("hivemind.p2p", "hivemind.dht", "hivemind.averaging", "hivemind.optim", "p2ptrain.net")
    optimizers = ("torch.optim", "p2ptrain.maths", "transformers")
    bad = [f"{m} imports {t}" for m, names in MODULES.items() for t in names
           if (wing(m) == "maths" and t.startswith(networking)) or (wing(m) == "net" and t.startswith(optimizers))]
    assert not bad, bad


def test_sync_joins_maths_and_net_and_nothing_above() -> None:
    assert not offences({"ground", "maths", "net"}, "sync")


def test_only_the_cli_imports_the_testnet() -> None:
    bad = [f"{m} imports {t}" for m in MODULES if wing(m) != "testnet" and m != "p2ptrain.cli"
           for t in package_imports(m) if wing(t) == "testnet"]
    assert not bad, bad


def test_the_checks_see_a_forbidden_import(tmp_path: Path) -> None:
    """The reader catches function-level and `from package import module` imports (else the tests above could
    pass on a tree that breaks the rule)."""
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from p2ptrain.net import wire\n    import p2ptrain.sync.config\n")
    assert {"p2ptrain.net.wire", "p2ptrain.sync.config"} <= imports_of(source)
    assert wing("p2ptrain.net.wire") == "net" and wing("p2ptrain.peer") == "top"
    assert wing("p2ptrain.tensor_layout") == "ground" and wing("p2ptrain.maths") == "maths"
    assert wing("p2ptrain.memory.plan") == "top" and wing("p2ptrain.node") == "top"


def test_no_import_runs_from_a_lower_floor_up() -> None:
    bad = upward_imports(MODULES)
    assert not bad, bad


def test_the_package_has_no_import_circle() -> None:
    circles = import_circles(MODULES)
    assert not circles, circles


def test_the_checks_see_a_circle_closed_for_type_checking_and_an_upward_import(tmp_path: Path) -> None:
    """An import under `if TYPE_CHECKING:` counts like any other: a checkpoint module that names the peer class
    there closes a circle with the peer, and a net module that names a sync type there imports upward."""
    checkpoint = tmp_path / "checkpoint.py"
    checkpoint.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p2ptrain.peer import Peer\n"
                          "    from p2ptrain.sync.config import SyncConfig\n")
    modules = {"p2ptrain.peer": {"p2ptrain.peer_checkpoint"}, "p2ptrain.peer_checkpoint": imports_of(checkpoint),
               "p2ptrain.sync.config": set(), "p2ptrain.net.wire": imports_of(checkpoint) - {"p2ptrain.peer"}}
    assert import_circles(modules) == [["p2ptrain.peer", "p2ptrain.peer_checkpoint"]]
    assert upward_imports(modules) == ["p2ptrain.net.wire (net) imports p2ptrain.sync.config (sync)"]
    assert import_circles({"p2ptrain.a": {"p2ptrain.b"}, "p2ptrain.b": {"p2ptrain.c"}, "p2ptrain.c": set()}) == []


def external_names(tree: ast.AST) -> set[str]:
    """Names a module binds by importing from outside the package (`os`, hivemind's `P2P`, ...)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if not alias.name.startswith("p2ptrain"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith("p2ptrain"):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def private_names_defined(tree: ast.AST) -> set[str]:
    """The `_names` a module defines: functions, classes, methods, assigned names and its own attributes (setting
    `peer._x` from outside is reaching in, not defining)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def foreign_private_uses(source: str) -> list[str]:
    """`obj._name` where `_name` is another module's private name: not defined in this module, not reached through
    `self`, `cls` or `super()`, and not an outside library's (those are the library's business)."""
    tree = ast.parse(source)
    own, external = private_names_defined(tree), external_names(tree)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("p2ptrain"):
            uses += [f"line {node.lineno}: imports {alias.name}" for alias in node.names
                     if alias.name.startswith("_") and not alias.name.startswith("__")]
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        base = node.value
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in external):
            continue
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
            continue
        if node.attr not in own:
            uses.append(f"line {node.lineno}: {ast.unparse(node)}")
    return uses


def test_no_module_reaches_into_another_modules_private_names() -> None:
    bad = {module_name(path): uses for path in sorted(PACKAGE.rglob("*.py"))
           if (uses := foreign_private_uses(path.read_text()))}
    assert not bad, bad


def test_the_private_name_check_sees_a_reach_into_another_module() -> None:
    assert foreign_private_uses("def join(peer):\n    peer._apply_snapshot(1)\n") == [
        "line 2: peer._apply_snapshot"]
    assert foreign_private_uses("from p2ptrain.peer import _helper\n") == ["line 1: imports _helper"]
    assert foreign_private_uses("def patch(peer):\n    peer._announce = print\n") == ["line 2: peer._announce"]
    assert foreign_private_uses("import os\nclass A:\n    def _f(self, other):\n        other._f()\n"
                                "        self._g()\n        os._exit(0)\n") == []


def subclassed_sync_classes(sources: dict[str, str]) -> list[str]:
    """Classes of sync/ whose bases include another class of sync/ (Protocols extending Protocols aside)."""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    classes = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {base.id if isinstance(base, ast.Name) else base.attr for base in node.bases
                     if isinstance(base, (ast.Name, ast.Attribute))}
            if "Protocol" not in bases and bases & classes:
                found.append(f"{name}: {node.name}({', '.join(sorted(bases & classes))})")
    return found


def test_no_strategy_or_policy_of_sync_subclasses_another() -> None:
    """sync/'s policies plug into one driver through Protocols and compose what they share (STYLE.md)."""
    sources = {module_name(path): path.read_text() for path in sorted((PACKAGE / "sync").glob("*.py"))}
    assert subclassed_sync_classes(sources) == []
    assert subclassed_sync_classes({"a": "class A:\n    pass\n", "b": "from a import A\nclass B(A):\n    pass\n",
                                    "c": "class P(Protocol):\n    pass\nclass Q(P, Protocol):\n    pass\n"}) == [
        "b: B(A)"]
