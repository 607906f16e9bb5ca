"""docs/architecture.md's folder table is the map of the package: each folder may import only
the folders its row names (and only ones listed above it), and every folder of the package
has a row. Read from the doc itself, so the map and the code cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SHARED_CELL = "nothing of kvwatch"  # the shared modules' row: every other row may import them
IMPORT = re.compile(r"^\s*(?:from|import)\s+kvwatch\.([a-z_]+)", re.MULTILINE)


def _names(cell: str) -> set[str]:
    """The package names a folder cell spells: `agent/act/`, `agent/files.py`,
    `agent/exporters/`."""
    return {Path(path.rstrip("/")).stem for path in re.findall(r"`([^`]+)`", cell)}


def folder_rows() -> list[tuple[set[str], str]]:
    """(the names of a row's folders, its imports cell), in the doc's order."""
    section = DOC.read_text().split("## Folders", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows.append((_names(cells[0]), cells[2]))
    return rows


def allowed(rows: list[tuple[set[str], str]], index: int) -> set[str]:
    """What the row at `index` may import: its own names, the shared modules (every row may),
    and those its cell lists."""
    names, cell = rows[index]
    above = set().union(*(row[0] for row in rows[:index]))
    if cell in ("everything above", "anything above"):
        return names | above
    if cell == SHARED_CELL:
        return names
    shared = next(row_names for row_names, row_cell in rows if row_cell == SHARED_CELL)
    names = names | shared
    listed = {name.strip() for name in cell.split(",")}
    expanded = set().union(*(shared if name == "shared" else {name} for name in listed))
    unknown = expanded - above
    assert not unknown, f"{sorted(names)} may import {sorted(unknown)}, not listed above it"
    return names | expanded


def sources(name: str) -> list[Path]:
    for base in (ROOT / "agent", ROOT):
        if (base / name).is_dir():
            return sorted((base / name).rglob("*.py"))
        if (base / f"{name}.py").is_file():
            return [base / f"{name}.py"]
    raise AssertionError(f"docs/architecture.md names {name}, which is not in the package")


def test_every_folder_imports_only_what_its_row_allows() -> None:
    rows = folder_rows()
    wrong = []
    for index, (names, _) in enumerate(rows):
        permitted = allowed(rows, index)
        for name in sorted(names):
            for path in sources(name):
                for imported in set(IMPORT.findall(path.read_text())) - permitted:
                    wrong.append(f"{path.relative_to(ROOT)} imports kvwatch.{imported}")
    assert not wrong, "imports that docs/architecture.md does not allow:\n" + "\n".join(wrong)


def test_every_folder_of_the_package_has_a_row() -> None:
    listed = set().union(*(names for names, _ in folder_rows()))
    present = {path.stem for path in (ROOT / "agent").iterdir() if path.name != "__init__.py"}
    present = {name for name in present if not name.startswith((".", "__"))} | {"exporters"}
    assert present <= listed, f"folders with no row in docs/architecture.md: {present - listed}"
