"""The container image's Dockerfile, read statically (no Docker daemon runs here): two stages,
the compiler only in the first, the runtime with Python, libbpf1 and the wheel."""

from __future__ import annotations

import fnmatch
import re
import shlex
from dataclasses import dataclass, field

from tests.packaging.conftest import PACKAGING, REPO

DOCKERFILE = PACKAGING / "Dockerfile"
DOCKERIGNORE = PACKAGING / "Dockerfile.dockerignore"
BUILD_TOOLS = {"clang", "llvm", "gcc", "make", "libbpf-dev", "libc6-dev", "linux-headers-amd64"}


@dataclass
class Stage:
    """One FROM ... AS name section: its base and its instructions (keyword, arguments)."""

    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def arguments(self, keyword: str) -> list[str]:
        return [args for key, args in self.instructions if key == keyword]

    def apt_packages(self) -> set[str]:
        packages: set[str] = set()
        for command in self.arguments("RUN"):
            for part in command.split("&&"):
                words = shlex.split(part)
                if words[:2] == ["apt-get", "install"]:
                    packages |= {w for w in words[2:] if not w.startswith("-")}
        return packages


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comments dropped, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")
    ))  # fmt: skip
    result = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            result.append((keyword.upper(), " ".join(args.split())))
    return result


def stages() -> list[Stage]:
    found: list[Stage] = []
    for keyword, args in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            base, _, name = args.partition(" AS ")
            found.append(Stage(base, name))
        elif found:
            found[-1].instructions.append((keyword, args))
    return found


def test_two_stages_on_the_same_debian() -> None:
    build, runtime = stages()
    assert (build.name, runtime.name) == ("build", "runtime")
    assert build.base == runtime.base == "debian:${DEBIAN}-slim"


def test_build_stage_compiles_the_bpf_object_and_the_wheels() -> None:
    build, _ = stages()
    assert {"clang", "libbpf-dev", "python3"} <= build.apt_packages()
    runs = " ".join(build.arguments("RUN"))
    assert "make -C bpf CC=clang OUT=/src/agent/collect/bpf/kvwatch.bpf.o" in runs
    assert "BCC_DIR=/src/agent/collect/bpf/csrc" in runs
    assert "pip wheel --wheel-dir /wheels /src" in runs
    # the wheel is checked to carry the object and BCC's sources
    assert "kvwatch/collect/bpf/kvwatch.bpf.o" in runs
    assert "kvwatch/collect/bpf/csrc/kvwatch_bcc.c" in runs


def test_runtime_stage_has_python_libbpf_and_the_wheel_but_no_compiler() -> None:
    _, runtime = stages()
    packages = runtime.apt_packages()
    assert {"python3", "libbpf1"} <= packages
    assert not packages & BUILD_TOOLS
    assert not runtime.arguments("COPY")  # only the wheels come across, through a bind mount
    runs = " ".join(runtime.arguments("RUN"))
    assert "--mount=type=bind,from=build,source=/wheels" in runs
    assert "pip install --no-cache-dir --no-index --find-links /wheels kvwatch" in runs
    assert runtime.arguments("ENTRYPOINT") == ['["kvwatch"]']
    assert runtime.arguments("USER") == []  # root, limited by the capabilities it is given


def test_build_context_holds_what_the_build_copies() -> None:
    build, _ = stages()
    rules = [
        line
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for copy in build.arguments("COPY"):
        *sources, _ = copy.split()
        for source in sources:
            assert (REPO / source).exists(), source
            assert _included(source.rstrip("/"), rules), f"{source} is excluded from the context"
    assert not _included(".venv", rules)
    assert not _included("agent/collect/bpf/kvwatch.bpf.o", rules)  # built inside, never sent


def _included(path: str, rules: list[str]) -> bool:
    """Whether a .dockerignore with `rules` lets `path` into the build context (last match
    wins; `!` re-includes; a rule matching a parent directory covers what is inside)."""
    included = True
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule.lstrip("!").rstrip("/").replace("**/", "*")
        if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            included = negate
    return included
