#!/usr/bin/env python
"""Who imports whom inside megatron_kto/: rooms, floors, arrows, arrows running back up, circles.

    python tools/import_graph.py [--package-dir megatron_kto]

Vocabulary (DESIGN.md section 2 names the rooms):

- A *room* is a top-level package under `megatron_kto/` (`runtime/`, `config/`, ...) or a
  top-level module (`run.py`, `console.py`). The package's own `megatron_kto/__init__.py` is the
  building, not a room.
- An *arrow* A -> B says some module in room A imports some module in room B; its count is the
  number of distinct (importing module, imported module) pairs behind it. Imports anywhere in a
  module count: at module level and inside functions (a function-level import is still a
  dependency, only a later one). Imports under `if TYPE_CHECKING:` are listed apart and are not
  arrows: they never run.
- The *floors* are `FLOORS` below, bottom to top: the one place the intended order of the rooms
  is written down. A room may import rooms on lower floors only. An arrow to a higher floor
  *runs back up*; an arrow between two rooms of the same floor runs *sideways*. Both are
  reported, and `tests/test_import_graph.py` forbids both.
- A *cycle* is a strongly connected component (more than one module) of the module graph, with
  function-level imports included.

What an import statement points at: `import a.b` and `from a.b import x` point at module `a.b`;
`from a import b` also points at `a.b` when that is a module. The parent packages Python
initialises on the way (`a` for `import a.b`) are not counted: that would make every package
whose `__init__` re-exports its own modules a cycle.

Pure: reads the source with `ast`, imports nothing from megatron_kto.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "megatron_kto"

# Bottom to top. A room imports only rooms on floors below its own.
#    0  leaves: the process runtime, pure loss math, run logging, console text
#    1  config: the schema (with the model's shape), its errors and cross-field checks
#    2  conversion: pure HF <-> megatron tables and functions (read the model's shape), the one
#       place that knows how a tensor is named and sharded
#    3  data pipeline; the model room (megatron-core models, forward, log-probs, schedules)
#    4  checkpointing: model-only and training-state checkpoints (HF directories via conversion)
#    5  peft: LoRA adapters, their wiring and adapter checkpoints
#    6  planning (memory / layout plans of models with or without LoRA); hf_writer (Hugging Face
#       files in and out: the training-time writer and its gathers, the offline converter's
#       driver and LoRA exports; it builds models and runs collectives, conversion/ does not)
#    7  algorithms and evaluation: training and scoring loops over the models
#    8  prepare: a composed config made concrete (checkpoint, HF config, tokenizer, LoRA)
#    9  run: builds and trains one prepared run
#   10  entry: the Hydra entry points (compose, prepare, run, report user errors)
FLOORS: tuple[tuple[str, ...], ...] = (
    ("runtime", "losses", "logging", "console"),
    ("config",),
    ("conversion",),
    ("data", "models"),
    ("checkpointing",),
    ("peft",),
    ("planning", "hf_writer"),
    ("algorithms", "eval"),
    ("prepare",),
    ("run",),
    ("entry",),
)


@dataclass(frozen=True)
class Import:
    """One resolved import of a megatron_kto module by another."""

    importer: str
    imported: str
    line: int
    kind: str  # "module" (top level), "function" (inside a def), "type_checking"


def module_names(package_dir: Path) -> dict[str, Path]:
    """Every module under `package_dir`, keyed by dotted name (a package by its own name)."""
    modules: dict[str, Path] = {}
    root = package_dir.parent
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool, in_type_checking: bool) -> Iterator[tuple]:
    """Yield (import node, in_function, in_type_checking) for every import under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function, in_type_checking
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk(child, True, in_type_checking)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), in_function, False)
        else:
            yield from _walk(child, in_function, in_type_checking)


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name a (possibly relative) `from ... import` reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """The megatron_kto modules `module` (at `path`) imports, resolved against `known`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node, in_function, in_tc in _walk(tree, False, False):
        kind = "type_checking" if in_tc else ("function" if in_function else "module")
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            source = _absolute(module, is_package, node)
            targets.append(source)
            targets += [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in known]
        for target in targets:
            # `import a.b.c` where only a.b is ours and c an attribute cannot happen; but a
            # name may be a package's attribute, so walk up to the nearest known module.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target.startswith(PACKAGE) and target != module:
                found.append(Import(module, target, node.lineno, kind))
    return found


def room_of(module: str) -> str | None:
    """`megatron_kto.config.keys` -> `config`; the building itself has no room."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def floor_of() -> dict[str, int]:
    return {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one member, each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        # Iterative, so a deep chain never meets the recursion limit.
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components, key=lambda c: (-len(c), c))


