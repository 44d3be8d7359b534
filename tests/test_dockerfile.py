"""The GPU image, checked statically (CI cannot build or run it).

The base image must carry a torch and a Transformer Engine that satisfy megatron-core's own
requirements — read from the installed megatron-core's metadata, with pip's rule that an
installed pre-release only satisfies `>=X` if it sorts above X — and must provide the pip
constraints file; no install may touch the GPU stack; megatron-core is pinned to the version
CI runs; every COPY source exists and is not excluded from the build context.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"

#: torch and Transformer Engine per NGC PyTorch tag. 25.01: torch 2.6.0a0 (the pre-release that
#: broke the old image; its TE does not matter here). 25.11: torch 2.10.0a0+b558c986e8 and
#: TE 2.9.0 as `pip list` reports them in that image; the Docker build re-checks both ranges,
#: so a wrong entry here fails the build rather than shipping. Add a tag when moving the base.
NGC_STACKS = {
    "25.01": ("2.6.0a0", None),
    "25.11": ("2.10.0a0+b558c986e8", "2.9.0"),
}
#: The pip constraints file exists from NGC 25.03 on (release notes).
CONSTRAINTS_SINCE = (25, 3)
CONSTRAINTS = "/etc/pip/constraint.txt"
GPU_STACK = re.compile(r"^(torch|transformer[-_]?engine.*|apex|flash[-_]?attn.*|nvidia-.*)$", re.I)


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        current += " " + line[:-1] if line.endswith("\\") else " " + line
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _base_tag() -> str:
    froms = [args for op, args in _instructions() if op == "FROM"]
    assert len(froms) == 1, froms
    match = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", froms[0])
    assert match, f"base image must be an NGC PyTorch tag, got {froms[0]}"
    return f"{match[1]}.{match[2]}"


def _requirement(name: str, extra: str | None = None) -> SpecifierSet:
    for line in importlib.metadata.requires("megatron-core") or []:
        req = Requirement(line)
        in_extra = req.marker is not None and req.marker.evaluate({"extra": extra or ""})
        if req.name.replace("_", "-") == name and (req.marker is None) == (extra is None):
            if extra is None or in_extra:
                return req.specifier
    raise AssertionError(f"megatron-core declares no requirement on {name} (extra {extra})")


def _pip_accepts_installed(version: str, spec: SpecifierSet) -> bool:
    # pip keeps an installed distribution whose version is in the specifier, pre-releases
    # included; the version is compared without its local part (+git...).
    return Version(version) in SpecifierSet(str(spec), prereleases=True)


def test_stack_check_would_have_caught_the_old_base() -> None:
    torch_req = _requirement("torch")
    assert not _pip_accepts_installed(NGC_STACKS["25.01"][0], torch_req)


def test_base_image_satisfies_megatron_core() -> None:
    tag = _base_tag()
    assert tag in NGC_STACKS, f"add NGC {tag}'s torch / Transformer Engine versions to NGC_STACKS"
    torch_version, te_version = NGC_STACKS[tag]
    torch_req = _requirement("torch")
    assert _pip_accepts_installed(torch_version, torch_req), (
        f"NGC {tag}: torch {torch_version} does not satisfy megatron-core's torch{torch_req} "
        "(pip ranks a pre-release below its release) — pip would replace it"
    )
    # The range megatron-core 0.16.1 tests Transformer Engine with (its `dev` extra).
    te_req = _requirement("transformer-engine", extra="dev")
    assert te_version is not None and _pip_accepts_installed(te_version, te_req), (
        f"NGC {tag}: Transformer Engine {te_version} outside megatron-core's tested {te_req}"
    )
    year, month = (int(x) for x in tag.split("."))
    assert (year, month) >= CONSTRAINTS_SINCE, "the image must ship /etc/pip/constraint.txt"


def _pip_installs() -> list[list[str]]:
    """Every `pip install` command of every RUN, as words (shell quoting respected)."""
    commands = []
    for op, args in _instructions():
        if op != "RUN":
            continue
        lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|"):
                if words[:2] == ["pip", "install"] or words[:4] == [
                    "python",
                    "-m",
                    "pip",
                    "install",
                ]:
                    commands.append(words)
                words = []
            else:
                words.append(token)
    return commands


def test_every_pip_install_is_constrained_and_leaves_the_gpu_stack_alone() -> None:
    installs = _pip_installs()
    assert installs, "the image installs megatron_kto"
    for words in installs:
        flags = " ".join(words)
        assert f"--constraint {CONSTRAINTS}" in flags or f"-c {CONSTRAINTS}" in flags, flags
        for word in words[2:]:
            if word.startswith("-") or word == CONSTRAINTS:
                continue
            name = re.split(r"[\[<>=!~ ]", word, maxsplit=1)[0]
            assert not GPU_STACK.match(name), f"installs GPU-stack package {word!r}"
    text = DOCKERFILE.read_text()
    assert "diff /opt/gpu_stack.txt" in text, "the build must compare the GPU stack before/after"
    assert "transformer_engine_warning" in text, "the build must check the TE version range"


def test_megatron_core_pinned_to_the_tested_version() -> None:
    pins = {
        word.split("==", 1)[1]
        for words in _pip_installs()
        for word in words
        if word.startswith("megatron-core==")
    }
    assert pins == {importlib.metadata.version("megatron-core")}, pins


def _dockerignore() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]


@pytest.mark.parametrize("source", [a for op, a in _instructions() if op == "COPY"])
def test_copied_paths_exist_and_are_in_the_build_context(source) -> None:
    *sources, _dest = shlex.split(source)
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        for pattern in _dockerignore():
            assert not fnmatch.fnmatch(src, pattern.removeprefix("**/")), (src, pattern)
