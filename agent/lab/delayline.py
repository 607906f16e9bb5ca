"""A network emulator for kernels built without sch_netem (this CI kernel): two TUN devices
and a process between them that delays every IP packet by a fixed time and drops a share of
them at random, both ways — what `tc qdisc add ... netem delay D loss L` does on each end.

Run as `python -m kvwatch.lab.delayline NAME_A NAME_B DELAY_MS LOSS_PERCENT`: it creates
the two devices in its own network namespace, prints "ready", then relays until killed; the
caller moves each device into a namespace of its own and gives it an address.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import random
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU_BYTES = 1500


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay(ends: tuple[int, int], delay_s: float, loss: float) -> None:
    """Packets read from one end are written to the other `delay_s` later, in order."""
    queues: dict[int, collections.deque[tuple[float, bytes]]] = {
        ends[0]: collections.deque(),
        ends[1]: collections.deque(),
    }
    other = {ends[0]: ends[1], ends[1]: ends[0]}
    while True:
        now = time.monotonic()
        due = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(due) - now) if due else 1.0
        readable, _, _ = select.select(list(ends), [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            while True:
                try:
                    packet = os.read(fd, MTU_BYTES + 64)
                except BlockingIOError:
                    break
                if random.random() >= loss:
                    queues[other[fd]].append((now + delay_s, packet))
        for fd, queue in queues.items():
            while queue and queue[0][0] <= now:
                # A write that fails (the device is down or being moved) is a lost packet.
                with contextlib.suppress(OSError):
                    os.write(fd, queue.popleft()[1])


def main() -> None:
    name_a, name_b, delay_ms, loss_percent = sys.argv[1:5]
    ends = (open_tun(name_a), open_tun(name_b))
    print("ready", flush=True)
    relay(ends, int(delay_ms) / 1000, float(loss_percent) / 100)


if __name__ == "__main__":
    main()