@dataclass
class Report:
    """Everything the command prints, as data (the test reads it)."""

    modules: list[str]
    imports: list[Import]
    rooms: list[str]
    arrows: dict[tuple[str, str], int]
    back_up: list[tuple[str, str]]
    sideways: list[tuple[str, str]]
    unplaced: list[str]
    cycles: list[list[str]]


def analyse(package_dir: Path) -> Report:
    """Parse every module under `package_dir` and derive rooms, arrows, floors and cycles."""
    paths = module_names(package_dir)
    known = set(paths)
    imports = [imp for name, path in paths.items() for imp in imports_of(name, path, known)]
    rooms = sorted({r for m in paths if (r := room_of(m)) is not None})
    pairs: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        if imp.kind == "type_checking":
            continue
        graph[imp.importer].add(imp.imported)
        a, b = room_of(imp.importer), room_of(imp.imported)
        if a and b and a != b:
            pairs[(a, b)].add((imp.importer, imp.imported))
    arrows = {pair: len(edges) for pair, edges in sorted(pairs.items())}
    floors = floor_of()
    unplaced = [r for r in rooms if r not in floors]
    back_up = [(a, b) for a, b in arrows if a in floors and b in floors and floors[b] > floors[a]]
    sideways = [(a, b) for a, b in arrows if a in floors and b in floors and floors[b] == floors[a]]
    return Report(
        modules=sorted(paths),
        imports=imports,
        rooms=rooms,
        arrows=arrows,
        back_up=back_up,
        sideways=sideways,
        unplaced=unplaced,
        cycles=strongly_connected(graph),
    )


def _short(module: str) -> str:
    return module.removeprefix(f"{PACKAGE}.")


def format_report(report: Report) -> str:
    """The human-readable report `main` prints."""
    floors = floor_of()
    out = [
        f"{len(report.modules)} modules, {len(report.rooms)} rooms on {len(FLOORS)} floors, "
        f"{len(report.arrows)} arrows, {len(report.back_up)} running back up, "
        f"{len(report.sideways)} sideways, {len(report.cycles)} cycles",
        "",
        "floors (bottom to top):",
    ]
    for level, rooms in enumerate(FLOORS):
        out.append(f"  {level}: {', '.join(rooms)}")
    if report.unplaced:
        out.append(f"  not on any floor: {', '.join(report.unplaced)}")
    out += ["", "arrows (importing room -> imported room: import pairs):"]
    for (a, b), count in report.arrows.items():
        mark = ""
        if (a, b) in report.back_up:
            mark = "  <- runs back up"
        elif (a, b) in report.sideways:
            mark = "  <- sideways"
        out.append(f"  {a} -> {b}: {count}{mark}")
    by_pair: dict[tuple[str, str], list[Import]] = defaultdict(list)
    for imp in report.imports:
        if imp.kind != "type_checking":
            by_pair[(room_of(imp.importer), room_of(imp.imported))].append(imp)
    for title, wrong in (("running back up", report.back_up), ("sideways", report.sideways)):
        out += ["", f"arrows {title} ({len(wrong)}):"]
        for a, b in wrong:
            out.append(f"  {a} (floor {floors[a]}) -> {b} (floor {floors[b]}):")
            for imp in sorted(by_pair[(a, b)], key=lambda i: (i.importer, i.line)):
                out.append(
                    f"    {_short(imp.importer)}:{imp.line} -> {_short(imp.imported)} ({imp.kind})"
                )
    out += ["", f"module cycles, function-level imports included ({len(report.cycles)}):"]
    for cycle in report.cycles:
        out.append("  " + " <-> ".join(_short(m) for m in cycle))
    function_level = [i for i in report.imports if i.kind == "function"]
    out += ["", f"function-level imports ({len(function_level)}, counted as arrows):"]
    for imp in sorted(function_level, key=lambda i: (i.importer, i.line)):
        out.append(f"  {_short(imp.importer)}:{imp.line} -> {_short(imp.imported)}")
    type_only = [i for i in report.imports if i.kind == "type_checking"]
    out += ["", f"TYPE_CHECKING imports ({len(type_only)}, not arrows):"]
    for imp in sorted(type_only, key=lambda i: (i.importer, i.line)):
        out.append(f"  {_short(imp.importer)}:{imp.line} -> {_short(imp.imported)}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--package-dir",
        type=Path,
        default=Path(__file__).resolve().parents[1] / PACKAGE,
        help="the megatron_kto package directory (default: the one beside tools/)",
    )
    args = parser.parse_args(argv)
    print(format_report(analyse(args.package_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
