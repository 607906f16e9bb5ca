"""How KV sizes read in the tables: unknown, exact, and the engine hook's estimates."""

from __future__ import annotations

from kvwatch.tools.tables import kv_text


def test_kv_text_marks_estimates_and_unknowns() -> None:
    assert kv_text({"kv_bytes": None}) == "-"
    assert kv_text({"kv_bytes": 3 * 1024 * 1024, "kv_estimated": False}) == "3.0M"
    assert kv_text({"kv_bytes": 2048, "kv_estimated": True}) == "2.0K (est.)"
    assert kv_text({"kv_bytes": 512}) == "512B"  # an agent that predates the field
