"""`python -m kvwatch.cli`, the same as the `kvwatch` command."""

from kvwatch.cli import main

main()
