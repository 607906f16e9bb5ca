"""The Prometheus scrape configuration docs/deploy.md gives, checked by promtool."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.packaging.conftest import REPO, require_tool

MARKER = "<!-- prometheus.yml -->"


def test_scrape_config_in_the_docs_passes_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "prometheus")
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert MARKER in docs
    block = docs.split(MARKER, 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    config = tmp_path / "prometheus.yml"
    config.write_text(block)
    checked = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(config)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "job_name: kvwatch" in block
