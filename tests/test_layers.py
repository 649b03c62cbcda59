"""The package's layers: every import points down, none between two packages of one floor.

Read from the source (ast), imports inside functions and under TYPE_CHECKING included: a lazy
import that runs back up is still a dependency that runs back up. A new package or top-level
module must be given its floor here, which is the point: where it stands is decided once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "supervisord_gpu"

#: higher imports lower, never the other way; docs/design.md lists the same floors (tests/test_docs.py)
FLOORS: dict[str, int] = {
    "errors": 0, "records": 0, "addresses": 0,
    "names": 1, "bus": 1, "sglang": 1,
    "config": 2, "systemd": 2,
    "ownership": 3,
    "checks": 4,
    "engine": 5, "rehearsal": 5, "parking": 5,
    "cluster": 6, "metrics": 6,
    "controller": 7,
    "api": 8,
    "daemon": 9,
    "cli": 10,
}

#: imports the floors would allow that must still never be: a rehearsal is decided once, where the
#: daemon is assembled (daemon.py's Backends), and handed down; the lifecycle never asks again
FORBIDDEN: dict[str, frozenset[str]] = {
    "controller": frozenset({"rehearsal"}),
}


def part_of(module: str) -> str:
    """supervisord_gpu.engine.process -> engine; supervisord_gpu.daemon -> daemon."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(path: Path, package: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import of ours in `path`."""
    here = list(path.relative_to(package.parent).parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "supervisord_gpu":  # from supervisord_gpu import x / from .. import x
                found += [(node.lineno, f"supervisord_gpu.{a.name}") for a in node.names]
            elif target.startswith("supervisord_gpu."):
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("supervisord_gpu.")]
    return found


def sources(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def violations(package: Path) -> list[str]:
    """One line per import that runs back up, or across to another package of its floor."""
    wrong = []
    for path in sources(package):
        mine = part_of(".".join(path.relative_to(package.parent).with_suffix("").parts))
        if mine in ("", "__init__"):
            continue
        for line, target in imports(path, package):
            theirs = part_of(target)
            if theirs in (mine, "", "__init__") or theirs not in FLOORS:
                continue
            if theirs in FORBIDDEN.get(mine, ()):
                wrong.append(f"{path.relative_to(package.parent)}:{line}: {mine} imports {target} (never: "
                             "see FORBIDDEN)")
            elif FLOORS[theirs] >= FLOORS[mine]:
                wrong.append(f"{path.relative_to(package.parent)}:{line}: {mine} (floor {FLOORS[mine]}) "
                             f"imports {target} (floor {FLOORS[theirs]})")
    return wrong


def test_every_package_and_top_level_module_has_a_floor():
    parts = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in sources(PACKAGE)} - {"__init__", "data"}
    assert sorted(parts - set(FLOORS)) == [], "give each a floor in FLOORS"


def test_no_import_runs_back_up_or_across_a_floor():
    assert violations(PACKAGE) == []


@pytest.mark.parametrize("module, line, why", [
    ("engine", "from ..cli import gpusupctl", "engine (floor 5) imports supervisord_gpu.cli"),
    ("engine", "    from ..api.service import BusService", "engine (floor 5) imports supervisord_gpu.api.service"),
    ("engine", "from supervisord_gpu.rehearsal import setup", "engine (floor 5) imports supervisord_gpu.rehearsal"),
    ("controller", "    from ..rehearsal.setup import stand_ins", "controller imports supervisord_gpu.rehearsal.setup (never"),
])
def test_the_check_sees_an_import_that_runs_back_up_or_across(tmp_path, module, line, why):
    package = tmp_path / "supervisord_gpu"
    (package / module).mkdir(parents=True)
    (package / module / "process.py").write_text("from ..records import dataclass\n"
                                                 + ("def f():\n" if line.startswith(" ") else "") + line + "\n")
    found = violations(package)
    assert len(found) == 1 and why in found[0], found  # the import of records (floor 0) is fine
