"""The GPU image, checked statically (CI cannot build or run it).

Every fact is read from where it lives, never from a copy in this test: the base tag and the
torch / Transformer Engine versions it ships from the Dockerfile's ARGs (stated once; the build's
first RUN checks them against the image), megatron-core's requirements from the installed
megatron-core's metadata (extras included), our own from setup.py. Checked: the base image's
torch and TE satisfy megatron-core (with pip's rule that an installed pre-release only satisfies
`>=X` if it sorts above X) and our setup.py; our TE range (`gpu_settings`) is megatron-core's;
megatron-core is pinned to the version CI runs, inside setup.py's range; no pip install can
touch the GPU stack (constraints file, no GPU package named, no extra that pulls one); every
COPY source exists and is not excluded from the build context.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_kto.runtime import gpu_settings

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"

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


def _args() -> dict[str, str]:
    """The Dockerfile's `ARG NAME=value` defaults."""
    out = {}
    for op, args in _instructions():
        if op == "ARG" and "=" in args:
            name, value = args.split("=", 1)
            out[name.strip()] = value.strip()
    return out


def _base_tag() -> str:
    froms = [args for op, args in _instructions() if op == "FROM"]
    assert len(froms) == 1, froms
    image = re.sub(r"\$\{(\w+)\}", lambda m: _args()[m[1]], froms[0])
    match = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", image)
    assert match, f"base image must be an NGC PyTorch tag, got {image}"
    return f"{match[1]}.{match[2]}"


def _setup_kwargs() -> dict:
    """setup.py's `install_requires` and `extras_require` (literals, read without running it)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"
    )
    wanted = ("install_requires", "extras_require")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in wanted}


def _ours(name: str) -> SpecifierSet:
    for line in _setup_kwargs()["install_requires"]:
        req = Requirement(line)
        if req.name == name:
            return req.specifier
    raise AssertionError(f"setup.py does not require {name}")


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
    # NGC 25.01 shipped torch 2.6.0a0, which pip ranks below 2.6.0: installing megatron-core
    # there replaced the image's torch (and broke TE and Apex).
    assert not _pip_accepts_installed("2.6.0a0", _requirement("torch"))


def test_base_image_torch_satisfies_megatron_core_and_us() -> None:
    tag, torch_version = _base_tag(), _args()["NGC_TORCH"]
    for owner, spec in (("megatron-core", _requirement("torch")), ("setup.py", _ours("torch"))):
        assert _pip_accepts_installed(torch_version, spec), (
            f"NGC {tag}: torch {torch_version} does not satisfy {owner}'s torch{spec} "
            "(pip ranks a pre-release below its release) — pip would replace it"
        )
    year, month = (int(x) for x in tag.split("."))
    assert (year, month) >= CONSTRAINTS_SINCE, "the image must ship /etc/pip/constraint.txt"


def test_base_image_transformer_engine_is_in_megatron_cores_tested_range() -> None:
    te_version = _args()["NGC_TRANSFORMER_ENGINE"]
    # The range megatron-core tests Transformer Engine with: its `dev` extra.
    te_req = _requirement("transformer-engine", extra="dev")
    assert _pip_accepts_installed(te_version, te_req), (
        f"NGC {_base_tag()}: Transformer Engine {te_version} outside megatron-core's {te_req}"
    )
    # The build runs this check on the image's TE: it must agree.
    assert gpu_settings.transformer_engine_warning(te_version) is None


def test_our_tested_transformer_engine_range_is_megatron_cores() -> None:
    te_req = _requirement("transformer-engine", extra="dev")
    ours = {f">={gpu_settings.TE_TESTED_MIN}", f"<{gpu_settings.TE_TESTED_BELOW}"}
    assert {str(s) for s in te_req} == ours, (te_req, ours)


def test_the_header_comment_names_the_stated_versions() -> None:
    first = DOCKERFILE.read_text().splitlines()[0]
    args = _args()
    for key in ("NGC_TAG", "NGC_TORCH", "NGC_TRANSFORMER_ENGINE"):
        assert args[key].removesuffix(".0") in first, (key, args[key], first)


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
    (pin,) = pins
    assert Version(pin) in _ours("megatron-core"), (pin, _ours("megatron-core"))


def test_no_extra_the_image_installs_pulls_a_gpu_package() -> None:
    extras_require = _setup_kwargs()["extras_require"]
    for line in _setup_kwargs()["install_requires"]:
        name = Requirement(line).name
        assert name == "torch" or not GPU_STACK.match(name), line
    extras = {
        extra.strip()
        for words in _pip_installs()
        for word in words
        if (match := re.fullmatch(r"\.\[([^\]]*)\]", word))
        for extra in match[1].split(",")
    }
    assert extras, "the image installs megatron_kto with its extras"
    for extra in extras:
        for line in extras_require[extra]:
            assert not GPU_STACK.match(Requirement(line).name), f"extra [{extra}] pulls {line}"


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
