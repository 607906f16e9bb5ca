"""Builds the light engine-side wheel, kvwatch-hook (packaging/kvwatch-hook/pyproject.toml).

    python scripts/build_hook_wheel.py [OUT_DIR]      # default: dist/

Setuptools will not package sources from outside the project folder, so this stages the
wheel's project in a temporary folder: the pyproject and README from packaging/kvwatch-hook,
and the hook's modules (PACKAGES whole, and SHARED) copied unchanged from agent/, so each file
in the light wheel is byte for byte the one in the full kvwatch wheel. Then `pip wheel
--no-build-isolation --no-deps` builds it there, offline, with the setuptools of the Python
running this script (70.1 or newer, which builds wheels without the `wheel` package).

What the wheel holds is written out here, not computed from the imports:
tests/packaging/test_hook_wheel.py checks that it is exactly what kvwatch.hook imports,
transitively, and that all of that is standard library only.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "agent"
PROJECT = REPO / "packaging" / "kvwatch-hook"
DEFAULT_OUT = REPO / "dist"
DISTRIBUTION = "kvwatch_hook"  # the wheel file's name starts with it

# What the engine hook needs: its packages whole (the ASGI middleware included), every module
# of each but no subpackages, and the shared modules they import, each with kvwatch/__init__.py.
PACKAGES = ("kvwatch.hook", "kvwatch.hookwire")
SHARED = ("kvwatch.errors", "kvwatch.sockets")


def source_of(module: str) -> Path:
    """Where `module`'s file lies in this repository (agent/ is the kvwatch package)."""
    folder = SOURCE.joinpath(*module.split(".")[1:])
    return folder / "__init__.py" if folder.is_dir() else folder.with_suffix(".py")


def modules() -> list[str]:
    """Every module the light wheel carries, by import name."""
    names = ["kvwatch", *SHARED]
    for package in PACKAGES:
        names.append(package)
        folder = source_of(package).parent
        files = sorted(path for path in folder.glob("*.py") if path.name != "__init__.py")
        names += [f"{package}.{path.stem}" for path in files]
    return names


def module_path(module: str) -> Path:
    """The file, relative to the wheel's root, that holds `module`: kvwatch.hook ->
    kvwatch/hook/__init__.py, kvwatch.errors -> kvwatch/errors.py."""
    return Path("kvwatch", source_of(module).relative_to(SOURCE))


def stage(directory: Path) -> None:
    """Writes the light wheel's project into `directory`."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(PROJECT / name, directory / name)
    for module in modules():
        source, target = source_of(module), directory / module_path(module)
        if not source.is_file():
            raise SystemExit(f"{module}: {source} is missing (SHARED in {__file__})")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def build(out_dir: Path = DEFAULT_OUT) -> Path:
    """Builds the wheel into `out_dir` (replacing an older kvwatch-hook wheel there) and
    returns its path. Raises CalledProcessError, with pip's output, if the build fails."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob(f"{DISTRIBUTION}-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="kvwatch-hook-") as temporary:
        project = Path(temporary) / "project"
        project.mkdir()
        stage(project)
        command = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps"]
        command += ["--no-index", "--disable-pip-version-check", "--quiet"]
        command += ["--wheel-dir", str(out_dir), str(project)]
        subprocess.run(command, check=True, cwd=temporary)
    wheels = sorted(out_dir.glob(f"{DISTRIBUTION}-*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one {DISTRIBUTION} wheel in {out_dir}, found {wheels}")
    return wheels[0]


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    print(build(out_dir.resolve()))


if __name__ == "__main__":
    main()
