"""A token-stream server for the verdict tests: a client that sends `stream` (or `stream
RATE`) gets SSE events of about 200 bytes at the server's rate (or RATE bytes per second),
written with blocking sends (a coupled engine), until it disconnects; `burst BYTES SECONDS`
gets that many bytes written at once into a send buffer large enough for them, and the
socket closed SECONDS later (a server that finished, held the keep-alive connection for a
while and closed it while the kernel still drains: uvicorn's 5 s); any other line gets
nothing. Run inside the server namespace: `python -m kvwatch.lab.token_server HOST PORT
BYTES_PER_SECOND`. Prints one JSON line per finished stream."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

EVENT = b"data: " + b"t" * 190 + b"\n\n"


def serve(conn: socket.socket, bytes_per_second: int) -> None:
    peer = "{}:{}".format(*conn.getpeername()[:2])
    ended = "idle"
    try:
        words = conn.recv(256).split()
        if words and words[0] == b"burst":
            burst(conn, int(words[1]), float(words[2]))
            ended = "closed"
        else:
            if words and words[0] == b"stream":
                stream(conn, len(EVENT) / (int(words[1]) if len(words) > 1 else bytes_per_second))
            conn.recv(1)  # an idle connection is held until the client leaves
    except OSError as exc:
        ended = type(exc).__name__
    print(json.dumps({"peer": peer, "ended": ended}), flush=True)
    conn.close()


def stream(conn: socket.socket, interval: float) -> None:
    """Writes an event every `interval` seconds until a write fails."""
    next_at = time.monotonic()
    while True:
        conn.sendall(EVENT)
        next_at += interval
        time.sleep(max(0.0, next_at - time.monotonic()))


def burst(conn: socket.socket, size: int, linger_seconds: float) -> None:
    """Queues `size` bytes of events in one go, waits, and closes: the kernel sends the rest."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * size)
    conn.sendall((EVENT * (size // len(EVENT) + 1))[:size])
    time.sleep(linger_seconds)
    conn.close()


def main() -> None:
    host, port, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    listener = socket.create_server((host, port), backlog=256)
    print(json.dumps({"listening": f"{host}:{port}"}), flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn, rate), daemon=True).start()


if __name__ == "__main__":
    main()
