"""A client of the agent's HTTP API, for the commands that read a running daemon."""

from __future__ import annotations

from typing import Any

import httpx

from kvwatch.errors import KvwatchError

DEFAULT_AGENT_URL = "http://127.0.0.1:9431"


def get_json(base_url: str, path: str, timeout_seconds: float = 5.0) -> Any:
    """GET base_url + path as JSON; a clear error when no agent answers there."""
    url = base_url.rstrip("/") + path
    try:
        response = httpx.get(url, timeout=timeout_seconds)
    except httpx.HTTPError as exc:
        raise KvwatchError(
            f"no kvwatch agent answers at {base_url} ({exc})",
            "start it with `kvwatch run`, or point --url at it",
        ) from exc
    if response.status_code == 404:
        raise KvwatchError(
            response.json().get("error", f"{url}: not found"),
            "check the request id (`kvwatch streams` lists live ones)",
        )
    if response.status_code != 200:
        raise KvwatchError(
            f"the agent at {base_url} answered {response.status_code} for {path}",
            "see the agent's log",
        )
    return response.json()
