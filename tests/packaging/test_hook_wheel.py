"""The light engine-side wheel, kvwatch-hook (scripts/build_hook_wheel.py): built from the
repository's sources, it holds exactly the modules the hook imports (all standard library
only), each byte for byte the repository's; installed alone into a bare venv, it imports,
pulls in nothing of the agent, and talks to a real agent's HookServer over a unix socket."""

from __future__ import annotations

import ast
import asyncio
import email.message
import email.parser
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

import kvwatch
from kvwatch.hookserver.hook_server import HookServer
from kvwatch.lab.waiting import wait_until_async
from scripts import build_hook_wheel
from tests.packaging.conftest import REPO

SOURCE = REPO / "agent"
HOOK_PACKAGE = "kvwatch.hook"
# What `pip install kvwatch` brings and an engine image must not get from the hook.
AGENT_DEPENDENCIES = (
    "click",
    "rich",
    "numpy",
    "prometheus_client",
    "psutil",
    "pynvml",
    "starlette",
    "uvicorn",
    "httpx",
    "torch",
)
WAIT_SECONDS = 20.0
INSTALL_SECONDS = 60.0
BYTES_PER_BLOCK = 16384

# Runs in the light venv: imports what an engine imports and reports what got loaded.
IMPORT_CHECK = """
import importlib.util, json, sys
import kvwatch.hook, kvwatch.hook.asgi, kvwatch.hookwire.protocol
names = json.loads(sys.argv[1])
loaded = sorted({name.split(".")[0] for name in sys.modules})
print(json.dumps({
    "hook_file": kvwatch.hook.__file__,
    "importable": [name for name in names if importlib.util.find_spec(name) is not None],
    "foreign": [n for n in loaded if n not in (*sys.stdlib_module_names, "kvwatch", "__main__")],
}))
"""

# Runs in the light venv: an engine with one stream, which answers cancels; once its stdin
# closes it stops the hook and prints what it saw.
ENGINE = f"""
import json, os, sys
from kvwatch.hook import CancelOutcome, EngineHook, EngineInfo

cancels = []

def cancel(request_id, reason):
    cancels.append([request_id, reason])
    return CancelOutcome(request_id, "cancelled", 4, 4 * {BYTES_PER_BLOCK})

info = EngineInfo(engine="light-engine", model="tiny", pid=os.getpid(),
                  bytes_per_block={BYTES_PER_BLOCK}, device="cpu", kv_blocks_total=64)
hook = EngineHook(info, cancel, sys.argv[1], reconnect_seconds=0.1)
hook.start()
hook.stream_opened("req-light", ("127.0.0.1", 8000), ("127.0.0.1", 40001), 4)
sys.stdin.read()
hook.stop()
print(json.dumps({{"cancels": cancels, "counters": hook.counters()}}))
"""


# --- The hook's imports, read from the sources -----------------------------------------------


def kvwatch_source(module: str) -> Path | None:
    """The repository file of a kvwatch module (agent/ is kvwatch, exporters/ kvwatch.exporters),
    or None when `module` names no module (`from kvwatch.hook import EngineHook`)."""
    parts = module.split(".")
    if parts[1:2] == ["exporters"]:
        folder = REPO.joinpath("exporters", *parts[2:])
    else:
        folder = SOURCE.joinpath(*parts[1:])
    for path in (folder / "__init__.py", folder.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module name) of each import that runs when `module` is imported: every import
    statement, at any depth, but those under `if TYPE_CHECKING:`. `from a import b` yields both
    a and a.b (the latter matters only where it is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            children: list[ast.AST] = list(node.orelse)
        else:
            children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        for child in children:
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def hook_modules() -> list[str]:
    """Every module of the kvwatch.hook package: what an engine may import (the ASGI
    middleware included)."""
    folder = SOURCE / "hook"
    names = [HOOK_PACKAGE]
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            names.append(".".join([HOOK_PACKAGE, *parts]))
    return names


def import_closure(roots: list[str]) -> tuple[set[str], list[str]]:
    """The kvwatch modules that importing `roots` loads (their packages' __init__ included),
    and "file:line imports name" for every import of something outside kvwatch and the
    standard library."""
    needed: set[str] = set()
    foreign: list[str] = []
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in needed:
            continue
        path = kvwatch_source(module)
        assert path is not None, f"{module} has no source file"
        needed.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:end]) for end in range(1, len(parts))]
        for line, name in imports(path, module):
            top = name.partition(".")[0]
            if top == "kvwatch":
                if kvwatch_source(name) is not None:
                    todo.append(name)
            elif top not in sys.stdlib_module_names:
                foreign.append(f"{path.relative_to(REPO)}:{line} imports {top}")
    return needed, sorted(set(foreign))


# --- The wheel --------------------------------------------------------------------------------


def wheel_modules(wheel: Path) -> dict[str, str]:
    """Module name -> file name in the wheel, for every .py file outside its dist-info."""
    modules = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(".py") and ".dist-info/" not in name:
                parts = name.removesuffix(".py").split("/")
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = name
    return modules


def wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(archive.read(name).decode())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hook_wheel.build(tmp_path_factory.mktemp("hook-wheel"))


@pytest.fixture(scope="module")
def light_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Python of a new venv (no system site packages, not even pip) with only the light
    wheel installed, by this venv's pip, from the file alone."""
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index"]
    install += ["--no-deps", "--disable-pip-version-check", "--quiet", str(wheel)]
    subprocess.run(install, check=True, timeout=INSTALL_SECONDS)
    return python


def run_light(python: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`script` in the light venv, isolated (-I: no PYTHONPATH, no user site, not this
    checkout on sys.path), from a folder that is not the repository."""
    return subprocess.run(
        [str(python), "-I", "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=WAIT_SECONDS,
        cwd=python.parent,
        check=False,
    )


def test_the_light_wheel_holds_exactly_what_the_hook_imports(wheel: Path) -> None:
    needed, foreign = import_closure(hook_modules())
    assert not foreign, (
        "the engine hook must import only the standard library (kvwatch-hook has no "
        "dependencies; docs/engines.md, 'Installing the hook in an engine image'):\n"
        + "\n".join(foreign)
    )
    carried = set(wheel_modules(wheel))
    assert not needed - carried, (
        f"kvwatch.hook imports {sorted(needed - carried)}, which the kvwatch-hook wheel lacks: "
        "add them to SHARED (or PACKAGES) in scripts/build_hook_wheel.py"
    )
    assert not carried - needed, (
        f"the kvwatch-hook wheel carries {sorted(carried - needed)}, which kvwatch.hook does "
        "not import: drop them from scripts/build_hook_wheel.py"
    )


def test_the_light_wheel_is_the_repository_s_files_and_has_no_dependencies(wheel: Path) -> None:
    """Same files as the full kvwatch wheel (so installing both overwrites nothing with
    something else), same version, and no Requires-Dist."""
    with zipfile.ZipFile(wheel) as archive:
        for module, name in wheel_modules(wheel).items():
            source = kvwatch_source(module)
            assert source is not None, f"{name} in the wheel is no module of the repository"
            assert archive.read(name) == source.read_bytes(), f"{name} differs from {source}"
        others = [n for n in archive.namelist() if not n.endswith(".py") and ".dist-info/" not in n]
        assert not others, f"files besides modules in the light wheel: {others}"
    metadata = wheel_metadata(wheel)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert metadata["Name"] == "kvwatch-hook"
    assert metadata["Version"] == project["version"] == kvwatch.__version__
    assert metadata["Requires-Python"] == project["requires-python"]
    assert metadata.get_all("Requires-Dist") is None, metadata.get_all("Requires-Dist")


def test_the_light_venv_imports_the_hook_and_nothing_of_the_agent(light_python: Path) -> None:
    result = run_light(light_python, IMPORT_CHECK, json.dumps(AGENT_DEPENDENCIES))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert Path(report["hook_file"]).is_relative_to(light_python.parent.parent), report
    assert report["importable"] == [], f"the light venv can import {report['importable']}"
    assert report["foreign"] == [], f"importing the hook loaded {report['foreign']}"


def test_the_light_venv_s_hook_talks_to_a_real_agent(light_python: Path, socket_path: str) -> None:
    """hello and open reach the agent's HookServer; its cancel reaches the engine's handler
    and the engine's answer comes back."""

    async def scenario() -> str:
        server = HookServer(socket_path, allowed_uids=(os.geteuid(),))
        await server.start()
        engine = await asyncio.create_subprocess_exec(
            str(light_python),
            "-I",
            "-c",
            ENGINE,
            socket_path,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=str(light_python.parent),
        )
        try:
            await wait_until_async(
                lambda: server.live("req-light"),
                WAIT_SECONDS,
                lambda: f"the engine's open (engines: {server.engines()})",
            )
            (hello,) = server.engines()
            assert hello["engine"] == "light-engine" and hello["pid"] == engine.pid, hello
            assert hello["bytes_per_block"] == BYTES_PER_BLOCK, hello
            (stream,) = server.streams()
            assert (stream.request_id, stream.kv_blocks) == ("req-light", 4), stream
            assert (stream.local.port, stream.remote.port) == (8000, 40001), stream
            outcome = await server.command(
                "cancel", "req-light", "stalled", {}, timeout_seconds=WAIT_SECONDS
            )
            assert (outcome.status, outcome.freed_blocks) == ("cancelled", 4), outcome
            assert engine.stdin is not None
            engine.stdin.close()
            out, err = await asyncio.wait_for(engine.communicate(), WAIT_SECONDS)
            assert engine.returncode == 0, err.decode()
            return out.decode()
        finally:
            if engine.returncode is None:
                engine.kill()
                await engine.wait()
            await server.close()

    report = json.loads(asyncio.run(asyncio.wait_for(scenario(), 2 * WAIT_SECONDS)))
    assert report["cancels"] == [["req-light", "stalled"]], report
