"""The package's wings and the one-way direction of their imports, read from the source (ast), not described.

- ground floor (`errors`, `tensor_layout`, `dict_to_dataclass`): imports nothing of the package but `errors`;
- `maths/` (training maths): the ground floor only, and no networking (hivemind's p2p, DHT or averaging);
- `net/` (libp2p, DHT, wire, exchanges): the ground floor only, and no optimizers;
- `sync/` (the strategies): where maths and net meet; never the top level or the testnet;
- `testnet/`: imported by the CLI only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "p2ptrain"
GROUND_FLOOR = {"p2ptrain.errors", "p2ptrain.tensor_layout", "p2ptrain.dict_to_dataclass"}
MAX_MODULE_LINES = 400


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


def wing(module: str) -> str:
    """'maths', 'net', 'sync', 'testnet', 'ground' or 'top' (cli, peer, config, ... and the top level's own
    packages, such as memory/ and node/)."""
    if module in GROUND_FLOOR:
        return "ground"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else "top"


def package_imports(module: str) -> set[str]:
    return {name for name in MODULES[module] if name.startswith("p2ptrain.") and name in MODULES}


def offences(allowed_wings: set[str], of_wing: str) -> list[str]:
    return [f"{module} imports {target}" for module in MODULES if wing(module) == of_wing
            for target in package_imports(module) if wing(target) not in allowed_wings | {of_wing}]


def test_the_source_tree_has_all_four_wings() -> None:
    assert {wing(m) for m in MODULES} == {"ground", "top", "maths", "net", "sync", "testnet"}
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


def test_no_module_is_over_400_lines() -> None:
    long = {m: n for m, n in ((module_name(p), len(p.read_text().splitlines())) for p in PACKAGE.rglob("*.py"))
            if n > MAX_MODULE_LINES}
    assert not long, f"split these by concept: {long}"
