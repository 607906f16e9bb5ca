"""Real reverse proxies from Debian's packages, configured for SSE the way their users do
(HTTP/1.1 to the upstream, kept alive; no response buffering; long timeouts), each started in
the foreground on loopback from a work directory, and stopped with its workers.

With the kernel's default buffers, a proxy's client socket autotunes its send buffer to
megabytes and absorbs a whole response of the reference engine; `small_buffers` caps it at
16 KiB (nginx `listen … sndbuf=`, haproxy `tune.sndbuf.client`), so a client that stops
reading blocks the engine as it would for a long generation. haproxy can also bound its
upstream socket's receive buffer (`tune.rcvbuf.server`, `upstream_rcvbuf`): the engine's own
socket then sees a window of a few kilobytes, and stalls whenever the client side of the proxy
holds still."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvwatch.lab.harness.demo import PROMPT
from kvwatch.lab.harness.stack import Service, free_port
from kvwatch.lab.loadgen.http import Target, build_request, completion_body
from kvwatch.lab.readers import Buffer, Reader

PROXIES = ("nginx", "haproxy")
START_SECONDS = 10.0
SMALL_SNDBUF_BYTES = 16384


def nginx_config(
    workdir: Path, port: int, upstream_port: int, small_buffers: bool, buffering: bool = False
) -> str:
    """nginx as its SSE users configure it (`proxy_buffering off`), or with `buffering`, as
    it comes (nginx's default, `proxy_buffering on`: it reads the upstream's response as fast
    as it comes, into memory and a temporary file, whatever its client reads)."""
    temp = workdir / "nginx-temp"
    sndbuf = f" sndbuf={SMALL_SNDBUF_BYTES}" if small_buffers else ""
    return f"""
user root;
daemon off;
worker_processes 2;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log info;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {temp}/body;
    proxy_temp_path {temp}/proxy;
    fastcgi_temp_path {temp}/fastcgi;
    uwsgi_temp_path {temp}/uwsgi;
    scgi_temp_path {temp}/scgi;
    upstream engine {{
        server 127.0.0.1:{upstream_port};
        keepalive 8;
    }}
    server {{
        listen 127.0.0.1:{port}{sndbuf};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            proxy_buffering {"on" if buffering else "off"};
            proxy_read_timeout 3600s;
            proxy_send_timeout 3600s;
            send_timeout 3600s;
        }}
    }}
}}
"""


def haproxy_config(
    workdir: Path, port: int, upstream_port: int, small_buffers: bool, upstream_rcvbuf: int = 0
) -> str:
    sndbuf = f"tune.sndbuf.client {SMALL_SNDBUF_BYTES}" if small_buffers else ""
    rcvbuf = f"tune.rcvbuf.server {upstream_rcvbuf}" if upstream_rcvbuf else ""
    return f"""
global
    maxconn 1000
    nbthread 2
    pidfile {workdir}/haproxy.pid
    {sndbuf}
    {rcvbuf}

defaults
    mode http
    option forwardfor
    timeout connect 5s
    timeout client 3600s
    timeout server 3600s

frontend clients
    bind 127.0.0.1:{port}
    default_backend engine

backend engine
    http-reuse always
    server engine 127.0.0.1:{upstream_port}
"""


@dataclass
class Proxy:
    """A running proxy: its master process (a kvwatch.lab.harness.stack Service) and its
    client port."""

    service: Service
    port: int

    @property
    def name(self) -> str:
        return self.service.name

    def stop(self) -> None:
        self.service.stop()


def start_proxy(
    name: str,
    workdir: Path,
    upstream_port: int,
    small_buffers: bool,
    upstream_rcvbuf: int = 0,
    buffering: bool = False,
) -> Proxy:
    """Starts `name` in front of 127.0.0.1:`upstream_port`; returns once it accepts.
    `upstream_rcvbuf` (haproxy only) bounds its upstream socket's receive buffer;
    `buffering` (nginx only) turns its response buffering on (nginx_config)."""
    assert name == "haproxy" or not upstream_rcvbuf, f"{name} has no upstream_rcvbuf setting here"
    assert name == "nginx" or not buffering, f"{name} has no buffering setting here"
    binary = shutil.which(name) or f"/usr/sbin/{name}"
    if not Path(binary).exists():
        raise AssertionError(f"{name} is not installed: run scripts/setup.sh")
    port = free_port()
    config = workdir / f"{name}.conf"
    if name == "nginx":
        (workdir / "nginx-temp").mkdir(exist_ok=True)
        config.write_text(nginx_config(workdir, port, upstream_port, small_buffers, buffering))
        command = [
            binary,
            "-c",
            str(config),
            "-p",
            str(workdir),
            "-e",
            str(workdir / "nginx-error.log"),
        ]
    else:
        config.write_text(
            haproxy_config(workdir, port, upstream_port, small_buffers, upstream_rcvbuf)
        )
        command = [binary, "-f", str(config), "-db"]
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    proxy = Proxy(Service(name, popen, log), port)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise AssertionError(f"{name} exited {popen.returncode}: {log.read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proxy
        except OSError:
            time.sleep(0.05)
    proxy.stop()
    raise AssertionError(f"{name} did not accept on port {port} within {START_SECONDS} s")


def through(proxy: Proxy, reader: Reader, max_tokens: int, keep_alive: bool = False) -> Reader:
    """Starts `reader` on a streaming completion through the proxy; X-Request-Id is its name.
    The request asks the proxy to close the connection after the response, unless
    `keep_alive`."""
    body = completion_body("completions", "kvwatch-reference-tiny", PROMPT, max_tokens)
    request = build_request(
        Target.parse(f"http://127.0.0.1:{proxy.port}"), "POST", "/v1/completions", body, reader.name
    )
    if keep_alive:
        request = request.replace(b"Connection: close", b"Connection: keep-alive", 1)
    reader.eof_ends = True
    reader.connect(socket.socket(), "127.0.0.1", proxy.port, request)
    return reader


def client(name: str, buffer: Buffer, rate: int, read_seconds: float | None = None) -> Reader:
    return Reader(name, buffer, rate, read_seconds=read_seconds)
