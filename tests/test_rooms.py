"""autotune/'s rooms import each other one way: no circle between rooms (docs/architecture.md).

A room is a subpackage (`autotune.cli`, `autotune.measure`, `autotune.search`,
`autotune.decide`); a module at the top of `autotune/` (the plan, the pipeline, the errors) is
a node of its own. The packages import one way too: workloads <- server <- autotune.
"""

from __future__ import annotations

import ast
from pathlib import Path

AUTOTUNE = Path(__file__).resolve().parents[1] / "autotune"


def _node(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "autotune" or len(parts) < 2:
        return None
    return parts[1]


def _room_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in AUTOTUNE.rglob("*.py"):
        parts = path.relative_to(AUTOTUNE.parent).with_suffix("").parts
        me = _node(".".join(parts).removesuffix(".__init__"))
        if me is None:  # autotune/__init__.py
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "autotune":
                    targets = [f"autotune.{alias.name}" for alias in node.names]
                else:
                    targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                other = _node(target)
                if other is not None and other != me:
                    edges.setdefault(me, set()).add(other)
    return edges


def _circle(edges: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for other in sorted(edges.get(node, ())):
            found = visit(other, path + [node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(edges):
        found = visit(node, [])
        if found:
            return found
    return None


def test_rooms_import_each_other_one_way() -> None:
    edges = _room_edges()
    assert {"cli", "measure", "search", "decide"} <= set(edges)
    assert _circle(edges) is None, " -> ".join(_circle(edges) or [])


def test_the_measure_room_needs_only_the_errors_from_above() -> None:
    assert _room_edges()["measure"] == {"errors"}


ROOMS = ("cli", "measure", "search", "decide")


def test_every_room_is_a_package_and_no_module_is_left_at_an_old_path() -> None:
    for room in ROOMS:
        assert (AUTOTUNE / room / "__init__.py").is_file()
    top = {path.stem for path in AUTOTUNE.glob("*.py")}
    moved = {path.stem for room in ROOMS for path in (AUTOTUNE / room).glob("*.py")}
    assert not (top & (moved - {"__init__"}))
    # The command line's modules before autotune/cli/ held them all.
    for old in ("cli", "run_cli", "retune", "worker_cli", "fork_server_cli", "measure_flags"):
        assert not (AUTOTUNE / f"{old}.py").exists(), old
    assert not any((AUTOTUNE.parent / "workloads" / f"{old}.py").exists() for old in ("cli", "replay_cli"))


ROOT = AUTOTUNE.parent
PACKAGES = ("autotune", "server", "workloads")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _module_edges() -> dict[str, set[str]]:
    """Module -> the project modules it imports (at the top, in functions, or for typing
    only: a circle for the type checker is a circle of design too)."""
    modules = {_module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for me, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target in modules and target != me and not me.startswith(target + "."):
                    edges.setdefault(me, set()).add(target)
    return edges


def test_packages_import_one_way() -> None:
    """workloads imports neither server nor autotune; server does not import autotune."""
    below = {"workloads": ("server", "autotune"), "server": ("autotune",)}
    for me, targets in _module_edges().items():
        forbidden = below.get(me.split(".")[0], ())
        wrong = sorted(target for target in targets if target.split(".")[0] in forbidden)
        assert not wrong, f"{me} imports {', '.join(wrong)}"


def test_no_two_modules_import_each_other_even_through_others() -> None:
    circle = _circle(_module_edges())
    assert circle is None, "import circle: " + " -> ".join(circle or [])
