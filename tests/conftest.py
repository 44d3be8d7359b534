"""Suite-wide test selection: the `slow` marker of the inner loop (``pytest -m "not slow"``).

A test is `slow` when it is marked `multirank` (gloo ranks) or `e2e` (CLI runs in
subprocesses), or when it is listed in `slow_tests.txt`: tests measured over ~1 s on the 2-core
CI box that are neither (multi-rank tests not marked so, subprocess runs of the tools, heavy
single-process steps). Entries: ``FILE`` (every test of the file), ``FILE::TEST`` (all its
parametrized cases), ``FILE::TEST[ID]`` (one case), ``FILE::@FIXTURE`` (every test of the file
that reads that fixture: a module-scoped fixture that runs ranks or CLI runs would otherwise
still run in the inner loop for its cheap readers).
"""

from __future__ import annotations

from pathlib import Path

import pytest

_SLOW_LIST = Path(__file__).with_name("slow_tests.txt")


def _listed() -> set[str]:
    names = set()
    for line in _SLOW_LIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(line)
    return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    listed = _listed()
    for item in items:
        path = Path(str(item.fspath)).name
        name = f"{path}::{item.name}"
        if (
            item.get_closest_marker("multirank")
            or item.get_closest_marker("e2e")
            or name in listed
            or name.split("[", 1)[0] in listed
            or path in listed
            or any(f"{path}::@{f}" in listed for f in getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.slow)
