"""Options shared by the commands: those that watch sockets (sockets, top, run), the flags
of config settings (checked by the config's own rules) and the agent's --url."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from kvwatch.collect.bpf.loader import SEND_MODES
from kvwatch.collect.collectors import BACKENDS
from kvwatch.config.load import load_config, parse_flag
from kvwatch.config.schema import (
    DEFAULT_AGENT_URL,
    DEFAULT_MIN_READER_BYTES_PER_SECOND,
    RANGES,
    AgentConfig,
)
from kvwatch.streams.states import StreamState

F = TypeVar("F", bound=Callable[..., Any])


def setting_option(*decls: str, key: str, help: str, **kwargs: Any) -> Callable[[F], F]:
    """A flag for the config setting `key`: its value is checked by the config's rules
    (kvwatch.config.load.parse_flag: type, range, the same message as for the file), and its help
    ends with the setting's range. A repeatable flag's values are checked together."""

    def check(_: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None or value == ():
            return value
        return parse_flag(key, value, param.opts[0])

    bounds = RANGES.get(key)
    shown = f"{help} (range {bounds.span})" if bounds is not None else help
    return click.option(*decls, callback=check, help=shown, **kwargs)


def _checked_url(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    # The HTTP client (~9 MB resident) is imported by the commands that read an agent,
    # never by `kvwatch run` itself.
    from kvwatch.tools.client import agent_url

    return agent_url(value)


def agent_url_option(help: str) -> Callable[[F], F]:
    """--url: the agent's HTTP API, checked (kvwatch.tools.client.agent_url) before use."""
    return click.option(
        "--url", default=DEFAULT_AGENT_URL, show_default=True, callback=_checked_url, help=help
    )


# Where the hidden --send-hook (the old name of --send-mode) leaves its value for --send-mode.
_OLD_SEND_FLAG = "kvwatch.send_hook"


def _old_send_flag(ctx: click.Context, _: click.Parameter, value: str | None) -> None:
    if value is not None:
        click.echo("--send-hook is now --send-mode", err=True)
        ctx.meta[_OLD_SEND_FLAG] = value


def _send_mode(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The value of --send-mode, else of the old --send-hook when only that was given (click
    processes the options given on the command line before those left to their default)."""
    given = ctx.get_parameter_source(param.name or "") not in (None, ParameterSource.DEFAULT)
    old: str | None = ctx.meta.get(_OLD_SEND_FLAG)
    return value if given or old is None else old


def collector_options(with_defaults: bool = True) -> Callable[[F], F]:
    """--port, --pid, --backend, --send-mode, --max-sockets, --stall-seconds,
    --min-reader-rate, --path.procfs.

    Without defaults (`kvwatch run`), an option the user did not give is None, so values from
    the config file and the environment are not overridden."""

    def default(value: object) -> dict[str, Any]:
        return {"default": value, "show_default": True} if with_defaults else {"default": None}

    decorators = [
        setting_option(
            "--port",
            "ports",
            key="collector.ports",
            metavar="PORT",
            multiple=True,
            help="Watch only sockets with this local port (repeatable, up to 16). "
            "Filtered in the kernel: other sockets cost almost nothing.",
        ),
        setting_option(
            "--pid",
            key="collector.pid",
            metavar="PID",
            default=None,
            help="Watch only sockets this process writes to (0: every process).",
        ),
        click.option(
            "--backend",
            type=click.Choice(BACKENDS),
            **default("auto"),
            help="core: the prebuilt BPF object (CO-RE, needs kernel BTF); bcc: the same "
            "programs compiled at start-up by BCC against the kernel's headers (kernels "
            "without BTF); diag: sock_diag polling, no BPF; auto: core with BTF, else bcc "
            "when BCC and headers are installed, else diag, saying why.",
        ),
        click.option(
            "--send-mode",
            type=click.Choice(("auto", *SEND_MODES)),
            **default("auto"),
            callback=_send_mode,
            help="Force the tcp_sendmsg attach mode (auto picks the best that attaches).",
        ),
        click.option(
            "--send-hook",
            type=click.Choice(("auto", *SEND_MODES)),
            default=None,
            expose_value=False,
            hidden=True,
            callback=_old_send_flag,
        ),
        setting_option(
            "--max-sockets",
            key="collector.max_sockets",
            metavar="N",
            **default(16384),
            help="Size of the in-kernel socket table (LRU; evictions are counted).",
        ),
        setting_option(
            "--stall-seconds",
            key="policy.stall_seconds",
            metavar="SECONDS",
            **default(3.0),
            help="Pending data with no ACK progress under a zero window or full "
            "send buffer for at least this long makes a stream `stalled` (behind a zero "
            "window, also for as long as --min-reader-rate requires).",
        ),
        setting_option(
            "--min-reader-rate",
            "min_reader_rate",
            key="policy.min_reader_bytes_per_second",
            metavar="BYTES",
            **default(DEFAULT_MIN_READER_BYTES_PER_SECOND),
            help="Bytes per second: a client that reads at least this fast is never called "
            "stalled, whatever its receive buffer, RTT or loss. Higher cuts dead readers "
            "sooner; the default is half a 50-token/s SSE stream.",
        ),
        setting_option(
            "--path.procfs",
            "procfs_root",
            key="path.procfs",
            metavar="DIR",
            **default("/proc"),
            help="Where the host's /proc is mounted (a DaemonSet mounts it elsewhere).",
        ),
    ]

    def apply(func: F) -> F:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


def collector_flags(
    ports: tuple[int, ...],
    pid: int | None,
    backend: str | None,
    send_mode: str | None,
    max_sockets: int | None,
    stall_seconds: float | None,
    min_reader_rate: int | None,
    procfs_root: str | None,
) -> dict[str, object | None]:
    """The collector options' values (`collector_options`) by config key; None: not given."""
    return {
        "collector.ports": ports or None,
        "collector.pid": pid,
        "collector.backend": backend,
        "collector.send_mode": send_mode,
        "collector.max_sockets": max_sockets,
        "policy.stall_seconds": stall_seconds,
        "policy.min_reader_bytes_per_second": min_reader_rate,
        "path.procfs": procfs_root,
    }


def load_with_flags(config_path: str | None, flags: dict[str, object | None]) -> AgentConfig:
    """The configuration a command runs with: defaults < the file at `config_path` < the
    environment < the flags given. `run` reads it so, and so do `sockets --standalone` and
    `top --standalone` (without a file): one loader, one set of defaults and bounds, one way
    to the collector's settings and the judge's thresholds."""
    given = {key: value for key, value in flags.items() if value is not None}
    return load_config(config_path, os.environ, given)


def announce_collector(note: str) -> None:
    """The collector's one-line account of itself (which backend, why, which attach points), on
    stderr, never wrapped: scripts and logs read it as one line."""
    click.secho(note, err=True, dim=True)


def state_filter_option() -> Callable[[F], F]:
    """--state (repeatable): show only streams in these states; passed as `states`."""
    return click.option(
        "--state",
        "states",
        type=click.Choice([s.value for s in StreamState]),
        multiple=True,
        help="Show only streams in this state (repeatable).",
    )
