"""Single keys from the terminal (cbreak mode) and what each does to the view.

Keys: s next sort · r reverse · t next state filter · p port filter · i pid filter ·
c clear filters · q quit. `p` and `i` read digits until Enter (Esc cancels, an empty entry
clears that filter)."""

from __future__ import annotations

import os
import select
import sys
import termios
import tty
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from kvwatch.top.model import SORT_KEYS, STATE_SEVERITY, RowFilter

KEYS_HELP = "keys: s sort  r reverse  t state  p port  i pid  c clear  q quit"
ENTER = ("\r", "\n")
ESCAPE = "\x1b"
BACKSPACE = ("\x7f", "\b")
PROMPTS = {"p": "port", "i": "pid"}


class KeyReader:
    """Puts a terminal stdin in cbreak mode (keys arrive one by one, unechoed; Ctrl-C still
    interrupts) and restores its settings on exit. Without a terminal it never yields a key."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else -1
        self._saved: list[Any] | None = None

    def __enter__(self) -> KeyReader:
        if self.fd >= 0:
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def read(self, timeout_seconds: float) -> str:
        """The keys typed within the timeout ("" when none; escape sequences come whole)."""
        if self.fd < 0:
            return ""
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout_seconds))
        return os.read(self.fd, 32).decode("utf-8", "replace") if ready else ""


@dataclass
class Controls:
    """Applies keys to a RowFilter. While a prompt is open (after `p` or `i`), keys edit its
    text instead. Owned by the display loop."""

    view: RowFilter
    prompt: str = ""
    typed: str = ""
    quit: bool = False
    _prompt_key: str = field(default="", repr=False)

    def press(self, keys: str) -> None:
        if keys.startswith(ESCAPE) and len(keys) > 1:
            return  # an arrow or function key: not ours
        for key in keys:
            self._press_one(key)

    def _press_one(self, key: str) -> None:
        if self.prompt:
            self._edit(key)
        elif key == "q":
            self.quit = True
        elif key == "s":
            self.view.sort = SORT_KEYS[(SORT_KEYS.index(self.view.sort) + 1) % len(SORT_KEYS)]
        elif key == "r":
            self.view.reverse = not self.view.reverse
        elif key == "t":
            self.view.states = _next_state(self.view.states)
        elif key == "c":
            self.view.ports, self.view.pid, self.view.states = (), None, ()
        elif key in PROMPTS:
            self.prompt, self.typed, self._prompt_key = PROMPTS[key], "", key

    def _edit(self, key: str) -> None:
        if key == ESCAPE:
            self.prompt = ""
        elif key in BACKSPACE:
            self.typed = self.typed[:-1]
        elif key.isdigit() and len(self.typed) < 7:
            self.typed += key
        elif key in ENTER:
            number = int(self.typed) if self.typed else None
            if self._prompt_key == "p":
                self.view.ports = (number,) if number else ()
            else:
                self.view.pid = number
            self.prompt = ""

    def footer(self) -> str:
        if self.prompt:
            return f"{self.prompt}: {self.typed}_   (Enter apply, empty clears, Esc cancel)"
        return KEYS_HELP


def _next_state(states: tuple[str, ...]) -> tuple[str, ...]:
    """All → stalled → zero_window → ... → closed → all."""
    if len(states) != 1:
        return (STATE_SEVERITY[0],)
    position = STATE_SEVERITY.index(states[0]) + 1
    return (STATE_SEVERITY[position],) if position < len(STATE_SEVERITY) else ()
