"""The rooms of megatron_kto/ stay in their floors, and no modules import each other in a circle.

Reads the source with `tools/import_graph.py` (ast only: nothing of megatron_kto is imported, so
this runs in about a second). Rooms, floors and what counts as an arrow are described in that
tool's docstring; `python tools/import_graph.py` prints the whole picture.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import import_graph  # noqa: E402

PACKAGE_DIR = REPO / "megatron_kto"


@pytest.fixture(scope="module")
def report() -> import_graph.Report:
    return import_graph.analyse(PACKAGE_DIR)


def _arrows(report, wrong: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """(importing module, imported room) behind the room arrows in `wrong`."""
    return {
        (imp.importer, import_graph.room_of(imp.imported))
        for imp in report.imports
        if imp.kind != "type_checking"
        and (import_graph.room_of(imp.importer), import_graph.room_of(imp.imported)) in wrong
    }


def test_no_module_cycles(report) -> None:
    cycles = {frozenset(c) for c in report.cycles}
    assert cycles == set(), "modules importing each other in a circle"


def test_every_room_is_on_a_floor(report) -> None:
    assert report.unplaced == [], "add the room to FLOORS in tools/import_graph.py"


def test_no_room_imports_a_room_above_or_beside_it(report) -> None:
    back_up = _arrows(report, report.back_up)
    assert back_up == set(), "imports running back up (move the piece down)"
    assert report.sideways == [], "rooms on one floor must not import each other"


def test_config_does_not_import_peft(report) -> None:
    wrong = [
        f"{imp.importer}:{imp.line} -> {imp.imported}"
        for imp in report.imports  # TYPE_CHECKING imports included
        if import_graph.room_of(imp.importer) == "config"
        and import_graph.room_of(imp.imported) == "peft"
    ]
    assert wrong == []


def test_the_tool_counts_function_level_imports_and_not_type_checking_ones(tmp_path) -> None:
    """A two-room package: `a.one` imports `b.two` at module level; `b.two` imports `a.one`
    inside a function (a cycle, and an arrow b -> a); `b.three` imports `a` only under
    TYPE_CHECKING (no arrow); `a.four` imports `a.one` relatively."""
    pkg = tmp_path / "megatron_kto"
    for room in ("a", "b"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "one.py").write_text("from megatron_kto.b import two\n")
    (pkg / "b" / "two.py").write_text("def f():\n    import megatron_kto.a.one\n")
    (pkg / "b" / "three.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from megatron_kto.a import one\n"
    )
    (pkg / "a" / "four.py").write_text("from . import one\n")
    result = import_graph.analyse(pkg)
    assert result.rooms == ["a", "b"]
    # `from megatron_kto.b import two` reads the package `b` and its module `two`: two pairs.
    assert result.arrows == {("a", "b"): 2, ("b", "a"): 1}
    assert result.cycles == [["megatron_kto.a.one", "megatron_kto.b.two"]]
    kinds = {(i.importer, i.imported): i.kind for i in result.imports}
    assert kinds[("megatron_kto.b.three", "megatron_kto.a.one")] == "type_checking"
    assert kinds[("megatron_kto.a.four", "megatron_kto.a.one")] == "module"


def test_conversion_is_pure() -> None:
    """conversion/ holds tables and tensor functions only: no collectives, no megatron-core (the
    gathers and model building live in hf_writer/ and models/)."""
    import ast

    wrong = []
    for path in sorted((PACKAGE_DIR / "conversion").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name.startswith(("torch.distributed", "megatron.")) or name == "megatron":
                    wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert wrong == []
