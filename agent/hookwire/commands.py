"""The table of the agent's commands to engines, which both sides build on: the agent's
`HookServer.command` and its actions, the engine hook's handlers, features and counters. A
new command is one row here and its two message classes (kvwatch.hookwire.protocol)."""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.hookwire.protocol import (
    FEATURE_DETACH,
    FEATURE_PARK,
    FEATURE_PAUSE,
    Answer,
    Cancel,
    Cancelled,
    Command,
    Detach,
    Detached,
    Park,
    Parked,
    Pause,
    Paused,
    Release,
    Released,
    plural,
)


@dataclass(frozen=True)
class CommandKind:
    """One row: a command the agent sends, the answer type that answers it, the hello feature
    an engine offers it under (None: every engine takes it), and the status that says it did
    what it asks (`effect`)."""

    command: type[Command]
    answer: type[Answer]
    feature: str | None
    effect: str

    @property
    def name(self) -> str:
        return self.command.TYPE


COMMAND_KINDS: dict[str, CommandKind] = {
    kind.name: kind
    for kind in (
        CommandKind(Cancel, Cancelled, None, "cancelled"),
        CommandKind(Park, Parked, FEATURE_PARK, "parked"),
        CommandKind(Detach, Detached, FEATURE_DETACH, "detached"),
        CommandKind(Pause, Paused, FEATURE_PAUSE, "paused"),
        CommandKind(Release, Released, FEATURE_PAUSE, "released"),
    )
}


def command_kind(name: str) -> CommandKind:
    """The row of the command called `name`; ValueError naming the known ones if none is."""
    kind = COMMAND_KINDS.get(name)
    if kind is None:
        known = ", ".join(COMMAND_KINDS)
        raise ValueError(f"unknown engine-hook command {name!r} (known: {known})")
    return kind


def agent_command_counters() -> tuple[str, ...]:
    """The agent's event counters of each command (kvwatch_hook_events_total{event=...}):
    sent, answered, timed out, lost with its connection, of an unknown request, not sent, and
    answers that matched no command of its kind."""
    names: list[str] = []
    for name in COMMAND_KINDS:
        many = plural(name)
        names += [
            f"{many}_sent",
            f"{many}_answered",
            f"{name}_timeouts",
            f"{many}_lost",
            f"{many}_unknown_request",
            f"{name}_send_failures",
            f"unmatched_{name}_answers",
        ]
    return tuple(names)


def engine_command_counters() -> tuple[str, ...]:
    """The engine hook's counters of each command (`EngineHook.counters()`): received,
    answered, past its deadline, handler errors, refused while too many ran, and answers lost
    with their session."""
    names: list[str] = []
    for name in COMMAND_KINDS:
        many = plural(name)
        names += [
            f"{many}_received",
            f"{many}_answered",
            f"{name}_timeouts",
            f"{name}_handler_errors",
            f"{many}_refused_busy",
            f"{name}_answers_lost",
        ]
    return tuple(names)
