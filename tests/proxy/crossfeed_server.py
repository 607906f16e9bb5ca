"""A plain server, no proxy: it accepts two clients and, on one thread, reads what the first
sends and writes it to the second, until either leaves. To the kernel's relay pairing this
looks like a relay (the thread reads one socket, then writes another), but both sockets were
accepted. Run as `python -m tests.proxy.crossfeed_server PORT`; prints "listening" when ready."""

from __future__ import annotations

import socket
import sys


def main() -> None:
    listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
    print("listening", flush=True)
    source, _ = listener.accept()
    sink, _ = listener.accept()
    with source, sink:
        while data := source.recv(4096):
            sink.sendall(data)


if __name__ == "__main__":
    main()
