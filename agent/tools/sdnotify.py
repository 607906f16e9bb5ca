"""A small client of systemd's notification protocol (sd_notify), without a dependency.

Under `Type=notify` systemd passes the path of a datagram socket in `$NOTIFY_SOCKET` ("@name"
for an abstract one) and waits for `READY=1` before it calls the service started; with
`WatchdogSec=` it also passes `$WATCHDOG_USEC` (and `$WATCHDOG_PID`, the process meant) and
restarts the service when no `WATCHDOG=1` arrives within that time. `STATUS=` text shows in
`systemctl status`. Outside systemd (no `$NOTIFY_SOCKET`) every call is a cheap no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)

NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"


def _socket_address(value: str) -> str | None:
    """The AF_UNIX address of a `$NOTIFY_SOCKET` value; None for kinds not handled (vsock)."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Sends `state` (e.g. "READY=1\\nSTATUS=watching") to the service manager.

    Returns True when the message was sent, False when there is no manager to tell or the
    send failed (logged, never raised: a service must not die because systemd went away).
    """
    value = (os.environ if env is None else env).get(NOTIFY_SOCKET_ENV, "")
    address = _socket_address(value)
    if address is None:
        if value:
            log.debug("$%s=%r is not a unix socket; not notifying", NOTIFY_SOCKET_ENV, value)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # Never wait: a manager that does not read (its queue full) must not stop the
            # event loop this runs on; the notification is dropped and said so.
            sock.sendto(state.encode(), socket.MSG_DONTWAIT, address)
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", value, exc)
        return False
    return True


class Watchdog:
    """Pings systemd's watchdog every `interval_seconds`, half the `WatchdogSec=` it set.

    Invariant: pings come from `run()` on the daemon's event loop, so they stop when the loop
    stops turning, which is what the watchdog exists to catch. The owner creates the task
    after READY=1 and cancels it at shutdown.
    """

    def __init__(self, interval_seconds: float, env: Mapping[str, str] | None = None) -> None:
        self.interval_seconds = interval_seconds
        self.env = env
        self.pings = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Watchdog | None:
        """A watchdog when the manager asked for one for this process; None otherwise."""
        values = os.environ if env is None else env
        try:
            usec = int(values.get(WATCHDOG_USEC_ENV, ""))
        except ValueError:
            return None
        pid_text = values.get(WATCHDOG_PID_ENV, "")
        if usec <= 0 or (pid_text and pid_text != str(os.getpid())):
            return None
        return cls(usec / 2e6, env)

    def ping(self) -> bool:
        sent = notify("WATCHDOG=1", self.env)
        self.pings += sent
        return sent

    async def run(self) -> None:
        """Pings until cancelled."""
        while True:
            self.ping()
            await asyncio.sleep(self.interval_seconds)
