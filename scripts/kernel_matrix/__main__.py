"""`python -m scripts.kernel_matrix`: run the kernel rows and write the compatibility table."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

from scripts.kernel_matrix.kernels import MatrixError
from scripts.kernel_matrix.matrix import ROWS, RowResult, run_row
from scripts.kernel_matrix.report import assertion_lines, render
from scripts.kernel_matrix.vm import REPO

EXIT_FAILED = 1
EXIT_MISSING = 3


@click.command()
@click.option(
    "--kernel",
    "kernels",
    multiple=True,
    type=click.Choice(ROWS),
    help="Run only these rows (repeatable); default: all.",
)
@click.option(
    "--doc",
    type=click.Path(dir_okay=False, path_type=Path),
    default=REPO / "docs" / "kernel-matrix.md",
    show_default=True,
    help="Where to write the table.",
)
def main(kernels: tuple[str, ...], doc: Path) -> None:
    """Boot each kernel, force each attach mode it offers, run the socket scenarios."""
    rows: list[RowResult] = []
    with tempfile.TemporaryDirectory(prefix="kvwatch-matrix-") as workdir:
        for name in kernels or ROWS:
            click.echo(f"kernel-matrix: {name} ...", err=True)
            try:
                row = run_row(name, Path(workdir))
            except MatrixError as exc:
                click.echo(f"kernel-matrix: {exc}", err=True)
                sys.exit(EXIT_MISSING)
            click.echo(
                f"kernel-matrix: {name} ({row.release}) took {row.run.seconds:.0f} s", err=True
            )
            rows.append(row)
    doc.write_text(render(rows))
    failed = [line for row in rows for line in row.failures()]
    for failure in failed:
        click.echo("kernel-matrix: FAILED " + "\n  ".join(assertion_lines(failure)), err=True)
    click.echo(f"kernel-matrix: wrote {doc}", err=True)
    sys.exit(EXIT_FAILED if failed else 0)


if __name__ == "__main__":
    main()
