"""Kernel packages for the matrix: found in the Debian registry, downloaded and unpacked once.

The newest package matching a spec's name pattern is chosen (`apt-cache pkgnames`), fetched
with `apt-get download` and unpacked with `dpkg-deb -x` into the cache (nothing is installed).
A spec with `headers` also gets the image's headers packages, merged into one tree for BCC
(Debian splits them into an arch-specific part and a `-common` part it includes).
The cache lives outside the repository and is reused between runs; when the registry cannot
be reached, the newest tree already in the cache is used. Trees of older builds of the same
spec are removed when a newer one arrives.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "KVWATCH_KERNEL_CACHE"
DEFAULT_CACHE = Path("/var/cache/kvwatch-kernels")
APT_TIMEOUT_SECONDS = 300
IMAGE_PREFIX = "linux-image-"
HEADERS_PREFIX = "linux-headers-"
HEADERS_DIR = "headers"


class MatrixError(Exception):
    """Something the matrix needs is missing; the message says what to do."""


@dataclass(frozen=True)
class KernelSpec:
    """A kernel row: `pattern` matches the image package names; its groups order builds."""

    name: str
    title: str
    pattern: str
    headers: bool = False  # also fetch the kernel's headers (the BCC backend is tested there)

    def build_key(self, package: str) -> tuple[int, ...] | None:
        match = re.fullmatch(self.pattern, package)
        return tuple(int(group) for group in match.groups()) if match else None

    def newest(self, packages: list[str]) -> str | None:
        matching = [p for p in packages if self.build_key(p) is not None]
        return max(matching, key=lambda p: self.build_key(p) or ()) if matching else None


DEBIAN_KERNELS = (
    KernelSpec(
        "debian-6.1", "Debian 12, Linux 6.1", r"linux-image-6\.1\.0-(\d+)-amd64", headers=True
    ),
    KernelSpec("debian-6.12", "Debian 12, Linux 6.12", r"linux-image-6\.12\.(\d+)\+deb12-amd64"),
)


@dataclass(frozen=True)
class KernelTree:
    """An unpacked kernel package: boot/vmlinuz-* and lib/modules/* under `root`."""

    package: str
    root: Path

    @property
    def image(self) -> Path:
        images = sorted((self.root / "boot").glob("vmlinuz-*"))
        if not images:
            raise MatrixError(f"{self.root} holds no boot/vmlinuz-*: delete it and run again")
        return images[0]

    @property
    def release(self) -> str:
        return self.image.name.removeprefix("vmlinuz-")

    @property
    def headers(self) -> Path | None:
        """The merged header tree BCC compiles against, when it was fetched."""
        tree = self.root / HEADERS_DIR
        return tree if (tree / "include" / "linux" / "kconfig.h").is_file() else None


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def _run(command: list[str], cwd: Path | None = None) -> str:
    if shutil.which(command[0]) is None:
        raise MatrixError(f"{command[0]} is not installed: kernel packages come from apt (Debian)")
    done = subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=APT_TIMEOUT_SECONDS, check=False
    )
    if done.returncode != 0:
        raise MatrixError(f"`{' '.join(command)}` failed: {done.stderr.strip()[-800:]}")
    return done.stdout


def registry_packages(spec: KernelSpec) -> list[str]:
    """Image packages the registry offers for `spec`; refreshes apt's lists once if none."""
    for attempt in range(2):
        names = _run(["apt-cache", "pkgnames", IMAGE_PREFIX]).split()
        if any(spec.build_key(name) for name in names) or attempt:
            return names
        _run(["apt-get", "update", "-qq"])
    return []


def _unpacked(spec: KernelSpec, trees: Path) -> list[str]:
    return [p.name for p in trees.glob("*") if spec.build_key(p.name) and (p / "boot").is_dir()]


def fetch(spec: KernelSpec, cache: Path) -> KernelTree:
    """The newest kernel of `spec`, unpacked in `cache` (downloaded only if not there yet)."""
    trees, debs = cache / "trees", cache / "debs"
    trees.mkdir(parents=True, exist_ok=True)
    debs.mkdir(parents=True, exist_ok=True)
    try:
        package = spec.newest(registry_packages(spec))
    except MatrixError:
        package = None
    package = package or spec.newest(_unpacked(spec, trees))
    if package is None:
        raise MatrixError(
            f"no {spec.title} kernel package ({spec.pattern}) in the registry or in {cache}: "
            "check the apt sources and run `apt-get update`"
        )
    root = trees / package
    if not (root / "boot").is_dir():
        _download_and_unpack(package, debs, root)
    tree = KernelTree(package, root)
    if spec.headers and tree.headers is None:
        _fetch_headers(tree, debs)
    _prune(spec, package, trees, debs)
    return tree


def _download(package: str, debs: Path) -> Path:
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        _run(["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package], cwd=debs)
        found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        raise MatrixError(f"apt-get download {package} left no .deb in {debs}")
    return found[-1]


def _download_and_unpack(package: str, debs: Path, root: Path) -> None:
    deb = _download(package, debs)
    partial = root.with_name(root.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _run(["dpkg-deb", "-x", str(deb), str(partial)])
    partial.rename(root)


def headers_packages(release: str) -> list[str]:
    """The headers package of `release` and the `-common` package it depends on."""
    package = HEADERS_PREFIX + release
    depends = _run(["apt-cache", "depends", "--no-recommends", "--no-suggests", package])
    common = [
        word
        for line in depends.splitlines()
        if (word := line.split()[-1]).startswith(HEADERS_PREFIX) and word.endswith("-common")
    ]
    return [*common[:1], package]


def _dangling_links(directory: str, names: list[str]) -> list[str]:
    return [name for name in names if not Path(directory, name).exists()]


def _fetch_headers(tree: KernelTree, debs: Path) -> None:
    """Unpacks the headers packages and merges their trees (`-common` first, the generated
    arch-specific files over it) into `tree.root/headers`. The .debs are deleted after."""
    partial = tree.root / (HEADERS_DIR + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    merged = partial / "merged"
    for package in headers_packages(tree.release):
        deb = _download(package, debs)
        unpacked = partial / package
        _run(["dpkg-deb", "-x", str(deb), str(unpacked)])
        shutil.copytree(
            unpacked / "usr" / "src" / package,
            merged,
            symlinks=True,
            ignore=_dangling_links,  # scripts/, tools/: links into kbuild, which BCC needs not
            dirs_exist_ok=True,
        )
        deb.unlink()
    merged.rename(tree.root / HEADERS_DIR)
    shutil.rmtree(partial)


def _prune(spec: KernelSpec, keep: str, trees: Path, debs: Path) -> None:
    for tree in trees.glob("*"):
        if spec.build_key(tree.name.removesuffix(".partial")) and tree.name != keep:
            shutil.rmtree(tree, ignore_errors=True)
    for deb in debs.glob("*.deb"):
        if spec.build_key(deb.name.split("_")[0]) and not deb.name.startswith(f"{keep}_"):
            deb.unlink()
