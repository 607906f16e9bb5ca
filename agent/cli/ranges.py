"""Number ranges of the flags that are no config setting (--interval, --duration, ...); kept
apart from kvwatch.cli.options so that `kvwatch engine` and `loadgen` load nothing else."""

from __future__ import annotations

import math
from typing import Any

import click

# The longest --interval or --settle: time.sleep() overflows on absurd values.
MAX_WAIT_SECONDS = 3600.0


class NumberRange(click.FloatRange):
    """click's FloatRange, without NaN (which passes every comparison, so every range)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number", param, ctx)
        return number
