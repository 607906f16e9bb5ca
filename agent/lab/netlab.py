"""Two test hosts, each in a network namespace the test creates, joined by a link with delay
and loss: a server host and a client host, MTU 1500 (MSS 1448), as a client across a real
network sees a server. The link is a veth pair with `tc netem` on both ends where the kernel
has sch_netem; on kernels built without it (this CI kernel: CONFIG_NET_SCH_NETEM is not set)
it is a pair of TUN devices with a delay line between them (agent/lab/delayline.py),
which delays and drops packets the same way. Everything is removed at close."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvwatch.collect.netns import network_namespace

T = TypeVar("T")
_labs = itertools.count(1)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Link:
    """One netem setting: one-way delay on each end (so the RTT is twice it) and loss."""

    delay_ms: int = 0
    loss_percent: float = 0.0

    @property
    def shaped(self) -> bool:
        return bool(self.delay_ms or self.loss_percent)

    def describe(self) -> str:
        return f"rtt {2 * self.delay_ms} ms, loss {self.loss_percent:g}%"


def netem_args(link: Link) -> list[str]:
    return ["netem", "delay", f"{link.delay_ms}ms", "loss", f"{link.loss_percent}%"]


class NetLab:
    """Owns two namespaces (`server_ns`, `client_ns`) and the veth pair between them."""

    def __init__(self, path: Link) -> None:
        self.path = path
        index = next(_labs)
        tag = f"{os.getpid() % 10000}x{index}"
        self.server_ns, self.client_ns = f"kvws{tag}", f"kvwc{tag}"
        self.server_ip, self.client_ip = f"10.213.{index}.1", f"10.213.{index}.2"
        self.emulator: subprocess.Popen[bytes] | None = None
        self.devices = (f"kvw{tag}s", f"kvw{tag}c")
        ip("netns", "add", self.server_ns)
        try:
            ip("netns", "add", self.client_ns)
            self._link()
        except BaseException:
            self.close()
            raise
        # One thread per namespace creates sockets there; sockets then work from anywhere.
        self._threads = {ns: ThreadPoolExecutor(1) for ns in (self.server_ns, self.client_ns)}

    def _link(self) -> None:
        ip("link", "add", "veth-s", "netns", self.server_ns, "type", "veth", "peer", "veth-c",
           "netns", self.client_ns)  # fmt: skip
        ends = ((self.server_ns, "veth-s"), (self.client_ns, "veth-c"))
        if self.path.shaped and not all(self._netem(ns, dev) for ns, dev in ends):
            ip("-n", self.server_ns, "link", "del", "veth-s")
            ends = self._delay_line()
        addresses = ((self.server_ip, self.client_ip), (self.client_ip, self.server_ip))
        for (ns, dev), (addr, peer) in zip(ends, addresses, strict=True):
            ip("-n", ns, "addr", "add", addr, "peer", f"{peer}/32", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up", "mtu", "1500")
            ip("-n", ns, "link", "set", "lo", "up")

    def _netem(self, ns: str, dev: str) -> bool:
        done = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                *netem_args(self.path),
            ],
            capture_output=True,
            check=False,
        )
        return done.returncode == 0

    def _delay_line(self) -> tuple[tuple[str, str], tuple[str, str]]:
        """TUN devices and the delay line between them, instead of veth and netem."""
        self.emulator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvwatch.lab.delayline",
                *self.devices,
                str(self.path.delay_ms),
                str(self.path.loss_percent),
            ],
            stdout=subprocess.PIPE,
        )
        assert self.emulator.stdout is not None
        assert self.emulator.stdout.readline().strip() == b"ready", "the delay line failed"
        ends = ((self.server_ns, self.devices[0]), (self.client_ns, self.devices[1]))
        for ns, dev in ends:
            ip("link", "set", "dev", dev, "netns", ns)
        return ends

    def run_in(self, ns: str, work: Callable[[], T]) -> T:
        """Runs `work` on a thread inside namespace `ns` (to create sockets there)."""

        def entered() -> T:
            with network_namespace(Path("/run/netns", ns)):
                return work()

        return self._threads[ns].submit(entered).result()

    def client_socket(self) -> socket.socket:
        return self.run_in(self.client_ns, socket.socket)

    def spawn_server(self, module: str, *args: str, log: Path) -> subprocess.Popen[bytes]:
        """`python -m module args` inside the server namespace, its output in `log`."""
        with log.open("wb") as out:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.server_ns, sys.executable, "-m", module, *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    def close(self) -> None:
        for executor in getattr(self, "_threads", {}).values():
            executor.shutdown(wait=True)
        if self.emulator is not None:
            self.emulator.kill()
            self.emulator.wait()
        for ns in (self.server_ns, self.client_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
