"""A token-stream server for the verdict tests: every client that sends a line gets SSE
events of about 200 bytes at a fixed rate, written with blocking sends (a coupled engine),
until it disconnects. Run inside the server namespace: `python -m tests.verdicts.token_server
HOST PORT BYTES_PER_SECOND`. Prints one JSON line per finished stream."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

EVENT = b"data: " + b"t" * 190 + b"\n\n"


def serve(conn: socket.socket, bytes_per_second: int) -> None:
    peer = "{}:{}".format(*conn.getpeername()[:2])
    sent, interval = 0, len(EVENT) / bytes_per_second
    try:
        conn.recv(256)
        next_at = time.monotonic()
        while True:
            conn.sendall(EVENT)
            sent += len(EVENT)
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
    except OSError as exc:
        ended = type(exc).__name__
    print(json.dumps({"peer": peer, "sent": sent, "ended": ended}), flush=True)
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
