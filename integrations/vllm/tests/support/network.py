"""The clients' side of a real link: a network namespace joined to this host's by a veth pair,
MTU 1500 (MSS 1448), as a client across a network reaches a server — not loopback, where the
agent's record of a reader's window misleads it after a hold (docs/engines.md, "Tested
where"). The server stays in this host's namespace (the agent watches it there); a client
socket is created inside the namespace and used from any thread. Needs root; everything is
removed at close."""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor

CLONE_NEWNET = 0x40000000
SUBNET = "10.214.{}.{}"


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class ClientNetwork:
    """Owns the namespace and the veth pair; `server_ip` is this host's end."""

    def __init__(self) -> None:
        index = os.getpid() % 250 + 1
        self.namespace = f"kvwvllm{os.getpid()}"
        self.host_device, self.client_device = f"kvwv{os.getpid()}h", "eth0"
        self.server_ip, self.client_ip = SUBNET.format(index, 1), SUBNET.format(index, 2)
        ip("netns", "add", self.namespace)
        try:
            ip("link", "add", self.host_device, "type", "veth", "peer", "name",
               self.client_device, "netns", self.namespace)  # fmt: skip
            ip("addr", "add", self.server_ip, "peer", f"{self.client_ip}/32", "dev",
               self.host_device)  # fmt: skip
            ip("link", "set", self.host_device, "up", "mtu", "1500")
            inside = ("-n", self.namespace)
            ip(*inside, "addr", "add", self.client_ip, "peer", f"{self.server_ip}/32", "dev",
               self.client_device)  # fmt: skip
            ip(*inside, "link", "set", self.client_device, "up", "mtu", "1500")
            ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        # One thread lives in the namespace and creates the clients' sockets there.
        self._inside = ThreadPoolExecutor(1, initializer=self._enter)

    def _enter(self) -> None:
        fd = os.open(f"/run/netns/{self.namespace}", os.O_RDONLY)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, CLONE_NEWNET) != 0:
                error = ctypes.get_errno()
                raise OSError(error, f"setns into {self.namespace}: {os.strerror(error)}")
        finally:
            os.close(fd)

    def socket(self) -> socket.socket:
        """A TCP socket in the clients' namespace (kernel-default buffers)."""
        return self._inside.submit(socket.socket).result()

    def close(self) -> None:
        if hasattr(self, "_inside"):
            self._inside.shutdown(wait=True)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", self.host_device], capture_output=True, check=False)
