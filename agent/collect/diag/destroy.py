"""Reset one TCP socket with SOCK_DESTROY (what `ss -K` does), matched by 4-tuple and cookie.

The kernel aborts the socket (tcp_abort): the peer receives a RST (ECONNRESET), and a send() or
recv() blocked in the owning process wakes with ECONNABORTED. Needs CAP_NET_ADMIN in the
socket's network namespace and CONFIG_INET_DIAG_DESTROY. Blocking; see kvwatch.collect.diag.snapshot
for why it must not run inside an asyncio loop.
"""

from __future__ import annotations

import enum
import errno
import os

from kvwatch.collect.diag.snapshot import (
    NLM_F_ACK,
    NLM_F_REQUEST,
    DiagClient,
    exact_request,
    netlink_failure,
)
from kvwatch.collect.diag.wire import NLMSG_ERROR, nlmsg_errno, nlmsg_type
from kvwatch.errors import KvwatchError
from kvwatch.sockets import Endpoint

SOCK_DESTROY = 21  # include/uapi/linux/sock_diag.h


class DestroyResult(enum.Enum):
    """What SOCK_DESTROY did; failures that need an operator raise instead."""

    DESTROYED = "destroyed"
    # No socket has that 4-tuple and cookie any more: it closed, or the 4-tuple now belongs to
    # a newer socket (the cookie check keeps kvwatch from resetting the wrong connection).
    NOT_FOUND = "not_found"


def destroy_socket(local: Endpoint, remote: Endpoint, cookie: int) -> DestroyResult:
    """Aborts the TCP socket with this local/remote 4-tuple and socket cookie.

    Returns DESTROYED, or NOT_FOUND when no such socket exists; raises PrivilegeError without
    CAP_NET_ADMIN or kernel support, KvwatchError for anything else. An IPv4-mapped IPv6 socket
    (shown with IPv4 addresses) is found by the IPv4 lookup: both families share one table.
    """
    action = f"resetting the TCP socket {local} -> {remote}"
    request = exact_request(local, remote, NLM_F_REQUEST | NLM_F_ACK, cookie)
    with DiagClient() as client:
        replies = client.request(request, SOCK_DESTROY, action)
    codes = [nlmsg_errno(reply) for reply in replies if nlmsg_type(reply) == NLMSG_ERROR]
    if not codes:
        raise KvwatchError(
            f"{action}: the kernel sent no acknowledgement",
            hint="retry; if it persists, check that `ss -K` works on this host",
        )
    if codes[0] == 0:
        return DestroyResult.DESTROYED
    if codes[0] == errno.ENOENT:
        return DestroyResult.NOT_FOUND
    raise netlink_failure(OSError(codes[0], os.strerror(codes[0])), action)
