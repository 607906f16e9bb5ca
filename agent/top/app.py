"""The loops of `kvwatch top`: live on a terminal, frame after frame when piped, or once."""

from __future__ import annotations

import dataclasses
import time

from rich.console import Console
from rich.live import Live
from rich.text import Text

from kvwatch.errors import KvwatchError
from kvwatch.top.keys import Controls, KeyReader
from kvwatch.top.model import Frame, RowFilter
from kvwatch.top.render import render_frame
from kvwatch.top.sources import FrameSource


def print_frame(source: FrameSource, view: RowFilter, console: Console) -> None:
    """One frame, no key help: for --once and for piped output."""
    console.print(render_frame(source.frame(), view, console.width, []))


def run_piped(source: FrameSource, view: RowFilter, console: Console, interval: float) -> None:
    """Not a terminal: a frame every `interval` seconds, separated by a blank line."""
    while True:
        print_frame(source, view, console)
        console.print()
        time.sleep(interval)


def _refresh(source: FrameSource, last: Frame | None) -> Frame:
    """A new frame; when the daemon stops answering, the last one with the error in its
    header (the view stays up and recovers when the daemon is back)."""
    try:
        return source.frame()
    except KvwatchError as exc:
        if last is None:
            raise
        return Frame(dataclasses.replace(last.header, error=exc.message), last.rows)


def run_live(source: FrameSource, view: RowFilter, console: Console, interval: float) -> None:
    """A full-screen view refreshed every `interval` seconds and at every key."""
    controls = Controls(view)
    frame: Frame | None = None
    with KeyReader() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
        while not controls.quit:
            frame = _refresh(source, frame)
            deadline = time.monotonic() + interval
            while not controls.quit:
                footer = [Text(controls.footer(), style="dim")]
                live.update(render_frame(frame, view, console.width, footer), refresh=True)
                pressed = keys.read(deadline - time.monotonic())
                if not pressed:
                    break
                controls.press(pressed)
