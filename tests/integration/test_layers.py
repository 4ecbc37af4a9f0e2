"""The package's import graph runs one way: no circle, no module importing a layer above it."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "toolkit"

# The public decorator factories sit on top of Step: only the package root imports them.
DECORATOR_MODULES = {"toolkit.step._decorating"}
ROOTS = {
    "toolkit",
    "toolkit.plugins",
    "toolkit.checkpoints",
    "toolkit.distributed",
    "toolkit.step",
    "toolkit.loop",
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every toolkit module ``path`` imports, anywhere in it (TYPE_CHECKING blocks too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolkit"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("toolkit"))
    return found


def _graph() -> dict[str, set[str]]:
    return {_module(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_import_graph_has_no_circle() -> None:
    # static_order raises CycleError naming the circle.
    order = list(graphlib.TopologicalSorter(_graph()).static_order())
    assert "toolkit.step._step" in order


def test_no_module_imports_a_package_root() -> None:
    # Importing a package root from inside pulls in every module above it.
    upward = {m: sorted(i & ROOTS) for m, i in _graph().items() if i & ROOTS and m not in ROOTS}
    assert not upward, upward


def test_only_the_package_root_imports_the_decorator_factories() -> None:
    # The phases' configurations and behaviour sit beneath Step (toolkit.step._phases); the
    # factories only validate arguments on top, so nothing below may reach up to them.
    users = {m: sorted(i & DECORATOR_MODULES) for m, i in _graph().items() if m != "toolkit"}
    assert not {m: i for m, i in users.items() if i}, users
    assert {_module(p) for p in PACKAGE.rglob("*.py")} >= DECORATOR_MODULES


COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "register_comm_hook",
    "scatter",
    "send",
}


def test_only_toolkit_distributed_calls_collectives() -> None:
    # One layer for what crosses ranks: its device rule and its cost table hold only if no
    # other module issues a collective of its own.
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "distributed":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if not (isinstance(func, ast.Attribute) and func.attr in COLLECTIVES):
                continue
            owner = ast.unparse(func.value)  # dist.all_reduce, torch.distributed.barrier
            if owner in ("dist", "torch.distributed") or func.attr == "register_comm_hook":
                found.append(f"{_module(path)}:{node.lineno} {owner}.{func.attr}")
    assert not found, found


# docs/architecture.md's order: utilities < distributed < step < loop, checkpoints < plugins.
LAYERS = {"distributed": 1, "step": 2, "loop": 3, "checkpoints": 3, "plugins": 4}


def _layer(module: str) -> int:
    """The layer of a toolkit module: 0 for the utilities (toolkit._*, toolkit.plot)."""
    parts = module.split(".")
    return 5 if module == "toolkit" else LAYERS.get(parts[1], 0)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` that go up a layer, or across between loop and checkpoints."""
    found = []
    for module, imports in graph.items():
        for imported in imports:
            mine, theirs = _layer(module), _layer(imported)
            same_package = module.split(".")[:2] == imported.split(".")[:2]
            if mine < theirs or (mine == theirs and mine and not same_package):
                found.append(f"{module} -> {imported}")
    return found


def test_every_import_goes_down_the_layers_of_the_architecture() -> None:
    assert not _upward(_graph())


def test_the_layer_check_sees_the_two_imports_that_once_broke_the_order() -> None:
    broken = {
        "toolkit._tree": {"toolkit.step._weighted"},
        "toolkit.loop._data": {"toolkit.checkpoints._rng"},
    }
    assert _upward(broken) == ["toolkit._tree -> toolkit.step._weighted",
                               "toolkit.loop._data -> toolkit.checkpoints._rng"]  # fmt: skip
